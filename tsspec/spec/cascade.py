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
  members apart itself, and benches a losing one (not asked for the next ``bench_length(streak)``
  proposals: 4, 8, 16 ... 256 while it keeps losing, and after a loss that paid a catch-up, long
  enough that the catch-up is 3% of the plain time benched; kept across the engine's sequences, as
  the governor keeps a park) while the members before it go on drafting.
  A member loses when it proposed nothing for its forward, or when the steps it won cost more per
  emitted token than plain steps (``costs_more``; a draft that landed nothing is a step of one
  token there, no verdict alone: a 0.5B draft model that lands 88% of its tokens on code misses its
  first token in about one step of eight, and benched for each miss it sat out most of a prompt; two
  misses in a row as a verdict where the cost could not be judged yet cost it most of that again,
  docs/RESULTS.md): the cascade times each step as the interval between consecutive commits (every
  step commits, plain ones too), and keeps the recent steps each later member won beside the
  recent plain-like ones (no proposal asked of the loop, or one only the first member was asked
  for and declined). A later member's catch-up (``Draft.setup_ms``) is the cascade's to price, not
  passed on to the governor: its rule for setup (a probe that paid it and lost parks for as long as
  the setup is worth, up to thousands of steps) parked the whole cascade, n-gram with it, for the
  0.5B draft model's first lost catch-up on qwen2.5-coder-1.5b's grounded prompts (0.99x plain
  against n-gram's 1.16x). The first member's setup is passed on as before. The cascade prices a
  catch-up as the governor does: left out of the step's time (a member is not benched for the
  price of catching up over each new prompt; with it in, a 0.5B draft model that paid for itself on
  code was benched for the rest of the run in some runs, docs/RESULTS.md), and after a loss the
  catch-ups paid since the member's last verdict size its bench.
* An earlier member's proposal gives way to a later member's where it lands less: the cascade
  keeps, per member, the share of its drafted tokens the trunk accepted in the recent steps it won
  (an n-gram member's per match order, ``last_order``: a 2-token match is often a coincidence where
  an 8-token one quotes), and where an earlier member's share for this proposal is below a later,
  unbenched member's by more than ``DEFER_MARGIN``, the later member is asked; the earlier
  proposal stays as the step's draft if the later one has none.
* ``member_stats()`` counts, per member, the proposals it made, the steps it won, the tokens it
  drafted there, how many of them the trunk accepted, the proposals it sat out benched, and the
  proposals it set aside for a later member (``deferred``), for the
  sequence in hand (``begin`` zeroes them in place). It returns the live counts: the loop hands them
  to ``SpecStats.members`` once per sequence, and no step copies them.

Pure composition: no drafting logic of its own.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import replace
from typing import Callable, Sequence

import torch

from .governor import Sample, cost_ratio, is_losing, ms_per_token, park_length, setup_park_length
from .protocols import Draft, DraftContext, arms_after_prefix_reuse, tap_horizon
from .stats import member_line

__all__ = ["CascadeSpeculator", "DEFAULT_MIN_TOKENS", "bench_length", "costs_more", "gives_way", "landed_share"]

# the shortest proposal of an earlier member that wins its step: a one-token n-gram guess is often a
# coincidence, and the model drafter behind it would usually have proposed that token and more
DEFAULT_MIN_TOKENS = 2
BENCH_BASE = 4  # proposals a later member sits out after one losing draft
BENCH_CAP = 256
SETUP_BUDGET = 0.03  # a losing member's catch-ups may cost this share of the plain time it sits out
SETUP_BENCH_CAP = 4096
COST_SAMPLES = 8  # a later member's recent won steps, and the recent plain-like steps, kept
COST_MARGIN = 0.05  # a member's steps may cost this much more per token than plain ones
LAND_SAMPLES = 16  # the recent won steps whose landed share a member (per match order) is judged by
LAND_MIN_SAMPLES = 4  # fewer: no judgement, the earlier member's proposal wins as it always did
DEFER_MARGIN = 0.10  # an earlier member gives way where its landed share is below a later one's by more
ALL_ORDERS = -1  # the landed-share key of a member's steps whatever their match order


def landed_share(steps: Sequence[tuple[int, int]], min_samples: int = LAND_MIN_SAMPLES) -> float | None:
    """The share of the drafted tokens the trunk accepted over ``steps`` (``(accepted, drafted)``
    each), None with fewer than ``min_samples`` steps or nothing drafted. Pure."""
    if len(steps) < min_samples:
        return None
    drafted = sum(d for _, d in steps)
    return sum(a for a, _ in steps) / drafted if drafted else None


def gives_way(mine: float | None, later: Sequence[float | None], margin: float = DEFER_MARGIN) -> bool:
    """Whether a proposal whose member lands ``mine`` of its tokens gives way to a later member that
    lands one of ``later`` (None: not judged yet): only where both are known and a later one lands
    more by over ``margin``. Pure."""
    return mine is not None and any(x is not None and x > mine + margin for x in later)


def costs_more(won: Sequence[Sample], plain: Sequence[Sample], margin: float = COST_MARGIN,
               min_samples: int = 2) -> bool | None:
    """Whether the steps a member won, ``(ms, tokens emitted)`` each, cost more per emitted token
    than the plain-like steps beside them, by more than ``margin`` (the governor's ``cost_ratio``
    and ``is_losing``); None while either side has fewer than ``min_samples`` steps. Pure."""
    if len(won) < min_samples or len(plain) < min_samples:
        return None
    return is_losing(cost_ratio(won, plain), margin)


def bench_length(streak: int, base: int = BENCH_BASE, cap: int = BENCH_CAP, setup_ms: float = 0.0,
                 plain_ms_per_token: float | None = None, budget: float = SETUP_BUDGET,
                 setup_cap: int = SETUP_BENCH_CAP) -> int:
    """Proposals a member sits out after ``streak`` consecutive losses: the governor's
    ``park_length`` (``base`` doubled for each loss after the first, at most ``cap``), or, after a
    loss that paid a catch-up of ``setup_ms``, its ``setup_park_length`` (the catch-up at most
    ``budget`` of the plain time sat out, one proposal counted as one plain token's time, at most
    ``setup_cap``) where that is longer; 0 without a loss. Pure."""
    if streak <= 0:
        return 0
    return max(park_length(streak - 1, base, cap),
               setup_park_length(setup_ms, plain_ms_per_token, budget, setup_cap))


class CascadeSpeculator:
    name = "cascade"
    default_accept_rule = "match"

    def __init__(self, members: Sequence, min_tokens: int = DEFAULT_MIN_TOKENS,
                 clock: Callable[[], float] = time.perf_counter) -> None:
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
        self._counts = {n: dict(proposals=0, won=0, drafted=0, accepted=0, benched=0, deferred=0)
                        for n in self.names}
        self._winner: int | None = None  # the member whose draft the next commit settles
        self._winner_drafted = 0  # the length of its draft, for ``_landed``
        # (accepted, drafted) of the recent won steps, per (member, match order: 0 for a member without
        # one, ALL_ORDERS for all its steps)
        self._landed: dict[tuple[int, int], deque] = {}
        self._asks = 0  # proposals since the last reset (benches count in them, across sequences)
        self._streak = [0] * len(self.members)  # consecutive losses, per member
        self._benched_until = [0] * len(self.members)  # not asked while ``_asks`` is below
        self._clock = clock
        self._last_commit: float | None = None  # when the last step ended (``clock()``, seconds)
        self._asked_in_step: int | None = None  # the step's last member asked (None: no proposal)
        self._step_setup = 0.0  # the catch-ups paid in the step's proposal, left out of its time
        self._won_setup = [0.0] * len(self.members)  # catch-ups each member paid since its last verdict
        self._won_steps = [deque(maxlen=COST_SAMPLES) for _ in self.members]  # (ms, tokens) per member
        self._plain_steps: deque = deque(maxlen=COST_SAMPLES)

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
        # a member benched at the end of the last sequence stays benched for the rest of its bench,
        # its streak kept, as the governor keeps a park across sequences: a draft model's catch-up
        # over each new prompt (1.2 s for 300 tokens, the 0.5B drafter here) was paid again per prompt
        self._winner = None
        self._last_commit = self._clock()  # the first step is timed from here (after the prompt's forward)
        self._asked_in_step = None
        for c in self._counts.values():  # this sequence's counts; the dicts themselves stay
            for k in c:
                c[k] = 0
        for i, m in enumerate(self.members):
            m.begin(prompt, self._slice(i, hidden))

    def _key(self, i: int) -> tuple[int, int]:
        """Member i's landed-share key for its latest proposal: its match order where it has one."""
        return i, int(getattr(self.members[i], "last_order", 0) or 0)

    def _share(self, key: tuple[int, int]) -> float | None:
        return landed_share(self._landed.get(key, ()))

    def _win(self, i: int, d: Draft, setup: float) -> Draft:
        c = self._counts[self.names[i]]
        c["won"] += 1
        c["drafted"] += len(d.tokens)
        self._winner, self._winner_drafted = i, len(d.tokens)
        return Draft(d.tokens, d.probs, setup_ms=setup, parents=d.parents)

    def propose(self, ctx: DraftContext) -> Draft:
        self._winner = None
        self._asks += 1
        self._step_setup = 0.0
        setup = 0.0
        last = len(self.members) - 1
        self._asked_in_step = 0
        held: tuple[int, Draft] | None = None  # an earlier proposal that gave way to a later member
        for i, m in enumerate(self.members):
            c = self._counts[self.names[i]]
            if self._asks <= self._benched_until[i]:
                c["benched"] += 1
                continue
            self._asked_in_step = i
            d = m.propose(ctx if ctx.hidden is None else replace(ctx, hidden=self._slice(i, ctx.hidden)))
            self._step_setup += d.setup_ms
            if i == 0:
                setup += d.setup_ms  # a later member's catch-up is its step's cost (module doc)
            else:
                self._won_setup[i] += d.setup_ms
            c["proposals"] += 1
            if d.tokens and (len(d.tokens) >= min(self.min_tokens, ctx.max_tokens) or i == last):
                mine = self._share(self._key(i)) if held is None and i < last else None
                later = [] if mine is None else [self._share((j, ALL_ORDERS)) for j in range(i + 1, last + 1)
                                                 if self._asks > self._benched_until[j]]
                if gives_way(mine, later):
                    c["deferred"] += 1
                    held = (i, d)
                    continue
                return self._win(i, d, setup)
            if i > 0:
                self._lost(i)  # it paid its forward for nothing (its step is timed as its own at commit)
        if held is not None:  # the later members had nothing: the earlier proposal is the draft
            return self._win(held[0], held[1], setup)
        return Draft(setup_ms=setup)

    def _lost(self, i: int) -> None:
        self._streak[i] += 1
        # the catch-ups it paid since its last verdict (a first draft after a new prompt: the prompt's)
        self._benched_until[i] = self._asks + bench_length(self._streak[i], setup_ms=self._won_setup[i],
                                                           plain_ms_per_token=ms_per_token(self._plain_steps))
        self._won_steps[i].clear()  # after the bench, fresh evidence
        self._won_setup[i] = 0.0

    def _timed(self, n_tokens: int) -> None:
        """The step that just ended (``n_tokens`` committed): its time to the steps of the later
        member that was asked in it, or to the plain-like steps; that member's verdict."""
        now = self._clock()
        last, self._last_commit = self._last_commit, now
        winner, asked, self._asked_in_step = self._winner, self._asked_in_step, None
        setup, self._step_setup = self._step_setup, 0.0
        # a catch-up is one-off work, not what the member's steps cost (as the governor leaves it out
        # of its samples): it sizes the bench after a loss, never makes the loss
        ms = None if last is None else max((now - last) * 1000.0 - setup, 0.0)
        if winner is None and not asked:  # a plain step, or only the first member asked and it declined
            if ms is not None:
                self._plain_steps.append((ms, n_tokens))
            return
        i = winner if winner is not None else asked
        if i == 0:
            return
        if ms is not None:
            self._won_steps[i].append((ms, n_tokens))  # after a bench, the first evidence of the next verdict
        if winner is None:  # asked and declined: judged when it declined
            return
        verdict = costs_more(self._won_steps[i], self._plain_steps)  # a draft that landed nothing included
        if verdict:
            self._lost(i)
        elif verdict is False:
            self._won_setup[i] = 0.0  # the catch-ups so far paid for themselves
            if n_tokens >= 2:
                self._streak[i] = 0  # it pays: its next loss benches it for the shortest time again

    def commit(self, tokens: Sequence[int], hidden: torch.Tensor | None, start_pos: int) -> None:
        if self._winner is not None:
            accepted = max(len(tokens) - 1, 0)
            self._counts[self.names[self._winner]]["accepted"] += accepted
            # its order's share and its own in all (its match order is still the proposal's: members
            # are asked nothing between a proposal and its commit)
            for key in {self._key(self._winner), (self._winner, ALL_ORDERS)}:
                self._landed.setdefault(key, deque(maxlen=LAND_SAMPLES)).append((accepted, self._winner_drafted))
        self._timed(len(tokens))
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
        self._asks = 0
        self._streak = [0] * len(self.members)
        self._benched_until = [0] * len(self.members)
        self._last_commit = None
        self._asked_in_step = None
        self._step_setup = 0.0
        for d in self._won_steps:
            d.clear()
        self._won_setup = [0.0] * len(self.members)
        self._plain_steps.clear()
        self._landed.clear()
        for m in self.members:
            m.reset()

    # -- reporting --------------------------------------------------------------------------------
    def member_stats(self) -> dict[str, dict[str, int]]:
        """Per member (by name, in order): proposals made, steps won, tokens drafted in them,
        accepted of those, and proposals sat out benched, this sequence; the live counts, not a copy."""
        return self._counts

    def report(self) -> str:
        return "cascade: " + "; ".join(f"{n} {member_line(c)}" for n, c in self.member_stats().items())

