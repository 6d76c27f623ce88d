"""Block speculation: a drafter that proposes a whole window in ONE forward pass (DFlash, DFlash2).

Contract:

* The speculator drives a block draft head (``DraftHead`` of kind ``BLOCK``): ``walk_block(anchor,
  position, pick)`` returns ``block_size - 1`` draft tokens and the drafter's confidence in each;
  ``catch_up(tokens, tap_rows, start_pos)`` feeds it the exact tap rows of tokens that landed in
  the trunk. It reads the trunk's residuals at ``taps`` (the drafter's target layers), so
  ``needs_hidden_state`` is True.
* The window is clamped to ``block_size - 1``: one pass drafts at most that many tokens.
* ``--spec-pmin`` (``min_draft_prob``, default 0.35) gates the CUMULATIVE prefix probability: the
  draft keeps token i while ``conf[0] * ... * conf[i] >= min_draft_prob``. The same number is far
  stricter than a per-token threshold. 0 keeps the whole block; a cut to zero tokens makes the loop
  take a plain step.
* Drafts are the drafter's argmax by default (``match`` acceptance, exact output). With
  ``sample_drafts`` (what ``--spec-accept residual`` selects) each draft is DRAWN from the drafter's
  distribution after the caller's sampler transforms (``ctx.sampler.probs``), with a keyed random
  number, and ``Draft.probs`` carries those distributions, as the residual rule requires: it is
  only exact when drafts are drawn from the q it is given.
* It may arm after a reused KV prefix: the drafter's ring refills from each forwarded suffix and
  every commit, so a gap costs a shorter drafting context, never a wrong token.
* The ring refills lazily: ``begin`` and ``commit`` only keep the tap rows, and ``propose`` writes
  what is pending in one batched pass first. A parked stretch (the governor drafting nothing)
  costs no drafter work per token; the refill after it is one-off work reported as
  ``Draft.setup_ms``, which the governor budgets apart from the drafting verdict. At most a ring's
  worth of rows is kept: older ones would be overwritten anyway.
* Token trees (``tree`` nodes, ``--spec-tree``; greedy drafts only): the block's rows give each
  position's second guess too, and the likeliest of those join the drafted chain as sibling leaves
  (``tree.sibling_leaves``), at no drafter cost. (A position's guess does not depend on the one
  before it in a plain DFlash block, so a lattice could hang the chain's tail under a sibling too;
  the leaves are what is built.)
* While the governor keeps it parked for longer than ``tap_horizon`` steps (its ring's size, at most
  ``RECENT_ROWS``), the trunk taps nothing for it: its first proposal after the park drafts from
  the rows it held before and the newest ``tap_horizon`` rows, with a gap between, as after a
  reused prefix. A drafter whose layers all slide over a window no longer than that loses nothing;
  one with full attention drafts from less of the past, the price of a park that costs no tap
  copies and no refill of a stretch nobody drafted in.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from ..sampling import Stream
from .protocols import Draft, DraftContext, MinDraftProb
from .tree import SIBLING_MIN, sibling_leaves

__all__ = ["BlockSpeculator", "gate_cumulative"]

DEFAULT_MIN_DRAFT_PROB = 0.35
# the newest committed rows a drafter is given after a park (its ring's size when smaller)
RECENT_ROWS = 64
# keyed draws of draft tokens: a salt and stream of their own, independent of the verify's draws
DRAFT_STREAM = Stream.BLOCK_DRAFT  # keyed draws of sampled drafts, apart from the trunk's own stream


def gate_cumulative(conf: Sequence[float], min_prob: float) -> int:
    """How many leading drafts keep their cumulative prefix probability >= ``min_prob``."""
    cum = 1.0
    for i, c in enumerate(conf):
        cum *= float(c)
        if cum < min_prob:
            return i
    return len(conf)


class BlockSpeculator:
    name = "block"
    min_draft_prob = MinDraftProb()
    default_min_draft_prob = DEFAULT_MIN_DRAFT_PROB
    needs_hidden_state = True
    can_arm_after_prefix_reuse = True  # the drafter's ring refills from the forwarded suffix
    default_accept_rule = "match"

    def __init__(self, head, taps: Sequence[int], max_draft_tokens: int = 8,
                 min_draft_prob: float | None = None, *, sample_drafts: bool = False, tree: int = 0,
                 sibling_min: float = SIBLING_MIN) -> None:
        if max_draft_tokens < 1:
            raise ValueError(f"max_draft_tokens must be >= 1, got {max_draft_tokens}")
        if tree < 0:
            raise ValueError(f"tree must be >= 0 nodes, got {tree}")
        self.tree = tree  # node budget of a tree draft (0: chains)
        self.sibling_min = sibling_min  # a sibling's least chance where the governor has no gate
        self.head = head  # weights; this sequence's drafter state (a KV ring) is ``state``
        self.state = head.new_state()
        self._taps = tuple(int(t) for t in taps)
        self.max_draft_tokens = min(max_draft_tokens, head.block_size - 1)
        self.min_draft_prob = min_draft_prob  # validated; None: the default
        self.sample_drafts = sample_drafts
        # counters one report line can print
        self.proposals = 0  # propose() calls
        self.drafted = 0  # tokens proposed after the gate
        self.gated = 0  # tokens the gate cut
        self.last_conf: list[float] = []  # confidences of the last block, for a live display
        # committed (start position, tokens, tap rows) not yet written into the ring, oldest first
        self._pending: list[tuple[int, list[int], torch.Tensor]] = []
        self._pending_rows = 0

    @property
    def taps(self) -> tuple[int, ...]:
        return self._taps

    @property
    def tap_horizon(self) -> int:
        """The newest committed rows it needs tapped before a proposal (the loop's ``tap_horizon``)."""
        ring = getattr(self.state, "rows", None)
        return RECENT_ROWS if ring is None else max(1, min(RECENT_ROWS, int(ring)))

    def begin(self, prompt: Sequence[int], hidden: torch.Tensor | None) -> None:
        self.reset()
        if hidden is not None and hidden.shape[0]:
            # tap rows may cover only a forwarded suffix (an adopted prefix): they end at the prompt's end
            start = len(prompt) - hidden.shape[0]
            self._keep(start, list(prompt[start:]), hidden)

    def _keep(self, start: int, tokens: list[int], rows: torch.Tensor) -> None:
        self._pending.append((start, tokens, rows))
        self._pending_rows += rows.shape[0]
        limit = getattr(self.state, "rows", None)  # the ring's size: older rows cannot survive it
        while limit is not None and len(self._pending) > 1 and self._pending_rows - self._pending[0][2].shape[0] >= limit:
            self._pending_rows -= self._pending.pop(0)[2].shape[0]

    def sync(self) -> None:
        """Write every pending committed row into the ring now (``propose`` does this itself;
        inspection and tests call it to see the ring as drafting would)."""
        self._catch_up()

    def _catch_up(self) -> None:
        """Write the pending rows into the ring: each contiguous run in one pass."""
        runs: list[tuple[int, list[int], list[torch.Tensor]]] = []
        for start, tokens, rows in self._pending:
            if runs and runs[-1][0] + len(runs[-1][1]) == start:
                runs[-1][1].extend(tokens)
                runs[-1][2].append(rows)
            else:
                runs.append((start, list(tokens), [rows]))
        self._pending, self._pending_rows = [], 0
        for start, tokens, rows in runs:
            self.head.catch_up(tokens, rows[0] if len(rows) == 1 else torch.cat(rows), start, self.state)

    def propose(self, ctx: DraftContext) -> Draft:
        self.proposals += 1
        k = min(ctx.max_tokens, self.max_draft_tokens)
        if k <= 0:
            return Draft()
        setup_ms = 0.0
        if self._pending:
            # more than a verify leaves behind: a refill after a parked stretch, one-off work
            long_refill = self._pending_rows > self.max_draft_tokens + 1
            t0 = time.perf_counter()
            self._catch_up()
            setup_ms = (time.perf_counter() - t0) * 1000.0 if long_refill else 0.0
        rows: list[torch.Tensor] = []
        pick = None  # None: the head's own argmax walk
        if self.sample_drafts and ctx.sampler is not None:
            sampler = ctx.sampler
            hist = sampler.draft_history(ctx.history)

            def pick(e: int, row: torch.Tensor) -> int:
                # q: the drafter's distribution at position + 1 + e, after the caller's transforms
                q = sampler.probs(row, hist)
                tok = sampler.draw(q, ctx.position + 1 + e, DRAFT_STREAM)
                rows.append(q)
                hist.append(tok)
                return tok

        walk = getattr(self.head, "walk_block", None)
        chances: list | None = [] if self.tree and pick is None else None  # the lattice's second guesses
        if walk is not None and chances is not None:
            tokens, conf = walk(ctx.last_token, ctx.position, self.state, pick, chances)
        elif walk is not None:
            tokens, conf = walk(ctx.last_token, ctx.position, self.state, pick)
        else:  # a block head with only the protocol's greedy draft_block: no sampled drafts
            tokens, conf = self.head.draft_block(ctx.last_token, ctx.hidden, ctx.position, self.state)
            conf, rows = [float(c) for c in conf], []
        self.last_conf = [float(c) for c in conf]
        n = gate_cumulative(conf[:k], self.min_draft_prob)
        self.gated += min(k, len(tokens)) - n
        self.drafted += n
        if n == 0:
            return Draft(setup_ms=setup_ms)
        if chances:
            floor = ctx.min_prob if ctx.min_prob is not None else self.sibling_min
            nodes, parents = sibling_leaves(tokens[:n], chances, self.tree, floor)
            if len(nodes) != n:  # siblings joined (or the chain was cut to the budget)
                return Draft(tokens=nodes, setup_ms=setup_ms, parents=parents)
        probs = torch.stack(rows[:n]) if rows else None
        return Draft(tokens=list(tokens[:n]), probs=probs, setup_ms=setup_ms)

    def commit(self, tokens: Sequence[int], hidden: torch.Tensor | None, start_pos: int) -> None:
        if hidden is not None and len(tokens):
            self._keep(start_pos, list(tokens), hidden[: len(tokens)])

    def reset(self) -> None:
        self.state.reset()
        self._pending, self._pending_rows = [], 0
