"""Training a DFlash-style block drafter (``dflash``) on a frozen trunk's tapped residuals.

The drafter is the one ``tsspec.drafters.dflash`` runs: the residual rows entering a few trunk
layers are encoded (``fc``, ``enc.output_norm``) into context keys and values; a block
``[anchor, MASK x (B-1)]`` attends over them and over itself (non-causal) through a few small
transformer layers, and its rows 1..B-1 are read out through the trunk's own output rows (the draft
vocabulary). Here the same passes run batched with autograd: many anchors of one chunk share the
chunk's context, each seeing only the positions before it, as the ring does at decode time.

Row e of the block at anchor position p drafts the token at p + e; its target is the trunk's soft
next-token distribution at position p + e - 1 (teacher-forced), weighted less the further it is
from the anchor (a late draft only counts when every earlier one landed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np
import torch
import torch.nn.functional as F

from ..drafters.dflash.ops import _rope_at
from ..models.base import apply_rope, rms_norm
from .features import Features
from .head import add_matrix, add_provenance, path_acceptance, write_and_rename

ARCH = "dflash"
ANCHORS_PER_CHUNK = 32  # anchors of one chunk that share its context in a training step
POSITION_DECAY = 0.7  # loss weight of block row e is POSITION_DECAY ** (e - 1)


def choose_taps(n_layers: int, count: int) -> tuple[int, ...]:
    """Trunk layers whose entering residual the drafter reads: ``count`` spread from layer 1 to the
    last layer (shallow rows say what the text is, deep ones what the trunk is about to say)."""
    if n_layers < 2:
        return (0,)
    return tuple(int(t) for t in np.unique(np.round(np.linspace(1, n_layers - 1, count)).astype(int)))


def choose_mask_token(feats: Features, embed: torch.Tensor) -> int:
    """A token the training text never holds nor the trunk predicts, whose embedding row has a
    typical norm (the block's MASK; a near-zero row would blow up in the first norm)."""
    vocab = embed.shape[0]
    seen = torch.zeros(vocab, dtype=torch.bool)
    seen[feats.tokens.reshape(-1)] = True
    seen[feats.top_ids.reshape(-1)] = True
    unseen = torch.nonzero(~seen).flatten()
    if unseen.numel() == 0:
        unseen = torch.arange(vocab)
    norms = embed.float().norm(dim=-1)
    gap = (norms[unseen] - norms.median()).abs()
    return int(unseen[int(torch.argmin(gap))])


@dataclass(frozen=True)
class BlockShape:
    d: int
    n_taps: int
    n_layers: int
    n_heads: int
    n_kv: int
    head_dim: int
    ffn: int
    block_size: int
    eps: float
    rope_base: float

    @classmethod
    def for_trunk(cls, d: int, n_taps: int, n_layers: int, ffn: int, block_size: int, eps: float,
                  rope_base: float) -> "BlockShape":
        head_dim = 64 if d % 64 == 0 and d >= 128 else max(2, d // 2 - (d // 2) % 2)
        n_heads = max(1, d // head_dim)
        n_kv = n_heads // 3 if n_heads % 3 == 0 and n_heads >= 6 else n_heads
        return cls(d, n_taps, n_layers, n_heads, n_kv, head_dim, ffn, block_size, eps, rope_base)


class BlockLayer(torch.nn.Module):
    def __init__(self, s: BlockShape, g: torch.Generator):
        super().__init__()
        std = 0.02
        q_dim, kv_dim = s.n_heads * s.head_dim, s.n_kv * s.head_dim
        r = lambda *shape: torch.nn.Parameter(torch.randn(*shape, generator=g) * std)
        self.attn_norm = torch.nn.Parameter(torch.ones(s.d))
        self.attn_q, self.attn_k, self.attn_v = r(q_dim, s.d), r(kv_dim, s.d), r(kv_dim, s.d)
        self.attn_output = r(s.d, q_dim)
        self.attn_q_norm = torch.nn.Parameter(torch.ones(s.head_dim))
        self.attn_k_norm = torch.nn.Parameter(torch.ones(s.head_dim))
        self.ffn_norm = torch.nn.Parameter(torch.ones(s.d))
        self.ffn_gate, self.ffn_up = r(s.ffn, s.d), r(s.ffn, s.d)
        self.ffn_down = r(s.d, s.ffn)


class BlockModule(torch.nn.Module):
    """The DFlash passes A-C as trainable parameters, batched over chunks and anchors."""

    def __init__(self, s: BlockShape, out_norm: torch.Tensor, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.shape = s
        fc = torch.randn(s.d, s.n_taps * s.d, generator=g) * (0.02 / math.sqrt(s.n_taps))
        self.fc = torch.nn.Parameter(fc)
        self.enc_norm = torch.nn.Parameter(torch.ones(s.d))
        self.layers = torch.nn.ModuleList([BlockLayer(s, g) for _ in range(s.n_layers)])
        self.out_norm = torch.nn.Parameter(out_norm.detach().float().clone())

    def _heads(self, x: torch.Tensor, w: torch.Tensor, norm: torch.Tensor, heads: int,
               cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [..., d] -> projected, per-head normed and roped [..., heads, hd] (cos/sin per row)."""
        s = self.shape
        lead = x.shape[:-1]
        y = (x @ w.T).reshape(-1, heads, s.head_dim)
        y = apply_rope(rms_norm(y, norm, s.eps), cos, sin, True)
        return y.reshape(*lead, heads, s.head_dim)

    def forward(self, taps: torch.Tensor, tokens: torch.Tensor, anchor: torch.Tensor, embed: torch.Tensor,
                mask_token: int) -> torch.Tensor:
        """taps [N, L, T*d] (the chunk's tapped rows), tokens [N, L], anchor [N, m] positions
        -> the block's final-normed rows 1..B-1 [N, m, B-1, d]."""
        s = self.shape
        N, L, _ = taps.shape
        m, B = anchor.shape[1], s.block_size
        g = rms_norm(taps.float() @ self.fc.T, self.enc_norm, s.eps)  # PASS A [N, L, d]
        cos_c, sin_c = _rope_at(torch.arange(L), s.rope_base, s.head_dim)
        cos_c, sin_c = cos_c.repeat(N, 1).to(g.device), sin_c.repeat(N, 1).to(g.device)
        pos = anchor[..., None] + torch.arange(B, device=anchor.device)  # [N, m, B]
        cos_b, sin_b = (t.to(g.device) for t in _rope_at(pos.reshape(-1).cpu(), s.rope_base, s.head_dim))
        ids = torch.full((N, m, B), mask_token, dtype=torch.long, device=tokens.device)
        ids[..., 0] = tokens.gather(1, anchor)
        x = embed[ids].float()  # [N, m, B, d]
        visible = torch.arange(L, device=anchor.device)[None, None, :] < anchor[..., None]  # [N, m, L]
        rep = s.n_heads // s.n_kv
        scale = 1.0 / math.sqrt(s.head_dim)
        for layer in self.layers:
            # PASS B: the context's keys and values (from g, shared by every anchor of the chunk)
            kc = self._heads(g, layer.attn_k, layer.attn_k_norm, s.n_kv, cos_c, sin_c).repeat_interleave(rep, 2)
            vc = (g @ layer.attn_v.T).reshape(N, L, s.n_kv, s.head_dim).repeat_interleave(rep, 2)
            # PASS C: the block
            u = rms_norm(x, layer.attn_norm, s.eps)
            q = self._heads(u, layer.attn_q, layer.attn_q_norm, s.n_heads, cos_b, sin_b)  # [N, m, B, h, hd]
            kb = self._heads(u, layer.attn_k, layer.attn_k_norm, s.n_kv, cos_b, sin_b).repeat_interleave(rep, 3)
            vb = (u @ layer.attn_v.T).reshape(N, m, B, s.n_kv, s.head_dim).repeat_interleave(rep, 3)
            s_ctx = torch.einsum("nmbhd,nlhd->nmhbl", q, kc) * scale
            s_ctx = s_ctx.masked_fill(~visible[:, :, None, None, :], float("-inf"))
            s_blk = torch.einsum("nmbhd,nmchd->nmhbc", q, kb) * scale
            p = torch.softmax(torch.cat([s_ctx, s_blk], dim=-1), dim=-1)
            a = (torch.einsum("nmhbl,nlhd->nmbhd", p[..., :L], vc)
                 + torch.einsum("nmhbc,nmchd->nmbhd", p[..., L:], vb))
            x = x + a.reshape(N, m, B, -1) @ layer.attn_output.T
            u = rms_norm(x, layer.ffn_norm, s.eps)
            x = x + (F.silu(u @ layer.ffn_gate.T) * (u @ layer.ffn_up.T)) @ layer.ffn_down.T
        return rms_norm(x[:, :, 1:], self.out_norm, s.eps)


@dataclass
class BlockBatch:
    taps: torch.Tensor  # [N, L, T*d]
    tokens: torch.Tensor  # [N, L]
    anchor: torch.Tensor  # [N, m] anchor positions
    top_ids: torch.Tensor  # [N, m, B-1, k]: the trunk's targets for block rows 1..B-1
    top_p: torch.Tensor  # [N, m, B-1, k]
    greedy: torch.Tensor  # [N, m, B-1]: the trunk's greedy token at each row's position
    follows: torch.Tensor  # [N, m, B-1]: does the text's token there equal the trunk's greedy one


def make_block_batch(feats: Features, chunks: torch.Tensor, anchor: torch.Tensor, block_size: int) -> BlockBatch:
    """Chunks [N] and their anchors [N, m] -> what one forward and its loss read."""
    n = chunks[:, None, None]
    at = anchor[..., None] + torch.arange(block_size - 1, device=anchor.device)  # position p + e - 1
    top_ids = feats.top_ids[n, at]
    return BlockBatch(
        taps=feats.hidden[chunks], tokens=feats.tokens[chunks], anchor=anchor,
        top_ids=top_ids, top_p=feats.top_p[n, at], greedy=top_ids[..., 0],
        follows=feats.tokens[n, at + 1] == top_ids[..., 0],
    )


def sample_block_batch(feats: Features, n_anchors: int, block_size: int, gen: torch.Generator) -> BlockBatch:
    """``n_anchors`` random anchors, ``ANCHORS_PER_CHUNK`` per random chunk."""
    C, L = feats.tokens.shape
    per = min(ANCHORS_PER_CHUNK, n_anchors)
    N = max(1, -(-n_anchors // per))
    chunks = torch.randint(C, (N,), generator=gen)
    anchor = torch.randint(1, L - block_size + 1, (N, per), generator=gen)  # p + B - 1 <= L - 1 (follows reads it)
    dev = feats.tokens.device
    return make_block_batch(feats, chunks.to(dev), anchor.to(dev), block_size)


def block_loss(module: BlockModule, embed: torch.Tensor, lm_rows: torch.Tensor, t2d: torch.Tensor, mask_token: int,
               batch: BlockBatch) -> tuple[torch.Tensor, dict]:
    """Cross-entropy of each block row against the trunk's soft targets, rows weighted by distance."""
    h = module(batch.taps, batch.tokens, batch.anchor, embed, mask_token)
    logq = torch.log_softmax(h @ lm_rows.T, dim=-1)  # [N, m, B-1, Vd]
    d_ids = t2d[batch.top_ids]
    p = batch.top_p * (d_ids >= 0)
    ce = -(p * logq.gather(-1, d_ids.clamp(min=0))).sum(-1).mean(dim=(0, 1))  # [B-1]
    w = POSITION_DECAY ** torch.arange(ce.shape[0], dtype=ce.dtype, device=ce.device)
    total = (w * ce).sum() / w.sum()
    return total, {f"ce{e + 1}": float(ce[e].detach()) for e in range(min(3, ce.shape[0]))}


@torch.no_grad()
def evaluate_block(module: BlockModule, embed: torch.Tensor, lm_rows: torch.Tensor, d2t: torch.Tensor, mask_token: int,
                   feats: Features, max_anchors: int = 4096, seed: int = 0) -> dict:
    """Held-out acceptance as greedy decoding would see it: the block's e-th draft is judged only
    where the trunk's greedy path follows the text for the e - 1 tokens before it; ``accept[e - 1]``
    is the share of those anchors whose first e drafts all equal the trunk's greedy tokens, and
    ``tokens_per_verify`` the expected tokens one verify of the whole block emits."""
    s = module.shape
    gen = torch.Generator().manual_seed(seed)
    C, L = feats.tokens.shape
    per = min(L - s.block_size, max(ANCHORS_PER_CHUNK, max_anchors // C))  # distinct anchors per chunk
    chunks = torch.randperm(C, generator=gen)[: max(1, max_anchors // per)]
    anchor = torch.stack([1 + torch.randperm(L - s.block_size, generator=gen)[:per] for _ in range(len(chunks))])
    hits, follows = [], []
    dev = feats.tokens.device
    for i in range(0, len(chunks), 8):
        b = make_block_batch(feats, chunks[i:i + 8].to(dev), anchor[i:i + 8].to(dev), s.block_size)
        h = module(b.taps, b.tokens, b.anchor, embed, mask_token)
        hits.append((d2t[(h @ lm_rows.T).argmax(-1)] == b.greedy).reshape(-1, s.block_size - 1))
        follows.append(b.follows.reshape(-1, s.block_size - 1))
    hit, fol = torch.cat(hits), torch.cat(follows)
    return path_acceptance(hit, fol)


def copy_tokenizer_keys(w, trunk) -> None:
    """The trunk's (a ``GGUFFile``) ``tokenizer.*`` keys with their stored types: llama.cpp builds
    a vocabulary for every model it loads, a drafter included. An empty array is left out: gguf-py
    cannot write one (llama.cpp's own writer can), and an absent key reads the same there."""
    import gguf

    for key, value in trunk.metadata.items():
        if not key.startswith("tokenizer.") or key == "tokenizer.ggml.mask_token_id":
            continue
        types = trunk.reader.fields[key].types
        if types[0] == gguf.GGUFValueType.ARRAY:
            if len(value):
                w.add_key_value(key, list(value), types[0], sub_type=types[-1])
        else:
            w.add_key_value(key, value, types[0])


def export_block_gguf(path: Path, module: BlockModule, taps: tuple[int, ...], mask_token: int, head_rows,
                      d2t: np.ndarray, trunk: Mapping[str, object], training: Mapping[str, object],
                      *, trunk_file, context_length: int, weights: str = "q8_0") -> None:
    """Write the drafter in the ``dflash`` layout ``tsspec.drafters.dflash`` and llama.cpp's
    ``draft-dflash`` read: its own matrices (Q8_0 or F32), the norms exact, ``output.weight`` = the
    trunk's output rows ``d2t`` (I64, as llama.cpp requires) in their stored blocks, the trunk's
    tokenizer keys (``trunk_file``: its ``GGUFFile``), the MASK token where llama.cpp
    reads it (``tokenizer.ggml.mask_token_id``), the trunk's ``context_length``, plus
    ``dflash.trunk.*`` keys binding it to its trunk."""
    import gguf

    s = module.shape
    path = Path(path)
    tmp = path.with_name(path.name + ".part")
    w = gguf.GGUFWriter(str(tmp), ARCH)
    w.add_name(f"tsspec block drafter for {trunk.get('name', trunk['architecture'])}")
    for key, value in (("block_count", s.n_layers), ("embedding_length", s.d), ("attention.head_count", s.n_heads),
                       ("attention.head_count_kv", s.n_kv), ("attention.key_length", s.head_dim),
                       ("rope.dimension_count", s.head_dim), ("feed_forward_length", s.ffn),
                       ("block_size", s.block_size), ("mask_token_id", mask_token),
                       ("vocab_size", int(trunk["vocab_size"]))):
        w.add_uint32(f"{ARCH}.{key}", int(value))
    w.add_float32(f"{ARCH}.attention.layer_norm_rms_epsilon", float(s.eps))
    w.add_float32(f"{ARCH}.rope.freq_base", float(s.rope_base))
    w.add_array(f"{ARCH}.target_layers", [int(t) for t in taps])
    add_provenance(w, ARCH, trunk, training)
    w.add_uint32(f"{ARCH}.context_length", int(context_length))
    copy_tokenizer_keys(w, trunk_file)
    w.add_uint32("tokenizer.ggml.mask_token_id", int(mask_token))

    def matrix(name: str, p: torch.Tensor) -> None:
        add_matrix(w, name, p, weights)

    def vector(name: str, p: torch.Tensor) -> None:
        w.add_tensor(name, p.detach().float().cpu().contiguous().numpy())

    matrix("fc.weight", module.fc)
    vector("enc.output_norm.weight", module.enc_norm)
    vector("output_norm.weight", module.out_norm)
    for i, layer in enumerate(module.layers):
        p = f"blk.{i}."
        for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
            matrix(p + n + ".weight", getattr(layer, n))
        for n in ("attn_norm", "attn_q_norm", "attn_k_norm", "ffn_norm"):
            vector(p + n + ".weight", getattr(layer, n))
    # the trunk's own output rows, block for block: the drafter scores exactly what the trunk would
    raw = head_rows.stored()
    if head_rows.type_name in ("F32", "F16", "BF16"):
        dt = {"F32": np.float32, "F16": np.float16}.get(head_rows.type_name)
        if dt is None:
            w.add_tensor("output.weight", head_rows.dense().astype(np.float32))
        else:
            w.add_tensor("output.weight", raw.view(dt).reshape(head_rows.shape))
    else:
        w.add_tensor("output.weight", raw, raw_dtype=gguf.GGMLQuantizationType[head_rows.type_name])
    w.add_tensor("d2t", np.asarray(d2t, dtype=np.int64))
    write_and_rename(w, tmp, path)
