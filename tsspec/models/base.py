"""The target side: a decoder-only transformer trunk.

Architectures (one file each in this package) turn GGUF metadata into an ``ArchConfig`` and name
their tensors; the compute below is shared. The model implements ``tsspec.spec.protocols.SpecTarget``:
it holds weights only, and every sequence has its own cache (``make_cache()``, see ``cache``):

* ``forward(tokens, cache, all_logits=, taps=)`` appends rows to ``cache`` and returns per-row
  logits and, on request, the residual entering each tapped layer;
* ``forward_batch(items)`` does that for several sequences in one pass: the linear layers once over
  all their rows, attention per sequence over its own cache (a lone forward is the one-item case);
* the cache is a ``KVCache``; trimming a rejected draft is arithmetic (``cache.trim(n)``).

Batch invariance is the contract that makes speculative output equal plain output: a row's
logits do not depend on how many rows share the forward. Linear layers get it from ``Linear``;
attention gets it by computing each row against a key range that depends only on the row's own
position (``attention_span``) with a matrix product whose row count is padded to a size that stays
on one GEMM route (``ATTN_MIN_ROWS``); those steps live in ``ops`` (re-exported here), and how a
forward executes (torch, native, Triton) in ``runners``.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import BadInput, ModelFileError
from ..gguf_file import GGUFFile
from .protocols import ForwardItem, ForwardOutput
from ..weights import Embedding, Linear, to_tensor
from .cache import KVCache, round_span
from .ops import ATTN_MIN_ROWS, SpanGroup, apply_rope, attend, attention_span, plan_attention, rms_norm, rope_tables  # noqa: F401
from .runners import pick_runner
from .config import DEFAULT_CTX, ArchConfig, Block, LayerSpec, common_config, q_scale, read_blocks, read_embedding, rope_bases  # noqa: F401,E501



# ----------------------------------------------------------------------------- pure ops


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": F.silu, "gelu_tanh": gelu_tanh}


class TransformerModel:
    """A llama-family trunk; architectures differ only by config and tensor names."""

    FUSABLE = True  # its blocks are ``Block``s the native fused forward runs (not a hybrid's)
    # ``forward_batch`` shares one forward among several sequences' rows (``SpecTarget``'s
    # protocol attribute; a trunk that cannot, such as a hybrid, says False and runs them in turn)
    batches_sequences = True
    # ``forward`` takes ``prompt`` (``ForwardItem.prompt``): the loop marks prompt chunks for it
    marks_prompt_rows = True
    # ``forward`` takes ``vocab`` (``ForwardItem.vocab``, ``head_rows.HeadRows``): logits for part
    # of the vocabulary
    cuts_vocab = True

    def __init__(self, cfg: ArchConfig, blocks: list[Block], embed: torch.Tensor, out_norm: torch.Tensor,
                 lm_head: Linear, n_ctx: int | None = None, path=None, device=None):
        self.cfg = cfg
        # ``device`` set: the Triton path (``load_model(device=...)``): every Linear on the triton
        # backend, norms, rope tables and caches on the device, attention by the Triton kernel;
        # the embedding stays on the host (only the rows a forward needs cross over)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.blocks = blocks
        self.embed = embed if isinstance(embed, Embedding) else Embedding(embed)  # rows -> float32
        self.out_norm = out_norm.to(self.device)
        self.lm_head = lm_head
        self.path = path
        self.vocab_size = cfg.vocab_size
        self.n_layers = cfg.n_layers
        self.hidden_size = cfg.d_model
        self.weight_format: str | None = None  # set by the loader
        self._max_context = min(n_ctx or DEFAULT_CTX, cfg.train_ctx)
        # rope tables for every position a cache can hold, shared by every sequence
        self._rope: dict[float, tuple[torch.Tensor, torch.Tensor]] = {
            base: tuple(t.to(self.device) for t in rope_tables(base, cfg.rope_dim, round_span(self._max_context)))
            for base in {spec.rope_base for spec in cfg.layers}}
        self.act = ACTIVATIONS[cfg.activation]
        self.q_scale = q_scale(cfg)
        self.q_dim = cfg.n_heads * cfg.head_dim
        self.kv_dim = cfg.n_kv_heads * cfg.head_dim
        self.windows = {spec.window for spec in cfg.layers}
        self._rope_bases = rope_bases(cfg)
        if self.FUSABLE:
            check_block_shapes(self)
        # how the blocks and the head execute (runners.py): native where every block weight is on
        # the gguf backend, Triton on a device, else the torch reference the others are tested against
        self.runner = pick_runner(self, device)

    @property
    def triton(self) -> bool:
        """Whether the trunk runs on a device (the Triton path)."""
        return self.runner.name == "triton"

    @property
    def fused(self):
        """The native blocks (``kernels.FusedBlocks``) where the native runner runs, else None."""
        return self.runner.fused

    def rope_lists(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The cos and sin tables of every rope base the layers use, in ``_rope_bases`` order (the
        native blocks index them per layer)."""
        return [self._rope[b][0] for b in self._rope_bases], [self._rope[b][1] for b in self._rope_bases]

    # -- SpecTarget surface ------------------------------------------------------------------
    @property
    def max_context(self) -> int:
        return self._max_context

    def make_cache(self) -> KVCache:
        """A new, empty cache for one sequence."""
        cfg = self.cfg
        return KVCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, self._max_context, device=self.device)

    def rope(self, base: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [positions, rope_dim / 2] for ``base``; shared with heads that ride the trunk."""
        return self._rope[base]

    # -- compute ------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, tokens: Sequence[int], cache: KVCache, *, all_logits: bool = False,
                taps: Sequence[int] | None = None, parents: Sequence[int] | None = None,
                base: int | None = None, prompt: bool = False, vocab=None) -> ForwardOutput:
        """``tokens`` appended to ``cache`` (``parents``, ``base``: as a token tree; ``prompt``: they
        are prompt tokens; ``vocab``: logits for those ids only; see ``ForwardItem``)."""
        return self._forward([ForwardItem(tokens, cache, all_logits, taps, parents, base, prompt, vocab)])[0]

    @torch.inference_mode()
    def forward_batch(self, items: Sequence[ForwardItem]) -> list[ForwardOutput]:
        """Several sequences' rows in one forward: ``items`` are ``ForwardItem``s (or tuples of
        ``(tokens, cache, all_logits, taps)``), each on its own cache. Every linear layer (QKV, O,
        FFN, LM head) runs once over all rows; rope, the cache writes and attention stay per
        sequence at its own positions. Each item's output is bitwise what ``forward`` gives it
        alone (batch invariance). Nothing is written to any cache unless every item's tokens and
        context fit."""
        items = [it if isinstance(it, ForwardItem) else ForwardItem(*it) for it in items]
        if not items:
            return []
        if len({id(it.cache) for it in items}) != len(items):
            raise ValueError("forward_batch: each item needs its own cache")
        if self.batches_sequences:
            return self._forward(items)  # checks every item's ids and room before any cache changes
        # a subclass whose trunk cannot share rows (see the attribute) runs them in turn: the
        # same promise, so every item is checked before the first forward
        for it in items:
            if it.parents is not None:
                raise ValueError(f"{self.cfg.arch}: token trees need a trunk that shares one forward among rows "
                                 "(a recurrent state follows one chain of rows)")
            self._check_tokens(it.tokens)
            it.cache.reserve(it.cache.length + len(it.tokens))
        return [self.forward(it.tokens, it.cache, all_logits=it.all_logits, taps=it.taps) for it in items]

    def _forward(self, items: list[ForwardItem]) -> list[ForwardOutput]:
        cfg = self.cfg
        hs = [self._token_rows(it.tokens) for it in items]  # every id checked before any cache changes
        starts = [it.cache.length for it in items]
        for it, start in zip(items, starts):
            it.cache.reserve(start + len(it.tokens))
        row0 = [0]
        for it in items:
            row0.append(row0[-1] + len(it.tokens))
        h = (hs[0] if len(hs) == 1 else torch.cat(hs)).to(self.device)  # [rows, d]
        want = {t: None for it in items for t in (it.taps or ())}
        h, tapped = self.runner.blocks(self, h, items, row0, starts, want)
        for it, start in zip(items, starts):
            it.cache.length = start + len(it.tokens)
        return self._output(h, want, items, row0, tapped)

    def _check_tokens(self, tokens: Sequence[int]) -> None:
        """The one place token ids are checked."""
        if len(tokens) == 0:
            raise ValueError("forward needs at least one token")
        if min(tokens) < 0 or max(tokens) >= self.cfg.vocab_size:
            raise BadInput(f"token id out of range for a vocabulary of {self.cfg.vocab_size}")

    def _token_rows(self, tokens: Sequence[int]) -> torch.Tensor:
        """Embedding rows [n, d] float32, for checked token ids."""
        self._check_tokens(tokens)
        h = self.embed[list(tokens)]
        return h * self.cfg.embed_scale if self.cfg.embed_scale != 1.0 else h

    def _output(self, h: torch.Tensor, want: dict, items: list[ForwardItem], row0: list[int],
                tapped: tuple | None = None) -> list[ForwardOutput]:
        """Each item's tap rows; the final norm and LM head (soft-capped where the file says so)
        once over the rows whose logits are asked for (all of an item's, or its last). ``tapped``:
        the taps the native forward copied out in order, taken as they are where an item asks for
        exactly those."""
        cfg = self.cfg
        if len(items) == 1:
            x = h if items[0].all_logits else h[-1:]
        else:
            idx = [r for s, it in enumerate(items)
                   for r in (range(row0[s], row0[s + 1]) if it.all_logits else (row0[s + 1] - 1,))]
            x = h[torch.tensor(idx, device=h.device)]
        vocab = items[0].vocab
        if any(it.vocab is not vocab for it in items):
            raise ValueError("the items of one forward ask for logits over different vocabularies")
        if vocab is not None:
            logits = vocab.logits(x)  # soft-capped where the file says so, -inf off its ids
        else:
            logits = self.runner.head(self, x)
            if cfg.final_softcap:
                logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        logits = self.runner.to_host(logits)  # the loop, the samplers and the drafters take host tensors
        outs, at = [], 0
        for s, it in enumerate(items):
            n = row0[s + 1] - row0[s] if it.all_logits else 1
            if not it.taps:
                hidden = None
            elif tapped is not None and tuple(it.taps) == tapped[0]:
                hidden = tapped[1][row0[s] : row0[s + 1]]
            else:
                hidden = torch.cat([want[t][row0[s] : row0[s + 1]] for t in it.taps], dim=-1)
            if hidden is not None:
                hidden = self.runner.to_host(hidden)
            outs.append(ForwardOutput(logits=logits if len(items) == 1 else logits[at : at + n], hidden=hidden))
            at += n
        return outs

    def weight_bytes(self) -> int:
        n = self.embed.nbytes()
        for b in self.blocks:
            n += b.qkv.nbytes() + b.o.nbytes() + b.gate_up.nbytes() + b.down.nbytes()
        if not _shares_storage(self.lm_head, self.embed):
            n += self.lm_head.nbytes()
        return n


def check_block_shapes(model: "TransformerModel") -> None:
    """Every block's products and norms against the metadata: a file whose tensors disagree with
    its hyper-parameters is refused by name here, not by a torch error (or, on the native path,
    reads past a buffer) inside the first forward."""
    cfg = model.cfg
    d, f, hd = cfg.d_model, cfg.ffn_dim, cfg.head_dim
    q, kv = cfg.n_heads * hd, cfg.n_kv_heads * hd
    name = model.path.name if model.path is not None else "model"
    for li, blk in enumerate(model.blocks):
        want = {"attn_q/k/v": (blk.qkv, q + 2 * kv, d), "attn_output": (blk.o, d, q),
                "ffn_gate/up": (blk.gate_up, 2 * f, d), "ffn_down": (blk.down, d, f)}
        for what, (lin, n_out, n_in) in want.items():
            if (lin.out_features, lin.in_features) != (n_out, n_in):
                raise ModelFileError(f"{name}: blk.{li}.{what} is {lin.out_features}x{lin.in_features}, but the "
                                     f"metadata gives {n_out}x{n_in} (d_model {d}, ffn {f}, heads {cfg.n_heads}/"
                                     f"{cfg.n_kv_heads} of {hd})")
        norms = {"attn_norm": d, "ffn_norm": d, "post_attention_norm": d, "post_ffw_norm": d,
                 "attn_q_norm": hd, "attn_k_norm": hd}
        for what, t in zip(norms, (blk.attn_norm, blk.ffn_norm, blk.post_attn_norm, blk.post_ffn_norm,
                                   blk.q_norm, blk.k_norm)):
            if t is not None and t.numel() != norms[what]:
                raise ModelFileError(f"{name}: blk.{li}.{what} has {t.numel()} elements, expected {norms[what]}")


def _shares_storage(head: Linear, embed: Embedding) -> bool:
    w = head.weight
    ptr = w.ctypes.data if isinstance(w, np.ndarray) else w.data_ptr()
    return ptr == embed.storage_ptr()


# ----------------------------------------------------------------------------- loading


def load_weight(g: GGUFFile, names: Sequence[str], fmt: str | None) -> list:
    """The weights of tensors that share one Linear.

    "auto": a ``GGUFWeight`` per tensor (the file's blocks as stored; ``Linear`` runs them on the
    native kernels, or falls back per tensor when those are unavailable). "int4" (drafters only):
    ``Int4Weight`` for all, exact codes for 4-bit tensors and lossy 4-bit for the rest. Otherwise
    float32 arrays."""
    from ..weights import GGUFWeight, int4_from_gguf, int4_quantize, int4_shape_ok, int4_supported

    if fmt == "auto":
        return [GGUFWeight.from_file(*g.tensor_raw(n), g.tensor_info(n).shape) for n in names]
    if fmt == "int4":
        infos = [g.tensor_info(n) for n in names]
        if all(int4_shape_ok(i.shape) for i in infos):
            return [int4_from_gguf(*g.tensor_raw(i.name), i.shape) if int4_supported(i.type_name, i.shape)
                    else int4_quantize(g.tensor(i.name)) for i in infos]
    return [g.tensor(n) for n in names]


def load_blocks(g: GGUFFile, cfg: ArchConfig, fmt: str | None, *, bias: bool = False, device=None) -> list[Block]:
    """Read the standard llama-family block tensors (``blk.N.*``) into fused Linears.

    With fmt "auto" a Linear keeps its tensors' GGUF blocks (see ``Linear`` for the backends);
    ``device``: the triton backend there, norms on the device too."""
    from ..weights import load_format

    fmt = load_format(fmt)

    def vec(name: str) -> torch.Tensor:
        v = to_tensor(g.tensor(name), torch.float32)
        return v if device is None else v.to(device)

    def fused(names: list[str], biases: list) -> Linear:
        return Linear.concat(list(zip(load_weight(g, names, fmt), biases)), fmt, device)

    def single(name: str) -> Linear:
        return Linear(load_weight(g, [name], fmt)[0], None, fmt, device)

    return read_blocks(g, cfg, bias=bias, fused=fused, single=single, vec=vec, threads=torch.get_num_threads())


def load_embedding(g: GGUFFile, cfg: ArchConfig, fmt: str, device=None) -> tuple[Embedding, Linear]:
    """The token embedding and the output head (tied to the embedding when the file has no
    ``output.weight``: then both share one copy of the stored blocks). ``device``: the head on the
    triton backend there; the embedding stays on the host (its own copy when tied)."""
    from ..weights import GGUFWeight, gguf_native, int4_shape_ok

    info = g.tensor_info("token_embd.weight")
    if tuple(info.shape) != (cfg.vocab_size, cfg.d_model):
        raise ModelFileError(
            f"{g.path.name}: token_embd is {tuple(info.shape)}, expected ({cfg.vocab_size}, {cfg.d_model})"
        )
    tied = not g.has_tensor("output.weight")
    head_name = "token_embd.weight" if tied else "output.weight"
    if device is not None:
        head_info = g.tensor_info(head_name)
        head = Linear(GGUFWeight.from_file(*g.tensor_raw(head_name), head_info.shape), None, fmt, device)
        if fmt == "auto" and gguf_native(info.type_name, tuple(info.shape)):
            return Embedding(GGUFWeight.from_file(*g.tensor_raw("token_embd.weight"), info.shape)), head
        dtype = torch.float32 if info.type_name in ("F32", "F16") else torch.bfloat16
        return Embedding(to_tensor(g.tensor("token_embd.weight"), dtype)), head
    if fmt == "auto" and gguf_native(info.type_name, tuple(info.shape)):
        embed_w, head = read_embedding(g, cfg, lambda w: Linear(w, None, fmt))
        return Embedding(embed_w), head
    dtype = torch.float32 if fmt == "f32" else torch.bfloat16
    if fmt == "auto" and info.type_name in ("F32", "F16"):
        dtype = torch.float32  # never below the file's precision
    dense = to_tensor(g.tensor("token_embd.weight"), dtype)
    embed = Embedding(dense)
    head_info = g.tensor_info(head_name)
    if fmt == "auto" or (fmt == "int4" and int4_shape_ok(head_info.shape)):
        # a head the file stores (or a drafter's lossy 4-bit one): its own copy in its own format
        lm_head = Linear(load_weight(g, [head_name], fmt)[0], None, fmt)
    elif not tied:
        lm_head = Linear(g.tensor(head_name), None, fmt)
    else:  # tied: share the embedding's storage
        lm_head = Linear(dense, None, fmt)
    return embed, lm_head


def build_model(g: GGUFFile, cfg: ArchConfig, fmt: str | None, n_ctx: int | None, *, bias: bool = False,
                device=None) -> TransformerModel:
    """``device`` (from ``load_model``): the Triton path on that device; None: the CPU formats."""
    from ..weights import load_format

    fmt = load_format(fmt)
    blocks = load_blocks(g, cfg, fmt, bias=bias, device=device)
    embed, lm_head = load_embedding(g, cfg, fmt, device)
    g.release_pages([n for n in ("token_embd.weight", "output.weight") if g.has_tensor(n)])
    out_norm = to_tensor(g.tensor("output_norm.weight"), torch.float32)
    model = TransformerModel(cfg, blocks, embed, out_norm, lm_head, n_ctx=n_ctx, path=g.path, device=device)
    model.weight_format = fmt  # the load format as resolved ("auto", "bf16", ...): drafters bound to it follow
    return model
