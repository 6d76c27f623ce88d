"""The one decoding loop: draft, verify, accept, roll back, commit.

It serves every target and every speculator through their protocols and never asks which one it
drives. With no speculator, or while the governor has parked drafting, or when the speculator has
nothing to propose, a step is a plain one-row forward: exactly what plain decoding does, so a
parked speculative run costs what plain decoding costs.

A ``DecodeState`` is one sequence's decoding state (its cache, speculator, governor and history); the
model it runs on holds weights only, so several sequences can share one loaded model and advance
in any interleaving. ``decode`` runs one sequence to the end. A step is two halves around its
forward (``prepare``, ``finish``), so ``step_together`` can give several sequences' rows one shared
forward (``decode_batched``; a server's scheduler): batch invariance makes each sequence's tokens
the ones it gets alone.

Positions: the token drawn from the trunk row that processed position ``p`` sits at position
``p + 1``; the sampler keys its draw on that position, so a verify row and a plain step agree.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..sampling import Sampler
from .plan import PLAIN, SpecPlan
from .protocols import (Cache, Draft, DraftContext, ForwardItem, ForwardOutput, Governor, SpecTarget, Speculator,
                        arms_after_prefix_reuse, drafts_within, tap_horizon)
from .run import PREFILL_CHUNK, Run, _ms, prefill_chunk, prompt_to_forward  # noqa: F401 - Run and the prefill chunk are the loop's (re-exported)
from .stats import SpecStats
from . import tree
from .verify import verify

NO_DRAFT = Draft()  # what a plain step drafts: one shared, never-modified value, not one per token


def forward_each(target: SpecTarget, items: Sequence[ForwardItem]) -> list[ForwardOutput]:
    """The items' outputs (each on its own cache): one shared forward when the target batches
    sequences (``BatchedTarget.batches_sequences``), else one ``forward`` per item, the reference
    the shared one is tested against. Item i's output is the same bits either way."""
    if len(items) > 1 and getattr(target, "batches_sequences", False):
        return target.forward_batch(items)
    return [_forward(target, it) for it in items]


def _forward(target: SpecTarget, it: ForwardItem) -> ForwardOutput:
    """One item's forward (a tree's parents passed where it is one; a prompt chunk marked as one
    where the target takes the mark)."""
    if it.prompt and getattr(target, "marks_prompt_rows", False):
        return target.forward(it.tokens, it.cache, all_logits=it.all_logits, taps=it.taps, prompt=True)
    if it.parents is not None:
        return target.forward(it.tokens, it.cache, all_logits=it.all_logits, taps=it.taps, parents=it.parents)
    return target.forward(it.tokens, it.cache, all_logits=it.all_logits, taps=it.taps)


@dataclass
class Rows:
    """What one sequence forwards in a step: a chunk of its prompt (``prefill``), its last token (a
    plain step), or its last token and a draft (a verify). ``DecodeState.prepare`` makes it,
    ``DecodeState.finish`` takes the forward's output."""

    pos: int  # the position the first row takes (for a step: the last token's)
    draft: Draft
    item: ForwardItem
    prepare_ms: float  # drafting and sizing, for the governor's step time
    prefill: bool = False
    proposed: bool = False  # the speculator was asked for a draft (it may have drafted nothing)


def rollback_memory_bytes(target, window: int) -> int:
    """The memory one sequence holds to undo a verify of ``window`` drafts: 0 for a KV cache (its
    trim is arithmetic); a hybrid trunk's per-row recurrent-state slots for window + 1 rows, or, in
    its copy mode (``TS_Q35_VERIFY_SNAPSHOTS=0``), the one pre-verify copy of its state."""
    if getattr(target, "verify_snapshots", True) is False and hasattr(target, "state_bytes"):
        return int(target.state_bytes())
    per_window = getattr(target, "rollback_state_bytes", None)
    return int(per_window(window)) if per_window is not None and window > 0 else 0


class DecodeState:
    """One sequence decoding on a shared target: ``start`` it, then ``step`` until ``done``.

    ``plan`` is how it speculates (``SpecPlan``; ``PLAIN``: it does not), held as given.
    ``cache`` may already hold a prefix of the prompt (a kept cache: a conversation's earlier turns);
    only the rest is forwarded. A speculator that cannot arm after such a reused prefix
    (``can_arm_after_prefix_reuse``) is not used for this sequence (``speculator`` is then None).
    """

    def __init__(self, target: SpecTarget, sampler: Sampler, plan: SpecPlan = PLAIN, *, cache: Cache | None = None,
                 stats: SpecStats | None = None, drawable: int | None = None):
        self.target = target
        # ids at or past ``drawable`` have no token (a file's vocab_size padded past its token
        # list): never drawn, never drafted
        self.drawable = drawable
        self.sampler = sampler
        self.cache = cache if cache is not None else target.make_cache()
        self.plan = plan
        self.speculator: Speculator | None = plan.speculator  # this sequence's: None once it declines
        self.governor: Governor | None = plan.governor
        self.window = plan.window
        self.accept_rule = plan.rule()
        self.stats = stats if stats is not None else SpecStats()
        self.history: list[int] = []  # prompt + emitted tokens; the last is not in the cache yet
        self.prompt_len = 0
        self.last = -1
        self.hidden_last: torch.Tensor | None = None
        self.taps: tuple[int, ...] = ()
        self.tap_horizon: int | None = None  # the speculator's: None, every row is tapped
        self._todo: list[int] = []  # prompt tokens ``begin`` took that are not forwarded yet
        self._prefill_hidden: list[torch.Tensor] = []

    # -- prefill and the first token -------------------------------------------------------------
    def start(self, prompt: Sequence[int]) -> int:
        """Forward what the cache does not hold of ``prompt`` and draw the first token."""
        self.begin(prompt)
        while self.prefilling:
            self.step(1)
        return self.last

    def begin(self, prompt: Sequence[int]) -> None:
        """Take ``prompt``: the steps that follow forward what the cache does not hold of it, in
        chunks of ``prefill_chunk()`` (``prefilling`` until then), the last of them drawing the
        first token. ``start`` runs them alone; ``step_together`` shares them with other sequences'."""
        reused = self.cache.length
        todo = prompt_to_forward(prompt, reused)
        spec = self.speculator
        if spec is not None and reused and not arms_after_prefix_reuse(spec):
            spec = self.speculator = None
        self.taps = tuple(spec.taps) if spec is not None and spec.needs_hidden_state else ()
        self.tap_horizon = tap_horizon(spec) if self.taps else None
        st = self.stats
        members = getattr(spec, "member_stats", None)  # a composite's live per-member counts
        st.members = members() if members is not None else {}
        st.speculator = spec.name if spec is not None else None
        st.window = self.window if spec is not None else 0
        self.cache.set_rollback_window(st.window)  # a hybrid trunk's cache keeps a verify's rows only
        st.rollback_bytes = rollback_memory_bytes(self.target, st.window) if spec is not None else 0
        st.prompt_tokens = len(prompt)
        if self.governor is not None:
            self.governor.begin_sequence()
        self._t_prefill = time.perf_counter()
        self.cache.reserve(len(prompt) + 1)
        self.history = list(prompt)
        self.prompt_len = len(prompt)
        self._todo = todo  # prompt tokens not yet forwarded
        self._prefill_hidden = []

    def _taps_now(self) -> tuple[int, ...] | None:
        """The taps this step forwards: the speculator's, unless it reads only its newest
        ``tap_horizon`` rows and the governor keeps it parked for longer than that (a parked block
        drafter otherwise paid a tap copy every step and a refill of the whole stretch at the next
        probe, ~4% of a smollm2 run it never drafted in)."""
        if not self.taps:
            return None
        h = self.tap_horizon
        if h is not None and self.governor is not None and not drafts_within(self.governor, h):
            return None
        return self.taps

    @property
    def prefilling(self) -> bool:
        """Between ``begin`` and the first token."""
        return bool(self._todo)

    def _prefilled(self, rows: Rows, out: ForwardOutput) -> list[int]:
        """A prompt chunk went through; after the last, draw the first token -> [it] (else [])."""
        self._todo = self._todo[len(rows.item.tokens) :]
        if out.hidden is not None:
            self._prefill_hidden.append(out.hidden)
        elif self._prefill_hidden:  # a chunk went untapped: earlier rows would not end at the prompt's end
            self._prefill_hidden = []
        if self._todo:
            return []
        prompt = list(self.history)
        # tap rows cover the forwarded suffix only when a prefix was reused (or the drafter was parked)
        hidden = torch.cat(self._prefill_hidden) if self._prefill_hidden else None
        self._prefill_hidden = []
        self.last = self.sampler.sample(out.logits[-1], self.prompt_len, self.history)
        self.history.append(self.last)
        self.hidden_last = hidden[-1] if hidden is not None else None
        if self.speculator is not None:
            self.speculator.begin(prompt, hidden)
        st = self.stats
        st.prefill_ms = _ms(self._t_prefill)
        st.generated = 1
        return [self.last]

    # -- one step ----------------------------------------------------------------------------------
    def step(self, budget: int) -> list[int]:
        """Emit at least one and at most ``budget`` tokens (more than one only by verifying a draft,
        whose length ``_draft`` bounds by ``budget - 1``). While ``prefilling`` (after ``begin``): the
        next prompt chunk, emitting nothing, or the first token after the last chunk."""
        rows = self.prepare(budget)
        t0 = time.perf_counter()
        out = _forward(self.target, rows.item)
        return self.finish(rows, out, _ms(t0))

    def prepare(self, budget: int) -> Rows:
        """The first half of a step: the next prompt chunk while ``prefilling``; else draft (or not)
        and say which rows to forward. The forward may be shared with other sequences' rows
        (``step_together``); ``finish`` completes the step."""
        if self._todo:
            item = ForwardItem(self._todo[:prefill_chunk()], self.cache, False, self._taps_now(), prompt=True)
            return Rows(self.cache.length, NO_DRAFT, item, 0.0, prefill=True)
        t0 = time.perf_counter()
        pos = self.cache.length  # the last token takes this position
        draft = self._draft(pos, budget)
        taps = self._taps_now()
        if draft.parents is not None:  # row 0 is the last token; token i's row is i + 1
            item = ForwardItem([self.last, *draft.tokens], self.cache, True, taps, [-1, *(p + 1 for p in draft.parents)])
        elif draft.tokens:
            item = ForwardItem([self.last, *draft.tokens], self.cache, True, taps)
        else:
            item = ForwardItem([self.last], self.cache, False, taps)
        return Rows(pos, draft, item, _ms(t0), proposed=draft is not NO_DRAFT)

    def finish(self, rows: Rows, out: ForwardOutput, forward_ms: float, shared: int = 1) -> list[int]:
        """The second half of a step, given the forward of ``rows``: accept, trim, commit; -> the
        tokens emitted (none for a prompt chunk but the last). ``forward_ms``: the forward's wall
        time (a shared one's whole time); ``shared``: the decoding sequences whose rows it carried,
        this one included (the governor charges a draft's rows to each of them). The stats'
        rollback memory is then what the cache holds."""
        emitted = self._complete(rows, out, forward_ms, shared)
        self.stats.rollback_bytes = self.cache.rollback_bytes()  # as held: the live panel and --json show it
        return emitted

    def _complete(self, rows: Rows, out: ForwardOutput, forward_ms: float, shared: int) -> list[int]:
        if self.drawable is not None and out.logits.shape[-1] > self.drawable:
            with torch.inference_mode():  # in place (a forward's rows are inference tensors): no copy of [rows, vocab]
                out.logits[..., self.drawable:] = float("-inf")
        if rows.prefill:
            return self._prefilled(rows, out)
        t0 = time.perf_counter()
        draft = rows.draft
        if draft.tokens:
            self.stats.add_phase("verify", forward_ms)
            emitted = self._verify(rows.pos, draft, out)
        else:
            emitted = self._plain(rows.pos, out, forward_ms)
        self.history.extend(emitted)
        self.last = emitted[-1]
        st = self.stats
        st.generated = len(self.history) - self.prompt_len
        if self.governor is not None:
            step_ms = rows.prepare_ms + forward_ms + _ms(t0)
            # a proposal that drafted nothing is still speculation's cost (a head's step costs a
            # sixth of smollm2's): reported as plain it made the plain baseline look that much slower
            # a tree's reach is its depth: the governor sizes depths (``draft_length``) and reads a
            # verify's acceptance along them; its row cost is then the price of a depth, all of the
            # tree's rows at that depth included
            self.governor.record(rows.proposed, step_ms, len(emitted), draft.depth, setup_ms=draft.setup_ms,
                                 shared=shared)
            st.governor_state = self.governor.state
            st.governor_parks = self.governor.parks
        return emitted

    def _draft(self, pos: int, budget: int) -> Draft:
        spec, gov = self.speculator, self.governor
        if spec is None or (gov is not None and not gov.should_draft()):
            return NO_DRAFT
        # sized only when a draft will be asked for: a parked stretch pays no sizing per token
        window = self.window if gov is None else gov.draft_length(self.window)
        k_max = min(window, budget - 1, self.target.max_context - pos - 1)
        if k_max <= 0:
            return NO_DRAFT
        with self.stats.phase("draft"):
            ctx = DraftContext(self.last, pos, k_max, self.history, self.hidden_last, self.sampler,
                               None if gov is None else gov.min_draft_prob())
            draft = spec.propose(ctx)
        if draft.parents is not None:  # a tree: as many nodes as the context holds, no deeper than k_max
            keep = tree.prune_indices(draft.tokens, draft.parents, self.target.max_context - pos - 1, k_max,
                                      self.drawable)
            toks, parents = tree.subtree(draft.tokens, draft.parents, keep)
            probs = None if draft.probs is None or not toks else draft.probs[keep]
            return Draft(toks, probs, setup_ms=draft.setup_ms, parents=parents if toks else None)
        n = len(draft.tokens)
        if self.drawable is not None:  # a guess that is no token ends the draft: it cannot be accepted
            n = next((i for i, t in enumerate(draft.tokens) if not 0 <= t < self.drawable), n)
        n = min(n, k_max)
        if n < len(draft.tokens):
            draft = Draft(draft.tokens[:n], None if draft.probs is None else draft.probs[:n],
                          setup_ms=draft.setup_ms)
        return draft

    def _plain(self, pos: int, out: ForwardOutput, forward_ms: float) -> list[int]:
        """One row, exactly as plain decoding."""
        st = self.stats
        t0 = time.perf_counter()
        tok = self.sampler.sample(out.logits[-1], pos + 1, self.history)
        st.add_phase("plain", forward_ms + _ms(t0))
        st.plain_steps += 1
        self._commit([self.last], out.hidden, pos)
        return [tok]

    def _verify(self, pos: int, draft: Draft, out: ForwardOutput) -> list[int]:
        """Given the forward over [last, d1..dK]: keep the accepted prefix, trim the rest from the cache."""
        st = self.stats
        k = len(draft.tokens)
        if draft.parents is not None:
            return self._verify_tree(pos, draft, out)
        with st.phase("accept"):
            verdict = verify(self.accept_rule, out.logits, draft.tokens, draft.probs, self.sampler, pos + 1,
                             self.history)
        st.record_verify(k, verdict.accepted)
        kept = [self.last, *draft.tokens[: verdict.accepted]]
        with st.phase("rollback"):
            self.cache.trim(k - verdict.accepted)
        self._commit(kept, out.hidden, pos)
        return verdict.emitted(draft.tokens)

    def _verify_tree(self, pos: int, draft: Draft, out: ForwardOutput) -> list[int]:
        """Given the tree forward over [last, *tokens]: walk the trunk's draws down the tree, move
        the accepted path's cache rows into place (the rest dropped), commit them."""
        st = self.stats
        with st.phase("accept"):
            if self.accept_rule == "residual" and draft.probs is not None and not self.sampler.greedy:
                path, token = tree.walk_residual(out.logits, draft.tokens, draft.parents, draft.probs, self.sampler,
                                                 pos + 1, self.history)
            else:
                path, token = tree.walk(out.logits, draft.tokens, draft.parents, self.sampler, pos + 1, self.history)
        st.record_verify(len(draft.tokens), len(path))
        st.record_tree(len(draft.tokens), len(path))
        rows = [0, *(i + 1 for i in path)]
        with st.phase("rollback"):
            self.cache.keep_path(pos, rows)
        hidden = out.hidden[rows] if out.hidden is not None else None
        accepted = [draft.tokens[i] for i in path]
        self._commit([self.last, *accepted], hidden, pos)
        return [*accepted, token]

    def _commit(self, kept: list[int], hidden: torch.Tensor | None, pos: int) -> None:
        """Tell the speculator which tokens landed in the trunk, with their tap rows."""
        hid = hidden[: len(kept)] if hidden is not None else None
        self.hidden_last = hid[-1] if hid is not None else None
        if self.speculator is not None:
            with self.stats.phase("commit"):
                self.speculator.commit(kept, hid, pos)


def step_together(runs: list[Run]) -> None:
    """One step of each run (none of them done): every run drafts, the rows of all runs on one
    target share one forward (``forward_each``), then each accepts, trims and commits. Each run
    gets exactly the tokens its own ``step`` would give it: the forward is batch invariant and
    everything else is per sequence."""
    rows = [r.seq.prepare(r.budget) for r in runs]
    by_target: dict[int, list[int]] = {}
    for i, r in enumerate(runs):
        by_target.setdefault(id(r.seq.target), []).append(i)
    outs: list = [None] * len(runs)
    ms = [0.0] * len(runs)
    for idx in by_target.values():
        t0 = time.perf_counter()
        got = forward_each(runs[idx[0]].seq.target, [rows[i].item for i in idx])
        t = _ms(t0)
        for i, o in zip(idx, got):
            outs[i], ms[i] = o, t
    # the runs step in lock step: rows one of them adds (batched with the others' or forwarded after
    # them) delay the step of every run decoding beside it
    shared = max(1, sum(1 for row in rows if not row.prefill))
    for r, row, out, t in zip(runs, rows, outs, ms):
        r.absorb(r.seq.finish(row, out, t, shared))


def decode(
    target: SpecTarget,
    sampler: Sampler,
    prompt: Sequence[int],
    max_tokens: int,
    plan: SpecPlan = PLAIN,
    *,
    cache: Cache | None = None,
    on_token: Callable[[int], bool] | None = None,
    on_step: Callable[[SpecStats], None] | None = None,
    stats: SpecStats | None = None,
    drawable: int | None = None,
) -> list[int]:
    """Generate up to ``max_tokens`` tokens after ``prompt`` as ``plan`` says; returns them.

    ``cache``: a kept cache holding a prefix of ``prompt`` (default: a new one). ``on_token(tok) ->
    stop`` is called for every emitted token in order; returning True ends the run after that token.
    ``on_step(stats)`` is called after every step (for a live display). ``drawable``: the ids that
    have a token (``DecodeState``).
    """
    seq = DecodeState(target, sampler, plan, cache=cache, stats=stats, drawable=drawable)
    run = Run(seq, prompt, max_tokens, on_token=on_token, on_step=on_step)  # checks the prompt
    run.drive()  # nothing when max_tokens <= 0
    return run.finish()


def decode_interleaved(sequences: list[DecodeState], prompts: list[Sequence[int]], max_tokens: int) -> list[list[int]]:
    """Run several sequences (each on its own cache, possibly one shared model) one step each in
    turn, each with its own forward, until each has ``max_tokens`` tokens; -> their tokens. Each
    gets exactly what it gets alone."""
    outs = [[seq.start(p)] for seq, p in zip(sequences, prompts)]
    while any(len(o) < max_tokens for o in outs):
        for seq, out in zip(sequences, outs):
            if len(out) < max_tokens:
                out.extend(seq.step(max_tokens - len(out)))
    return outs


def decode_batched(sequences: list[DecodeState], prompts: list[Sequence[int]], max_tokens: int | list[int]
                   ) -> list[list[int]]:
    """Run several sequences to ``max_tokens`` tokens each (one number, or one per sequence), every
    step shared: the rows of all their plain steps and verifies go through one forward per target
    (``step_together``); -> their tokens. Each gets exactly what it gets alone."""
    budgets = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(sequences)
    runs = [Run(seq, p, n) for seq, p, n in zip(sequences, prompts, budgets)]
    for r in runs:
        r.begin()  # their prompts' chunks share forwards too
    while True:
        live = [r for r in runs if not r.done]
        if not live:
            return [r.finish() for r in runs]
        step_together(live)
