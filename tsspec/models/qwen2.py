"""``qwen2`` (Qwen2.5, Qwen2.5-Coder): llama block with biases on Q/K/V, NEOX rope."""

from __future__ import annotations

from ..gguf_file import GGUFFile
from ..validate import ArchTables, every_block, rope_base
from .config import ArchConfig, LayerSpec, common_config
from .llama import ATTENTION, FFN

ARCH = "qwen2"

ROPE_BASE = rope_base(1000000.0)
TABLES = ArchTables(ARCH, keys=(ROPE_BASE,), blocks=every_block({
    **ATTENTION, "attn_q.bias?": ("q",), "attn_k.bias?": ("kv",), "attn_v.bias?": ("kv",),
    "ffn_norm.weight": ("d",), **FFN}))
TRITON = True  # the trunk runs on the GPU path (``load_model(device="cuda")``)
LEAN = True  # the llama block: a plain greedy run takes it without torch (``models.lean``)
QKV_BIAS = True  # Q, K and V carry biases (where the file has them)


def config(g: GGUFFile) -> ArchConfig:
    c = common_config(g, ARCH)
    base = float(ROPE_BASE.read(g, ARCH))
    return ArchConfig(**c, rope_neox=True, layers=[LayerSpec(base) for _ in range(c["n_layers"])])


def load(g: GGUFFile, fmt: str | None = None, n_ctx: int | None = None, device=None):
    from .base import build_model  # torch: not imported by a run that only reads the config (``lean``)

    return build_model(g, config(g), fmt, n_ctx, bias=QKV_BIAS, device=device)
