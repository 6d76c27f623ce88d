"""The C structures of a llama-family trunk for the native kernels (``kernels.FusedBlocks``), built
from its blocks whatever holds their norms: torch tensors (the torch model's ``NativeRunner``) or
numpy arrays (``lean``, without torch). One builder, so both paths run the same C calls on the same
values.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .config import ArchConfig, Block


def _f32(t):
    """A float32, contiguous copy-or-view of a norm: numpy stays numpy, a tensor stays a tensor."""
    if isinstance(t, np.ndarray):
        return np.ascontiguousarray(t, dtype=np.float32)
    return t.float().contiguous()


def fused_blocks(cfg: ArchConfig, blocks: Sequence[Block], rope_bases: list[float], q_scale: float, lm_head,
                 out_norm):
    """``kernels.FusedBlocks`` over ``blocks`` (and ``fused_output`` for the head), or None when a
    block has a weight off the gguf backend (bf16/f32/int4 formats, unsupported quant types), the
    architecture's steps are not the C block's, or the kernels are missing."""
    from .. import kernels

    if not kernels.available():
        return None
    if cfg.activation not in ("silu", "gelu_tanh") or cfg.rope_dim % 2 or cfg.rope_dim > cfg.head_dim:
        return None
    layers, keep = [], []
    for li, blk in enumerate(blocks):
        lins = [kernels.c_linear(x) for x in (blk.qkv, blk.o, blk.gate_up, blk.down)]
        if any(x is None for x in lins):
            return None
        L = kernels.CLayer()
        L.qkv, L.o, L.gate_up, L.down = lins
        norms = {}
        for name in ("attn_norm", "ffn_norm", "q_norm", "k_norm", "post_attn_norm", "post_ffn_norm"):
            t = getattr(blk, name)
            if t is not None:
                t = _f32(t)
                keep.append(t)
                norms[name] = kernels._ptr(t)
            setattr(L, name, norms.get(name))
        spec = cfg.layers[li]
        L.window = spec.window or 0
        L.rope = rope_bases.index(spec.rope_base)
        layers.append(L)
        keep.append(blk)
    c = kernels.CConfig(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim, cfg.rope_dim // 2,
                        1 if cfg.rope_neox else 0, 1 if cfg.activation == "gelu_tanh" else 0, cfg.rms_eps, q_scale)
    return kernels.FusedBlocks(c, layers, keep, output=fused_output(cfg, lm_head, out_norm))


def fused_output(cfg: ArchConfig, lm_head, out_norm):
    """The native form of the final norm and LM head, or None when the head is off the gguf
    backend (the torch path then runs them)."""
    from .. import kernels

    head = kernels.c_linear(lm_head)
    if head is None:
        return None
    norm = _f32(out_norm)
    return kernels.FusedOutput(head, norm, cfg.rms_eps, [lm_head, norm])
