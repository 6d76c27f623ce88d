"""N-gram speculation (prompt-lookup decoding): draft what followed the last few tokens the
previous time they occurred in the context.

Contract:

* No weights, no hidden state, no trunk access: the only input is the token history (prompt +
  emitted tokens, the not-yet-forwarded last token included). That history is complete whatever
  the KV cache did, which is why this speculator may arm after a reused KV prefix.
* ``ngram_propose(history, n, k)`` is the specification, a plain function over a list:

    - the *suffix* is the last ``n`` tokens; an *occurrence* is an earlier place where those ``n``
      tokens appear, identified by its end ``e`` (the index just after it, ``n <= e < len``);
    - the chosen occurrence is the most recent one whose continuation ``history[e:]`` is at least
      ``k`` tokens long, else (every occurrence is too close to the end) the oldest one, whose
      continuation is the longest. Taking simply the newest occurrence drafts little or nothing on
      a run of a repeated token (``x x x x``: the newest earlier ``x x`` ends one token before the
      end), and that is exactly the output a looping model produces;
    - the draft is up to ``k`` tokens copied from ``e`` on. When the copy reaches the end of the
      history it keeps going over the tokens it has already drafted (an LZ77-style overlapping
      copy), i.e. it assumes the repetition of period ``len - e`` goes on: ``x x x x`` drafts
      ``x`` ``k`` times instead of one ``x``. ``periodic=False`` gives the plain copy.

  ``[1, 2, 3, 4, 1, 2, 3]``, n=2, k=3 -> ``[4, 1, 2]``.
* ``NGramIndex`` answers the same question incrementally: ``lookup(k, min_order)`` returns
  ``ngram_propose(history, n, k)`` for the largest ``n`` in ``max_order..min_order`` that has an
  occurrence (``[]`` if none). Appending or removing a token costs O(orders); a lookup costs
  O(orders) dict probes plus a binary search. Tests hold it to the brute-force reference on
  random histories, across truncations.
* ``NGramSpeculator`` is the ``Speculator`` over that index. ``--spec-pmin`` (``min_draft_prob``,
  in [0, 1], default 0) does not gate a probability here -- an n-gram draft has none -- it scales
  the required match length: ``min_order + round(pmin * (max_order - min_order))``.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Sequence

import torch

from tsspec.spec.protocols import Draft, DraftContext, MinDraftProb
from tsspec.spec.tree import Trie

__all__ = ["ngram_propose", "NGramIndex", "NGramSpeculator"]


# ----------------------------------------------------------------------------- the specification


def _choose_end(ends: Sequence[int], hi: int, length: int, k: int) -> int:
    """Among ``ends[:hi]`` (ascending, non-empty): the newest with >= k tokens after it, else the oldest."""
    i = bisect_right(ends, length - k, 0, hi) - 1
    return ends[i] if i >= 0 else ends[0]


def _copy(history: Sequence[int], end: int, k: int, periodic: bool) -> list[int]:
    """Up to ``k`` tokens from ``history[end:]``, continued over the draft itself when ``periodic``."""
    out = [int(t) for t in history[end : end + k]]
    if periodic and out:
        period = len(history) - end  # the copy source runs into the present: repeat what it saw
        while len(out) < k:
            out.append(out[len(out) - period])
    return out


def ngram_propose(history: Sequence[int], n: int, k: int, *, periodic: bool = True) -> list[int]:
    """Brute-force n-gram draft of up to ``k`` tokens for a suffix of exactly ``n`` tokens (see module doc)."""
    length = len(history)
    if n <= 0 or k <= 0 or length <= n:
        return []
    suffix = list(history[length - n :])
    ends = [e for e in range(n, length) if list(history[e - n : e]) == suffix]
    if not ends:
        return []
    return _copy(history, _choose_end(ends, len(ends), length, k), k, periodic)


# ----------------------------------------------------------------------------- the incremental index


class NGramIndex:
    """Token history plus, per order n, a map n-gram -> ascending ends of its occurrences.

    Ends are pushed in increasing order as tokens arrive, so each list is sorted for free and a
    rollback pops exactly the ends it added: ``truncate`` is the exact inverse of ``extend``.
    The last end in the list of the current suffix is always the suffix itself; ``lookup``
    excludes it.
    """

    def __init__(self, min_order: int = 2, max_order: int = 8, *, periodic: bool = True) -> None:
        if not 1 <= min_order <= max_order:
            raise ValueError(f"need 1 <= min_order <= max_order, got {min_order}, {max_order}")
        self.min_order = min_order
        self.max_order = max_order
        self.periodic = periodic
        self._tokens: list[int] = []
        # _ends[n - min_order][ngram] = ends of its occurrences, ascending
        self._ends: list[dict[tuple[int, ...], list[int]]] = [
            {} for _ in range(max_order - min_order + 1)
        ]

    def __len__(self) -> int:
        return len(self._tokens)

    def __getitem__(self, i: int) -> int:
        return self._tokens[i]

    @property
    def tokens(self) -> tuple[int, ...]:
        """A copy of the indexed history (O(len); for tests and debugging)."""
        return tuple(self._tokens)

    def ends_of(self, ngram: Sequence[int]) -> Sequence[int]:
        """The ends of ``ngram``'s occurrences, ascending (empty when it was never seen, or its
        order is outside [min_order, max_order]); a view to read, not to change."""
        n = len(ngram)
        if not self.min_order <= n <= self.max_order:
            return ()
        return self._ends[n - self.min_order].get(tuple(int(t) for t in ngram), ())

    def clear(self) -> None:
        self._tokens.clear()
        for table in self._ends:
            table.clear()

    def append(self, token: int) -> None:
        toks = self._tokens
        toks.append(int(token))
        end = len(toks)
        for n in range(self.min_order, min(self.max_order, end) + 1):
            table = self._ends[n - self.min_order]
            key = tuple(toks[end - n :])
            ends = table.get(key)
            if ends is None:
                table[key] = [end]
            else:
                ends.append(end)

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.append(t)

    def truncate(self, length: int) -> None:
        """Forget every token at position >= ``length`` (rollback); no-op if already that short."""
        if length < 0:
            raise ValueError(f"length must be >= 0, got {length}")
        toks = self._tokens
        while len(toks) > length:
            end = len(toks)
            for n in range(self.min_order, min(self.max_order, end) + 1):
                table = self._ends[n - self.min_order]
                key = tuple(toks[end - n :])
                ends = table[key]
                ends.pop()  # == end: it was the newest occurrence pushed
                if not ends:
                    del table[key]
            toks.pop()

    def lookup_order(self, max_tokens: int, min_order: int | None = None) -> tuple[int, list[int]]:
        """``(n, draft)`` for the longest matching order n, or ``(0, [])`` when nothing matches."""
        lo = self.min_order if min_order is None else max(min_order, self.min_order)
        toks = self._tokens
        length = len(toks)
        if max_tokens <= 0:
            return 0, []
        for n in range(min(self.max_order, length - 1), lo - 1, -1):
            ends = self._ends[n - self.min_order].get(tuple(toks[length - n :]))
            # ends[-1] == length is the suffix itself; an earlier occurrence is needed
            if ends is None or len(ends) < 2:
                continue
            end = _choose_end(ends, len(ends) - 1, length, max_tokens)
            return n, _copy(toks, end, max_tokens, self.periodic)
        return 0, []

    def lookup(self, max_tokens: int, min_order: int | None = None) -> list[int]:
        """Draft for the longest suffix of order in [min_order, max_order] seen before (see module doc)."""
        return self.lookup_order(max_tokens, min_order)[1]

    def lookup_tree(self, depth: int, nodes: int, min_order: int | None = None, per_order: int = 8
                    ) -> tuple[int, list[int], list[int]]:
        """``(n, tokens, parents)``: a token tree of at most ``nodes`` tokens and ``depth`` levels.
        Its first path is ``lookup_order(depth)``'s chain (so a tree accepts at least what that chain
        does); then the continuations of the same suffix's other occurrences, newest first, and of
        shorter suffixes (up to ``per_order`` occurrences each), merged into one trie under the
        budget. ``(0, [], [])`` when nothing matches."""
        order, first = self.lookup_order(depth, min_order)
        if not first:
            return 0, [], []
        trie = Trie(nodes)
        trie.insert(first)
        lo = self.min_order if min_order is None else max(min_order, self.min_order)
        toks, length = self._tokens, len(self._tokens)
        for n in range(order, lo - 1, -1):
            ends = self._ends[n - self.min_order].get(tuple(toks[length - n :]))
            for end in reversed((ends or [])[-1 - per_order : -1]):  # newest first, the suffix itself left out
                if trie.full:
                    return order, trie.tokens, trie.parents
                trie.insert(_copy(toks, end, depth, self.periodic))
        return order, trie.tokens, trie.parents


# ----------------------------------------------------------------------------- the speculator


class NGramSpeculator:
    """Prompt-lookup speculator: weight-free, works on every checkpoint, verified like any other."""

    name = "ngram"
    min_draft_prob = MinDraftProb()
    default_min_draft_prob = 0.0
    needs_hidden_state = False
    can_arm_after_prefix_reuse = True  # the token history is complete whatever the KV cache did
    default_accept_rule = "match"  # no draft distribution: accept while the drawn token matches

    def __init__(
        self,
        max_draft_tokens: int = 8,
        min_draft_prob: float | None = None,
        min_order: int = 2,
        max_order: int = 8,
        tree: int = 0,
    ) -> None:
        if max_draft_tokens < 1:
            raise ValueError(f"max_draft_tokens must be >= 1, got {max_draft_tokens}")
        if tree < 0:
            raise ValueError(f"tree must be >= 0 nodes, got {tree}")
        self.max_draft_tokens = max_draft_tokens
        self.tree = tree  # node budget of a tree draft (0: chains)
        self.index = NGramIndex(min_order, max_order)
        self.min_draft_prob = min_draft_prob  # validated; None: the default
        # counters one report line can print: proposals asked, proposals with a match, tokens drafted
        self.proposals = 0
        self.matches = 0
        self.drafted = 0
        self.last_order = 0  # n-gram order of the last match (0: none), for the live display

    @property
    def taps(self) -> tuple[int, ...]:
        return ()

    @property
    def required_order(self) -> int:
        """Shortest suffix match allowed to draft: pmin 0 -> min_order, pmin 1 -> max_order."""
        lo, hi = self.index.min_order, self.index.max_order
        return lo + round(self._min_draft_prob * (hi - lo))

    def begin(self, prompt: Sequence[int], hidden: torch.Tensor | None) -> None:
        self.index.clear()
        self.index.extend(prompt)

    def sync(self, history: Sequence[int]) -> None:
        """Make the index hold exactly ``history``; O(new tokens) on the append-only common path."""
        index = self.index
        shared = min(len(index), len(history))
        index.truncate(shared)
        # the history only grows by committed tokens or is cut back by a rollback; a differing
        # boundary token means a different sequence (begin() was skipped), so start over
        if shared and index[shared - 1] != int(history[shared - 1]):
            index.clear()
            shared = 0
        index.extend(history[shared:])

    def propose(self, ctx: DraftContext) -> Draft:
        self.sync(ctx.history)
        self.proposals += 1
        k = min(ctx.max_tokens, self.max_draft_tokens)
        parents = None
        if self.tree:
            order, tokens, parents = self.index.lookup_tree(k, self.tree, self.required_order)
        else:
            order, tokens = self.index.lookup_order(k, self.required_order)
        self.last_order = order
        if tokens:
            self.matches += 1
            self.drafted += len(tokens)
        return Draft(tokens=tokens, parents=parents if tokens else None)

    def commit(self, tokens: Sequence[int], hidden: torch.Tensor | None, start_pos: int) -> None:
        """Write the landed tokens at ``start_pos``.. so the index is current before the next propose.

        ``propose`` re-syncs from the history anyway; this only keeps the work off the next step.
        A commit that would leave a gap (an adopted prefix the index never saw) is ignored.
        """
        index = self.index
        if start_pos > len(index):
            return
        for i, tok in enumerate(tokens):
            pos = start_pos + i
            if pos < len(index):
                if index[pos] == int(tok):
                    continue
                index.truncate(pos)
            index.append(tok)

    def reset(self) -> None:
        self.index.clear()
        self.last_order = 0
