"""``llama`` (SmolLM2, Llama): RMSNorm, SiLU MLP, rotary attention with GQA.

The GGUF converter permutes Q/K rows for GGML's rope layout (adjacent pairs), so this file rotates
adjacent pairs (``rope_neox=False``) on the weights as stored rather than un-permuting them.

The llama block's tensor tables (``ATTENTION``, ``QK_NORM``, ``FFN``) are the family's: the other
architectures' files build their blocks from them.
"""

from __future__ import annotations

from ..gguf_file import GGUFFile
from ..validate import ArchTables, every_block, rope_base
from .config import ArchConfig, LayerSpec, common_config

ARCH = "llama"

# the llama family's block tensors, in numpy order (see ``validate.Table``)
ATTENTION = {"attn_norm.weight": ("d",), "attn_q.weight": ("q", "d"), "attn_k.weight": ("kv", "d"),
             "attn_v.weight": ("kv", "d"), "attn_output.weight": ("d", "q")}
QK_NORM = {"attn_q_norm.weight": ("hd",), "attn_k_norm.weight": ("hd",)}
FFN = {"ffn_gate.weight": ("ffn", "d"), "ffn_up.weight": ("ffn", "d"), "ffn_down.weight": ("d", "ffn")}

ROPE_BASE = rope_base(10000.0)
TABLES = ArchTables(ARCH, keys=(ROPE_BASE,), blocks=every_block({**ATTENTION, "ffn_norm.weight": ("d",), **FFN}))
TRITON = True  # the trunk runs on the GPU path (``load_model(device="cuda")``)
LEAN = True  # the llama block: a plain greedy run takes it without torch (``models.lean``)


def config(g: GGUFFile) -> ArchConfig:
    c = common_config(g, ARCH)
    base = float(ROPE_BASE.read(g, ARCH))
    return ArchConfig(**c, rope_neox=False, layers=[LayerSpec(base) for _ in range(c["n_layers"])])


def load(g: GGUFFile, fmt: str | None = None, n_ctx: int | None = None, device=None):
    from .base import build_model  # torch: not imported by a run that only reads the config (``lean``)

    return build_model(g, config(g), fmt, n_ctx, device=device)
