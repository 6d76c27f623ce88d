"""The decoding state of a plain greedy run on a lean trunk (``models.lean``), without torch.

``LeanDecode`` has the surface ``spec.run.Run`` drives (``begin``, ``prefilling``, ``step``), as
``spec.loop.DecodeState`` has: ``generate.Engine`` takes it for a lean trunk's plain runs, so the
text, stop handling and figures around it are the same code as every other run's.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Sequence

import numpy as np

from .plan import PLAIN, SpecPlan
from .run import _ms, prefill_chunk, prompt_to_forward
from .stats import SpecStats

if TYPE_CHECKING:
    from ..models.lean import LeanCache, LeanTrunk


class LeanDecode:
    """``spec.loop.DecodeState``'s surface for ``Run`` (``begin``, ``prefilling``, ``step``), plain and
    greedy: the prompt in chunks of ``prefill_chunk()``, then one row per step; each token the argmax
    of its row over the drawable ids, as ``sampling.argmax`` takes it (the lowest of tied maxima)."""

    speculator = None

    def __init__(self, trunk: "LeanTrunk", sampler, plan: SpecPlan = PLAIN, *, cache: "LeanCache",
                 stats: SpecStats, drawable: int | None):
        """As ``DecodeState``'s (``generate.Engine`` makes either alike); ``sampler``: a ``Sampler``
        or its ``SamplingParams``, greedy without penalties; ``plan``: plain only."""
        if plan.speculates:
            raise ValueError("a lean trunk decodes plainly: load the torch model to speculate")
        params = getattr(sampler, "params", sampler)
        if not params.greedy or params.has_penalties:
            raise ValueError("the lean path draws greedily without penalties only")
        self.trunk, self.cache, self.stats = trunk, cache, stats
        self.drawable = drawable
        self.history: list[int] = []
        self.prompt_len = 0
        self.last = -1
        self._todo: list[int] = []

    def begin(self, prompt: Sequence[int]) -> None:
        todo = prompt_to_forward(prompt, self.cache.length)
        st = self.stats
        st.members, st.speculator, st.window, st.rollback_bytes = {}, None, 0, 0
        st.prompt_tokens = len(prompt)
        self._t_prefill = time.perf_counter()
        self.cache.reserve(len(prompt) + 1)
        self.history = list(prompt)
        self.prompt_len = len(prompt)
        self._todo = todo

    @property
    def prefilling(self) -> bool:
        return bool(self._todo)

    def _draw(self, logits: np.ndarray) -> int:
        return int(np.argmax(logits[: self.drawable] if self.drawable is not None else logits))

    def step(self, budget: int) -> list[int]:
        st = self.stats
        if self._todo:
            n = prefill_chunk()
            chunk, self._todo = self._todo[:n], self._todo[n:]
            logits = self.trunk.forward(chunk, self.cache, prompt=True)
            if self._todo:
                return []
            self.last = self._draw(logits)
            self.history.append(self.last)
            st.prefill_ms = _ms(self._t_prefill)
            st.generated = 1
            return [self.last]
        t0 = time.perf_counter()
        tok = self._draw(self.trunk.forward([self.last], self.cache))
        st.add_phase("plain", _ms(t0))
        st.plain_steps += 1
        self.history.append(tok)
        self.last = tok
        st.generated = len(self.history) - self.prompt_len
        return [tok]
