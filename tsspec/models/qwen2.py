"""``qwen2`` (Qwen2.5, Qwen2.5-Coder): llama block with biases on Q/K/V, NEOX rope."""

from __future__ import annotations

from ..gguf_file import GGUFFile
from .base import ArchConfig, LayerSpec, build_model, common_config

ARCH = "qwen2"


def config(g: GGUFFile) -> ArchConfig:
    c = common_config(g, ARCH)
    base = float(g.get(f"{ARCH}.rope.freq_base", 1000000.0))
    return ArchConfig(**c, rope_neox=True, layers=[LayerSpec(base) for _ in range(c["n_layers"])])


def load(g: GGUFFile, fmt: str | None = None, n_ctx: int | None = None, device=None):
    return build_model(g, config(g), fmt, n_ctx, bias=True, device=device)
