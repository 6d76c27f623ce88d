"""How a llama-family trunk's blocks and output head execute: one object per backend.

A ``TransformerModel`` holds weights and the model's facts; the runner it picks when it is built
says how a forward runs them:

* ``TorchRunner``: the torch reference (products through each ``Linear``'s own backend, attention by
  ``base.attend`` over span groups). Every other runner is tested against it.
* ``NativeRunner``: every block in one C call per forward (``kernels.FusedBlocks``), and the final
  norm and LM head in one more where the head is native too. Taken when every block weight is on
  the gguf backend and the native kernels are built.
* ``TritonRunner``: the GPU path: the reference's block code on the device, attention by the Triton
  kernel, outputs moved to the host (the loop, the samplers and the drafters take host tensors).

All three give a row the same result whatever rows share its forward (batch invariance); the native
and the torch runner agree to rounding, which tests/test_kernels.py and tests/test_batch.py hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from .ops import apply_rope, attend, plan_attention, rms_norm
from .protocols import ForwardItem

if TYPE_CHECKING:
    from .base import Block, TransformerModel


@dataclass(frozen=True)
class TreeLayout:
    """Where a token tree's new rows sit and what each reads (``tree_layout``): row r is written to
    slot ``start + r``, takes position ``positions[r]``, and attends to the cache's first ``base``
    slots and then ``paths[r]`` (its ancestors' slots and its own, root first)."""

    base: int
    positions: list[int]
    paths: list[list[int]]


def tree_layout(start: int, n: int, parents: Sequence[int], base: int | None = None) -> TreeLayout:
    """The layout of ``n`` tree rows forwarded after a cache of ``start`` positions. The tree's
    nodes begin at slot ``base`` (None: ``start``, the rows are the whole tree): node j sits at slot
    ``base + j``, nodes [0, start - base) are already in the cache (an earlier forward of the same
    tree wrote them), and ``parents`` names every node's parent (-1: it follows the first ``base``
    positions), so ``len(parents) == start - base + n``. A node at depth d (a root: 0) takes
    position ``base + d``: a chain of its path would put it there. Pure; a ValueError for parents
    that do not come before their nodes."""
    base = start if base is None else int(base)
    pre = start - base
    if not 0 <= base <= start or len(parents) != pre + n or any(not -1 <= int(p) < j for j, p in enumerate(parents)):
        raise ValueError(f"a token tree's parents must precede their rows: {list(parents)} for {n} tokens"
                         f" after {pre} cached tree nodes")
    depth: list[int] = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    paths = []
    for r in range(pre, pre + n):
        out = [r]
        while parents[out[-1]] >= 0:
            out.append(int(parents[out[-1]]))
        paths.append([base + a for a in reversed(out)])
    return TreeLayout(base, [base + depth[r] for r in range(pre, pre + n)], paths)


def chain_layout(start: int, n: int) -> TreeLayout:
    """A chain's rows as a tree layout: row r at slot and position ``start + r``."""
    return TreeLayout(start, list(range(start, start + n)), [list(range(start, start + r + 1)) for r in range(n)])


@dataclass
class Segment:
    """One sequence's rows [i, j) of a forward, its cache, the position of row i, (torch attention)
    its span groups, and for a token tree its rows' layout (``tree_layout``)."""

    i: int
    j: int
    cache: object
    start: int
    groups: list | None
    tree: TreeLayout | None = None

    def positions(self) -> list[int]:
        """Each row's position (a chain's row r: start + r)."""
        return list(range(self.start, self.start + self.j - self.i)) if self.tree is None else self.tree.positions


def item_layout(it: ForwardItem, start: int) -> TreeLayout | None:
    """An item's tree layout after a cache of ``start`` positions, or None for a chain."""
    return None if it.parents is None else tree_layout(start, len(it.tokens), it.parents, it.base)


def tree_layouts(items: Sequence[ForwardItem], starts: Sequence[int]) -> list[TreeLayout] | None:
    """Every item's rows as a tree layout (a chain's as ``chain_layout``), or None when no item is
    a tree; each tree's parents checked before any cache changes."""
    if all(it.parents is None for it in items):
        return None
    return [item_layout(it, s) or chain_layout(s, len(it.tokens)) for it, s in zip(items, starts)]


class TorchRunner:
    """The torch reference: every block in torch, over one or more sequences' rows."""

    name = "torch"
    fused = None  # no native blocks (``NativeRunner`` holds them)

    def blocks(self, model: "TransformerModel", h: torch.Tensor, items: Sequence[ForwardItem], row0: list[int],
               starts: list[int], want: dict) -> tuple[torch.Tensor, tuple | None]:
        """Every block on the rows ``h`` [m, d]; ``want``'s layers get the residual entering them
        (``n_layers``: after the last). -> (h, None)."""
        layouts = [item_layout(it, starts[s]) for s, it in enumerate(items)]  # checked before any cache changes
        segs = [Segment(row0[s], row0[s + 1], it.cache, starts[s],
                        None if it.parents is not None else self.plan(model, starts[s], len(it.tokens), it.cache),
                        layouts[s])
                for s, it in enumerate(items)]
        for li, blk in enumerate(model.blocks):
            if li in want:
                want[li] = h
            h = self.block(model, li, blk, h, segs)
        if model.n_layers in want:
            want[model.n_layers] = h
        return h, None

    def plan(self, model: "TransformerModel", start: int, rows: int, cache) -> list | None:
        cfg = model.cfg
        return plan_attention(start, rows, cache.capacity, cfg.n_heads // cfg.n_kv_heads, model.windows)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: Segment, window) -> torch.Tensor:
        return attend(q, k, v, seg.groups, window)

    def block(self, model: "TransformerModel", li: int, blk: "Block", h: torch.Tensor,
              segs: list[Segment]) -> torch.Tensor:
        """One block over the rows of one or more sequences: the products once over all rows, rope,
        cache writes and attention per sequence (``segs``: each one's rows, cache and position)."""
        cfg = model.cfg
        spec = cfg.layers[li]
        n = h.shape[0]
        x = rms_norm(h, blk.attn_norm, cfg.rms_eps)
        qkv = blk.qkv(x)  # [n, q_dim + 2*kv_dim]
        qd, kvd = model.q_dim, model.kv_dim
        q = qkv[:, :qd].view(n, cfg.n_heads, cfg.head_dim)
        k = qkv[:, qd : qd + kvd].view(n, cfg.n_kv_heads, cfg.head_dim)
        v = qkv[:, qd + kvd :].view(n, cfg.n_kv_heads, cfg.head_dim)
        if blk.q_norm is not None:
            q = rms_norm(q, blk.q_norm, cfg.rms_eps)
            k = rms_norm(k, blk.k_norm, cfg.rms_eps)
        cos, sin = model.rope(spec.rope_base)
        if len(segs) == 1 and segs[0].tree is None:
            cos, sin = cos[segs[0].start : segs[0].start + n], sin[segs[0].start : segs[0].start + n]
        else:  # each row at its own sequence's position (a tree row's: its depth past the tree's base)
            pos = torch.tensor([p for g in segs for p in g.positions()]).to(cos.device)
            cos, sin = cos[pos], sin[pos]
        q = apply_rope(q, cos, sin, cfg.rope_neox) * model.q_scale
        k = apply_rope(k, cos, sin, cfg.rope_neox)
        parts = []
        for g in segs:
            cache, start, m = g.cache, g.start, g.j - g.i
            cache.k[li, :, start : start + m] = k[g.i : g.j].transpose(0, 1)
            cache.v[li, :, start : start + m] = v[g.i : g.j].transpose(0, 1)
            if g.tree is None:
                parts.append(self.attend(q[g.i : g.j], cache.k[li], cache.v[li], g, spec.window))
            else:
                parts.append(self.attend_tree(model, q[g.i : g.j], cache.k[li], cache.v[li], g, spec.window))
        a = parts[0] if len(parts) == 1 else torch.cat(parts)
        a = blk.o(a.reshape(n, qd))
        if blk.post_attn_norm is not None:
            a = rms_norm(a, blk.post_attn_norm, cfg.rms_eps)
        h = h + a
        x = rms_norm(h, blk.ffn_norm, cfg.rms_eps)
        gu = blk.gate_up(x)
        f = cfg.ffn_dim
        y = blk.down(model.act(gu[:, :f]) * gu[:, f:])
        if blk.post_ffn_norm is not None:
            y = rms_norm(y, blk.post_ffn_norm, cfg.rms_eps)
        return h + y

    def attend_tree(self, model: "TransformerModel", q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: Segment,
                    window) -> torch.Tensor:
        """A token tree's rows, each alone over the logical sequence a chain of its path would have
        in the cache: the first ``base`` slots, then its path's slots, in a span of the size the
        chain's row would get (zeros past the row, masked as there)."""
        cfg = model.cfg
        t = seg.tree
        out = []
        for r, (pos, path) in enumerate(zip(t.positions, t.paths)):
            groups = plan_attention(pos, 1, seg.cache.capacity, cfg.n_heads // cfg.n_kv_heads, model.windows)
            slots = torch.tensor(list(range(t.base)) + path, device=k.device)
            kk = k.new_zeros(k.shape[0], groups[0].span, k.shape[2])
            vv = torch.zeros_like(kk)
            kk[:, : len(slots)] = k[:, slots]
            vv[:, : len(slots)] = v[:, slots]
            out.append(attend(q[r : r + 1], kk, vv, groups, window))
        return torch.cat(out)

    def head(self, model: "TransformerModel", x: torch.Tensor) -> torch.Tensor:
        """The final norm and LM head over the rows ``x`` [m, d] -> logits [m, vocab] (before any
        soft-capping, which the model applies)."""
        return model.lm_head(rms_norm(x, model.out_norm, model.cfg.rms_eps))

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        return t


class TritonRunner(TorchRunner):
    """The GPU path: the reference's blocks on the device (every ``Linear`` on the triton backend),
    attention by the Triton kernel (it needs no span plan), results to the host."""

    name = "triton"

    def plan(self, model, start, rows, cache):
        return None

    def attend(self, q, k, v, seg, window):
        from ..kernels import triton_attention

        return triton_attention.attend(q, k, v, seg.start, window)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        return t.cpu()


class NativeRunner(TorchRunner):
    """Every block natively in one call (``kernels.FusedBlocks``); the head natively where it is on
    the gguf backend too, else the reference's torch head."""

    name = "native"

    def __init__(self, fused):
        self.fused = fused  # kernels.FusedBlocks

    def blocks(self, model, h, items, row0, starts, want):
        """All blocks in one native call; the tapped residuals are copied out by that call (one
        call per stretch between taps, and a clone per tap, cost a drafter that reads four layers
        ~7-11% of a smollm2 step). -> (h, (taps in order, their rows [m, taps * d]) or None)."""
        h = h.contiguous()
        cos, sin = model.rope_lists()
        taps = sorted(t for t in want if 0 <= t <= model.n_layers)
        trees = tree_layouts(items, starts)
        prompt = [it.prompt for it in items]
        if trees is not None:
            rows = self.fused.run_batch(h, 0, model.n_layers, row0, starts, [it.cache.k for it in items],
                                        [it.cache.v for it in items], cos, sin, taps, trees=trees, prompt=prompt)
        elif len(items) == 1:
            c = items[0].cache
            rows = self.fused.run(h, 0, model.n_layers, starts[0], c.k, c.v, cos, sin, taps, prompt=prompt[0])
        else:
            rows = self.fused.run_batch(h, 0, model.n_layers, row0, starts, [it.cache.k for it in items],
                                        [it.cache.v for it in items], cos, sin, taps, prompt=prompt)
        if not taps:
            return h, None
        d = h.shape[1]
        for j, t in enumerate(taps):
            want[t] = rows[:, j * d : (j + 1) * d]
        return h, (tuple(taps), rows)

    def head(self, model, x):
        if self.fused.output is not None:
            return self.fused.output(x)
        return super().head(model, x)


def fused_blocks(model: "TransformerModel"):
    """The native fused form of a llama-family trunk's blocks and head (``native.fused_blocks``),
    or None where it has none."""
    from .native import fused_blocks as build

    return build(model.cfg, model.blocks, model._rope_bases, model.q_scale, model.lm_head, model.out_norm)


def pick_runner(model: "TransformerModel", device) -> TorchRunner:
    """The runner a trunk gets when it is built: Triton on a device, native where every block weight
    is on the gguf backend and the kernels are built, else the torch reference."""
    if device is not None:
        return TritonRunner()
    fused = fused_blocks(model) if model.FUSABLE else None
    return NativeRunner(fused) if fused is not None else TorchRunner()
