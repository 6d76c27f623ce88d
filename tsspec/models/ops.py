"""The trunk's pure tensor steps, shared by the model (``base``) and its runners (``runners``):
norms, rope, and batch-invariant attention over span groups.

Attention is batch invariant because each row is computed against a key range that depends only on
its own position (``attention_span``), with a matrix product whose row count is padded to a size
that stays on one GEMM route (``ATTN_MIN_ROWS``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..weights import pad_rows
from . import config
from .config import SPAN_BLOCK

# fp32 batched GEMM takes a different route below 4 rows; pad to stay on the invariant one.
ATTN_MIN_ROWS = 4


def attention_span(position: int, capacity: int) -> int:
    """Number of cache positions a query at ``position`` attends over (masked beyond it)."""
    return min(capacity, (position // SPAN_BLOCK + 1) * SPAN_BLOCK)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [..., d] float32; weights stored as the file has them (gemma's +1 already folded in)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope_tables(base: float, rot_dim: int, n_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``config.rope_tables`` as tensors: (cos, sin) float32 [n_pos, rot_dim / 2]."""
    cos, sin = config.rope_tables(base, rot_dim, n_pos)
    return torch.from_numpy(cos), torch.from_numpy(sin)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    """Rotate the first ``2*cos.shape[-1]`` dims of x [rows, heads, head_dim]; cos/sin [rows, r/2]."""
    half = cos.shape[-1]
    rot, rest = x[..., : 2 * half], x[..., 2 * half :]
    c, s = cos[:, None, :], sin[:, None, :]
    if neox:  # pairs (i, i + half)
        a, b = rot[..., :half], rot[..., half:]
        out = torch.cat([a * c - b * s, b * c + a * s], dim=-1)
    else:  # GGML "normal" mode: adjacent pairs (2i, 2i+1)
        pairs = rot.unflatten(-1, (half, 2))
        a, b = pairs[..., 0], pairs[..., 1]
        out = torch.stack([a * c - b * s, b * c + a * s], dim=-1).flatten(-2)
    return out if rest.shape[-1] == 0 else torch.cat([out, rest], dim=-1)


@dataclass
class SpanGroup:
    """Consecutive rows that share an attention span, with their masks precomputed."""

    i: int  # first row
    j: int  # one past the last row
    span: int
    masks: dict  # window (None = global) -> bool mask [rep*g, span]


def plan_attention(start: int, rows: int, capacity: int, rep: int, windows: set) -> list[SpanGroup]:
    """Group the rows of one forward by attention span; masks are shared by every layer."""
    groups = []
    i = 0
    while i < rows:
        span = attention_span(start + i, capacity)
        j = i + 1
        while j < rows and attention_span(start + j, capacity) == span:
            j += 1
        g = max(j - i, ATTN_MIN_ROWS)
        pos = torch.arange(start + i, start + i + g)
        pos[j - i :] = start + j - 1  # pad rows repeat the last real row
        t = torch.arange(span)
        causal = t[None, :] <= pos[:, None]  # [g, span]
        masks = {}
        for w in windows:
            allowed = causal if w is None else causal & (t[None, :] > pos[:, None] - w)
            masks[w] = allowed.repeat(rep, 1)  # [rep*g, span], row r*g + m
        groups.append(SpanGroup(i, j, span, masks))
        i = j
    return groups


def attend(
    q: torch.Tensor,  # [rows, n_heads, head_dim], roped and scaled
    k_cache: torch.Tensor,  # [n_kv, capacity, head_dim]
    v_cache: torch.Tensor,  # [n_kv, capacity, head_dim]
    groups: list[SpanGroup],
    window: int | None,
) -> torch.Tensor:
    """Causal (optionally sliding-window) attention, batch invariant per row. -> [rows, heads, dim]."""
    rows, n_heads, dim = q.shape
    n_kv = k_cache.shape[0]
    rep = n_heads // n_kv
    out = q.new_empty(q.shape) if len(groups) > 1 else None
    for grp in groups:
        qg = pad_rows(q[grp.i : grp.j], ATTN_MIN_ROWS)  # [g, heads, dim]
        g = qg.shape[0]
        # [n_kv, rep*g, dim]: query head h = kv*rep + r reads kv head `kv`
        qh = qg.view(g, n_kv, rep, dim).permute(1, 2, 0, 3).reshape(n_kv, rep * g, dim)
        scores = torch.matmul(qh, k_cache[:, : grp.span].transpose(1, 2))  # [n_kv, rep*g, span]
        scores.masked_fill_(~grp.masks[window], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.matmul(probs, v_cache[:, : grp.span])  # [n_kv, rep*g, dim]
        o = o.view(n_kv, rep, g, dim).permute(2, 0, 1, 3).reshape(g, n_heads, dim)
        if out is None:
            return o[: grp.j - grp.i]
        out[grp.i : grp.j] = o[: grp.j - grp.i]
    return out


# ----------------------------------------------------------------------------- weights
