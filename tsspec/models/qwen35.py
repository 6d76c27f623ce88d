"""``qwen35`` (dense Qwen3.5/3.6): the hybrid trunk (``hybrid``) with llama.cpp's qwen35 layout.

Value heads are in llama.cpp's *tiled* order (value head h reads key head h % n_k; the converter
reorders HF's grouped heads), and a GatedDeltaNet layer's input product is stored as four tensors
(``attn_qkv``, ``attn_gate``, ``ssm_beta``, ``ssm_alpha``). A file may carry NextN/MTP blocks after
the main stack; ``tsspec.drafters.nextn`` loads them as a draft head.
"""

from __future__ import annotations

import numpy as np

from ..gguf_file import GGUFFile
from .base import ArchConfig
from .hybrid import HybridModel, HybridSpec, build_hybrid, hybrid_config

ARCH = "qwen35"


def config(g: GGUFFile) -> ArchConfig:
    return hybrid_config(g, ARCH, v_heads_tiled=True)


def gdn_projections(g: GGUFFile, p: str, hy: HybridSpec) -> list[np.ndarray]:
    """[qkv, z, beta, alpha] weight matrices of one qwen35 GatedDeltaNet layer."""
    return [g.tensor(p + "attn_qkv.weight"), g.tensor(p + "attn_gate.weight"),
            g.tensor(p + "ssm_beta.weight"), g.tensor(p + "ssm_alpha.weight")]


def load(g: GGUFFile, fmt: str | None = None, n_ctx: int | None = None, *,
         verify_snapshots: bool = True) -> HybridModel:
    return build_hybrid(g, config(g), fmt, n_ctx, gdn_projections, verify_snapshots=verify_snapshots)
