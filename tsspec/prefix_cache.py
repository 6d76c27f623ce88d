"""A pool of kept caches of finished sequences: the prefix reuse of a conversation (one kept cache)
and of a server (``--slots`` of them). It sits beside the two that use it, above the loop: what a
cache holds is the model's (``models.cache``), which kept cache a prompt continues is theirs."""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from .models.cache import common_prefix


def _prompt_rows_differ() -> bool:
    from . import kernels

    return kernels.available() and kernels.prompt_tiles_on()


class PrefixCache:
    """Kept caches of finished sequences, keyed by the tokens each holds; at most ``slots``, least
    recently used first out. A chat keeps one (its conversation's); a server keeps several."""

    def __init__(self, make_cache, slots: int = 1):
        if slots < 1:
            raise ValueError(f"a prefix cache needs at least one slot, got {slots}")
        self.make_cache = make_cache
        self.slots = slots
        self.entries: OrderedDict[int, tuple[list[int], object]] = OrderedDict()
        self._ids = 0

    def take(self, prompt: Sequence[int]) -> tuple[object, int]:
        """The kept cache sharing the longest prefix with ``prompt``, cut to that prefix (leaving at
        least one prompt token to forward), or an empty one; -> (cache, positions reused). The cache
        leaves the pool until ``give`` returns it."""
        best, best_n = None, 0
        for key, (tokens, _) in self.entries.items():
            n = common_prefix(tokens, prompt)
            if n > best_n:
                best, best_n = key, n
        if best is None:
            if len(self.entries) >= self.slots:  # recycle the least recently used one's memory
                _, (_, cache) = self.entries.popitem(last=False)
                cache.reset()
                return cache, 0
            return self.make_cache(), 0
        _, cache = self.entries.pop(best)
        return cache, cache.keep(min(best_n, len(prompt) - 1))

    def give(self, tokens: Sequence[int], cache, prompt_len: int | None = None) -> None:
        """Return a cache holding ``tokens`` (position by position; extra ones are ignored), most
        recent. ``prompt_len``: how many of them were its prompt; while prompt rows round otherwise
        than generated ones (``kernels.prompt_tiles_on``), only those are offered for reuse, so a
        reply over a kept cache is the one a fresh run over the whole prompt gives."""
        keep = cache.length
        if prompt_len is not None and _prompt_rows_differ():
            keep = min(keep, prompt_len)
        self._ids += 1
        self.entries[self._ids] = (list(tokens[:keep]), cache)
        while len(self.entries) > self.slots:
            self.entries.popitem(last=False)

    def clear(self) -> None:
        self.entries.clear()
