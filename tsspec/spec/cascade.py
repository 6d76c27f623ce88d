"""A cascade of speculators: the cheap ones first, a model drafter only where they have nothing.

Workloads mix quoting and new text. n-gram lookup is nearly free and very good where the answer
quotes the prompt, and finds nothing where it writes something new; a draft model or head does well
on both but pays a drafter forward for every token it proposes, even where n-gram would have proposed
the same tokens for free. A cascade asks its members in order each step; the first whose proposal
has at least ``min_tokens`` tokens (or a shorter one from the last member) is the step's draft.

Contract:

* It is one more speculator: the loop, the governor and the verify rules do not know it is several.
  The governor judges the cascade as a whole (its cost is what the members' proposals cost).
* Every member sees every commit, whoever proposed: each keeps its state in step with what the trunk
  kept (a draft model's cache, a head's rows, a block drafter's ring catch up lazily at their next
  proposal, as after a parked stretch), so a member skipped for many steps costs nothing until asked.
* Members that read trunk rows get their own taps: the cascade asks the trunk for the union of its
  members' taps and hands each member the columns of its own (tap j of a row is columns
  ``j*d..(j+1)*d``, as ``ForwardOutput.hidden`` lays them out).
* It arms after a reused prefix only if every member does; ``tap_horizon`` is the longest any
  member needs (None when one needs every row).
* The governor judges the cascade as one speculator, so the cascade prices its later (model)
  members apart itself: a member after the first whose draft lands nothing (the trunk rejected its
  first token, or it proposed nothing for its forward) is benched, not asked, for the next
  ``bench_length(streak)`` proposals (4, 8, 16 ... 256 for consecutive losses; a draft that lands
  a token ends the streak), while the members before it go on drafting. Its one-off catch-up
  (``Draft.setup_ms``) is not passed on: the governor's rule for setup (a probe that paid it and
  lost parks for as long as the setup is worth, up to thousands of steps) would park the whole
  cascade, n-gram with it, for a model member's loss (measured: qwen2.5-coder-1.5b on grounded
  prompts, the 0.5B draft model's first catch-up over the prompt parked the cascade for the rest of
  the workload, 0.99x plain against n-gram's 1.16x). The catch-up is then the step's own cost, the
  first member's setup is passed on as before.
* ``member_stats()`` counts, per member, the proposals it made, the steps it won, the tokens it
  drafted there, how many of them the trunk accepted, and the proposals it sat out benched, for the
  sequence in hand (``begin`` zeroes them in place). It returns the live counts: the loop hands them
  to ``SpecStats.members`` once per sequence, and no step copies them.

Pure composition: no drafting logic of its own.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import torch

from .protocols import Draft, DraftContext, arms_after_prefix_reuse, tap_horizon

__all__ = ["CascadeSpeculator", "DEFAULT_MIN_TOKENS", "bench_length"]

# the shortest proposal of an earlier member that wins its step: a one-token n-gram guess is often a
# coincidence, and the model drafter behind it would usually have proposed that token and more
DEFAULT_MIN_TOKENS = 2
BENCH_BASE = 4  # proposals a later member sits out after one losing draft
BENCH_CAP = 256


def bench_length(streak: int, base: int = BENCH_BASE, cap: int = BENCH_CAP) -> int:
    """Proposals a member sits out after ``streak`` consecutive losing drafts: ``base`` doubled for
    each loss after the first, at most ``cap``; 0 without a loss. Pure."""
    if streak <= 0:
        return 0
    return min(cap, base << min(streak - 1, 30))


class CascadeSpeculator:
    name = "cascade"
    default_accept_rule = "match"

    def __init__(self, members: Sequence, min_tokens: int = DEFAULT_MIN_TOKENS) -> None:
        if len(members) < 2:
            raise ValueError(f"a cascade needs at least two members, got {len(members)}")
        if min_tokens < 1:
            raise ValueError(f"min_tokens must be >= 1, got {min_tokens}")
        self.members = list(members)
        self.min_tokens = min_tokens
        self.names = [m.name for m in self.members]
        self.max_draft_tokens = max(m.max_draft_tokens for m in self.members)
        self.min_draft_prob = self.members[-1].min_draft_prob
        self.default_min_draft_prob = self.members[-1].default_min_draft_prob
        self.needs_hidden_state = any(m.needs_hidden_state for m in self.members)
        self.can_arm_after_prefix_reuse = all(arms_after_prefix_reuse(m) for m in self.members)
        self._taps = tuple(sorted({t for m in self.members if m.needs_hidden_state for t in m.taps}))
        # per member: the positions of its taps among the cascade's (None: it reads none)
        self._cols = [tuple(self._taps.index(t) for t in m.taps) if m.needs_hidden_state else None
                      for m in self.members]
        horizons = [tap_horizon(m) for m in self.members if m.needs_hidden_state]
        self.tap_horizon = None if not horizons or None in horizons else max(horizons)
        self._counts = {n: dict(proposals=0, won=0, drafted=0, accepted=0, benched=0) for n in self.names}
        self._winner: int | None = None  # the member whose draft the next commit settles
        self._asks = 0  # proposals of this sequence
        self._streak = [0] * len(self.members)  # consecutive losing drafts, per member
        self._benched_until = [0] * len(self.members)  # not asked while ``_asks`` is below

    @property
    def taps(self) -> tuple[int, ...]:
        return self._taps

    def _slice(self, i: int, hidden: torch.Tensor | None) -> torch.Tensor | None:
        """Member i's columns of the cascade's tap rows (None where it reads none)."""
        cols = self._cols[i]
        if cols is None or hidden is None:
            return None
        if cols == tuple(range(len(self._taps))):
            return hidden
        d = hidden.shape[-1] // len(self._taps)
        return torch.cat([hidden[..., j * d : (j + 1) * d] for j in cols], dim=-1)

    # -- Speculator -------------------------------------------------------------------------------
    def begin(self, prompt: Sequence[int], hidden: torch.Tensor | None) -> None:
        self._winner = None
        self._asks = 0
        self._streak = [0] * len(self.members)
        self._benched_until = [0] * len(self.members)
        for c in self._counts.values():  # this sequence's counts; the dicts themselves stay
            for k in c:
                c[k] = 0
        for i, m in enumerate(self.members):
            m.begin(prompt, self._slice(i, hidden))

    def propose(self, ctx: DraftContext) -> Draft:
        self._winner = None
        self._asks += 1
        setup = 0.0
        last = len(self.members) - 1
        for i, m in enumerate(self.members):
            c = self._counts[self.names[i]]
            if self._asks <= self._benched_until[i]:
                c["benched"] += 1
                continue
            d = m.propose(ctx if ctx.hidden is None else replace(ctx, hidden=self._slice(i, ctx.hidden)))
            if i == 0:
                setup += d.setup_ms  # a later member's catch-up is its step's cost (module doc)
            c["proposals"] += 1
            if d.tokens and (len(d.tokens) >= min(self.min_tokens, ctx.max_tokens) or i == last):
                c["won"] += 1
                c["drafted"] += len(d.tokens)
                self._winner = i
                return Draft(d.tokens, d.probs, setup_ms=setup, parents=d.parents)
            if i > 0:
                self._lost(i)  # it paid its forward for nothing
        return Draft(setup_ms=setup)

    def _lost(self, i: int) -> None:
        self._streak[i] += 1
        self._benched_until[i] = self._asks + bench_length(self._streak[i])

    def commit(self, tokens: Sequence[int], hidden: torch.Tensor | None, start_pos: int) -> None:
        if self._winner is not None:
            landed = max(len(tokens) - 1, 0)
            self._counts[self.names[self._winner]]["accepted"] += landed
            if self._winner > 0:
                if landed:
                    self._streak[self._winner] = 0
                else:
                    self._lost(self._winner)
            self._winner = None
        for i, m in enumerate(self.members):
            m.commit(tokens, self._slice(i, hidden), start_pos)

    def end_sequence(self, tokens: Sequence[int]) -> None:
        """The sequence ended: told to every member that keeps what sequences wrote."""
        for m in self.members:
            end = getattr(m, "end_sequence", None)
            if end is not None:
                end(tokens)

    def reset(self) -> None:
        self._winner = None
        for m in self.members:
            m.reset()

    # -- reporting --------------------------------------------------------------------------------
    def member_stats(self) -> dict[str, dict[str, int]]:
        """Per member (by name, in order): proposals made, steps won, tokens drafted in them,
        accepted of those, and proposals sat out benched, this sequence; the live counts, not a copy."""
        return self._counts

    def report(self) -> str:
        parts = [f"{n} won {c['won']} of {c['proposals']} asked, {c['accepted']}/{c['drafted']} accepted"
                 + (f", benched {c['benched']}" if c["benched"] else "") for n, c in self.member_stats().items()]
        return "cascade: " + "; ".join(parts)

