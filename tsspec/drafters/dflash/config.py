"""The DFlash drafter's hyper-parameters, read and range-checked from its GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ...errors import ModelFileError
from ...gguf_file import GGUFFile
from ...validate import MAX_DIM, typed_value

ARCH = "dflash"
MAX_TAPS = 256  # target layers a drafter may read (real ones read a handful)

# pick(e, row [vocab]) -> token: how the walk turns block position e's scores into a draft token
Pick = Callable[[int, torch.Tensor], int]


# ----------------------------------------------------------------------------- config


@dataclass
class DFlashConfig:
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    rms_eps: float
    rope_base: float
    rope_dim: int
    block_size: int
    mask_token_id: int
    target_layers: tuple[int, ...]  # trunk layers whose ENTERING residual feeds pass A, in fc order
    sliding_window: int | None  # None: full attention
    swa_layers: tuple[bool, ...]  # per draft layer: does the window apply
    causal: bool = False  # within the block (the published drafters are non-causal)
    conv_kernel: int = 0
    conv_group: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    logit_scale: float = 1.0
    final_softcap: float | None = None


def _meta_int(g: GGUFFile, key: str, default=None, *, required: bool = False, low: int = 0,
              high: int = MAX_DIM) -> int | None:
    """An integer key in [low, high] (type and range checked as ``tsspec.validate`` does)."""
    v = g.get(key)
    if v is None:
        if required:
            raise ModelFileError(f"{g.path.name}: missing metadata key {key!r} (a dflash drafter needs it)")
        return default
    if isinstance(v, list):  # per-layer lists: ours must be uniform
        if not v or any(x != v[0] for x in v):
            raise ModelFileError(f"{g.path.name}: {key} must be one value, got {v!r}")
        v = v[0]
    return typed_value(g.path.name, key, v, int, low, high)


def _meta_float(g: GGUFFile, key: str, default: float | None, *, low: float = -1e30,
                high: float = 1e30) -> float | None:
    """A finite number in [low, high], or ``default`` when absent."""
    v = g.get(key)
    if v is None:
        return default
    return typed_value(g.path.name, key, v, float, low, high)


def read_config(g: GGUFFile, trunk_rope_base: float | None = None) -> DFlashConfig:
    """Hyper-parameters from ``dflash.*`` metadata; a missing or inconsistent key names itself."""
    name = g.path.name
    a = ARCH
    n_layers = _meta_int(g, f"{a}.block_count", required=True)
    d = _meta_int(g, f"{a}.embedding_length", required=True)
    n_heads = _meta_int(g, f"{a}.attention.head_count", required=True)
    n_kv = _meta_int(g, f"{a}.attention.head_count_kv", n_heads)
    if n_layers < 1 or d < 1 or n_heads < 1 or n_kv < 1 or n_heads % n_kv:
        raise ModelFileError(
            f"{name}: inconsistent dflash shape: block_count={n_layers}, embedding_length={d}, "
            f"attention.head_count={n_heads}, attention.head_count_kv={n_kv}"
        )
    head_dim = _meta_int(g, f"{a}.attention.key_length", d // n_heads)
    rope_base = _meta_float(g, f"{a}.rope.freq_base", trunk_rope_base, low=1e-6)
    if rope_base is None:
        raise ModelFileError(f"{name}: missing metadata key '{a}.rope.freq_base'")
    rope_dim = _meta_int(g, f"{a}.rope.dimension_count", head_dim)
    if rope_dim > head_dim or rope_dim % 2:
        raise ModelFileError(f"{name}: {a}.rope.dimension_count={rope_dim} does not fit head_dim {head_dim}")

    block = _meta_int(g, f"{a}.block_size", required=True)
    if block < 2:
        raise ModelFileError(f"{name}: {a}.block_size must be >= 2 (an anchor and a draft), got {block}")
    mask = g.get(f"{a}.mask_token_id", g.get("tokenizer.ggml.mask_token_id"))
    if mask is None:
        raise ModelFileError(f"{name}: missing metadata key '{a}.mask_token_id'")
    mask = typed_value(name, f"{a}.mask_token_id", mask, int, 0, MAX_DIM)  # below the vocabulary: _check_trunk

    layers = g.get(f"{a}.target_layers")
    if layers is None:
        ids = g.get(f"{a}.target_layer_ids")
        if ids is None:
            raise ModelFileError(f"{name}: missing metadata key '{a}.target_layers'")
        if not isinstance(ids, list):
            raise ModelFileError(f"{name}: {a}.target_layer_ids must be a list, got {ids!r}")
        # HF output of layer i == residual entering layer i + 1
        layers = [typed_value(name, f"{a}.target_layer_ids", i, int, -1, 1 << 62) + 1 for i in ids]
    if not isinstance(layers, list) or not layers:
        raise ModelFileError(f"{name}: {a}.target_layers must be a non-empty list, got {layers!r}")
    if len(layers) > MAX_TAPS:
        raise ModelFileError(f"{name}: {a}.target_layers lists {len(layers)} layers (at most {MAX_TAPS})")
    layers = tuple(typed_value(name, f"{a}.target_layers", x, int, -(1 << 62), 1 << 62) for x in layers)
    if min(layers) < 0:
        raise ModelFileError(f"{name}: {a}.target_layers has a negative index: {list(layers)}")

    window = _meta_int(g, f"{a}.attention.sliding_window", 0) or None
    pattern = g.get(f"{a}.attention.sliding_window_pattern")
    if pattern is None:
        swa = (window is not None,) * n_layers
    else:
        if not isinstance(pattern, list) or len(pattern) != n_layers:
            raise ModelFileError(
                f"{name}: {a}.attention.sliding_window_pattern must list {n_layers} layers, got {pattern!r}"
            )
        swa = tuple(bool(x) and window is not None for x in pattern)

    scale = _meta_float(g, f"{a}.logit_scale", 1.0)
    softcap = _meta_float(g, f"{a}.final_logit_softcapping", None, low=0.0)
    return DFlashConfig(
        n_layers=n_layers, d_model=d, n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim, ffn_dim=0,
        rms_eps=_meta_float(g, f"{a}.attention.layer_norm_rms_epsilon", 1e-6, low=1e-30, high=1.0),
        rope_base=rope_base, rope_dim=rope_dim, block_size=block, mask_token_id=mask,
        target_layers=layers, sliding_window=window, swa_layers=swa,
        causal=bool(g.get(f"{a}.attention.causal", False)),
        conv_kernel=_meta_int(g, f"{a}.conv_kernel_size", 0),
        conv_group=_meta_int(g, f"{a}.conv_group_size", 0),
        selector_rank=_meta_int(g, f"{a}.selector_rank", 0),
        selector_top_k=_meta_int(g, f"{a}.selector_top_k", 0),
        logit_scale=scale if scale else 1.0,
        final_softcap=softcap if softcap and softcap > 0 else None,
    )
