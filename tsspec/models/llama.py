"""``llama`` (SmolLM2, Llama): RMSNorm, SiLU MLP, rotary attention with GQA.

The GGUF converter permutes Q/K rows for GGML's rope layout (adjacent pairs), so this file rotates
adjacent pairs (``rope_neox=False``) on the weights as stored rather than un-permuting them.
"""

from __future__ import annotations

from ..gguf_file import GGUFFile
from .base import ArchConfig, LayerSpec, build_model, common_config

ARCH = "llama"


def config(g: GGUFFile) -> ArchConfig:
    c = common_config(g, ARCH)
    base = float(g.get(f"{ARCH}.rope.freq_base", 10000.0))
    return ArchConfig(**c, rope_neox=False, layers=[LayerSpec(base) for _ in range(c["n_layers"])])


def load(g: GGUFFile, fmt: str | None = None, n_ctx: int | None = None, device=None):
    return build_model(g, config(g), fmt, n_ctx, device=device)
