"""``qwen35`` (dense Qwen3.5/3.6): the hybrid trunk (``hybrid``) with llama.cpp's qwen35 layout.

Value heads are in llama.cpp's *tiled* order (value head h reads key head h % n_k; the converter
reorders HF's grouped heads), and a GatedDeltaNet layer's input product is stored as four tensors
(``attn_qkv``, ``attn_gate``, ``ssm_beta``, ``ssm_alpha``). A file may carry NextN/MTP blocks after
the main stack; ``tsspec.drafters.nextn`` loads them as a draft head.
"""

from __future__ import annotations

from ..gguf_file import GGUFFile
from .base import ArchConfig, load_weight
from .hybrid import HybridModel, HybridSpec, build_hybrid, hybrid_config

ARCH = "qwen35"


def config(g: GGUFFile) -> ArchConfig:
    return hybrid_config(g, ARCH, v_heads_tiled=True)


def gdn_projections(g: GGUFFile, p: str, hy: HybridSpec, fmt: str) -> list:
    """[qkv, z, beta, alpha] weights of one qwen35 GatedDeltaNet layer, in the load format (the
    file's blocks under "auto")."""
    return load_weight(g, [p + "attn_qkv.weight", p + "attn_gate.weight", p + "ssm_beta.weight",
                           p + "ssm_alpha.weight"], fmt)


def load(g: GGUFFile, fmt: str | None = None, n_ctx: int | None = None, *,
         verify_snapshots: bool = True) -> HybridModel:
    return build_hybrid(g, config(g), fmt, n_ctx, gdn_projections, verify_snapshots=verify_snapshots)
