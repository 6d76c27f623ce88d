"""The hybrid trunk shared by ``qwen35`` and ``qwen3next``: GatedDeltaNet layers interleaved with gated
full attention (``gated_attention``), each followed by a dense SiLU-gated FFN.

Layers: ``(i + 1) % full_attention_interval == 0`` are full attention, the rest GatedDeltaNet
(``{arch}.attention.recurrent_layers``, a per-layer list, overrides the interval).

* GatedDeltaNet (``GDNLayer``): one fused input product [qkv | z | beta | alpha]; a depthwise causal
  conv (kernel ``ssm.conv_kernel``) + SiLU over qkv; q and k l2-normed; per value head
  beta = sigmoid(b), g = ssm_a * softplus(alpha + ssm_dt) (``ssm_a`` = -exp(A_log) as the converter
  stores it); the gated delta rule (``gated_delta``); out = ssm_out(rmsnorm(o) * silu(z)).
  Value heads are in llama.cpp's *tiled* order for qwen35 (value head h reads key head h % n_k;
  the converter reorders HF's grouped heads) and in HF's *grouped* order for qwen3next (h // r).
* Norm weights are used as stored: the converter folded Qwen's (1 + w) into every RMS norm except
  the GatedDeltaNet output norm (``ssm_norm``), which HF stores plain.

Batch invariance (measured, see ``tests/test_hybrid.py``): forwards of up to ``cache.ROW_FORM_MAX`` rows
(every decode step and every verify) run the delta rule row by row (``delta_rule_rows``) and compute
the per-head gates row by row, so row m's arithmetic is the same whether it runs alone or inside a
verify: speculative output equals plain output bit for bit. Longer forwards (prompt chunks) use the
chunked parallel form, which differs from the row form by ~1e-6 relative; plain and speculative
decoding prefill identically, so that never reaches the exactness contract.

The per-sequence state (attention KV, recurrent states, and what a trim of a verify needs) is a
``cache.HybridCache``; the model holds weights only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from ..errors import ModelFileError
from ..gguf_file import GGUFFile
from .protocols import ForwardItem, ForwardOutput
from ..weights import Linear, load_format
from .base import ArchConfig, LayerSpec, TransformerModel, _shares_storage, common_config, load_embedding, \
    plan_attention, rms_norm
from .cache import HybridCache, KVCache
from .gated_attention import AttnLayer, ffn, gated_attention, load_attn_layer, vec, weight
from .gated_delta import causal_conv, delta_rule_chunked, delta_rule_rows, l2norm

# the window the loop should use unless the user chose one: every extra verify row costs one more
# per-row recurrent state (see rollback_state_bytes), and acceptance decays with depth
PREFERRED_WINDOW = 3


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


# ----------------------------------------------------------------------------- layers


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


def _per_row(fn, *xs: torch.Tensor) -> torch.Tensor:
    """Apply an elementwise ``fn`` one row at a time.

    A narrow row (a few heads) spread over a multi-row tensor would put some of its elements on
    the SIMD path and others on the scalar tail of the elementwise kernel, which round differently
    for exp/softplus; one row per call keeps a row's bits independent of the row count.
    """
    return torch.stack([fn(*(x[i] for x in xs)) for i in range(xs[0].shape[0])])


class HybridModel(TransformerModel):
    """A SpecTarget over interleaved GatedDeltaNet and gated attention layers."""

    FUSABLE = False  # GatedDeltaNet layers: the torch path (with the native products) only
    cuts_vocab = False  # its ``forward`` takes no ``vocab``
    # a recurrent state per sequence, advanced in place and undone through the cache's slots: its
    # forward takes one sequence, and ``forward_batch`` runs the items one after another
    batches_sequences = False
    marks_prompt_rows = False  # its layers run in torch: every row on one arithmetic

    def __init__(self, cfg: ArchConfig, layers: list, embed: torch.Tensor, out_norm: torch.Tensor,
                 lm_head: Linear, n_ctx: int | None = None, path=None, *, verify_snapshots: bool = True):
        self.hy: HybridSpec = cfg.extra["hybrid"]
        self.attn_slot = {}  # layer index -> KV cache layer
        for i, rec in enumerate(self.hy.recurrent):
            if not rec:
                self.attn_slot[i] = len(self.attn_slot)
        self.gdn_index = [i for i, rec in enumerate(self.hy.recurrent) if rec]
        super().__init__(cfg, layers, embed, out_norm, lm_head, n_ctx=n_ctx, path=path)
        # per-row slots (True) or copy + replay (False, TS_Q35_VERIFY_SNAPSHOTS=0) for new caches
        self.verify_snapshots = verify_snapshots
        self.preferred_window = PREFERRED_WINDOW

    def make_cache(self) -> HybridCache:
        cfg, hy = self.cfg, self.hy
        kv = KVCache(max(1, len(self.attn_slot)), cfg.n_kv_heads, cfg.head_dim, self._max_context)
        return HybridCache(kv, (hy.conv_kernel - 1, hy.conv_dim), (hy.n_v_heads, hy.head_k_dim, hy.head_v_dim),
                           len(self.gdn_index), snapshots=self.verify_snapshots)

    # -- sizes -----------------------------------------------------------------------------------
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
        hy = self.hy
        return len(self.gdn_index) * ((hy.conv_kernel - 1) * hy.conv_dim + hy.n_v_heads * hy.head_k_dim
                                      * hy.head_v_dim) * 4

    # -- compute ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, tokens: Sequence[int], cache: HybridCache, *, all_logits: bool = False,
                taps: Sequence[int] | None = None) -> ForwardOutput:
        cfg = self.cfg
        h = self._token_rows(tokens)  # [n, d]; checks the ids before the cache changes
        replay = cache.replay
        if replay:  # copy mode after a trim: the kept rows of the last verify run again first
            h = torch.cat([self._token_rows(replay), h])
        rows = [*replay, *tokens]
        n = len(rows)
        cache.reserve(cache.length + len(tokens))
        mode = cache.plan(rows)  # settles a pending forward first: the state then sits at ``start``
        start = cache.state_len
        want = {t: None for t in (taps or ())}
        cos, sin = self._rope[cfg.layers[0].rope_base]
        cos, sin = cos[start : start + n], sin[start : start + n]
        kv = cache.kv
        groups = plan_attention(start, n, kv.capacity, cfg.n_heads // cfg.n_kv_heads, {None})
        g_i = 0
        for li, blk in enumerate(self.blocks):
            if li in want:
                want[li] = h
            x = rms_norm(h, blk.attn_norm, cfg.rms_eps)
            if isinstance(blk, GDNLayer):
                a = self._gdn(blk, g_i, x, cache, mode)
                g_i += 1
            else:
                slot = self.attn_slot[li]
                a = gated_attention(cfg, blk, x, kv.k[slot], kv.v[slot], start, cos, sin, groups)
            h = h + a
            h = h + ffn(blk, rms_norm(h, blk.post_norm, cfg.rms_eps))
        if cfg.n_layers in want:
            want[cfg.n_layers] = h
        cache.finish(n, mode)
        skip = len(replay)
        if skip:  # the replayed rows' outputs belong to an earlier forward
            h = h[skip:]
            want = {t: r[skip:] for t, r in want.items()}
        return self._output(h, want, [ForwardItem(tokens, cache, all_logits, taps)], [0, h.shape[0]])[0]

    def _gdn(self, blk: GDNLayer, j: int, x: torch.Tensor, cache: HybridCache, mode: str) -> torch.Tensor:
        hy = self.hy
        n = x.shape[0]
        C, vd, nv = hy.conv_dim, hy.value_dim, hy.n_v_heads
        st = cache.states[j]
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
            rows = cache.slot_rows(j) if mode == "slots" else None
            o = delta_rule_rows(st.ssm, q, k, v, g, beta, rows)
        if mode == "slots":
            cache.pending.conv_cat.append(conv_cat)
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


def load_gdn_layer(g: GGUFFile, p: str, hy: HybridSpec, fmt: str, projections) -> GDNLayer:
    def t(name: str):
        return weight(g, name, fmt)

    mats = projections(g, p, hy, fmt)  # the file's blocks under "auto", like every other product
    conv = vec(g, p + "ssm_conv1d.weight")
    if conv.shape != (hy.conv_dim, hy.conv_kernel):
        raise ModelFileError(f"{g.path.name}: {p}ssm_conv1d is {tuple(conv.shape)}, "
                             f"expected ({hy.conv_dim}, {hy.conv_kernel})")
    return GDNLayer(
        attn_norm=vec(g, p + "attn_norm.weight"),
        in_proj=Linear.concat([(m, None) for m in mats], fmt),
        conv_w=conv,
        ssm_a=vec(g, p + "ssm_a").reshape(-1),
        dt_bias=vec(g, p + "ssm_dt.bias").reshape(-1),
        ssm_norm=vec(g, p + "ssm_norm.weight").reshape(-1),
        out=Linear(t(p + "ssm_out.weight"), None, fmt),
        post_norm=vec(g, p + "post_attention_norm.weight"),
        gate_up=Linear.concat([(t(p + "ffn_gate.weight"), None), (t(p + "ffn_up.weight"), None)], fmt),
        down=Linear(t(p + "ffn_down.weight"), None, fmt),
    )


def build_hybrid(g: GGUFFile, cfg: ArchConfig, fmt: str | None, n_ctx: int | None, projections, *,
                 verify_snapshots: bool = True) -> HybridModel:
    fmt = load_format(fmt)
    hy: HybridSpec = cfg.extra["hybrid"]
    layers = []
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        layers.append(load_gdn_layer(g, p, hy, fmt, projections) if hy.recurrent[i] else load_attn_layer(g, p, fmt))
    embed, lm_head = load_embedding(g, cfg, fmt)
    model = HybridModel(cfg, layers, embed, vec(g, "output_norm.weight"), lm_head, n_ctx=n_ctx, path=g.path,
                        verify_snapshots=verify_snapshots)
    model.weight_format = fmt
    return model
