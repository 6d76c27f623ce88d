"""``Run``: one sequence's budget and stop handling around a decoding state's steps, apart from the
loop (``spec.loop``) because it needs nothing but the state's steps: the speculative ``DecodeState``
and the plain native one (``models.lean.LeanDecode``, a run without torch) are driven alike."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Sequence

from .stats import SpecStats

if TYPE_CHECKING:
    from .loop import DecodeState

PREFILL_CHUNK = 256  # prompt tokens one prefill step forwards
# ... while prompt rows take the AMX tile route (kernels/prompt_tiles.c): its per-product work (each
# weight unpacked once per chunk) spreads over more rows. A 1024-token prompt of qwen2.5-coder-1.5b
# took 0.87x the time in chunks of 512 as in chunks of 256 (0.83x at 1024; the default products:
# 1.01x), docs/RESULTS.md. Rows are computed alike in any chunking, so only speed changes.
TILE_PREFILL_CHUNK = 512


def prefill_chunk() -> int:
    """The prompt tokens one prefill step forwards now (``PREFILL_CHUNK``, or
    ``TILE_PREFILL_CHUNK`` while prompt rows are on the tiles)."""
    from .. import kernels

    return TILE_PREFILL_CHUNK if kernels.available() and kernels.prompt_tiles_on() else PREFILL_CHUNK


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000.0


def prompt_to_forward(prompt: Sequence[int], reused: int) -> list[int]:
    """The tokens of ``prompt`` a decoding state forwards when its cache holds ``reused`` of them
    (a kept cache: a conversation's earlier turns); a prompt that is empty or does not extend the
    cache is a ValueError. Every decoding state's ``begin`` takes its prompt through here."""
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    if reused >= len(prompt):
        raise ValueError(f"the cache holds {reused} positions; the prompt must extend it (has {len(prompt)})")
    return list(prompt[reused:])


class Run:
    """One sequence decoded to ``max_tokens`` tokens or until ``on_token`` says stop: the budget and
    stop handling ``decode`` (one sequence) and ``decode_batched`` / a server's scheduler (several,
    stepped together) share. ``start`` it, then while not ``done``: ``absorb(seq.step(budget))``
    (or a step shared through ``step_together``); ``finish`` returns the tokens.

    ``on_token(tok) -> stop`` is called for every emitted token in order; returning True ends the
    run after that token (later tokens of the same step are dropped, as they would be alone).
    ``on_step(stats)`` is called after every step (for a live display).
    """

    def __init__(self, seq: "DecodeState", prompt: Sequence[int], max_tokens: int, *,
                 on_token: Callable[[int], bool] | None = None, on_step: Callable[[SpecStats], None] | None = None):
        if not prompt:
            raise ValueError("the prompt must hold at least one token")
        self.seq, self.prompt, self.max_tokens = seq, prompt, max_tokens
        self.on_token, self.on_step = on_token, on_step
        self.out: list[int] = []
        self.stopped = max_tokens <= 0
        self._t_decode = 0.0

    @property
    def done(self) -> bool:
        return self.stopped or len(self.out) >= self.max_tokens

    @property
    def budget(self) -> int:
        return self.max_tokens - len(self.out)

    def begin(self) -> None:
        """Take the prompt: the next steps prefill it (shared with other runs' steps, or alone
        through ``start``) and draw the first token. Nothing when ``max_tokens`` is 0."""
        if not self.stopped:
            self.seq.begin(self.prompt)

    def start(self) -> None:
        """Prefill alone and the first token."""
        self.begin()
        while not self.stopped and self.seq.prefilling:
            self.absorb(self.seq.step(self.budget))

    def drive(self) -> None:
        """Run alone to the end: ``start``, then one step after another until ``done``."""
        self.start()
        while not self.done:
            self.absorb(self.seq.step(self.budget))

    def absorb(self, emitted: list[int]) -> None:
        """The tokens one step emitted (none for a prompt chunk but the last)."""
        if not emitted:
            return
        first = not self.out
        for tok in emitted:
            self.out.append(tok)
            if self.on_token is not None and self.on_token(tok):
                self.stopped = True
                break
        if first:  # the first token ends the prefill; decoding is timed from here
            self._t_decode = time.perf_counter()
            return
        st = self.seq.stats
        st.decode_ms = _ms(self._t_decode)
        if self.on_step is not None:
            self.on_step(st)

    def finish(self) -> list[int]:
        if self.out:
            st = self.seq.stats
            st.decode_ms = _ms(self._t_decode)
            st.generated = len(self.out)
        # a speculator that keeps what sequences wrote (the suffix store) learns this one ended
        end = getattr(self.seq.speculator, "end_sequence", None)
        if end is not None and self.out:
            end([*self.prompt, *self.out])
        return self.out
