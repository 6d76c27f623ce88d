"""Gated full attention (Qwen3.5/3.6, Qwen3-Next): the attention layer of the hybrid trunks, and the
decoder block of their NextN/MTP draft heads (``tsspec.drafters.nextn``), which is why it lives in a
module of its own rather than in either user.

``attn_q`` emits query and an output gate interleaved per head ([q_h, gate_h] for each head h), q/k
RMS norms per head, NEOX rope on the first ``rope.dimension_count`` dims of a head (partial rotary).
M-RoPE sections (``rope.dimension_sections``) collapse to plain rope for text: every section reads
the same text position. Output = o_proj(attn * sigmoid(gate)). Every layer then has a dense
SiLU-gated FFN behind ``post_attention_norm``. KV caching and attention are ``base``'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..gguf_file import GGUFFile
from ..weights import Linear, to_tensor
from .base import ArchConfig, apply_rope, attend, load_weight, plan_attention, rms_norm


@dataclass
class AttnLayer:
    """Gated full attention; also the decoder block of a NextN/MTP head."""

    attn_norm: torch.Tensor
    qkv: Linear  # rows: [q_0, gate_0, q_1, gate_1, ...] (2 * n_heads * head_dim), k, v
    o: Linear
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear


def ffn(blk, x: torch.Tensor) -> torch.Tensor:
    gu = blk.gate_up(x)
    f = gu.shape[1] // 2
    return blk.down(F.silu(gu[:, :f]) * gu[:, f:])


def gated_attention(cfg: ArchConfig, blk: AttnLayer, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    start: int, cos: torch.Tensor, sin: torch.Tensor, groups=None) -> torch.Tensor:
    """x [n, d] normed -> attention output [n, d]; writes K/V at start..start+n of the given caches.

    ``groups``: ``base.plan_attention`` for this forward (planned here when not given).
    """
    n = x.shape[0]
    nh, nkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    p = blk.qkv(x)
    qg = p[:, : 2 * nh * hd].view(n, nh, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(n, nh * hd)
    k = p[:, 2 * nh * hd : 2 * nh * hd + nkv * hd].view(n, nkv, hd)
    v = p[:, 2 * nh * hd + nkv * hd :].view(n, nkv, hd)
    q = rms_norm(q, blk.q_norm, cfg.rms_eps)
    k = rms_norm(k, blk.k_norm, cfg.rms_eps)
    q = apply_rope(q, cos, sin, True) * (1.0 / math.sqrt(hd))
    k = apply_rope(k, cos, sin, True)
    k_cache[:, start : start + n] = k.transpose(0, 1)
    v_cache[:, start : start + n] = v.transpose(0, 1)
    if groups is None:
        groups = plan_attention(start, n, k_cache.shape[1], nh // nkv, {None})
    a = attend(q, k_cache, v_cache, groups, None).reshape(n, nh * hd)
    return blk.o(a * torch.sigmoid(gate))


def vec(g: GGUFFile, name: str) -> torch.Tensor:
    return to_tensor(g.tensor(name), torch.float32)


def weight(g: GGUFFile, name: str, fmt: str):
    """One product's weight in the load format (the file's blocks under "auto")."""
    return load_weight(g, [name], fmt)[0]


def load_attn_layer(g: GGUFFile, p: str, fmt: str) -> AttnLayer:
    def t(name: str):
        return weight(g, name, fmt)

    return AttnLayer(
        attn_norm=vec(g, p + "attn_norm.weight"),
        qkv=Linear.concat([(t(p + "attn_q.weight"), None), (t(p + "attn_k.weight"), None),
                           (t(p + "attn_v.weight"), None)], fmt),
        o=Linear(t(p + "attn_output.weight"), None, fmt),
        q_norm=vec(g, p + "attn_q_norm.weight"),
        k_norm=vec(g, p + "attn_k_norm.weight"),
        post_norm=vec(g, p + "post_attention_norm.weight"),
        gate_up=Linear.concat([(t(p + "ffn_gate.weight"), None), (t(p + "ffn_up.weight"), None)], fmt),
        down=Linear(t(p + "ffn_down.weight"), None, fmt),
    )
