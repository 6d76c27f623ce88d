"""``qwen35`` (dense Qwen3.5/3.6): a hybrid trunk of GatedDeltaNet layers and gated full attention.

Layers: ``(i + 1) % full_attention_interval == 0`` are full attention, the rest GatedDeltaNet
(``{arch}.attention.recurrent_layers``, a per-layer list, overrides the interval). Every layer then
has a dense SiLU-gated FFN behind ``post_attention_norm``.

* Full attention (``AttnLayer``): ``attn_q`` emits query and an output gate interleaved per head
  ([q_h, gate_h] for each head h), q/k RMS norms per head, NEOX rope on the first
  ``rope.dimension_count`` dims of a head (partial rotary). M-RoPE sections
  (``rope.dimension_sections``) collapse to plain rope for text: every section reads the same text
  position. Output = o_proj(attn * sigmoid(gate)). KV cache and attention are ``base``'s.
* GatedDeltaNet (``GDNLayer``): one fused input product [qkv | z | beta | alpha]; a depthwise causal
  conv (kernel ``ssm.conv_kernel``) + SiLU over qkv; q and k l2-normed; per value head
  beta = sigmoid(b), g = ssm_a * softplus(alpha + ssm_dt) (``ssm_a`` = -exp(A_log) as the converter
  stores it); the gated delta rule (``gated_delta``); out = ssm_out(rmsnorm(o) * silu(z)).
  Value heads are in llama.cpp's *tiled* order for qwen35 (value head h reads key head h % n_k;
  the converter reorders HF's grouped heads) and in HF's *grouped* order for qwen3next (h // r).
* Norm weights are used as stored: the converter folded Qwen's (1 + w) into every RMS norm except
  the GatedDeltaNet output norm (``ssm_norm``), which HF stores plain.

Batch invariance (measured, see ``tests/test_hybrid.py``): forwards of up to ``ROW_FORM_MAX`` rows
(every decode step and every verify) run the delta rule row by row (``delta_rule_rows``) and compute
the per-head gates row by row, so row m's arithmetic is the same whether it runs alone or inside a
verify: speculative output equals plain output bit for bit. Longer forwards (prompt chunks) use the
chunked parallel form, which differs from the row form by ~1e-6 relative; plain and speculative
decoding prefill identically, so that never reaches the exactness contract.

Rollback (``verify_persists_kv``). A multi-row forward never writes the live recurrent state: it
writes the state after *every* row into per-row slots (``RollbackSlots``, two buffers used in turn)
and the conv window after row m is a slice of the concatenated input it builds anyway. The live
state is therefore the pre-verify state until a commit, so ``snapshot()`` copies nothing, and
``rewind(length)`` inside the last forward commits slot ``length - start - 1`` by pointing the live
state at it (no copy, no re-forward). A forward that follows an all-accepted verify commits the
last slot first. Single-row steps update the live state in place. ``TS_Q35_VERIFY_SNAPSHOTS=0``
restores the old path: multi-row forwards update the live state in place, ``snapshot()`` copies it,
``restore()`` puts it back and the loop re-forwards the kept prefix.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import ModelFileError
from ..gguf_file import GGUFFile
from ..spec.protocols import ForwardOutput
from ..weights import Linear, load_format, to_tensor
from .base import (
    ArchConfig,
    KVCache,
    LayerSpec,
    TransformerModel,
    _shares_storage,
    apply_rope,
    attend,
    common_config,
    load_embedding,
    load_weight,
    plan_attention,
    rms_norm,
)
from .gated_delta import RecurrentState, causal_conv, delta_rule_chunked, delta_rule_rows, l2norm

ARCH = "qwen35"
# forwards of at most this many rows use the batch-invariant row form (>= the largest verify: 64 + 1)
ROW_FORM_MAX = 65
# the window the loop should use unless the user chose one: every extra verify row costs one more
# per-row recurrent state (see rollback_state_bytes), and acceptance decays with depth
PREFERRED_WINDOW = 3


def verify_snapshots_enabled() -> bool:
    return os.environ.get("TS_Q35_VERIFY_SNAPSHOTS", "1").strip().lower() not in ("0", "false", "no", "off")


# ----------------------------------------------------------------------------- config


@dataclass
class HybridSpec:
    """The GatedDeltaNet and layer-pattern part of the config."""

    recurrent: list[bool]  # per main layer: True = GatedDeltaNet
    conv_kernel: int
    n_k_heads: int
    n_v_heads: int
    head_k_dim: int
    head_v_dim: int
    v_heads_tiled: bool  # value head h reads key head h % n_k (True) or h // (n_v / n_k) (False)
    n_nextn: int = 0  # NextN/MTP blocks stored after the main stack

    @property
    def key_dim(self) -> int:
        return self.n_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.n_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


def hybrid_config(g: GGUFFile, arch: str, *, v_heads_tiled: bool) -> ArchConfig:
    c = common_config(g, arch)
    n_nextn = int(g.get(f"{arch}.nextn_predict_layers", 0) or 0)
    n_main = c["n_layers"] - n_nextn
    if n_main <= 0:
        raise ModelFileError(f"{g.path.name}: block_count {c['n_layers']} leaves no layers beside {n_nextn} NextN")
    c["n_layers"] = n_main
    flags = g.get(f"{arch}.attention.recurrent_layers")
    if isinstance(flags, list) and len(flags) >= n_main:
        recurrent = [bool(x) for x in flags[:n_main]]
    else:
        interval = int(g.get(f"{arch}.full_attention_interval", 4))
        recurrent = [(i + 1) % interval != 0 for i in range(n_main)]

    def req(key: str):
        return int(g.require(f"{arch}.ssm.{key}"))

    n_v = req("time_step_rank")
    spec = HybridSpec(
        recurrent=recurrent,
        conv_kernel=req("conv_kernel"),
        n_k_heads=req("group_count"),
        n_v_heads=n_v,
        head_k_dim=req("state_size"),
        head_v_dim=req("inner_size") // n_v,
        v_heads_tiled=v_heads_tiled,
        n_nextn=n_nextn,
    )
    if spec.n_v_heads % spec.n_k_heads:
        raise ModelFileError(f"{g.path.name}: {n_v} value heads do not divide into {spec.n_k_heads} key heads")
    base = float(g.get(f"{arch}.rope.freq_base", 10000000.0))
    return ArchConfig(**c, rope_neox=True, qk_norm=True, layers=[LayerSpec(base) for _ in range(n_main)],
                      extra={"hybrid": spec})


def config(g: GGUFFile) -> ArchConfig:
    return hybrid_config(g, ARCH, v_heads_tiled=True)


# ----------------------------------------------------------------------------- layers


@dataclass
class AttnLayer:
    """Gated full attention; also the decoder block of a NextN/MTP head."""

    attn_norm: torch.Tensor
    qkv: Linear  # rows: [q_0, gate_0, q_1, gate_1, ...] (2 * n_heads * head_dim), k, v
    o: Linear
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear


@dataclass
class GDNLayer:
    attn_norm: torch.Tensor
    in_proj: Linear  # rows: qkv (conv_dim), z (value_dim), beta (n_v), alpha (n_v)
    conv_w: torch.Tensor  # [conv_dim, K]
    ssm_a: torch.Tensor  # [n_v] = -exp(A_log)
    dt_bias: torch.Tensor  # [n_v]
    ssm_norm: torch.Tensor  # [head_v_dim]
    out: Linear
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear


def ffn(blk, x: torch.Tensor) -> torch.Tensor:
    gu = blk.gate_up(x)
    f = gu.shape[1] // 2
    return blk.down(F.silu(gu[:, :f]) * gu[:, f:])


def gated_attention(cfg: ArchConfig, blk: AttnLayer, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    start: int, cos: torch.Tensor, sin: torch.Tensor, groups=None) -> torch.Tensor:
    """x [n, d] normed -> attention output [n, d]; writes K/V at start..start+n of the given caches.

    ``groups``: ``base.plan_attention`` for this forward (planned here when not given).
    """
    n = x.shape[0]
    nh, nkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    p = blk.qkv(x)
    qg = p[:, : 2 * nh * hd].view(n, nh, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(n, nh * hd)
    k = p[:, 2 * nh * hd : 2 * nh * hd + nkv * hd].view(n, nkv, hd)
    v = p[:, 2 * nh * hd + nkv * hd :].view(n, nkv, hd)
    q = rms_norm(q, blk.q_norm, cfg.rms_eps)
    k = rms_norm(k, blk.k_norm, cfg.rms_eps)
    q = apply_rope(q, cos, sin, True) * (1.0 / math.sqrt(hd))
    k = apply_rope(k, cos, sin, True)
    k_cache[:, start : start + n] = k.transpose(0, 1)
    v_cache[:, start : start + n] = v.transpose(0, 1)
    if groups is None:
        groups = plan_attention(start, n, k_cache.shape[1], nh // nkv, {None})
    a = attend(q, k_cache, v_cache, groups, None).reshape(n, nh * hd)
    return blk.o(a * torch.sigmoid(gate))


def _per_row(fn, *xs: torch.Tensor) -> torch.Tensor:
    """Apply an elementwise ``fn`` one row at a time.

    A narrow row (a few heads) spread over a multi-row tensor would put some of its elements on
    the SIMD path and others on the scalar tail of the elementwise kernel, which round differently
    for exp/softplus; one row per call keeps a row's bits independent of the row count.
    """
    return torch.stack([fn(*(x[i] for x in xs)) for i in range(xs[0].shape[0])])


class RollbackSlots:
    """Per-row recurrent states of one multi-row forward: what a rollback commits from.

    ``ssm[b]`` [layers][rows, H, dk, dv] are two buffers used in turn, so the one the live state
    points into is never the one the next verify writes. Conv windows are slices of ``conv_cat``.
    """

    def __init__(self) -> None:
        self.ssm: list[list[torch.Tensor]] = [[], []]
        self.rows = 0

    def ensure(self, rows: int, shapes: list[tuple[int, ...]]) -> bool:
        """Grow to ``rows`` rows; True when the buffers were reallocated."""
        if rows <= self.rows:
            return False
        self.ssm = [[torch.empty(rows, *s) for s in shapes] for _ in range(2)]
        self.rows = rows
        return True


@dataclass
class _Pending:
    start: int  # cache position of the forward's first row
    n: int
    buf: int  # which RollbackSlots buffer holds its rows
    conv_cat: list[torch.Tensor] = field(default_factory=list)  # per GDN layer [K-1+n, C]


class HybridModel(TransformerModel):
    """A SpecTarget over interleaved GatedDeltaNet and gated attention layers."""

    FUSABLE = False  # GatedDeltaNet layers: the torch path (with the native products) only

    def __init__(self, cfg: ArchConfig, layers: list, embed: torch.Tensor, out_norm: torch.Tensor,
                 lm_head: Linear, n_ctx: int | None = None, path=None):
        self.hy: HybridSpec = cfg.extra["hybrid"]
        self.attn_slot = {}  # layer index -> KV cache layer
        for i, rec in enumerate(self.hy.recurrent):
            if not rec:
                self.attn_slot[i] = len(self.attn_slot)
        self.gdn_index = [i for i, rec in enumerate(self.hy.recurrent) if rec]
        super().__init__(cfg, layers, embed, out_norm, lm_head, n_ctx=n_ctx, path=path)
        self.cache = KVCache(max(1, len(self.attn_slot)), cfg.n_kv_heads, cfg.head_dim, min(self._max_context, 512))
        self._build_rope(self.cache.capacity)
        self.snapshots = verify_snapshots_enabled()
        self.preferred_window = PREFERRED_WINDOW
        self.draft_head = None  # a NextN/MTP head when the file carries one
        self._slots = RollbackSlots()
        self._live_buf: int | None = None
        self._pending: _Pending | None = None
        self._persisted = True
        self._snap: tuple[int, list[RecurrentState]] | None = None
        self._snap_requested = False
        self._reset_state()

    # -- recurrent state -----------------------------------------------------------------------
    def _reset_state(self) -> None:
        hy = self.hy
        self.states = [
            RecurrentState(torch.zeros(hy.conv_kernel - 1, hy.conv_dim),
                           torch.zeros(hy.n_v_heads, hy.head_k_dim, hy.head_v_dim))
            for _ in self.gdn_index
        ]
        self._state_len = 0
        self._live_buf = None
        self._pending = None
        self._snap = None
        self._snap_requested = False
        self._persisted = True

    def _commit(self, length: int) -> None:
        """Point the live state at the slot of the last forward that ends at ``length``."""
        p = self._pending
        slot = length - p.start - 1
        if not 0 <= slot < p.n:
            raise ValueError(f"cannot commit length {length} from a forward over {p.start}..{p.start + p.n}")
        k1 = self.hy.conv_kernel - 1
        for j, st in enumerate(self.states):
            st.ssm = self._slots.ssm[p.buf][j][slot]
            st.conv = p.conv_cat[j][slot + 1 : slot + 1 + k1]
        self._live_buf = p.buf
        self._state_len = length
        self._pending = None

    def _settle(self) -> None:
        if self._pending is not None:
            self._commit(self.cache.length)

    def recurrent_states(self) -> list[RecurrentState]:
        """The live state of every GatedDeltaNet layer at ``cache_len`` (commits a pending verify)."""
        self._settle()
        return self.states

    def per_row_state_bytes(self) -> int:
        hy = self.hy
        return len(self.gdn_index) * hy.n_v_heads * hy.head_k_dim * hy.head_v_dim * 4

    def rollback_state_bytes(self, window: int) -> int:
        """Memory the fast rollback holds for a draft window: two buffers of window+1 per-row states."""
        hy = self.hy
        rows = window + 1
        conv = len(self.gdn_index) * (hy.conv_kernel - 1 + rows) * hy.conv_dim * 4
        return 2 * rows * self.per_row_state_bytes() + conv

    def state_bytes(self) -> int:
        return sum(s.nbytes() for s in self.states)

    # -- SpecTarget surface --------------------------------------------------------------------
    @property
    def verify_persists_kv(self) -> bool:
        return self._persisted

    def snapshot(self) -> None:
        if self.snapshots:
            self._snap_requested = True  # free: the next multi-row forward leaves the live state alone
            self._snap = None
            return
        self._settle()
        self._snap = (self._state_len, [s.clone() for s in self.states])
        self._snap_requested = False

    def restore(self) -> None:
        if self._snap is not None:
            self._state_len, self.states = self._snap[0], self._snap[1]
            self._snap = None
            self._live_buf = None
        elif self._pending is not None:  # the live state never left the pre-verify point
            self._pending = None
        self._snap_requested = False

    def rewind(self, length: int) -> None:
        self.cache.rewind(length)
        if length == 0:
            self._reset_state()
            return
        p = self._pending
        if p is not None and p.start < length <= p.start + p.n:
            self._commit(length)
        elif length != self._state_len or p is not None:
            raise ValueError(
                f"the recurrent state is at {self._state_len} and cannot rewind to {length}; "
                "restore() a snapshot first"
            )

    def reset(self) -> None:
        self.cache.length = 0
        self._reset_state()

    # -- compute ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, tokens: Sequence[int], *, all_logits: bool = False,
                taps: Sequence[int] | None = None) -> ForwardOutput:
        cfg = self.cfg
        n = len(tokens)
        if n == 0:
            raise ValueError("forward needs at least one token")
        self._settle()
        start = self.cache.length
        if start != self._state_len:
            raise ValueError(f"KV length {start} and recurrent state length {self._state_len} disagree")
        self.ensure_capacity(start + n)
        h = self._token_rows(tokens)  # [n, d]

        # how this forward treats the recurrent state
        if n == 1:
            mode = "inplace"
        elif n <= ROW_FORM_MAX:
            mode = "slots" if self.snapshots else "inplace"
        else:
            mode = "chunked"
        if mode != "slots" and n > 1 and self._snap_requested and self._snap is None:
            self._snap = (self._state_len, [s.clone() for s in self.states])  # lazily, only when needed
        pending = None
        if mode == "slots":
            hy = self.hy
            if self._slots.ensure(n, [(hy.n_v_heads, hy.head_k_dim, hy.head_v_dim)] * len(self.gdn_index)):
                self._live_buf = None
            buf = 1 if self._live_buf == 0 else 0
            pending = _Pending(start, n, buf)

        want = {t: None for t in (taps or ())}
        cos, sin = self._rope[cfg.layers[0].rope_base]
        cos, sin = cos[start : start + n], sin[start : start + n]
        groups = plan_attention(start, n, self.cache.capacity, cfg.n_heads // cfg.n_kv_heads, {None})
        g_i = 0
        for li, blk in enumerate(self.blocks):
            if li in want:
                want[li] = h
            x = rms_norm(h, blk.attn_norm, cfg.rms_eps)
            if isinstance(blk, GDNLayer):
                a = self._gdn(blk, g_i, x, mode, pending)
                g_i += 1
            else:
                slot = self.attn_slot[li]
                a = gated_attention(cfg, blk, x, self.cache.k[slot], self.cache.v[slot], start, cos, sin,
                                    groups)
            h = h + a
            h = h + ffn(blk, rms_norm(h, blk.post_norm, cfg.rms_eps))
        if cfg.n_layers in want:
            want[cfg.n_layers] = h
        self.cache.length = start + n
        if pending is not None:
            self._pending = pending
            self._persisted = True
        else:
            self._state_len = start + n
            self._persisted = n == 1
        self._snap_requested = False
        return self._output(h, want, taps, all_logits)

    def _gdn(self, blk: GDNLayer, j: int, x: torch.Tensor, mode: str, pending: _Pending | None) -> torch.Tensor:
        hy = self.hy
        n = x.shape[0]
        C, vd, nv = hy.conv_dim, hy.value_dim, hy.n_v_heads
        st = self.states[j]
        p = blk.in_proj(x)
        z = p[:, C : C + vd].view(n, nv, hy.head_v_dim)
        b, alpha = p[:, C + vd : C + vd + nv], p[:, C + vd + nv :]
        conv_cat = torch.cat([st.conv, p[:, :C]], dim=0)  # [K-1+n, C]
        y = causal_conv(conv_cat, blk.conv_w, n)
        kd = hy.key_dim
        q = l2norm(y[:, :kd].reshape(n, hy.n_k_heads, hy.head_k_dim)) * (1.0 / math.sqrt(hy.head_k_dim))
        k = l2norm(y[:, kd : 2 * kd].reshape(n, hy.n_k_heads, hy.head_k_dim))
        v = y[:, 2 * kd :].reshape(n, nv, hy.head_v_dim)
        r = nv // hy.n_k_heads
        if r > 1:
            q, k = ((t.repeat(1, r, 1) if hy.v_heads_tiled else t.repeat_interleave(r, dim=1)) for t in (q, k))
        if mode == "chunked":
            beta = torch.sigmoid(b)
            g = blk.ssm_a * F.softplus(alpha + blk.dt_bias)
            o = delta_rule_chunked(st.ssm, q, k, v, g, beta)
        else:
            beta = _per_row(torch.sigmoid, b)
            g = _per_row(lambda a_: blk.ssm_a * F.softplus(a_ + blk.dt_bias), alpha)
            rows = self._slots.ssm[pending.buf][j] if mode == "slots" else None
            o = delta_rule_rows(st.ssm, q, k, v, g, beta, rows)
        if mode == "slots":
            pending.conv_cat.append(conv_cat)
        else:
            st.conv = conv_cat[n:]
        o = rms_norm(o, blk.ssm_norm, self.cfg.rms_eps) * F.silu(z)
        return blk.out(o.reshape(n, vd))

    def weight_bytes(self) -> int:
        n = self.embed.nbytes()
        for b in self.blocks:
            lins = [b.qkv, b.o] if isinstance(b, AttnLayer) else [b.in_proj, b.out]
            n += sum(x.nbytes() for x in lins) + b.gate_up.nbytes() + b.down.nbytes()
        if not _shares_storage(self.lm_head, self.embed):
            n += self.lm_head.nbytes()
        return n


# ----------------------------------------------------------------------------- loading


def _vec(g: GGUFFile, name: str) -> torch.Tensor:
    return to_tensor(g.tensor(name), torch.float32)


def _weight(g: GGUFFile, name: str, fmt: str):
    """One product's weight in the load format (the file's blocks under "auto")."""
    return load_weight(g, [name], fmt)[0]


def load_attn_layer(g: GGUFFile, p: str, fmt: str) -> AttnLayer:
    def t(name: str):
        return _weight(g, name, fmt)

    return AttnLayer(
        attn_norm=_vec(g, p + "attn_norm.weight"),
        qkv=Linear.concat([(t(p + "attn_q.weight"), None), (t(p + "attn_k.weight"), None),
                           (t(p + "attn_v.weight"), None)], fmt),
        o=Linear(t(p + "attn_output.weight"), None, fmt),
        q_norm=_vec(g, p + "attn_q_norm.weight"),
        k_norm=_vec(g, p + "attn_k_norm.weight"),
        post_norm=_vec(g, p + "post_attention_norm.weight"),
        gate_up=Linear.concat([(t(p + "ffn_gate.weight"), None), (t(p + "ffn_up.weight"), None)], fmt),
        down=Linear(t(p + "ffn_down.weight"), None, fmt),
    )


def gdn_projections_qwen35(g: GGUFFile, p: str, hy: HybridSpec) -> list[np.ndarray]:
    """[qkv, z, beta, alpha] weight matrices of one qwen35 GatedDeltaNet layer."""
    return [g.tensor(p + "attn_qkv.weight"), g.tensor(p + "attn_gate.weight"),
            g.tensor(p + "ssm_beta.weight"), g.tensor(p + "ssm_alpha.weight")]


def load_gdn_layer(g: GGUFFile, p: str, hy: HybridSpec, fmt: str, projections) -> GDNLayer:
    def t(name: str):
        return _weight(g, name, fmt)

    mats = projections(g, p, hy)
    conv = _vec(g, p + "ssm_conv1d.weight")
    if conv.shape != (hy.conv_dim, hy.conv_kernel):
        raise ModelFileError(f"{g.path.name}: {p}ssm_conv1d is {tuple(conv.shape)}, "
                             f"expected ({hy.conv_dim}, {hy.conv_kernel})")
    return GDNLayer(
        attn_norm=_vec(g, p + "attn_norm.weight"),
        in_proj=Linear.concat([(m, None) for m in mats], fmt),
        conv_w=conv,
        ssm_a=_vec(g, p + "ssm_a").reshape(-1),
        dt_bias=_vec(g, p + "ssm_dt.bias").reshape(-1),
        ssm_norm=_vec(g, p + "ssm_norm.weight").reshape(-1),
        out=Linear(t(p + "ssm_out.weight"), None, fmt),
        post_norm=_vec(g, p + "post_attention_norm.weight"),
        gate_up=Linear.concat([(t(p + "ffn_gate.weight"), None), (t(p + "ffn_up.weight"), None)], fmt),
        down=Linear(t(p + "ffn_down.weight"), None, fmt),
    )


def build_hybrid(g: GGUFFile, cfg: ArchConfig, fmt: str | None, n_ctx: int | None, projections) -> HybridModel:
    fmt = load_format(fmt)
    hy: HybridSpec = cfg.extra["hybrid"]
    layers = []
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        layers.append(load_gdn_layer(g, p, hy, fmt, projections) if hy.recurrent[i] else load_attn_layer(g, p, fmt))
    embed, lm_head = load_embedding(g, cfg, fmt)
    model = HybridModel(cfg, layers, embed, _vec(g, "output_norm.weight"), lm_head, n_ctx=n_ctx, path=g.path)
    if hy.n_nextn and g.has_tensor(f"blk.{cfg.n_layers}.nextn.eh_proj.weight"):
        from ..drafters.nextn import NextNHead

        model.draft_head = NextNHead.from_gguf(g, model, fmt=fmt)
    return model


def load(g: GGUFFile, fmt: str | None = None, n_ctx: int | None = None) -> HybridModel:
    return build_hybrid(g, config(g), fmt, n_ctx, gdn_projections_qwen35)
