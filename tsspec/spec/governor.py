"""The speculation cost governor: speculation must never make decoding slower.

It sits beside the loop, not inside it. Per step the loop asks ``should_draft()``, runs either a
speculative step (propose + verify + rollback + commit) or a plain step (one single-token
forward), and reports what it actually ran with ``record(speculative, ms, tokens)``:

* ``tokens`` is how many tokens the step emitted (a plain step: 1);
* ``ms`` is the step's wall time, propose time included -- a proposer that finds nothing still
  costs its lookup, and that is part of what the governor must weigh;
* if the governor said "draft" and the speculator was asked but drafted nothing, report it as
  speculative with ``drafted=0``: its proposal is speculation's cost (a head's step is a sixth of
  a smollm2 step), and reported as plain it made the plain baseline look that much slower, so a
  losing head was held (0.90x of plain on code). A step the loop ran plain without asking (no
  context headroom) is plain.

It also sizes the drafts. ``draft_length(window)`` picks the length k that maximises expected
tokens per unit of time, ``E(k) / (1 + row * k)``, from two measured things:

* ``E(k)``, the tokens a verify of k drafts would emit, estimated from the recent verifies without
  assuming a shape: the chance that draft j is taken given j - 1 were is counted over the verifies
  that drafted j (a product-limit estimate, so a verify cut short by its own length is not counted as
  a rejection past it). n-gram drafts are taken whole or not at all, a drafter's fade token by token;
  both are read as they are.
* ``row``, the time one more drafted token adds to a step (drafting it plus its verify row) over a
  plain step's time: the median over recent speculative steps of ``(ms - plain ms) / k``. On this
  kind of CPU a verify row costs 0.15-0.45 of a whole step, so long drafts pay only when taken.

The same two measurements give a confidence gate for drafters whose confidences are calibrated
(``min_draft_prob``): one more drafted token that lands with chance c raises the expected rate R
(tokens per plain step's time) iff ``c > row * R`` (``cost_gate``): at R = 1.4, a gate of 0.07
where a drafted token costs 0.05 of a step and of 0.42 where it costs 0.3. The loop hands it to the
speculator in ``DraftContext.min_prob``.

Sequences that share a forward (a server's, ``spec.loop.step_together``) share its price: a drafted
row delays the step of every sequence in it, while its gain is one sequence's. So a speculative step
reported with ``shared`` sequences in its forward is charged its time over a plain step's that many
times (``shared_cost``), and the row cost, the confidence gate and the verdict all read that charge:
a draft is judged by what it does to the server's throughput, not to one request's (with four
sequences in a step, a request's governor otherwise weighed its own tokens gained against a quarter
of the time its rows cost). And a server's governors, one per request, share their parks
(``SharedParks``): a request that begins while another is parked starts parked, so short requests
do not each pay a probe to relearn a loss.

A token tree is reported by its depth (``Draft.depth``): its length is how far it reaches, ``E(k)``
reads acceptance along depths, and ``row`` becomes the price of one more depth with all the tree's
rows at it; the confidence gate then prices a node as a depth, which errs towards smaller trees.

Before any verify the first draft is short (``FIRST_DRAFT``): a long first draft that is rejected
costs several steps, and there is no evidence yet. Without a cost measurement (no plain step yet, or
a caller that does not report how many tokens it drafted) the length falls back to
``draft_length(window, recent)``: twice the mean accepted run plus one.

Contract: the governor reads no clock and draws no random number. Its decisions are a pure
function of the stream of ``record`` calls, so tests drive it with synthetic timings. The
arithmetic lives in module-level pure functions (``ms_per_token``, ``cost_ratio``,
``is_losing``, ``park_length``); the class only sequences them.

Measurement. Cost is milliseconds per *emitted* token, for each kind of step, as a ratio of sums
over a rolling window of the last ``window`` steps of that kind (a ratio of sums weights each
step by the tokens it produced; a mean of per-step ratios would let a one-token miss count as
much as an eight-token hit). ``ratio`` = speculative / plain; below 1 speculation wins. The first
``warmup`` steps of each kind can be left unmeasured, for an engine whose first steps carry one-off
costs (kernel compilation, graph capture) that would otherwise sit in a window for ``window``
steps; the CPU engine has none (its kernels are built at load), so the default is 0: every probe
step of a losing speculator is paid for, and an unmeasured one only delays the verdict.

States:

* ``probing`` -- gathering evidence. The first probe of a sequence interleaves speculative and
  plain steps (S P P S P P ...) until both kinds have ``probe_spec`` / ``probe_plain`` measured
  samples; plain samples are needed because the baseline is measured in the same run, on the
  same context, not assumed (a later sequence of the same engine starts with the last one's plain
  samples as its baseline, so its first probe drafts only, its first proposal unmeasured: S S S).
  The plain step right after a proposal is not one: it still pays for the proposal (a drafter's
  weights evict the trunk's from cache), so its time and token go to the speculative side, and a
  clean plain step follows it. A proposal that drafted nothing (a gate cut it) is on the
  speculative side too, but only counts towards ``probe_spec`` after ``probe_empty`` proposals: a
  probe judges what drafting costs, and two declined drafts do not show it; but
  declines that have already cost more than a plain step over plain steps' time park it.
  A probe's two or so measured steps are mostly luck for a drafter that lands a third of its
  drafts, so its verdict leans on the cost model behind the draft length (``predicted_rate()``:
  acceptance pooled over the recent verifies with a prior, and the measured cost of a drafted
  row), with the measured ratio as a veto:

  - it parks at once, mid-probe, on a loss a few more steps cannot turn: ``ratio > 1 + margin``
    that is sharp (``> 1 + recent_margin``: a rejected draft of a drafter whose every token costs
    about a step, qwen2.5-coder-0.5b for 1.5b) or that the model expects too (``predicted_rate()
    < 1``); declined drafts alone never park before ``probe_empty`` of them;
  - at its end it holds where the model expects some draft length to pay (``predicted_rate() >=
    1``) and the ratio shows no sharp loss; without a model (no verify of known length) where
    ``ratio <= 1``, and never without a drafted step in the window: six declined drafts measured
    against the slow first plain steps after a prompt's forward once read as a win.

  One rejected draft of a cheap drafter is a mild loss the model expects to turn (qwen2.5-coder-
  1.5b's trained head: a drafted row costs 0.12 of a step here): parking on it, as the ratio
  alone did, parked that head on two probes in three, 1.05x plain on code against 1.12x drafting
  always. A wrong hold is cheap to undo: holding judges the measured ratio after every step.
* ``holding`` -- speculation is winning: draft every step for ``hold_steps`` steps, but check
  after every step and park AT ONCE when it turns losing (``ratio > 1 + margin``), judged on the
  whole window and, so that a sharp turn is caught within a few steps rather than after the
  window has rolled over, also on the newest ``recent`` speculative steps alone (against the
  wider ``recent_margin``: four misses in a row are routine for a drafter that wins overall,
  while a drafter that has turned 2x slower crosses it in four steps). The margin is
  hysteresis: entering needs a win (``<= 1``), staying only needs not clearly losing. When the
  hold runs out, a short re-probe (``probe_plain`` plain steps) refreshes the plain baseline,
  which grows with the context, then the verdict is taken again.
* ``parked`` -- drafting off for ``park_length`` steps: ``park_base`` doubled for every park since
  the last win, capped at ``park_cap`` (8, 16, 32 ... 256). Its plain steps refresh the plain
  window. Then a re-probe of ``probe_spec`` speculative steps, measured against a *cleared*
  speculative window: the old evidence is what parked it, the question is whether it changed.
  A win resets the backoff.

An always-losing drafter thus costs one losing step per park, and parks grow geometrically:
over 500 tokens at 2x the plain cost per token that is ~1.5 % above all-plain.

Setup cost. Some proposals carry one-off work that is not what a draft costs step after step: a
draft model catching up on the tokens it missed while parked (up to its 256-token window: on this
CPU over a second for the 0.5B drafter, 30-45 trunk steps). The loop reports it apart
(``record(..., setup_ms=)``, from ``Draft.setup_ms``). It is left out of the samples the verdict
reads, so a drafter that wins once caught up is not parked for the price of catching up; and a
probe that paid it and still lost parks for at least ``setup / (probe_budget * plain ms per
token)`` steps, doubled per consecutive park as the backoff is (``setup_park_length``; cap
``setup_park_cap``), so re-probing a losing drafter with an expensive catch-up costs at most
``probe_budget`` (3 %) of the plain time it is parked for, and less the longer it keeps losing.
Without this a 45-step catch-up every 256-step park cost the draft model ~15 % while parked.

``enabled=False`` (``TS_SPEC_ADAPTIVE=0``, mapped by the caller) drafts every step; the windows
are still kept so the display can show the ratio. ``begin_sequence()`` (what the loop calls) starts
a new sequence of the same engine: a fresh speculative window and acceptance, the plain baseline
kept, and a drafter parked at the end of the last one stays parked for the rest of that park, its
backoff kept; ``reset()`` forgets everything.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from itertools import islice
from typing import Iterable, Sequence

__all__ = [
    "GovernorConfig",
    "SpeculationCostGovernor",
    "PROBING",
    "HOLDING",
    "PARKED",
    "DISABLED",
    "ms_per_token",
    "cost_ratio",
    "is_losing",
    "park_length",
    "setup_park_length",
    "draft_length",
    "continuation",
    "expected_emitted",
    "row_cost",
    "best_draft_length",
    "best_rate",
    "rate_at",
    "cost_gate",
    "GATE_FLOOR",
    "GATE_CAP",
    "RECENT_ACCEPTED",
    "RECENT_VERIFIES",
    "FIRST_DRAFT",
    "ROW_FLOOR",
]

PROBING = "probing"
HOLDING = "holding"
PARKED = "parked"
DISABLED = "disabled"  # enabled=False: always drafting, nothing decided

Sample = tuple[float, int]  # (ms, tokens emitted) of one step


# ----------------------------------------------------------------------------- the verdict (pure)


def ms_per_token(samples: Iterable[Sample]) -> float | None:
    """Sum of ms over sum of tokens; None with no samples, inf when time bought no token."""
    ms = 0.0
    tokens = 0
    n = 0
    for m, t in samples:
        ms += m
        tokens += t
        n += 1
    if n == 0:
        return None
    if tokens == 0:
        return float("inf") if ms > 0 else None
    return ms / tokens


def cost_ratio(spec: Iterable[Sample], plain: Iterable[Sample]) -> float | None:
    """Speculative over plain ms per token (below 1: speculation wins); None without both."""
    s = ms_per_token(spec)
    p = ms_per_token(plain)
    if s is None or p is None or p == 0.0 or p == float("inf"):
        return None
    return s / p


def is_losing(ratio: float | None, margin: float) -> bool:
    """Clearly slower than plain: outside the noise margin. Unknown is not losing."""
    return ratio is not None and ratio > 1.0 + margin


RECENT_ACCEPTED = 8  # verifies whose accepted counts size the next draft


def draft_length(window: int, recent_accepted: Iterable[int]) -> int:
    """How many tokens to draft next: up to ``window``, but no more than twice the recent mean run
    of accepted drafts plus one. Every drafted token costs a verify row (on a CPU each row past the
    first costs 0.15-0.45 of a whole step) while on prose most of a window of 8 is rejected; where
    drafts are taken whole the mean climbs back and the length with it. No evidence: ``window``."""
    acc = list(recent_accepted)
    if not acc:
        return window
    return max(1, min(window, math.ceil(2 * sum(acc) / len(acc)) + 1))


RECENT_VERIFIES = 16  # (drafted, accepted) of the newest verifies, for the cost-aware length
FIRST_DRAFT = 3  # the first draft of a sequence, before any evidence
# the least a drafted token is taken to cost, as a fraction of a step: a row is never free (its KV
# write, logits, acceptance check), and timings of small forwards can make it look negative; with no
# floor a nearly-never-taken draft would be lengthened for a gain of a hundredth of a token
ROW_FLOOR = 0.02


def continuation(verifies: Iterable[tuple[int, int]], window: int, prior: float = 1.0) -> list[float]:
    """Per position j = 1..window, the chance the j-th draft is accepted given the j - 1 before it
    were, from ``(drafted, accepted)`` verifies: among the verifies that drafted j and accepted
    j - 1, the share that accepted j (verifies that stopped short of j say nothing about it). Each
    estimate is pulled towards the previous position's by ``prior`` pseudo-observations (the first
    position's towards 1/2), and a position no verify reached takes the previous estimate."""
    vs = [(int(k), int(a)) for k, a in verifies]
    out: list[float] = []
    last = 0.5
    for j in range(1, window + 1):
        reached = [a for k, a in vs if k >= j and a >= j - 1]
        p = (sum(1 for a in reached if a >= j) + prior * last) / (len(reached) + prior) if reached else last
        out.append(p)
        last = p
    return out


def expected_emitted(verifies: Iterable[tuple[int, int]], window: int) -> list[float]:
    """``E[k]`` for k = 0..window: tokens a verify of k drafts is expected to emit (the accepted
    drafts plus the trunk's own token), from ``continuation``."""
    e, survive = [1.0], 1.0
    for p in continuation(verifies, window):
        survive *= p
        e.append(e[-1] + survive)
    return e


def row_cost(spec_steps: Iterable[tuple[float, int]], plain_ms: float) -> float | None:
    """Time one drafted token adds to a step, as a fraction of a plain step: the median over
    speculative steps ``(ms, drafted)`` of ``(ms - plain_ms) / drafted``, at least ``ROW_FLOOR``;
    None without steps or a plain time."""
    per = sorted((ms - plain_ms) / k for ms, k in spec_steps if k > 0)
    if not per or not plain_ms > 0:
        return None
    return max(per[len(per) // 2] / plain_ms, ROW_FLOOR)


def best_draft_length(expected: Sequence[float], row: float) -> int:
    """The k in 1..len(expected)-1 with the most expected tokens per unit of time,
    ``expected[k] / (1 + row * k)``; the shorter on ties."""
    return max(range(1, len(expected)), key=lambda k: (rate_at(expected, row, k), -k))


def rate_at(expected: Sequence[float], row: float, k: int) -> float:
    """Expected tokens per plain step's worth of time with k drafts, ``expected[k] / (1 + row * k)``."""
    return expected[k] / (1.0 + row * k)


def best_rate(expected: Sequence[float], row: float) -> float:
    """``rate_at`` the best draft length (``best_draft_length``): below 1, no draft length pays."""
    return rate_at(expected, row, best_draft_length(expected, row))


# the cost gate's bounds: never so low that a near-certain miss is drafted, never so high that a
# calibrated head with a cheap row drafts only sure things
GATE_FLOOR, GATE_CAP = 0.02, 0.9


def cost_gate(row: float, rate: float) -> float:
    """The least chance of landing for which one more drafted token pays, for a drafter whose
    confidences are calibrated: adding a token that lands with chance c to a draft whose expected
    rate is ``rate`` tokens per plain step's time, at ``row`` of a step per drafted token, raises
    the rate iff ``c > row * rate``. A drafter that loses is the governor's to park, so the rate is
    taken as at least 1. Clamped to [GATE_FLOOR, GATE_CAP]."""
    return min(max(row * max(rate, 1.0), GATE_FLOOR), GATE_CAP)


def shared_cost(ms: float, plain_ms: float | None, shared: int) -> float:
    """What a speculative step of ``ms`` costs when ``shared`` decoding sequences' rows went through
    its forward: what it took over a plain step (``plain_ms``) delayed each of them, so that excess
    is counted ``shared`` times; ``ms`` itself alone, or without a plain time."""
    if shared <= 1 or plain_ms is None or plain_ms == float("inf") or ms <= plain_ms:
        return ms
    return plain_ms + shared * (ms - plain_ms)


def park_length(streak: int, base: int, cap: int) -> int:
    """Steps to park after ``streak`` earlier parks without a win in between: base * 2**streak, capped."""
    return min(base << min(streak, 30), cap)


def setup_park_length(setup_ms: float, plain_ms_per_token: float | None, budget: float, cap: int,
                      streak: int = 0) -> int:
    """The shortest park that makes a probe's one-off ``setup_ms`` at most ``budget`` of the plain
    time parked after it, doubled for each of ``streak`` earlier parks without a win in between (as
    ``park_length`` doubles), capped; 0 without setup or a plain measurement."""
    if setup_ms <= 0.0 or not plain_ms_per_token or plain_ms_per_token == float("inf"):
        return 0
    return min(math.ceil(setup_ms / (budget * plain_ms_per_token)) << min(streak, 30), cap)


# ----------------------------------------------------------------------------- the state machine


@dataclass(frozen=True)
class GovernorConfig:
    window: int = 16  # steps of each kind in the rolling cost window
    recent: int = 4  # newest speculative steps also judged alone, to catch a turn within a few steps
    margin: float = 0.05  # losing means ratio > 1 + margin
    # the newest steps alone are noisy (a few misses in a row are normal for a good drafter):
    # they park only on a sharp turn; a mild one shows in the whole window
    recent_margin: float = 0.5
    probe_spec: int = 2  # measured speculative steps a probe needs (first probe, and after a park)
    probe_plain: int = 2  # measured plain steps the first probe needs, and a re-probe after a hold
    # proposals that drafted nothing a probe takes before they count towards probe_spec: a head whose
    # gate cut two drafts in a row is not shown to lose when it drafts (qwen2.5-coder-1.5b's head,
    # parked 8, 16, 32 steps on such probes, ran 1.05x plain on code, against 1.11x drafting always)
    probe_empty: int = 4
    # first steps of each kind left unmeasured: for engines whose first steps carry one-off costs
    # (compilation, graph capture); on the CPU there are none, and each unmeasured probe step is a
    # step of a losing speculator paid before the verdict
    warmup: int = 0
    hold_steps: int = 128  # drafting steps between plain-baseline refreshes while winning
    park_base: int = 8  # first park; doubled per consecutive park
    park_cap: int = 256
    # a probe's one-off setup (a drafter's catch-up) may cost at most this share of the park after it
    probe_budget: float = 0.03
    setup_park_cap: int = 8192

    def __post_init__(self) -> None:
        if self.window < 1 or not 1 <= self.recent <= self.window:
            raise ValueError("need window >= 1 and 1 <= recent <= window")
        if self.probe_spec < 1 or self.probe_plain < 1 or self.warmup < 0 or self.probe_empty < 0:
            raise ValueError("need probe_spec >= 1, probe_plain >= 1, warmup >= 0, probe_empty >= 0")
        if self.margin < 0 or self.recent_margin < 0 or self.hold_steps < 1 or not 1 <= self.park_base <= self.park_cap:
            raise ValueError("need margin >= 0, hold_steps >= 1, 1 <= park_base <= park_cap")
        if not 0.0 < self.probe_budget <= 1.0 or self.setup_park_cap < self.park_cap:
            raise ValueError("need 0 < probe_budget <= 1 and setup_park_cap >= park_cap")


class SharedParks:
    """What the governors of one engine's sequences share: the one that parked last, until one of
    them holds (a win is newer evidence), and the one that measured the newest plain step. A sequence
    that begins while that one is still parked starts parked, and a new governor takes the plain
    samples of the other as its baseline (``begin_sequence``). Read and written by the thread that
    steps the sequences."""

    def __init__(self) -> None:
        self.latest: "SpeculationCostGovernor | None" = None
        # the governor that measured the engine's newest plain step: a new sequence's baseline
        self.measured: "SpeculationCostGovernor | None" = None


class SpeculationCostGovernor:
    """Parks drafting while it is losing; see the module docstring for the policy."""

    def __init__(self, config: GovernorConfig | None = None, *, enabled: bool = True,
                 shared_parks: "SharedParks | None" = None) -> None:
        self.config = config or GovernorConfig()
        self.enabled = enabled
        self.shared_parks = shared_parks  # where the engine's governors leave their parks
        self.reset()

    # -- what the loop calls

    def begin_sequence(self) -> None:
        """A new sequence of the same engine (a bench prompt, a chat turn, a server request): the
        speculative window and the acceptance start empty, the plain samples stay as the baseline
        (the same engine's plain step; the first probe then takes no plain steps: on the agent
        workload's 25-40-token requests its two pairs of them were a tenth of a request's steps,
        where the suffix store would have drafted), and a drafter that was parked when the last
        sequence ended stays parked for the rest of that park, its backoff kept. Without this every
        sequence would pay a first probe (for a draft model: its catch-up too) to relearn a loss;
        with it a losing drafter is retried once per park, across sequences as within one. (A park longer than a sequence
        carries over; it does not start again, or a drafter parked longer than one sequence would
        never be retried.) With ``shared_parks`` (``SharedParks``: a server's governors, one per request, in
        step together) a sequence that begins while another governor of the engine is parked starts
        parked for the rest of that park: a server's short requests otherwise each paid a probe; and a
        new governor takes as its baseline the plain samples of the one that measured the engine's
        newest plain step."""
        source = self
        other = self.shared_parks.latest if self.shared_parks is not None else None
        if self._state != PARKED and other is not None and other is not self and other._state == PARKED:
            source = other
        parked = self.enabled and source._state == PARKED
        streak, left = source._streak, source._steps_left
        baseline = list(self._plain)
        measured = self.shared_parks.measured if self.shared_parks is not None else None
        if not baseline and measured is not None:  # a server's new request: the engine's plain step
            baseline = list(measured._plain)
        self.reset()
        self._carry_baseline(baseline)
        if parked:
            self._streak = streak
            self._state = PARKED
            self._steps_left = max(1, left)

    def _carry_baseline(self, plain: list[Sample]) -> None:
        """Take the last sequence's plain samples as this one's baseline: the same engine's plain
        step, measured in the same run; the first probe then needs no plain steps of its own."""
        if not plain:
            return
        self._plain.extend(plain)
        self._seen_plain = self.config.warmup + len(plain)
        if self._state == PROBING:
            self._need_plain = max(0, self._need_plain - len(plain))
        # the sequence's first proposal pays what a new prompt costs once and a baseline measured
        # in another sequence does not: a cascade's draft model catching up over the prompt inside
        # that step (the cascade prices it for its member, not as setup), the first steps after the
        # prompt's forward. Judged against the carried baseline it parked the cascade on code 15
        # times a run where it had held; so it is not measured (its acceptance still counts)
        self._unmeasured = True

    def reset(self) -> None:
        """Forget everything, backoff and windows included."""
        c = self.config
        self._spec: deque[Sample] = deque(maxlen=c.window)
        self._plain: deque[Sample] = deque(maxlen=c.window)
        self._seen_spec = 0  # steps of each kind reported, for the warmup skip
        self._seen_plain = 0
        self._after_spec = False  # the last step was speculative (the next plain one is not clean)
        self._unmeasured = False  # leave the next proposal out of the samples (a carried baseline's first)
        self._declined = False  # the last step was a proposal that drafted nothing
        self._streak = 0  # parks since the last win: the backoff exponent
        self.parks = 0  # parks this sequence, for the display
        self._accepted: deque[int] = deque(maxlen=RECENT_ACCEPTED)  # drafts taken by recent verifies
        self._verifies: deque[tuple[int, int]] = deque(maxlen=RECENT_VERIFIES)  # (drafted, accepted)
        self._spec_rows: deque[tuple[float, int]] = deque(maxlen=c.window)  # measured (ms, drafted)
        self._spec_drafted: deque[bool] = deque(maxlen=c.window)  # beside _spec: did that step draft
        self.steps = 0
        self.drafted_steps = 0
        self.setup_ms = 0.0  # one-off setup reported since the current probe began
        self._window = FIRST_DRAFT  # the longest draft the loop last allowed (draft_length's window)
        self._gate: float | None = None  # the cost gate as of the last draft_length (min_draft_prob)
        # first probe: warmup steps do not count as evidence, so ask for that many more
        self._probe(c.probe_spec + c.warmup, c.probe_plain + c.warmup)

    def draft_length(self, window: int) -> int:
        """How many tokens the next draft may have: the cost-aware length (module docstring), the
        whole window when disabled."""
        if not self.enabled:
            return window
        self._window = window
        self._gate = None
        if not self._accepted:
            return min(window, FIRST_DRAFT)
        plain = ms_per_token(self._plain)
        row = row_cost(self._spec_rows, plain) if plain is not None and self._verifies else None
        if row is None:
            return draft_length(window, self._accepted)
        expected = expected_emitted(self._verifies, window)
        k = best_draft_length(expected, row)
        self._gate = cost_gate(row, rate_at(expected, row, k))
        return k

    def min_draft_prob(self) -> float | None:
        """The confidence gate the measured costs call for, as of the last ``draft_length``: the
        least chance of landing for which one more drafted token pays (``cost_gate`` of the measured
        row cost and the chosen length's expected rate). For drafters whose confidences are
        calibrated; None before the row cost is measured, and when disabled."""
        return self._gate if self.enabled else None

    def should_draft(self) -> bool:
        if not self.enabled or self._state == HOLDING:
            return True
        if self._state == PARKED:
            return False
        # probing: interleave, speculative first on ties, until both needs are met; a declined
        # proposal (which does not count towards probe_spec yet) is followed by the plain steps
        # still needed, so that the declines are measured against a baseline as they come
        if self._declined and self._need_plain > 0:
            return False
        return self._need_spec > 0 and self._need_spec >= self._need_plain

    def drafts_within(self, steps: int) -> bool:
        """Whether a draft may be asked for within the next ``steps`` steps: always, unless parked
        with more than ``steps`` plain steps left (the loop then taps no rows for a drafter that only
        reads the newest ones)."""
        return not (self.enabled and self._state == PARKED and self._steps_left > steps)

    def record(self, speculative: bool, ms: float, tokens: int, drafted: int | None = None,
               setup_ms: float = 0.0, shared: int = 1) -> None:
        """One step: what kind it was, its wall time, the tokens it emitted, (speculative) how many
        tokens it drafted (None: unknown, and the draft length falls back to the accepted-run rule)
        and how much of ``ms`` was one-off setup (module docstring: left out of the samples, and
        budgeted through the park that follows a losing probe). ``shared``: the decoding sequences
        whose rows went through this step's forward, this one included (module docstring: a
        speculative step's time over a plain step's is charged to it that many times)."""
        if ms < 0 or tokens < 0 or (drafted is not None and drafted < 0) or not 0 <= setup_ms:
            raise ValueError(f"need ms, tokens, drafted, setup_ms >= 0, got {ms}, {tokens}, {drafted}, {setup_ms}")
        if shared < 1:
            raise ValueError(f"need shared >= 1, got {shared}")
        c = self.config
        self.steps += 1
        proposed = bool(speculative)
        if not speculative and self._after_spec:
            # the plain step right after a proposal still pays for it (the drafter's weights and
            # buffers evicted the trunk's from cache: on smollm2 with its head, 4.0 ms against 2.7 in
            # a run of plain steps), so it is speculation's cost, not a plain sample
            speculative, drafted = True, 0
        self._after_spec = proposed
        if proposed or not speculative:  # a proposal, or a clean plain step (not a proposal's aftermath)
            self._declined = proposed and drafted == 0
        setup_ms = min(float(setup_ms), float(ms))
        self.setup_ms += setup_ms
        ms = float(ms) - setup_ms
        unmeasured = proposed and self._unmeasured
        if unmeasured:
            self._unmeasured = False
        if speculative:
            if shared > 1:  # alone (every one-sequence run): its own time, nothing summed
                ms = shared_cost(ms, ms_per_token(self._plain), shared)
            if drafted != 0:  # 0: asked, drafted nothing; its time counts, its tokens say nothing of acceptance
                self.drafted_steps += 1
                accepted = max(int(tokens) - 1, 0)  # a verify emits its accepted drafts + 1
                self._accepted.append(accepted)
                if drafted is not None:  # None: a caller that does not say how many it drafted
                    self._verifies.append((int(drafted), min(accepted, int(drafted))))
            self._seen_spec += 1
            if self._seen_spec > c.warmup and not unmeasured:
                self._spec.append((float(ms), int(tokens)))
                self._spec_drafted.append(drafted != 0)
                if drafted:
                    self._spec_rows.append((float(ms), int(drafted)))
        else:
            self._seen_plain += 1
            if self._seen_plain > c.warmup:
                self._plain.append((float(ms), int(tokens)))
                if self.shared_parks is not None:
                    self.shared_parks.measured = self
        if not self.enabled:
            return

        if self._state == PROBING:
            # a proposal counts as a probe's speculative step, a clean plain step as its plain one;
            # the plain step after a proposal is neither (its time is on the speculative side)
            if proposed and not unmeasured:
                self._probe_asked += 1
                if drafted != 0 or self._probe_asked > c.probe_empty:
                    self._need_spec = max(0, self._need_spec - 1)
            elif not speculative:
                self._need_plain = max(0, self._need_plain - 1)
            if self._probe_lost():
                self._park()
            elif self._need_spec == 0 and self._need_plain == 0:
                self._conclude_probe()
        elif self._state == HOLDING:
            self._steps_left -= 1
            if self._losing_now():
                self._park()
            elif self._steps_left <= 0:
                self._probe(0, c.probe_plain)  # refresh the plain baseline, keep the spec window
        else:  # PARKED
            self._steps_left -= 1
            if self._steps_left <= 0:
                self._spec.clear()  # the evidence that parked it is what is being retested
                self._spec_drafted.clear()
                self._spec_rows.clear()
                self._probe(c.probe_spec, 0)

    # -- what the display reads

    @property
    def state(self) -> str:
        return DISABLED if not self.enabled else self._state

    @property
    def steps_left(self) -> int | None:
        """Steps until the state ends (probing: samples still needed); None when disabled."""
        if not self.enabled:
            return None
        if self._state == PROBING:
            return self._need_spec + self._need_plain
        return self._steps_left

    @property
    def ratio(self) -> float | None:
        """Speculative / plain ms per emitted token over the rolling windows (None: not measured)."""
        return cost_ratio(self._spec, self._plain)

    def predicted_rate(self) -> float | None:
        """What the cost model behind ``draft_length`` expects of the best draft length: tokens per
        plain step's worth of time, from the recent verifies' acceptance and the measured row cost
        (below 1: no length pays); None before a verify of known length and a plain step."""
        plain = ms_per_token(self._plain)
        if plain is None or not self._verifies or not self._spec_rows:
            return None
        row = row_cost(self._spec_rows, plain)
        return None if row is None else best_rate(expected_emitted(self._verifies, self._window), row)

    def describe(self) -> str:
        r = self.ratio
        left = self.steps_left
        parts = [self.state if left is None else f"{self.state} ({left} left)"]
        parts.append("ratio --" if r is None else f"ratio {r:.2f}")
        parts.append(f"parks {self.parks}")
        return ", ".join(parts)

    # -- transitions

    def _probe(self, need_spec: int, need_plain: int) -> None:
        self._state = PROBING
        self._need_spec = need_spec
        self._need_plain = need_plain
        self._probe_asked = 0  # proposals this probe, empty ones included
        self._steps_left = 0
        self.setup_ms = 0.0

    def _probe_lost(self) -> bool:
        """Park before the probe ends: clearly losing (``ratio > 1 + margin``) and either sharply
        (``recent_margin``) or as the cost model expects too (module docstring); declined drafts
        alone only after ``probe_empty`` of them."""
        c = self.config
        r = self.ratio
        if not is_losing(r, c.margin):
            return False
        if is_losing(r, c.recent_margin):
            return True
        if not any(self._spec_drafted):  # declines alone: nothing yet to model
            return self._probe_asked > c.probe_empty or self._declines_cost_a_step()
        rate = self.predicted_rate()
        return rate is None or rate < 1.0

    def _declines_cost_a_step(self) -> bool:
        """The probe's declined drafts have together cost more than a plain step's time over what
        plain steps would have (``probe_empty`` is an allowance for cheap declines: a head whose
        declined step costs 4% of a trunk step; smollm2's weak block drafter declined at half a
        step each, its aftermath included, so five of them cost two and a half steps a probe)."""
        plain = ms_per_token(self._plain)
        if plain is None or plain == float("inf"):
            return False
        return sum(ms - plain * tokens for ms, tokens in self._spec) > plain

    def _conclude_probe(self) -> None:
        if not self._spec or not self._plain:
            # every sample so far was warmup or measured nothing: one more of what is missing
            self._need_spec = 0 if self._spec else 1
            self._need_plain = 0 if self._plain else 1
            return
        r = self.ratio
        rate = self.predicted_rate()
        # a probe's two or so steps are mostly luck: the cost model decides, the ratio vetoes a sharp loss
        if r is None:  # not measurable (plain steps that took no time): nothing to hold on
            win = False
        elif rate is None:  # no model: a measured win, by a window that drafted (declines alone never hold)
            win = r <= 1.0 and any(self._spec_drafted)
        else:
            win = rate >= 1.0 and not is_losing(r, self.config.recent_margin)
        if win:
            # a measured win resets the backoff; a hold on the model's word alone keeps it, so that a
            # model the holding steps keep refuting (a cost it does not see) is retried ever less often
            self._hold(reset_backoff=r <= 1.0)
        else:
            self._park()

    def _hold(self, reset_backoff: bool = True) -> None:
        self._state = HOLDING
        self._steps_left = self.config.hold_steps
        if reset_backoff:
            self._streak = 0
        if self.shared_parks is not None:  # newer evidence than any park: new sequences probe again
            self.shared_parks.latest = None

    def _park(self) -> None:
        c = self.config
        setup = self.setup_ms if self._state == PROBING else 0.0  # what this probe paid to set up
        self._state = PARKED
        self._steps_left = max(park_length(self._streak, c.park_base, c.park_cap),
                               setup_park_length(setup, ms_per_token(self._plain), c.probe_budget, c.setup_park_cap,
                                                 self._streak))
        self._streak += 1
        self.parks += 1
        if self.shared_parks is not None:
            self.shared_parks.latest = self

    def _losing_now(self) -> bool:
        c = self.config
        if is_losing(self.ratio, c.margin):
            return True
        if len(self._spec) < c.recent:
            return False
        newest = islice(reversed(self._spec), c.recent)
        return is_losing(cost_ratio(newest, self._plain), c.recent_margin)
