"""The DFlash/DFlash2 drafter's weights and passes A-C (``DFlashModel``), its per-sequence KV ring, and the
layer-3 adapter (``DFlashHead``) the block speculator drives."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from ...models.base import apply_rope, rms_norm
from ...sampling import argmax, best_other
from ...weights import Linear
from ..protocols import DraftHeadKind
from .config import DFlashConfig, Pick
from .ops import _rope_at, grouped_dynamic_conv, selector_lattice


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
    def _block(self, anchor: int, position: int, ring: KVRing) -> tuple[torch.Tensor, torch.Tensor]:
        """PASS C: (h [B-1, H] after the final norm, logits after the transform over the drafter's
        own vocabulary: the target's, or the draft vocabulary ``d2t`` indexes)."""
        cfg = self.cfg
        ids = torch.full((cfg.block_size,), cfg.mask_token_id, dtype=torch.long)
        ids[0] = anchor
        x = self.embed[ids].float()  # [B, H]
        cos, sin = _rope_at(torch.arange(position, position + cfg.block_size), cfg.rope_base, cfg.rope_dim)
        slots = ring.context(position)  # committed positions < P the ring still holds
        for li, layer in enumerate(self.layers):
            x = self._layer(li, layer, x, position, cos, sin, ring, slots)
        h = rms_norm(x[1:], self.out_norm, cfg.rms_eps)
        return h, self.transform_logits(self.lm_head(h))

    def block_forward(self, anchor: int, position: int, ring: KVRing) -> tuple[torch.Tensor, torch.Tensor]:
        """PASS C: -> (h [B-1, H] after the final norm, logits [B-1, V] after the transform)."""
        h, logits = self._block(anchor, position, ring)
        if self.d2t is not None:  # reduced draft vocabulary: scatter into the target's (after the
            full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))  # softcap,
            full[:, self.d2t] = logits  # which would turn -inf into -softcap)
            logits = full
        return h, logits

    @torch.inference_mode()
    def walk(self, anchor: int, position: int, ring: KVRing, pick: Pick | None = None,
             others: list | None = None) -> tuple[list[int], list[float]]:
        """PASS C plus the read-out: (B-1 draft tokens, each one's drafter confidence).

        ``pick(e, row)`` chooses position e's token from a [vocab] score row (default: argmax).
        Plain DFlash: the row is position e's logits. With the selector: the row is the lattice
        row of the token picked at e-1 (``-inf`` outside position e's candidates). Confidence is
        the softmax of the row at the picked token (the gate multiplies these).

        ``others`` (a list, for token trees): each position's ``(confidence of the picked token,
        that of the best other token of the same row, that token)`` is appended to it.
        """
        tokens: list[int] = []
        conf: list[float] = []
        if pick is None and self.d2t is not None and (self.selector is None or not self.selector_enabled):
            # greedy over a draft vocabulary: argmax and softmax over its rows only, not over a
            # target-sized row that is -inf everywhere else (the same tokens and confidences)
            _, small = self._block(anchor, position, ring)
            probs = torch.softmax(small, dim=-1)
            p, i = probs.max(dim=-1)
            if others is not None:
                top = torch.topk(probs, min(2, probs.shape[-1]), dim=-1)
                for e in range(probs.shape[0]):
                    j = 1 if int(top.indices[e, 0]) == int(i[e]) else 0
                    j = min(j, top.indices.shape[1] - 1)
                    others.append((float(p[e]), float(top.values[e, j]), int(self.d2t[top.indices[e, j]])))
            return self.d2t[i].tolist(), p.tolist()
        pick = pick or (lambda e, row: argmax(row))
        h, logits = self.block_forward(anchor, position, ring)
        if self.selector is None or not self.selector_enabled:
            for e in range(logits.shape[0]):
                tok = pick(e, logits[e])
                tokens.append(tok)
                q = torch.softmax(logits[e], -1)
                conf.append(float(q[tok]))
                if others is not None:
                    others.append(best_other(q, tok))
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
            q = torch.softmax(scores, -1)
            conf.append(float(q[prev]))
            if others is not None:
                c, alt, j = best_other(q, prev)
                others.append((c, alt, int(cand[e, j])))
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

    def walk_block(self, last_token: int, position: int, state: KVRing, pick: Pick | None = None,
                   others: list | None = None) -> tuple[list[int], list[float]]:
        return self.model.walk(last_token, position, state, pick, others)

    def catch_up(self, tokens: Sequence[int], hidden: torch.Tensor, start_pos: int, state: KVRing) -> None:
        self.model.inject(hidden, start_pos, state)
