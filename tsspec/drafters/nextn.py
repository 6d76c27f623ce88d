"""NextN/MTP draft heads (Qwen3.5/3.6): one extra decoder block stored after the main stack.

Tensors ``blk.N.nextn.*`` with N = the trunk's layer count: ``eh_proj`` [d, 2d], ``enorm``,
``hnorm``, a full gated-attention decoder block at ``blk.N.*`` (as ``qwen35``'s attention layers),
and optionally ``shared_head_norm``/``shared_head_head`` and ``embed_tokens`` (else the trunk's
output norm, LM head and embedding are borrowed).

One head step, for the token t at sequence position p and the trunk row h of position p - 1:

    x  = eh_proj([enorm(embed(t)), hnorm(h)])        # e first, as llama.cpp concatenates
    x += attn(attn_norm(x))  at head-cache row p - 1 (rope position p - 1)
    x += ffn(post_norm(x))
    h' = head_norm(x);  logits = lm_head(h')          # h' chains into the next step

Hidden space. The head reads the trunk's *final-normed* hidden (llama.cpp's ``h_nextn``) and
chains its own normed output, so ``draft_step``/``catch_up`` take rows in that space;
``from_trunk`` maps trunk tap rows (tap ``n_layers``: the residual before the final norm) into it.

Each sequence gives the head its own small KV cache (``new_state()``; row r holds the pair
(h_r, t_{r+1})); rows written while chaining drafts are provisional and are rewritten from the
trunk's exact rows by the next catch-up. The head itself holds weights only.

A trunk file that carries NextN blocks gets its head from ``builtin_head(trunk)``, loaded once per
trunk on first use (the model layer never imports a drafter).
"""

from __future__ import annotations

import weakref
from typing import Sequence

import torch

from ..errors import ModelFileError
from ..gguf_file import GGUFFile
from ..models.qwen35 import nextn_tensors
from ..validate import check_tensors
from .protocols import DraftHeadKind
from ..weights import Embedding, GGUFWeight, Linear, gguf_native, load_format, to_tensor
from ..models.base import rms_norm
from ..models.cache import KVCache
from ..models.gated_attention import AttnLayer, ffn, gated_attention, load_attn_layer, weight


def nextn_layer_index(g: GGUFFile) -> int | None:
    for name in g.tensor_names():
        if name.endswith(".nextn.eh_proj.weight"):
            return int(name.split(".")[1])
    return None


def own_embedding(g: GGUFFile, name: str, fmt: str):
    """A head's own embedding table in the load format: under "auto" the file's rows as stored
    (dequantized exactly on lookup) or, off the native kernels, their float32 values; bf16 only
    when asked for (bf16, or the lossy int4 drafter format)."""
    info = g.tensor_info(name)
    if fmt == "auto" and gguf_native(info.type_name, tuple(info.shape)):
        return Embedding(GGUFWeight.from_file(*g.tensor_raw(name), info.shape))
    return to_tensor(g.tensor(name), torch.bfloat16 if fmt in ("bf16", "int4") else torch.float32)


class NextNHead:
    """DraftHead (PER_TOKEN) over a NextN/MTP block bound to one trunk."""

    kind = DraftHeadKind.PER_TOKEN
    block_size = 1

    def __init__(self, target, eh_proj: Linear, enorm: torch.Tensor, hnorm: torch.Tensor, block: AttnLayer,
                 head_norm: torch.Tensor, lm_head: Linear, embed: torch.Tensor):
        self.target = target
        self.cfg = target.cfg
        self.eh_proj, self.enorm, self.hnorm = eh_proj, enorm, hnorm
        self.block, self.head_norm, self.lm_head, self.embed = block, head_norm, lm_head, embed

    def new_state(self) -> KVCache:
        """One sequence's head cache (one attention layer), growing up to the trunk's context."""
        return KVCache(1, self.cfg.n_kv_heads, self.cfg.head_dim, self.target.max_context, capacity=256)

    @classmethod
    def from_gguf(cls, g: GGUFFile, target, *, layer: int | None = None, fmt: str | None = None) -> "NextNHead":
        fmt = load_format(fmt)
        layer = nextn_layer_index(g) if layer is None else layer
        if layer is None:
            raise ModelFileError(f"{g.path.name}: no NextN/MTP block (blk.N.nextn.eh_proj.weight)")
        cfg = getattr(target, "cfg", None)
        if cfg is None or not hasattr(target, "out_norm"):
            raise ModelFileError(f"{g.path.name}: a NextN head needs a transformer trunk to bind to")
        p = f"blk.{layer}."
        # every tensor of the block against the trunk it binds to, by name, before any is read
        hp = dict(d=cfg.d_model, q=cfg.n_heads * cfg.head_dim, q2=2 * cfg.n_heads * cfg.head_dim,
                  kv=cfg.n_kv_heads * cfg.head_dim, hd=cfg.head_dim, ffn=cfg.ffn_dim, vocab=cfg.vocab_size)
        check_tensors(g.path.name, hp, {t.name: t for t in g.records}, nextn_tensors(layer, hp))
        eh_shape = tuple(g.tensor_info(p + "nextn.eh_proj.weight").shape)
        want_q = 2 * cfg.n_heads * cfg.head_dim
        if eh_shape != (cfg.d_model, 2 * cfg.d_model) or g.tensor_info(p + "attn_q.weight").shape[0] != want_q:
            raise ModelFileError(
                f"{g.path.name}: NextN block shapes (eh_proj {eh_shape}) do not fit this trunk "
                f"(d_model {cfg.d_model}, gated q of {want_q} rows)"
            )

        def vec(name: str) -> torch.Tensor:
            return to_tensor(g.tensor(name), torch.float32)

        embed = (own_embedding(g, p + "nextn.embed_tokens.weight", fmt)
                 if g.has_tensor(p + "nextn.embed_tokens.weight") else target.embed)
        head = (Linear(weight(g, p + "nextn.shared_head_head.weight", fmt), None, fmt)
                if g.has_tensor(p + "nextn.shared_head_head.weight") else target.lm_head)
        norm = vec(p + "nextn.shared_head_norm.weight") if g.has_tensor(p + "nextn.shared_head_norm.weight") \
            else target.out_norm
        return cls(target, Linear(weight(g, p + "nextn.eh_proj.weight", fmt), None, fmt), vec(p + "nextn.enorm.weight"), vec(p + "nextn.hnorm.weight"),
                   load_attn_layer(g, p, fmt), norm, head, embed)

    # -- hidden space ---------------------------------------------------------------------------
    def from_trunk(self, rows: torch.Tensor) -> torch.Tensor:
        """Trunk tap rows [n, d] (residual after the last layer) -> the head's input space."""
        return rms_norm(rows.float(), self.target.out_norm, self.cfg.rms_eps)

    # -- compute --------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward_rows(self, tokens: Sequence[int], hidden: torch.Tensor, start_pos: int, cache: KVCache
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens at positions start_pos.., hidden [n, d] of positions start_pos-1.. -> (logits, h') per row."""
        cfg = self.cfg
        n = len(tokens)
        r0 = start_pos - 1
        if r0 < 0:
            raise ValueError("a NextN step needs the hidden row of the previous position")
        cache.reserve(r0 + n)
        ids = torch.as_tensor(list(tokens), dtype=torch.long)
        e = rms_norm(self.embed[ids].float(), self.enorm, cfg.rms_eps)
        h = rms_norm(hidden.float().reshape(n, -1), self.hnorm, cfg.rms_eps)
        x = self.eh_proj(torch.cat([e, h], dim=-1))
        cos, sin = self.target.rope(cfg.layers[0].rope_base)
        blk = self.block
        x = x + gated_attention(cfg, blk, rms_norm(x, blk.attn_norm, cfg.rms_eps), cache.k[0],
                                cache.v[0], r0, cos[r0 : r0 + n], sin[r0 : r0 + n])
        x = x + ffn(blk, rms_norm(x, blk.post_norm, cfg.rms_eps))
        cache.length = r0 + n
        h_out = rms_norm(x, self.head_norm, cfg.rms_eps)
        return self.lm_head(h_out), h_out

    # -- DraftHead ------------------------------------------------------------------------------
    def draft_step(self, token: int, hidden: torch.Tensor, position: int, state: KVCache
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        logits, h = self.forward_rows([token], hidden.reshape(1, -1), position, state)
        return logits[0], h[0]

    def catch_up(self, tokens: Sequence[int], hidden: torch.Tensor, start_pos: int, state: KVCache) -> None:
        if tokens:
            self.forward_rows(tokens, hidden, start_pos, state)

    def catch_up_and_step(self, tokens: Sequence[int], hidden: torch.Tensor, start_pos: int, state: KVCache
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """The catch-up over committed rows folded with the first draft step: one forward, last row out."""
        logits, h = self.forward_rows(tokens, hidden, start_pos, state)
        return logits[-1], h[-1]

    def draft_block(self, last_token, hidden, position, state):
        raise NotImplementedError("a NextN head drafts one token per pass")


class NextNDrafter:
    """A separate draft-head GGUF bound to its target (served by the registry's ``draft-head`` entry)."""

    speculator_name = "draft-head"
    preferred_window = None  # the trunk's, else the default

    def __init__(self, head: NextNHead, path=None):
        self.draft_head = head
        self.path = path
        self.notes: list[str] = []
        self.warnings: list[str] = []


def load(g: GGUFFile, target, options=None) -> NextNDrafter:
    """Bind a NextN/MTP-only GGUF to ``target`` (shapes must match; embeddings/head are borrowed)."""
    from . import drafter_format

    return NextNDrafter(NextNHead.from_gguf(g, target, fmt=drafter_format(options, target)), path=g.path)


_BUILTIN: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def builtin_head(target) -> NextNHead | None:
    """The NextN/MTP head stored in the trunk's own file (a hybrid trunk with ``nextn_predict_layers``),
    loaded once per trunk on first use; None when the file carries none."""
    hy = getattr(target, "cfg", None) and target.cfg.extra.get("hybrid")
    if not hy or not hy.n_nextn or getattr(target, "path", None) is None:
        return None
    try:
        return _BUILTIN[target]
    except KeyError:
        pass
    g = GGUFFile(target.path)
    head = None
    if g.has_tensor(f"blk.{target.cfg.n_layers}.nextn.eh_proj.weight"):
        head = NextNHead.from_gguf(g, target, layer=target.cfg.n_layers, fmt=target.weight_format)
    _BUILTIN[target] = head
    return head
