"""``gemma3``: sliding-window local layers and global layers, sandwich norms, GELU MLP.

* Five local (sliding-window, rope base 10000) layers per global one (the file's rope base);
  ``gemma3.attention.sliding_window_pattern`` overrides the period where a file has it.
* Norm weights are used as stored: the GGUF converter already folded Gemma's +1 into them.
* Embeddings are scaled by sqrt(d_model); queries by 1/sqrt(head_dim).
* Final logits are soft-capped only when the file says so.
"""

from __future__ import annotations

import math

from ..gguf_file import GGUFFile
from ..validate import ArchTables, Key, every_block, rope_base
from .config import ArchConfig, LayerSpec, common_config
from .llama import ATTENTION, FFN, QK_NORM

ARCH = "gemma3"
LOCAL_ROPE_BASE = 10000.0

ROPE_BASE = rope_base(1000000.0)  # the global layers'
WINDOW = Key("attention.sliding_window", int, 512, high=1 << 40)
PERIOD = Key("attention.sliding_window_pattern", int, 6)
SOFTCAP = Key("final_logit_softcapping", float, optional=True, low=0, high=1e30)
TABLES = ArchTables(ARCH, keys=(ROPE_BASE, WINDOW, PERIOD, SOFTCAP), blocks=every_block({
    **ATTENTION, **QK_NORM, "post_attention_norm.weight": ("d",), "ffn_norm.weight": ("d",), **FFN,
    "post_ffw_norm.weight": ("d",)}))
TRITON = True  # the trunk runs on the GPU path (``load_model(device="cuda")``)
LEAN = True  # the llama block: a plain greedy run takes it without torch (``models.lean``)


def config(g: GGUFFile) -> ArchConfig:
    c = common_config(g, ARCH)
    base = float(ROPE_BASE.read(g, ARCH))
    window = int(WINDOW.read(g, ARCH))
    period = int(PERIOD.read(g, ARCH))
    layers = [
        LayerSpec(base, None) if (i + 1) % period == 0 else LayerSpec(LOCAL_ROPE_BASE, window)
        for i in range(c["n_layers"])
    ]
    softcap = SOFTCAP.read(g, ARCH)
    return ArchConfig(
        **c,
        rope_neox=True,
        layers=layers,
        activation="gelu_tanh",
        qk_norm=True,
        post_norms=True,
        embed_scale=math.sqrt(c["d_model"]),
        final_softcap=float(softcap) if softcap else None,
    )


def load(g: GGUFFile, fmt: str | None = None, n_ctx: int | None = None, device=None):
    from .base import build_model  # torch: not imported by a run that only reads the config (``lean``)

    return build_model(g, config(g), fmt, n_ctx, device=device)
