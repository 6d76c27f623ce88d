"""Tiny random-weight DFlash / DFlash2 drafter GGUF files, bound to a tiny trunk from ``tests/tiny.py``.

The layout is the one ``tsspec.drafters.dflash`` documents (llama.cpp's ``dflash`` names): numpy
``[out, in]`` matrices, ``blk.{i}.{attn,ffn}_conv_base`` as raw ``[2, K, H]`` tensors,
``dflash.target_layers`` as the indices of the layers whose ENTERING residual is read.

``dflash2=True`` adds the conv and selector tensors and keys; ``conv=`` / ``selector=`` write only
one of them. ``drop_keys`` / ``target_layer_ids`` / ``fc_width`` exist to write the inconsistent
files the loader must refuse.
"""

from __future__ import annotations

from pathlib import Path

from tiny import finish_gguf

import numpy as np

from tsspec.gguf_file import GGUFFile


def _rand(rng, shape, std):
    return (rng.standard_normal(shape) * std).astype(np.float32)


def _norm(rng, n):
    return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)


def trunk_shape(trunk_path) -> dict:
    """hidden size, layer count, vocabulary and rope base of a tiny trunk file."""
    g = GGUFFile(trunk_path)
    arch = g.arch
    vocab = g.get(f"{arch}.vocab_size") or len(g.get("tokenizer.ggml.tokens"))
    return dict(hidden=int(g.get(f"{arch}.embedding_length")), n_layers=int(g.get(f"{arch}.block_count")),
                vocab=int(vocab), rope_base=float(g.get(f"{arch}.rope.freq_base", 10000.0)))


def write_tiny_dflash(
    path,
    trunk_path,
    *,
    seed: int = 1,
    dflash2: bool = False,
    conv: bool | None = None,
    selector: bool | None = None,
    n_layers: int = 2,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    ffn_dim: int = 96,
    block_size: int = 5,
    target_layers: list[int] | None = None,
    target_layer_ids: list[int] | None = None,
    sliding_window: int | None = 12,
    mask_token_id: int | None = None,
    conv_kernel: int = 3,
    conv_group: int = 16,
    selector_rank: int = 8,
    selector_top_k: int = 4,
    logit_scale: float | None = None,
    softcap: float | None = None,
    hidden: int | None = None,
    fc_width: int | None = None,
    drop_keys: tuple[str, ...] = (),
    strength: float = 1.0,
    draft_vocab: list[int] | None = None,
) -> Path:
    """Write a random dflash drafter for the trunk at ``trunk_path``; returns the path.

    ``target_layers`` defaults to ``[1, n_trunk_layers - 1]``; ``hidden`` to the trunk's hidden
    size (another value writes a drafter bound to a different trunk). ``strength`` scales the block
    outputs so a test can make the drafter's residual stream matter more or less. ``draft_vocab``
    writes an own LM head over those target ids plus the ``d2t`` map (a reduced draft vocabulary).
    """
    import gguf

    t = trunk_shape(trunk_path)
    d = hidden if hidden is not None else t["hidden"]
    vocab = t["vocab"]
    conv = dflash2 if conv is None else conv
    selector = dflash2 if selector is None else selector
    if target_layers is None and target_layer_ids is None:
        target_layers = [1, t["n_layers"] - 1]
    n_taps = len(target_layers if target_layers is not None else target_layer_ids)
    fc_in = fc_width if fc_width is not None else n_taps * t["hidden"]
    hd = d // n_heads
    q_dim, kv_dim = n_heads * hd, n_kv_heads * hd
    mask = mask_token_id if mask_token_id is not None else vocab - 1

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), "dflash")
    keys: dict[str, tuple] = {
        "dflash.block_count": ("u32", n_layers),
        "dflash.embedding_length": ("u32", d),
        "dflash.feed_forward_length": ("u32", ffn_dim),
        "dflash.attention.head_count": ("u32", n_heads),
        "dflash.attention.head_count_kv": ("u32", n_kv_heads),
        "dflash.attention.key_length": ("u32", hd),
        "dflash.attention.layer_norm_rms_epsilon": ("f32", 1e-6),
        "dflash.rope.freq_base": ("f32", t["rope_base"]),
        "dflash.block_size": ("u32", block_size),
        "dflash.mask_token_id": ("u32", mask),
    }
    if target_layers is not None:
        keys["dflash.target_layers"] = ("arr", [int(x) for x in target_layers])
    if target_layer_ids is not None:
        keys["dflash.target_layer_ids"] = ("arr", [int(x) for x in target_layer_ids])
    if sliding_window:
        keys["dflash.attention.sliding_window"] = ("u32", sliding_window)
    if conv:
        keys["dflash.conv_kernel_size"] = ("u32", conv_kernel)
        keys["dflash.conv_group_size"] = ("u32", conv_group)
    if selector:
        keys["dflash.selector_rank"] = ("u32", selector_rank)
        keys["dflash.selector_top_k"] = ("u32", selector_top_k)
    if logit_scale is not None:
        keys["dflash.logit_scale"] = ("f32", logit_scale)
    if softcap is not None:
        keys["dflash.final_logit_softcapping"] = ("f32", softcap)
    for key, (kind, value) in keys.items():
        if key in drop_keys:
            continue
        if kind == "u32":
            w.add_uint32(key, int(value))
        elif kind == "f32":
            w.add_float32(key, float(value))
        else:
            w.add_array(key, value)

    rng = np.random.default_rng(seed)
    extra = np.random.default_rng(seed + 1000)  # DFlash2's tensors: the backbone stays the same
    s = strength
    tensors: dict[str, np.ndarray] = {
        "fc.weight": _rand(rng, (d, fc_in), 1.0 / np.sqrt(fc_in)),
        "enc.output_norm.weight": _norm(rng, d),
    }
    groups = d // conv_group if conv else 0
    out_norm = _norm(rng, d)
    for i in range(n_layers):
        p = f"blk.{i}."
        tensors[p + "attn_norm.weight"] = _norm(rng, d)
        tensors[p + "attn_q.weight"] = _rand(rng, (q_dim, d), 1.0 / np.sqrt(d))
        tensors[p + "attn_k.weight"] = _rand(rng, (kv_dim, d), 1.0 / np.sqrt(d))
        tensors[p + "attn_v.weight"] = _rand(rng, (kv_dim, d), 1.0 / np.sqrt(d))
        tensors[p + "attn_output.weight"] = _rand(rng, (d, q_dim), 2.0 * s / np.sqrt(q_dim))
        tensors[p + "attn_q_norm.weight"] = _norm(rng, hd)
        tensors[p + "attn_k_norm.weight"] = _norm(rng, hd)
        tensors[p + "ffn_norm.weight"] = _norm(rng, d)
        tensors[p + "ffn_gate.weight"] = _rand(rng, (ffn_dim, d), 1.0 / np.sqrt(d))
        tensors[p + "ffn_up.weight"] = _rand(rng, (ffn_dim, d), 1.0 / np.sqrt(d))
        tensors[p + "ffn_down.weight"] = _rand(rng, (d, ffn_dim), 2.0 * s / np.sqrt(ffn_dim))
        if conv:
            for side in ("attn_conv", "ffn_conv"):
                base = _rand(extra, (2, conv_kernel, d), 0.3)
                base[:, 0] += 1.0  # near identity at tap 0, so the sublayer still carries signal
                tensors[p + side + "_base"] = base
                tensors[p + side + "_proj.weight"] = _rand(extra, (2 * conv_kernel * groups, d), 0.3 / np.sqrt(d))
    if selector:
        tensors["selector_predecessor.weight"] = _rand(extra, (vocab, selector_rank), 1.0)
        tensors["selector_successor.weight"] = _rand(extra, (vocab, selector_rank), 1.0)
        tensors["selector_hidden.weight"] = _rand(extra, (selector_rank, d), 1.0 / np.sqrt(d))
    tensors["output_norm.weight"] = out_norm
    if draft_vocab is not None:
        tensors["output.weight"] = _rand(extra, (len(draft_vocab), d), 0.3)
        tensors["d2t"] = np.asarray(draft_vocab, dtype=np.int64)
    return finish_gguf(w, tensors, path)
