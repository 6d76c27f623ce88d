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
from .base import ArchConfig, LayerSpec, build_model, common_config

ARCH = "gemma3"
LOCAL_ROPE_BASE = 10000.0


def config(g: GGUFFile) -> ArchConfig:
    c = common_config(g, ARCH)
    base = float(g.get(f"{ARCH}.rope.freq_base", 1000000.0))
    window = int(g.get(f"{ARCH}.attention.sliding_window", 512))
    period = int(g.get(f"{ARCH}.attention.sliding_window_pattern", 6))
    layers = [
        LayerSpec(base, None) if (i + 1) % period == 0 else LayerSpec(LOCAL_ROPE_BASE, window)
        for i in range(c["n_layers"])
    ]
    softcap = g.get(f"{ARCH}.final_logit_softcapping")
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
    return build_model(g, config(g), fmt, n_ctx, device=device)
