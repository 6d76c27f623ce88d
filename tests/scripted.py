"""A test speculator that drafts a known continuation, corrupted where a test says, so the test
chooses exactly how many tokens each verify accepts (tests/test_loop.py, tests/test_hybrid.py)."""

from __future__ import annotations

from typing import Sequence

from tsspec.spec.protocols import Draft, DraftContext


class ScriptedSpeculator:
    """Drafts a known continuation (``truth``: prompt + plain output), corrupted where told.

    ``corrupt(step, i) -> bool`` says whether draft token ``i`` of proposal ``step`` is replaced by
    a wrong token, so a test chooses exactly how many tokens each verify accepts.
    """

    name = "scripted"
    default_min_draft_prob = 0.0
    min_draft_prob = 0.0
    needs_hidden_state = False
    can_arm_after_prefix_reuse = True
    default_accept_rule = "match"

    def __init__(self, truth: Sequence[int], corrupt, vocab: int, max_draft_tokens: int = 8):
        self.truth = list(truth)
        self.corrupt = corrupt
        self.vocab = vocab
        self.max_draft_tokens = max_draft_tokens
        self.drafts: list[int] = []  # length of every non-empty proposal
        self.accepted: list[int] = []  # accepted length of every verify, from commit
        self.wrong_at: list[int | None] = []  # first corrupted index of each proposal
        self._pending = False

    @property
    def taps(self) -> tuple[int, ...]:
        return ()

    def begin(self, prompt, hidden) -> None:
        assert hidden is None
        self.prompt_len = len(prompt)

    def propose(self, ctx: DraftContext) -> Draft:
        assert list(ctx.history) == self.truth[: len(ctx.history)], "history must be the plain output so far"
        assert ctx.position == len(ctx.history) - 1  # last token is not in the cache yet
        start = len(ctx.history)
        want = self.truth[start : start + min(ctx.max_tokens, self.max_draft_tokens)]
        step = len(self.drafts)
        out, wrong = [], None
        for i, t in enumerate(want):
            if self.corrupt(step, i):
                t = (t + 1 + step) % self.vocab
                wrong = i if wrong is None else wrong
            out.append(t)
        if out:
            self.drafts.append(len(out))
            self.wrong_at.append(wrong)
            self._pending = True
        return Draft(out)

    def commit(self, tokens, hidden, start_pos) -> None:
        if self._pending:
            self.accepted.append(len(tokens) - 1)
            self._pending = False

    def reset(self) -> None:
        pass


def keep_first(keep: int, k: int):
    """A ``corrupt`` rule: the first ``keep`` drafts of every proposal are right; ``keep`` < 0 varies
    it per proposal over 0..k, so every accepted length occurs."""
    if keep >= 0:
        return lambda step, i: i >= keep
    return lambda step, i: i >= step % (k + 1)
