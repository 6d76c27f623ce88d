"""DFlash and DFlash2 block drafters (``general.architecture = dflash``), bound to one target.

A DFlash drafter is a small block-diffusion model. It reads the target's own residuals and proposes
a whole block of tokens in ONE forward pass. It borrows the target's token embedding and LM head
and owns a small sliding KV ring; the target's KV cache is never touched. Three passes:

    PASS A  encoder     feat = concat(residual ENTERING each of dflash.target_layers)   [n, T*D]
                        g    = rmsnorm(fc @ feat, enc.output_norm)                         [n, H]
    PASS B  KV inject   K = rope_neox(rmsnorm_head(attn_k @ g, attn_k_norm)) ; V = attn_v @ g
                        ring[pos % ring_rows] <- K, V   (every layer; no Q, no attention, no FFN)
    PASS C  block draft ids = [anchor, MASK x (B-1)] at positions P..P+B-1 (P = anchor's position)
                        x = embed(ids) (the target's embedding, unscaled)
                        per layer:  a = attn(rmsnorm(x)) ; x += a ; x += ffn(rmsnorm(x))
                          attention: q/k norms per head, NEOX rope, non-causal within the block,
                          keys = ring context (positions < P, present in the ring) + the block,
                          sliding window: a query at q sees a key at p iff |q - p| < window
                        h = rmsnorm(x, output_norm) ; logits = the target's LM head (h[1:])
                        -> B-1 drafts: row i (i >= 1) predicts the token AT position P+i

The ring holds K/V of committed tokens only. It refills from the prompt (``begin``) and from
every commit, and it records which position each row holds, so a gap (an adopted KV prefix the
drafter never saw) simply masks out: drafting after a reused prefix starts with a shorter context.

DFlash2 adds two pieces, each a no-op when its tensors are absent (and switchable off for
attribution with ``TS_DFLASH_CONV=0`` / ``TS_DFLASH_SELECTOR=0``; the weights were trained with
both, so neither switch is a supported way to run a DFlash2 file):

* a grouped dynamic depthwise convolution around every attention and FFN sublayer. One projection
  of the sublayer INPUT u gives ``dyn = conv_proj @ u`` viewed [rows, 2, K, G] (side, tap, group);
  side 0 filters the input, side 1 the sublayer's output. For side s, block row r, channel c:
  ``y[r][c] = sum_t (base[s][t][c] + dyn[r][s][t][c // group_size]) * x[r - t][c]``, with
  ``x[r - t] = 0`` for r < t: the filter never reaches across the block boundary. The filtered
  value REPLACES the input / output (there is no extra residual around it);
* a candidate selector: ``unary, cand = topk(logits, K)`` per block position e (logits after the
  target's logit transform ``dflash.logit_scale`` and ``dflash.final_logit_softcapping``), and
  ``score[e][p][c] = unary[e][c] + < A[pred[e][p]] * (P h_e), B[cand[e][c]] >`` with A/B/P the
  ``selector_predecessor`` / ``selector_successor`` / ``selector_hidden`` weights and
  ``pred[0] = anchor``, ``pred[e] = cand[e-1]``. The draft is a GREEDY WALK over that lattice
  (see ``greedy_walk``): at each position the best candidate given the candidate already chosen
  before it. That is not the maximum-total path (Viterbi); it is what the reference drafter does.

GGUF layout read (llama.cpp's ``dflash`` names; numpy shapes, i.e. GGUF dims reversed):

    metadata  dflash.block_count, dflash.embedding_length, dflash.attention.head_count,
              dflash.attention.head_count_kv (default head_count), dflash.attention.key_length
              (default H / heads), dflash.attention.layer_norm_rms_epsilon (default 1e-6),
              dflash.rope.freq_base (default: the trunk's), dflash.rope.dimension_count (default
              head_dim), dflash.feed_forward_length (optional: the FFN tensors say it),
              dflash.block_size (>= 2), dflash.mask_token_id (or
              tokenizer.ggml.mask_token_id), dflash.target_layers = indices of the layers whose
              ENTERING residual is read (llama.cpp's converter writes HF ``target_layer_ids`` + 1);
              a file with only dflash.target_layer_ids (HF output indices) is read as those + 1.
              Optional: dflash.attention.sliding_window (0/absent: full attention),
              dflash.attention.sliding_window_pattern ([bool] per layer, True = sliding),
              dflash.attention.causal (default false), dflash.conv_kernel_size,
              dflash.conv_group_size, dflash.selector_rank, dflash.selector_top_k,
              dflash.logit_scale (0/absent: 1), dflash.final_logit_softcapping (0/absent: none).
    tensors   fc.weight [H, T*D] ; enc.output_norm.weight [H] ; output_norm.weight [H]
              blk.{i}.attn_norm.weight [H] ; blk.{i}.attn_q.weight [nh*hd, H] ;
              blk.{i}.attn_k.weight / attn_v.weight [nkv*hd, H] ; blk.{i}.attn_output.weight
              [H, nh*hd] ; blk.{i}.attn_q_norm.weight / attn_k_norm.weight [hd] ;
              blk.{i}.ffn_norm.weight [H] ; blk.{i}.ffn_gate.weight / ffn_up.weight [F, H] ;
              blk.{i}.ffn_down.weight [H, F]
    optional  token_embd.weight [V, H] (own embedding) ; output.weight [Vd, H] (own LM head) ;
              d2t [Vd] (draft row -> target token id, for a reduced draft vocabulary)
    DFlash2   blk.{i}.attn_conv_base / ffn_conv_base [2, K, H] (no ``.weight`` suffix) ;
              blk.{i}.attn_conv_proj.weight / ffn_conv_proj.weight [2*K*G, H], G = H / group ;
              selector_predecessor.weight / selector_successor.weight [V, r] ;
              selector_hidden.weight [r, H]

Refused with a reason: DSpark heads (``markov_w1.weight``), attention sinks, a drafter whose
hidden size, target layers or fc width do not fit the trunk it is attached to.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import BadInput, ModelFileError
from ..gguf_file import GGUFFile
from ..models.base import apply_rope, rms_norm
from ..settings import ENV_DFLASH_CONV as ENV_CONV, ENV_DFLASH_SELECTOR as ENV_SELECTOR
from ..spec.protocols import DraftHeadKind
from ..validate import MAX_DIM, typed_value
from ..weights import Linear, load_format, to_tensor
from . import DrafterOptions

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


# ----------------------------------------------------------------------------- pure pieces


def grouped_dynamic_conv(
    x: torch.Tensor,  # [rows, H] one block, row 0 = the anchor
    dyn: torch.Tensor,  # [rows, K, G] dynamic taps of this side, from the sublayer input
    base: torch.Tensor,  # [K, H] static taps of this side
    group_size: int,
) -> torch.Tensor:
    """``y[r][c] = sum_t (base[t][c] + dyn[r][t][c // group_size]) * x[r - t][c]``, x[<0] = 0."""
    rows, hidden = x.shape
    kernel = base.shape[0]
    taps = base[None] + dyn.repeat_interleave(group_size, dim=-1)  # [rows, K, H]
    y = taps[:, 0] * x
    for t in range(1, min(kernel, rows)):
        y[t:] += taps[t:, t] * x[:-t]  # rows r < t would read before the block: zero
    return y


def selector_lattice(
    unary: torch.Tensor,  # [E, k] transformed logits of the candidates
    cand: torch.Tensor,  # [E, k] candidate token ids
    ph: torch.Tensor,  # [E, r] P h_e
    pred_book: torch.Tensor,  # [V, r] A
    succ_book: torch.Tensor,  # [V, r] B
    anchor: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (first [k], trans [E-1, k, k]).

    ``first[c] = score[0][anchor][c]``; ``trans[e-1][p][c] = score[e][cand[e-1][p]][c]``.
    """
    a0 = pred_book[anchor] * ph[0]  # [r]
    first = unary[0] + succ_book[cand[0]] @ a0
    if unary.shape[0] == 1:
        return first, unary.new_zeros(0, unary.shape[1], unary.shape[1])
    a = pred_book[cand[:-1]] * ph[1:, None, :]  # [E-1, k(p), r]
    b = succ_book[cand[1:]]  # [E-1, k(c), r]
    trans = unary[1:, None, :] + torch.einsum("epr,ecr->epc", a, b)
    return first, trans


def greedy_walk(first: torch.Tensor, trans: torch.Tensor) -> list[int]:
    """Candidate indices of the greedy walk: argmax of ``first``, then of ``trans[e][previous]``.

    Among all paths it is the one whose per-step scores are lexicographically largest (step 0
    first); it equals the maximum-total path only when transitions do not trade off (see tests).
    """
    path = [int(torch.argmax(first))]
    for e in range(trans.shape[0]):
        path.append(int(torch.argmax(trans[e, path[-1]])))
    return path


def _rope_at(positions: torch.Tensor, base: float, rot_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
    ang = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    return ang.cos().float(), ang.sin().float()  # [n, rot_dim/2]


# ----------------------------------------------------------------------------- weights


@dataclass
class GroupedConv:
    base: torch.Tensor  # [2, K, H] float32: side 0 filters the input, side 1 the output
    proj: Linear  # H -> 2*K*G
    group_size: int

    def taps(self, u: torch.Tensor) -> torch.Tensor:
        """Dynamic taps from the sublayer input u [rows, H] -> [rows, 2, K, G]."""
        k = self.base.shape[1]
        return self.proj(u).view(u.shape[0], 2, k, -1)


@dataclass
class DraftLayer:
    attn_norm: torch.Tensor
    q: Linear
    kv: Linear  # K and V stacked: shared by pass B (on g) and pass C (on the block)
    o: Linear
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    ffn_norm: torch.Tensor
    gate_up: Linear
    down: Linear
    attn_conv: GroupedConv | None = None
    ffn_conv: GroupedConv | None = None


@dataclass
class Selector:
    pred_book: torch.Tensor  # [V, r] float32 (A)
    succ_book: torch.Tensor  # [V, r] float32 (B)
    hidden: Linear  # H -> r (P)
    top_k: int


class KVRing:
    """The drafter's own K/V of committed positions, row ``pos % rows``; ``pos_of`` says which."""

    def __init__(self, n_layers: int, n_kv: int, head_dim: int, rows: int):
        self.rows = rows
        self.k = torch.zeros(n_layers, n_kv, rows, head_dim)
        self.v = torch.zeros(n_layers, n_kv, rows, head_dim)
        self.pos_of = torch.full((rows,), -1, dtype=torch.long)  # -1: empty

    def reset(self) -> None:
        self.pos_of.fill_(-1)

    def forget_from(self, position: int) -> None:
        """Drop rows at positions >= ``position`` (they belonged to a discarded continuation)."""
        self.pos_of[self.pos_of >= position] = -1

    def write(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # positions [n] ascending; k, v [L, n_kv, n, hd]; only the newest `rows` can survive
        if positions.numel() > self.rows:
            positions, k, v = positions[-self.rows :], k[:, :, -self.rows :], v[:, :, -self.rows :]
        slots = positions % self.rows
        self.k[:, :, slots] = k
        self.v[:, :, slots] = v
        self.pos_of[slots] = positions

    def context(self, before: int) -> torch.Tensor:
        """Ring slots holding positions < ``before``, ordered by position."""
        pos = self.pos_of
        slots = torch.nonzero((pos >= 0) & (pos < before)).flatten()
        return slots[torch.argsort(pos[slots])]


# ----------------------------------------------------------------------------- the model


class DFlashModel:
    """Weights, the KV ring, and passes A-C. Borrows ``embed``/``lm_head`` from the target."""

    def __init__(self, cfg: DFlashConfig, layers: list[DraftLayer], fc: Linear, enc_norm: torch.Tensor,
                 out_norm: torch.Tensor, embed: torch.Tensor, lm_head: Linear, vocab_size: int,
                 ring_rows: int, d2t: torch.Tensor | None = None, selector: Selector | None = None,
                 path=None):
        self.cfg = cfg
        self.layers = layers
        self.fc = fc
        self.enc_norm = enc_norm
        self.out_norm = out_norm
        self.embed = embed  # [V, H]
        self.lm_head = lm_head  # H -> V (or Vd with d2t)
        self.vocab_size = vocab_size
        self.d2t = d2t  # [Vd] long, draft row -> target token id
        self.selector = selector
        self.path = path
        self.ring_rows = ring_rows
        self.q_dim = cfg.n_heads * cfg.head_dim
        self.kv_dim = cfg.n_kv_heads * cfg.head_dim
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        # attribution switches (TS_DFLASH_CONV / TS_DFLASH_SELECTOR); no-ops on a DFlash file
        self.conv_enabled = True
        self.selector_enabled = True

    @property
    def has_conv(self) -> bool:
        return self.layers[0].attn_conv is not None

    @property
    def has_selector(self) -> bool:
        return self.selector is not None

    @property
    def generation(self) -> int:
        return 2 if (self.has_conv or self.has_selector) else 1

    # -- passes A and B -------------------------------------------------------------------------
    def encode(self, feat: torch.Tensor) -> torch.Tensor:
        """PASS A: target feature rows [n, T*D] -> g [n, H]."""
        return rms_norm(self.fc(feat.float()), self.enc_norm, self.cfg.rms_eps)

    def context_kv(self, g: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """PASS B's projections: g [n, H] -> K, V [L, n_kv, n, hd] (K normed and roped)."""
        cfg = self.cfg
        n = g.shape[0]
        cos, sin = _rope_at(positions, cfg.rope_base, cfg.rope_dim)
        ks, vs = [], []
        for layer in self.layers:
            kv = layer.kv(g)
            k = kv[:, : self.kv_dim].view(n, cfg.n_kv_heads, cfg.head_dim)
            v = kv[:, self.kv_dim :].view(n, cfg.n_kv_heads, cfg.head_dim)
            k = apply_rope(rms_norm(k, layer.k_norm, cfg.rms_eps), cos, sin, True)
            ks.append(k.transpose(0, 1))
            vs.append(v.transpose(0, 1))
        return torch.stack(ks), torch.stack(vs)

    def new_state(self) -> KVRing:
        """One sequence's KV ring (the drafter's only per-sequence state)."""
        cfg = self.cfg
        return KVRing(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, self.ring_rows)

    @torch.inference_mode()
    def inject(self, feat: torch.Tensor, start_pos: int, ring: KVRing) -> None:
        """PASSES A+B for committed rows at ``start_pos``..: their K/V go into ``ring``."""
        n = feat.shape[0]
        if n == 0:
            return
        if n > ring.rows:  # only the newest rows can stay in the ring
            feat, start_pos = feat[-ring.rows :], start_pos + n - ring.rows
            n = ring.rows
        ring.forget_from(start_pos)
        positions = torch.arange(start_pos, start_pos + n)
        k, v = self.context_kv(self.encode(feat), positions)
        ring.write(positions, k, v)

    # -- pass C ---------------------------------------------------------------------------------
    def _attend(self, li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position: int,
                ring: KVRing, slots: torch.Tensor) -> torch.Tensor:
        """Block queries over ring context (``slots``) + the block. q [B, nh, hd]; k, v [B, n_kv, hd]."""
        cfg = self.cfg
        rows = q.shape[0]
        ctx_pos = ring.pos_of[slots]
        keys = torch.cat([ring.k[li][:, slots], k.transpose(0, 1)], dim=1)  # [n_kv, C+B, hd]
        vals = torch.cat([ring.v[li][:, slots], v.transpose(0, 1)], dim=1)
        rep = cfg.n_heads // cfg.n_kv_heads
        keys = keys.repeat_interleave(rep, dim=0)  # [nh, C+B, hd]: query head h reads kv head h // rep
        vals = vals.repeat_interleave(rep, dim=0)
        q_pos = torch.arange(position, position + rows)
        k_pos = torch.cat([ctx_pos, q_pos])
        allowed = torch.ones(rows, k_pos.numel(), dtype=torch.bool)
        if cfg.causal:
            allowed &= k_pos[None, :] <= q_pos[:, None]
        if cfg.swa_layers[li]:
            allowed &= (q_pos[:, None] - k_pos[None, :]).abs() < cfg.sliding_window
        scores = torch.einsum("bhd,hkd->hbk", q, keys) * self.scale  # [nh, B, C+B]
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return torch.einsum("hbk,hkd->bhd", probs, vals)  # [B, nh, hd]

    def _layer(self, li: int, layer: DraftLayer, x: torch.Tensor, position: int,
               cos: torch.Tensor, sin: torch.Tensor, ring: KVRing, slots: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        rows = x.shape[0]
        conv = self.conv_enabled
        u = rms_norm(x, layer.attn_norm, cfg.rms_eps)
        dyn = None
        if conv and layer.attn_conv is not None:
            dyn = layer.attn_conv.taps(u)  # [B, 2, K, G]
            u = grouped_dynamic_conv(u, dyn[:, 0], layer.attn_conv.base[0], layer.attn_conv.group_size)
        q = layer.q(u).view(rows, cfg.n_heads, cfg.head_dim)
        kv = layer.kv(u)
        k = kv[:, : self.kv_dim].view(rows, cfg.n_kv_heads, cfg.head_dim)
        v = kv[:, self.kv_dim :].view(rows, cfg.n_kv_heads, cfg.head_dim)
        q = apply_rope(rms_norm(q, layer.q_norm, cfg.rms_eps), cos, sin, True)
        k = apply_rope(rms_norm(k, layer.k_norm, cfg.rms_eps), cos, sin, True)
        a = layer.o(self._attend(li, q, k, v, position, ring, slots).reshape(rows, self.q_dim))
        if dyn is not None:
            a = grouped_dynamic_conv(a, dyn[:, 1], layer.attn_conv.base[1], layer.attn_conv.group_size)
        x = x + a
        u = rms_norm(x, layer.ffn_norm, cfg.rms_eps)
        dyn = None
        if conv and layer.ffn_conv is not None:
            dyn = layer.ffn_conv.taps(u)
            u = grouped_dynamic_conv(u, dyn[:, 0], layer.ffn_conv.base[0], layer.ffn_conv.group_size)
        gu = layer.gate_up(u)
        f = gu.shape[1] // 2
        y = layer.down(F.silu(gu[:, :f]) * gu[:, f:])
        if dyn is not None:
            y = grouped_dynamic_conv(y, dyn[:, 1], layer.ffn_conv.base[1], layer.ffn_conv.group_size)
        return x + y

    def transform_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The target's logit transform, as the drafter file states it."""
        cfg = self.cfg
        if cfg.logit_scale != 1.0:
            logits = logits * cfg.logit_scale
        if cfg.final_softcap:
            logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        return logits

    @torch.inference_mode()
    def block_forward(self, anchor: int, position: int, ring: KVRing) -> tuple[torch.Tensor, torch.Tensor]:
        """PASS C: -> (h [B-1, H] after the final norm, logits [B-1, V] after the transform)."""
        cfg = self.cfg
        ids = torch.full((cfg.block_size,), cfg.mask_token_id, dtype=torch.long)
        ids[0] = anchor
        x = self.embed[ids].float()  # [B, H]
        cos, sin = _rope_at(torch.arange(position, position + cfg.block_size), cfg.rope_base, cfg.rope_dim)
        slots = ring.context(position)  # committed positions < P the ring still holds
        for li, layer in enumerate(self.layers):
            x = self._layer(li, layer, x, position, cos, sin, ring, slots)
        h = rms_norm(x[1:], self.out_norm, cfg.rms_eps)
        logits = self.transform_logits(self.lm_head(h))
        if self.d2t is not None:  # reduced draft vocabulary: scatter into the target's (after the
            full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))  # softcap,
            full[:, self.d2t] = logits  # which would turn -inf into -softcap)
            logits = full
        return h, logits

    @torch.inference_mode()
    def walk(self, anchor: int, position: int, ring: KVRing, pick: Pick | None = None
             ) -> tuple[list[int], list[float]]:
        """PASS C plus the read-out: (B-1 draft tokens, each one's drafter confidence).

        ``pick(e, row)`` chooses position e's token from a [vocab] score row (default: argmax).
        Plain DFlash: the row is position e's logits. With the selector: the row is the lattice
        row of the token picked at e-1 (``-inf`` outside position e's candidates). Confidence is
        the softmax of the row at the picked token (the gate multiplies these).
        """
        pick = pick or (lambda e, row: int(torch.argmax(row)))
        h, logits = self.block_forward(anchor, position, ring)
        tokens: list[int] = []
        conf: list[float] = []
        if self.selector is None or not self.selector_enabled:
            for e in range(logits.shape[0]):
                tok = pick(e, logits[e])
                tokens.append(tok)
                conf.append(float(torch.softmax(logits[e], -1)[tok]))
            return tokens, conf
        sel = self.selector
        unary, cand = torch.topk(logits, sel.top_k, dim=-1)  # [E, k]
        first, trans = selector_lattice(unary, cand, sel.hidden(h), sel.pred_book, sel.succ_book, anchor)
        prev = None
        for e in range(logits.shape[0]):
            scores = first if e == 0 else trans[e - 1, prev]  # [k]
            row = logits.new_full((self.vocab_size,), float("-inf"))
            row[cand[e]] = scores
            tok = pick(e, row)
            hit = torch.nonzero(cand[e] == tok).flatten()
            if hit.numel() == 0:
                raise ValueError(f"pick chose token {tok}, which is not a selector candidate")
            prev = int(hit[0])
            tokens.append(tok)
            conf.append(float(torch.softmax(scores, -1)[prev]))
        return tokens, conf


# ----------------------------------------------------------------------------- layer 3 adapter


class DFlashHead:
    """The DraftHead (kind BLOCK) over a ``DFlashModel``."""

    kind = DraftHeadKind.BLOCK

    def __init__(self, model: DFlashModel):
        self.model = model
        self.block_size = model.cfg.block_size

    def new_state(self) -> KVRing:
        return self.model.new_state()

    def draft_step(self, token: int, hidden: torch.Tensor, position: int, state: KVRing):
        raise NotImplementedError("a DFlash drafter proposes whole blocks, not single tokens")

    def draft_block(self, last_token: int, hidden: torch.Tensor | None, position: int,
                    state: KVRing) -> tuple[list[int], torch.Tensor]:
        """Greedy block: (block_size - 1 drafts, per-token confidence). ``hidden`` is unused: the
        anchor's own residual does not exist yet; the context comes from the ring."""
        tokens, conf = self.model.walk(last_token, position, state)
        return tokens, torch.tensor(conf)

    def walk_block(self, last_token: int, position: int, state: KVRing, pick: Pick | None = None
                   ) -> tuple[list[int], list[float]]:
        return self.model.walk(last_token, position, state, pick)

    def catch_up(self, tokens: Sequence[int], hidden: torch.Tensor, start_pos: int, state: KVRing) -> None:
        self.model.inject(hidden, start_pos, state)


# ----------------------------------------------------------------------------- the drafter


class DFlashDrafter:
    """What ``load_drafter`` returns for a dflash file: served by the registry's ``block`` entry."""

    speculator_name = "block"
    preferred_window = None  # the trunk's, else the default

    def __init__(self, model: DFlashModel, target, path=None):
        self.model = model
        self.cfg = model.cfg
        self.draft_head = DFlashHead(model)
        self.path = path
        # (hidden, layers, vocab) of the trunk it was bound to: it drafts for that trunk only
        self.target_shape = (target.hidden_size, target.n_layers, target.vocab_size)
        self.notes = [f"{Path(str(path)).name if path else 'drafter'}: {self.describe()}"]
        self.warnings = []
        pieces = ((model.conv_enabled, model.has_conv, ENV_CONV, "convolution"),
                  (model.selector_enabled, model.has_selector, ENV_SELECTOR, "candidate selector"))
        for on, present, env, what in pieces:
            if present and not on:
                self.warnings.append(f"{env}=0: the DFlash2 {what} is off (for attribution only; "
                                     "the weights were trained with it)")

    @property
    def taps(self) -> tuple[int, ...]:
        return self.cfg.target_layers

    def describe(self) -> str:
        cfg = self.cfg
        parts = [f"DFlash{'2' if self.model.generation == 2 else ''}", f"{cfg.n_layers} layers",
                 f"block {cfg.block_size}", f"taps {list(cfg.target_layers)}"]
        if self.model.has_conv:
            parts.append(f"conv k={cfg.conv_kernel}/g={cfg.conv_group}" + ("" if self.model.conv_enabled else " (off)"))
        if self.model.has_selector:
            parts.append(f"selector r={cfg.selector_rank}/top-{cfg.selector_top_k}"
                         + ("" if self.model.selector_enabled else " (off)"))
        return ", ".join(parts)


# ----------------------------------------------------------------------------- loading


def _check_trunk(g: GGUFFile, cfg: DFlashConfig, target, fc_in: int, own_embed: bool, own_head: bool) -> None:
    """A drafter is trained against one trunk: refuse any other, naming the key that disagrees."""
    name = g.path.name
    bad = [t for t in cfg.target_layers if t >= target.n_layers]
    if bad:
        raise BadInput(
            f"{name}: dflash.target_layers {list(cfg.target_layers)} reach layer {max(bad)}, but the "
            f"trunk has {target.n_layers} layers; this drafter belongs to a different model"
        )
    want = len(cfg.target_layers) * target.hidden_size
    if fc_in != want:
        raise BadInput(
            f"{name}: fc.weight takes {fc_in} inputs, but {len(cfg.target_layers)} dflash.target_layers "
            f"x trunk hidden {target.hidden_size} = {want}; this drafter belongs to a different model"
        )
    if (not own_embed or not own_head) and cfg.d_model != target.hidden_size:
        raise BadInput(
            f"{name}: dflash.embedding_length {cfg.d_model} differs from the trunk's hidden size "
            f"{target.hidden_size}, and the drafter borrows the trunk's embedding and LM head"
        )
    if not 0 <= cfg.mask_token_id < target.vocab_size:
        raise BadInput(
            f"{name}: dflash.mask_token_id {cfg.mask_token_id} is outside the trunk's vocabulary "
            f"of {target.vocab_size}"
        )
    vocab = g.get("dflash.vocab_size")
    if vocab is not None and int(vocab) != target.vocab_size:
        raise BadInput(f"{name}: dflash.vocab_size {vocab} differs from the trunk's vocabulary {target.vocab_size}")


def _int_tensor(g: GGUFFile, name: str) -> torch.Tensor:
    """An integer tensor (``d2t`` is I64/I32), read as stored: there is nothing to dequantize."""
    for t in g.reader.tensors:
        if t.name == name:
            return torch.as_tensor(np.array(t.data).reshape(-1).astype(np.int64))
    raise ModelFileError(f"{g.path.name}: missing tensor {name!r}")


def load(g: GGUFFile, target, options: DrafterOptions | None = None, *, fmt: str | None = None) -> DFlashDrafter:
    """Read a dflash GGUF and bind it to ``target`` (a trunk exposing ``embed`` and ``lm_head``);
    ``fmt`` (default: the trunk's) is the format of the drafter's own weights."""
    options = options or DrafterOptions()
    name = g.path.name
    for marker, what in (("markov_w1.weight", "DSpark Markov head"), ("blk.0.attn_sinks.weight", "attention sinks")):
        if g.has_tensor(marker):
            raise ModelFileError(f"{name}: this dflash file carries a {what} ({marker}), which is not supported")
    trunk_base = None
    tcfg = getattr(target, "cfg", None)
    if tcfg is not None and getattr(tcfg, "layers", None):
        trunk_base = tcfg.layers[0].rope_base
    cfg = read_config(g, trunk_base)
    fmt = load_format(fmt or getattr(getattr(target, "lm_head", None), "fmt", None))

    def t(n: str) -> np.ndarray:
        return g.tensor(n)

    def vec(n: str, size: int) -> torch.Tensor:
        a = to_tensor(t(n), torch.float32)
        if a.shape != (size,):
            raise ModelFileError(f"{name}: {n} is {tuple(a.shape)}, expected ({size},)")
        return a

    def mat(n: str, shape: tuple[int, int]) -> np.ndarray:
        a = t(n)
        if a.shape != shape:
            raise ModelFileError(f"{name}: {n} is {a.shape}, expected {shape}")
        return a

    d, hd = cfg.d_model, cfg.head_dim
    q_dim, kv_dim = cfg.n_heads * hd, cfg.n_kv_heads * hd
    fc_w = t("fc.weight")
    if fc_w.ndim != 2 or fc_w.shape[0] != d:
        raise ModelFileError(f"{name}: fc.weight is {fc_w.shape}, expected ({d}, len(target_layers) x trunk hidden)")
    own_embed, own_head = g.has_tensor("token_embd.weight"), g.has_tensor("output.weight")
    _check_trunk(g, cfg, target, fc_w.shape[1], own_embed, own_head)

    if not g.has_tensor("blk.0.ffn_gate.weight"):
        raise ModelFileError(f"{name}: missing tensor 'blk.0.ffn_gate.weight'")
    cfg.ffn_dim = g.tensor_info("blk.0.ffn_gate.weight").shape[0]
    stated = _meta_int(g, "dflash.feed_forward_length")
    if stated is not None and stated != cfg.ffn_dim:
        raise ModelFileError(f"{name}: dflash.feed_forward_length {stated} disagrees with "
                             f"blk.0.ffn_gate.weight ({cfg.ffn_dim} rows)")
    f = cfg.ffn_dim

    conv_on = g.has_tensor("blk.0.attn_conv_base")
    stray = [n for n in g.tensor_names() if n.endswith("_conv_base")]
    if stray and not conv_on:
        raise ModelFileError(f"{name}: conv tensors present ({stray[0]}, ...) but blk.0.attn_conv_base is missing")
    if conv_on:
        if cfg.conv_kernel <= 0 or cfg.conv_group <= 0:
            raise ModelFileError(f"{name}: conv tensors present but dflash.conv_kernel_size / "
                                 "dflash.conv_group_size are missing or zero")
        if d % cfg.conv_group:
            raise ModelFileError(f"{name}: dflash.conv_group_size {cfg.conv_group} does not divide "
                                 f"dflash.embedding_length {d}")
    n_groups = d // cfg.conv_group if conv_on else 0

    def conv(prefix: str) -> GroupedConv | None:
        if not conv_on:
            return None
        base = t(prefix + "_base")
        if base.shape != (2, cfg.conv_kernel, d):
            raise ModelFileError(f"{name}: {prefix}_base is {base.shape}, expected (2, {cfg.conv_kernel}, {d})")
        proj = mat(prefix + "_proj.weight", (2 * cfg.conv_kernel * n_groups, d))
        return GroupedConv(to_tensor(base, torch.float32), Linear(proj, None, fmt), cfg.conv_group)

    layers = []
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        layers.append(DraftLayer(
            attn_norm=vec(p + "attn_norm.weight", d),
            q=Linear(mat(p + "attn_q.weight", (q_dim, d)), None, fmt),
            kv=Linear.concat([(mat(p + "attn_k.weight", (kv_dim, d)), None),
                              (mat(p + "attn_v.weight", (kv_dim, d)), None)], fmt),
            o=Linear(mat(p + "attn_output.weight", (d, q_dim)), None, fmt),
            q_norm=vec(p + "attn_q_norm.weight", hd),
            k_norm=vec(p + "attn_k_norm.weight", hd),
            ffn_norm=vec(p + "ffn_norm.weight", d),
            gate_up=Linear.concat([(mat(p + "ffn_gate.weight", (f, d)), None),
                                   (mat(p + "ffn_up.weight", (f, d)), None)], fmt),
            down=Linear(mat(p + "ffn_down.weight", (d, f)), None, fmt),
            attn_conv=conv(p + "attn_conv"),
            ffn_conv=conv(p + "ffn_conv"),
        ))

    vocab = target.vocab_size
    embed = to_tensor(mat("token_embd.weight", (vocab, d)), torch.float32) if own_embed else target.embed
    d2t = None
    if own_head:
        head_w = t("output.weight")
        if head_w.ndim != 2 or head_w.shape[1] != d:
            raise ModelFileError(f"{name}: output.weight is {head_w.shape}, expected (vocab, {d})")
        if g.has_tensor("d2t"):
            d2t = _int_tensor(g, "d2t")
            if d2t.numel() != head_w.shape[0] or int(d2t.min()) < 0 or int(d2t.max()) >= vocab:
                raise ModelFileError(f"{name}: d2t must map the {head_w.shape[0]} draft rows into the "
                                     f"trunk's vocabulary of {vocab}")
        elif head_w.shape[0] != vocab:
            raise BadInput(f"{name}: output.weight has {head_w.shape[0]} rows and no d2t map, but the "
                           f"trunk's vocabulary is {vocab}")
        lm_head = Linear(head_w, None, fmt)
    else:
        lm_head = target.lm_head

    selector = None
    parts = [n for n in ("selector_hidden.weight", "selector_predecessor.weight", "selector_successor.weight")
             if g.has_tensor(n)]
    if parts and not g.has_tensor("selector_hidden.weight"):
        raise ModelFileError(f"{name}: selector tensors present ({parts[0]}) but selector_hidden.weight is missing")
    if g.has_tensor("selector_hidden.weight"):
        r, k = cfg.selector_rank, cfg.selector_top_k
        if r <= 0 or k <= 0:
            raise ModelFileError(f"{name}: selector tensors present but dflash.selector_rank / "
                                 "dflash.selector_top_k are missing or zero")
        if k > vocab:
            raise ModelFileError(f"{name}: dflash.selector_top_k {k} exceeds the vocabulary {vocab}")
        selector = Selector(
            pred_book=to_tensor(mat("selector_predecessor.weight", (vocab, r)), torch.float32),
            succ_book=to_tensor(mat("selector_successor.weight", (vocab, r)), torch.float32),
            hidden=Linear(mat("selector_hidden.weight", (r, d)), None, fmt),
            top_k=k,
        )

    # every layer sliding: the ring needs one window of rows; any full-attention layer: everything
    if cfg.sliding_window is not None and all(cfg.swa_layers):
        ring_rows = cfg.sliding_window
    else:
        ring_rows = int(getattr(target, "max_context", 4096))
    model = DFlashModel(
        cfg, layers,
        fc=Linear(fc_w, None, fmt),
        enc_norm=vec("enc.output_norm.weight", d),
        out_norm=vec("output_norm.weight", d),
        embed=embed, lm_head=lm_head, vocab_size=vocab, ring_rows=ring_rows, d2t=d2t,
        selector=selector, path=g.path,
    )
    model.conv_enabled = options.dflash_conv
    model.selector_enabled = options.dflash_selector
    return DFlashDrafter(model, target, path=g.path)
