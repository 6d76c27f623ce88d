"""``qwen3`` (dense Qwen3): no QKV bias, RMS norms on each head's q and k before rope, NEOX rope."""

from __future__ import annotations

from ..gguf_file import GGUFFile
from ..validate import ArchTables, every_block, rope_base
from .config import ArchConfig, LayerSpec, common_config
from .llama import ATTENTION, FFN, QK_NORM

ARCH = "qwen3"

ROPE_BASE = rope_base(1000000.0)
TABLES = ArchTables(ARCH, keys=(ROPE_BASE,), blocks=every_block({**ATTENTION, **QK_NORM, "ffn_norm.weight": ("d",),
                                                                **FFN}))
TRITON = True  # the trunk runs on the GPU path (``load_model(device="cuda")``)
LEAN = True  # the llama block: a plain greedy run takes it without torch (``models.lean``)


def config(g: GGUFFile) -> ArchConfig:
    c = common_config(g, ARCH)
    base = float(ROPE_BASE.read(g, ARCH))
    return ArchConfig(**c, rope_neox=True, qk_norm=True, layers=[LayerSpec(base) for _ in range(c["n_layers"])])


def load(g: GGUFFile, fmt: str | None = None, n_ctx: int | None = None, device=None):
    from .base import build_model  # torch: not imported by a run that only reads the config (``lean``)

    return build_model(g, config(g), fmt, n_ctx, device=device)
