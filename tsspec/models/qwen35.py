"""``qwen35`` (dense Qwen3.5/3.6): the hybrid trunk (``hybrid``) with llama.cpp's qwen35 layout.

Value heads are in llama.cpp's *tiled* order (value head h reads key head h % n_k; the converter
reorders HF's grouped heads), and a GatedDeltaNet layer's input product is stored as four tensors
(``attn_qkv``, ``attn_gate``, ``ssm_beta``, ``ssm_alpha``). A file may carry NextN/MTP blocks after
the main stack; ``tsspec.drafters.nextn`` loads them as a draft head.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import numpy as np

from ..errors import ModelFileError
from ..gguf_file import GGUFFile
from ..validate import ArchTables, Key, Table, rope_base, show_value, table_tensors
from .base import ArchConfig, load_weight
from .hybrid import HybridModel, HybridSpec, build_hybrid, hybrid_config
from .llama import ATTENTION, FFN, QK_NORM

ARCH = "qwen35"

# ----------------------------------------------------------------------------- the hybrid trunks' facts
# (``qwen3next`` shares them; only its GatedDeltaNet input tensors differ)

HYBRID_KEYS = (
    rope_base(10000000.0),
    Key("ssm.conv_kernel", int, high=4096),
    Key("ssm.state_size", int),
    Key("ssm.group_count", int),
    Key("ssm.time_step_rank", int),
    Key("ssm.inner_size", int),
    Key("full_attention_interval", int, 4),
    Key("nextn_predict_layers", int, 0, low=0),
)

GATED_ATTENTION = {**ATTENTION, "attn_q.weight": ("q2", "d"), **QK_NORM}  # query and gate interleaved
HYBRID_FFN = {"post_attention_norm.weight": ("d",), **FFN}
ATTENTION_BLOCK = {**GATED_ATTENTION, **HYBRID_FFN}
# a GatedDeltaNet layer but for its input product, whose tensors each architecture names its way
GDN = {"attn_norm.weight": ("d",), "ssm_conv1d.weight": ("conv_dim", "conv_k"), "ssm_a": ("nv",),
       "ssm_dt.bias": ("nv",), "ssm_norm.weight": ("dv",), "ssm_out.weight": ("d", "value_dim")}
NEXTN = {"nextn.eh_proj.weight": ("d", "d2"), "nextn.enorm.weight": ("d",), "nextn.hnorm.weight": ("d",),
         "nextn.shared_head_norm.weight?": ("d",), "nextn.shared_head_head.weight?": ("vocab", "d"),
         "nextn.embed_tokens.weight?": ("vocab", "d")}
RECURRENT_BLOCK = {**GDN, "attn_qkv.weight": ("conv_dim", "d"), "attn_gate.weight": ("value_dim", "d"),
                   "ssm_beta.weight": ("nv", "d"), "ssm_alpha.weight": ("nv", "d"), **HYBRID_FFN}


def hybrid_blocks(recurrent_tables):
    """``validate.Blocks`` of a hybrid trunk: its main stack (``recurrent_tables(prefix, present)``
    gives a GatedDeltaNet block's tables), then the NextN blocks the file carries."""
    def blocks(hp: Mapping[str, Any], present: set[str]) -> Iterable[tuple[str, Table]]:
        out = []
        for i, recurrent in enumerate(hp["recurrent"]):
            p = f"blk.{i}."
            out += [(p, t) for t in recurrent_tables(p, present)] if recurrent else [(p, ATTENTION_BLOCK)]
        for j in range(hp["n_nextn"]):
            p = f"blk.{hp['n_main'] + j}."
            if p + "nextn.eh_proj.weight" in present:
                out += [(p, ATTENTION_BLOCK), (p, NEXTN)]
        return out
    return blocks


def nextn_tensors(layer: int, hp: Mapping[str, Any]) -> dict[str, tuple]:
    """name -> (shape, optional) of a NextN/MTP block at ``blk.{layer}``: a gated-attention block
    and the ``nextn.*`` tensors, shaped by the trunk it binds to (``hp`` as ``check_hparams`` gives)."""
    hp = {**hp, "d2": 2 * hp["d"]}
    p = f"blk.{layer}."
    return {**table_tensors(p, ATTENTION_BLOCK, hp), **table_tensors(p, NEXTN, hp)}


def hybrid_hparams(fname: str, arch: str, meta: Mapping[str, Any], v: dict, n_layers: int) -> dict:
    """``validate.Derive`` of the hybrid trunks: the NextN split, which layers recur and the
    GatedDeltaNet sizes, with the heads and the inner size checked to divide."""
    n_nextn = v["nextn_predict_layers"]
    n_main = n_layers - n_nextn
    if n_main < 1:
        raise ModelFileError(f"{fname}: metadata {arch}.block_count {n_layers} leaves no layers beside "
                             f"{n_nextn} NextN layers ({arch}.nextn_predict_layers)")
    nk, nv = v["ssm.group_count"], v["ssm.time_step_rank"]
    if nv % nk:
        raise ModelFileError(f"{fname}: {nv} value heads ({arch}.ssm.time_step_rank) do not divide into "
                             f"{nk} key heads ({arch}.ssm.group_count)")
    inner = v["ssm.inner_size"]
    if inner % nv:
        raise ModelFileError(f"{fname}: metadata {arch}.ssm.inner_size {inner} is not a multiple of the "
                             f"{nv} value heads")
    flags_key = f"{arch}.attention.recurrent_layers"
    flags = meta.get(flags_key)
    if flags is not None:
        if not isinstance(flags, list) or not all(isinstance(x, (bool, int)) for x in flags):
            raise ModelFileError(f"{fname}: metadata {flags_key} should be a list of booleans, found {show_value(flags)}")
    if isinstance(flags, list) and len(flags) >= n_main:
        recurrent = [bool(x) for x in flags[:n_main]]
    else:
        interval = v["full_attention_interval"]
        recurrent = [(i + 1) % interval != 0 for i in range(n_main)]
    dk, dv = v["ssm.state_size"], inner // nv
    return dict(n_main=n_main, n_nextn=n_nextn, recurrent=recurrent, nk=nk, nv=nv, dk=dk, dv=dv,
                conv_dim=2 * nk * dk + inner, value_dim=inner, conv_k=v["ssm.conv_kernel"],
                ssm_in=nk * (2 * dk + 2 * (nv // nk) * dv), nv2=2 * nv, d2=2 * v["embedding_length"])


# ----------------------------------------------------------------------------- qwen35

TABLES = ArchTables(ARCH, keys=HYBRID_KEYS, blocks=hybrid_blocks(lambda p, present: [RECURRENT_BLOCK]),
                    derive=hybrid_hparams)
TRITON = False  # the recurrence has no Triton kernel yet: the trunk runs on the CPU only


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
