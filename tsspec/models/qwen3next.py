"""``qwen3next`` (Qwen3-Next): the qwen35 hybrid trunk with Qwen3-Next's tensor layout.

Differences from ``qwen35`` (the compute is ``hybrid.HybridModel``'s):

* value heads stay in HF's grouped order (value head h reads key head h // (n_v / n_k));
* the GatedDeltaNet input projection is either split (``attn_qkv`` + ``attn_gate``, newer
  converters) or one fused ``ssm_in`` interleaved per key head as [q, k, v (r heads), z (r heads)];
  beta and alpha come fused in ``ssm_ba``, per key head [beta (r), alpha (r)]. Both are
  de-interleaved once at load into the [qkv | z | beta | alpha] product the trunk runs.

Supported subset: dense-FFN layers only. Qwen3-Next checkpoints route their FFNs through a
mixture of experts (``ffn_gate_inp``, ``ffn_*_exps``, shared expert); such files are declined with a
``ModelFileError`` rather than run wrongly.
"""

from __future__ import annotations

import numpy as np

from ..errors import ModelFileError
from ..gguf_file import GGUFFile
from ..validate import ArchTables
from ..weights import take_rows
from .base import ArchConfig, load_weight
from .hybrid import HybridModel, HybridSpec, build_hybrid, hybrid_config
from .qwen35 import GDN, HYBRID_FFN, HYBRID_KEYS, hybrid_blocks, hybrid_hparams

ARCH = "qwen3next"

# a GatedDeltaNet block: beta and alpha fused, and the input product split (attn_qkv + attn_gate,
# newer converters) or one fused ssm_in
RECURRENT_BLOCK = {**GDN, "ssm_ba.weight": ("nv2", "d"), **HYBRID_FFN}
SPLIT_INPUT = {"attn_qkv.weight": ("conv_dim", "d"), "attn_gate.weight": ("value_dim", "d")}
FUSED_INPUT = {"ssm_in.weight": ("ssm_in", "d")}


def _recurrent_tables(prefix: str, present: set[str]):
    return [RECURRENT_BLOCK, SPLIT_INPUT if prefix + "attn_qkv.weight" in present else FUSED_INPUT]


TABLES = ArchTables(ARCH, keys=HYBRID_KEYS, blocks=hybrid_blocks(_recurrent_tables), derive=hybrid_hparams)
TRITON = False  # the recurrence has no Triton kernel yet: the trunk runs on the CPU only


def config(g: GGUFFile) -> ArchConfig:
    return hybrid_config(g, ARCH, v_heads_tiled=False)


def gdn_projections(g: GGUFFile, p: str, hy: HybridSpec, fmt: str) -> list:
    """[qkv, z, beta, alpha] weights of one qwen3next GatedDeltaNet layer, flat head order, in the
    load format: the fused tensors are split by selecting their rows, which keeps the file's
    blocks (and so its precision) under "auto"."""
    nk, r = hy.n_k_heads, hy.n_v_heads // hy.n_k_heads
    dk, dv = hy.head_k_dim, hy.head_v_dim
    if g.has_tensor(p + "attn_qkv.weight"):
        qkv, z = load_weight(g, [p + "attn_qkv.weight", p + "attn_gate.weight"], fmt)
    else:
        # ssm_in: [nk * (2dk + 2 r dv), d], per key head [q (dk), k (dk), v (r dv), z (r dv)]
        w = load_weight(g, [p + "ssm_in.weight"], fmt)[0]
        group = np.arange(nk * (2 * dk + 2 * r * dv)).reshape(nk, 2 * dk + 2 * r * dv)
        q, k = group[:, :dk], group[:, dk : 2 * dk]
        v, zr = group[:, 2 * dk : 2 * dk + r * dv], group[:, 2 * dk + r * dv :]
        qkv = take_rows(w, np.concatenate([q.reshape(-1), k.reshape(-1), v.reshape(-1)]))
        z = take_rows(w, zr.reshape(-1))
    ba = load_weight(g, [p + "ssm_ba.weight"], fmt)[0]  # [2 n_v, d], per key head [beta (r), alpha (r)]
    pairs = np.arange(2 * nk * r).reshape(nk, 2 * r)
    return [qkv, z, take_rows(ba, pairs[:, :r].reshape(-1)), take_rows(ba, pairs[:, r:].reshape(-1))]


def load(g: GGUFFile, fmt: str | None = None, n_ctx: int | None = None, *,
         verify_snapshots: bool = True) -> HybridModel:
    cfg = config(g)
    moe = [n for n in g.tensor_names() if n.endswith(".ffn_gate_inp.weight") or "_exps." in n]
    if moe:
        raise ModelFileError(
            f"{g.path.name}: this qwen3next file has mixture-of-experts FFN layers ({moe[0]}, ...); "
            "only the dense-FFN subset of qwen3next is supported"
        )
    return build_hybrid(g, cfg, fmt, n_ctx, gdn_projections, verify_snapshots=verify_snapshots)
