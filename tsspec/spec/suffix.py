"""Suffix speculation: draft from what this engine has already read and written, across requests.

An agent loop repeats its tool-call JSON, its boilerplate and its own earlier answers from request
to request; n-gram lookup sees only the sequence in hand. The suffix speculator also looks up the
current suffix in a store of the earlier sequences (prompt and output) of the same engine: a
``generate --prompts`` batch, a chat, a bench configuration, a server's lifetime.

Contract:

* ``SuffixStore`` holds finished sequences, up to ``budget`` tokens, in two generations of half
  the budget each (the older dropped whole when the younger fills: no rebuild). Each generation's
  index is an ``NGramIndex`` over its sequences laid end to end with a separator that is no token,
  so no n-gram spans two of them. One lock guards it: a reader never sees a half-added sequence.
* ``SuffixSpeculator`` keeps its own sequence's index, as n-gram does, and asks the store too. The
  longer suffix match wins (the sequence's own on a tie: it is the fresher evidence). From the store
  it takes the continuations of up to ``per_match`` occurrences of the matched suffix, counts each
  continuation's tokens as a trie, and drafts the most followed path (``most_followed``): a token is
  drafted while at least half of the occurrences that reached its parent went on with it (the
  paper's frequency score, arXiv 2411.04975, with a fixed threshold). With a node budget (``tree``)
  it drafts the trie's most followed nodes as a token tree.
* A speculator sees its sequence end (``end_sequence``, which ``Run.finish`` calls) and adds it to
  the store then, once. Proposals read the store; nothing in it changes what is emitted: the trunk
  verifies every token, so the store changes speed only.
* The registry gives every sequence of one engine the same store (``Factory`` shared state), so
  two engines (two bench configurations) never share one.
"""

from __future__ import annotations

import threading
from typing import Sequence

import torch

from .ngram import NGramIndex, NGramSpeculator
from .protocols import Draft, DraftContext

__all__ = ["SuffixStore", "SuffixSpeculator", "most_followed", "DEFAULT_BUDGET"]

DEFAULT_BUDGET = 1 << 16  # tokens of earlier sequences kept
SEPARATOR = -1  # between sequences in the store's index: no token, so no n-gram spans two


def most_followed(continuations: Sequence[Sequence[int]], depth: int, nodes: int = 0, share: float = 0.5
                  ) -> tuple[list[int], list[int] | None]:
    """A draft from ``continuations`` (what followed each occurrence of the matched suffix):
    ``(tokens, None)``, the path that at each step takes the token most occurrences went on with,
    while at least ``share`` of those that reached it did so, up to ``depth`` tokens; or, with a
    node budget ``nodes``, ``(tokens, parents)``: a token tree of the trie's nodes that the most
    occurrences reached (every first token, and below it those that at least ``share`` of their
    parent's occurrences went on with), parents first, up to ``nodes`` tokens and ``depth`` levels.
    Pure."""
    # trie: node -> (count, children {token: node}); node 0 the root
    counts = [len(continuations)]
    children: list[dict[int, int]] = [{}]
    parent_of = [-1]
    token_of = [-1]
    depth_of = [0]
    for cont in continuations:
        at = 0
        for t in cont[:depth]:
            nxt = children[at].get(int(t))
            if nxt is None:
                nxt = len(counts)
                counts.append(0)
                children.append({})
                parent_of.append(at)
                token_of.append(int(t))
                depth_of.append(depth_of[at] + 1)
                children[at][int(t)] = nxt
            counts[nxt] += 1
            at = nxt
    if not nodes:
        out, at = [], 0
        while children[at] and len(out) < depth:
            tok, nxt = max(children[at].items(), key=lambda kv: (counts[kv[1]], -kv[0]))
            if counts[nxt] < share * counts[at]:
                break
            out.append(tok)
            at = nxt
        return out, None
    # a node's score: the share of all occurrences that reached it; parents score at least as high
    keep = [n for n in range(1, len(counts)) if counts[n] >= share * counts[parent_of[n]] or parent_of[n] == 0]
    keep.sort(key=lambda n: (-counts[n], depth_of[n], n))
    chosen: dict[int, int] = {}
    toks: list[int] = []
    pars: list[int] = []
    for n in keep:
        if len(toks) >= nodes:
            break
        p = parent_of[n]
        if p != 0 and p not in chosen:
            continue  # its parent did not make it: it cannot be reached
        chosen[n] = len(toks)
        toks.append(token_of[n])
        pars.append(-1 if p == 0 else chosen[p])
    return toks, pars


class _Generation:
    """Sequences laid end to end, each followed by ``SEPARATOR``, and their n-gram index."""

    def __init__(self, min_order: int, max_order: int) -> None:
        self.index = NGramIndex(min_order, max_order, periodic=False)
        self.tokens = 0  # separators not counted
        self.sequences = 0

    def add(self, seq: list[int]) -> None:
        self.index.extend(seq)
        self.index.append(SEPARATOR)
        self.tokens += len(seq)
        self.sequences += 1

    def continuations(self, suffix: tuple[int, ...], depth: int, limit: int) -> list[list[int]]:
        """What followed the newest ``limit`` occurrences of ``suffix`` here, newest first, each up to
        ``depth`` tokens and never past its sequence's end."""
        idx = self.index
        out = []
        for e in reversed(idx.ends_of(suffix)[-limit:] if limit > 0 else ()):
            cont = []
            for j in range(e, min(e + depth, len(idx))):
                t = idx[j]
                if t == SEPARATOR:
                    break
                cont.append(t)
            if cont:
                out.append(cont)
        return out


class SuffixStore:
    """Earlier sequences of one engine, indexed for suffix lookups; bounded, thread-safe.

    Two generations of at most half the budget each: sequences go into the young one; when it is
    full the old one is dropped whole and the young one takes its place. Eviction is then the drop of
    a dict, never a rebuild: rebuilding the whole index of a full 65,536-token store took about a
    second of the scheduler's thread, on every request once the budget was reached (measured).
    Between half the budget and the budget is held; a lookup reads the young generation first."""

    def __init__(self, budget: int = DEFAULT_BUDGET, min_order: int = 2, max_order: int = 8) -> None:
        if budget < 2:
            raise ValueError(f"budget must be >= 2 tokens, got {budget}")
        self.budget = budget
        self.min_order = min_order
        self.max_order = max_order
        self._lock = threading.Lock()
        self._old = _Generation(min_order, max_order)
        self._young = _Generation(min_order, max_order)
        self.sequences_added = 0
        self.lookups = 0
        self.hits = 0

    @property
    def tokens(self) -> int:
        """Tokens held (separators not counted)."""
        with self._lock:
            return self._old.tokens + self._young.tokens

    @property
    def sequences(self) -> int:
        """Sequences held."""
        with self._lock:
            return self._old.sequences + self._young.sequences

    def add(self, tokens: Sequence[int]) -> None:
        """A finished sequence (prompt and output), its last half-budget tokens at most; the older
        generation goes when the young one would pass half the budget."""
        half = self.budget // 2
        seq = [int(t) for t in tokens][-half:]
        if not seq:
            return
        with self._lock:
            if self._young.tokens + len(seq) > half:
                self._old, self._young = self._young, _Generation(self.min_order, self.max_order)
            self._young.add(seq)
            self.sequences_added += 1

    def continuations(self, history: Sequence[int], depth: int, min_order: int, per_match: int = 32
                      ) -> tuple[int, list[list[int]]]:
        """``(n, conts)``: for the longest suffix of ``history`` of order >= ``min_order`` found in
        the store, what followed its newest ``per_match`` occurrences (each up to ``depth`` tokens,
        cut at the end of its sequence); ``(0, [])`` when none is found."""
        with self._lock:
            self.lookups += 1
            lo = max(min_order, self.min_order)
            tail = tuple(int(t) for t in history[-self.max_order :])
            for n in range(min(self.max_order, len(tail)), lo - 1, -1):
                suffix = tail[len(tail) - n :]
                conts = self._young.continuations(suffix, depth, per_match)
                conts += self._old.continuations(suffix, depth, per_match - len(conts))
                if conts:
                    self.hits += 1
                    return n, conts
            return 0, []

    def gauges(self) -> list[tuple[str, str, str, float]]:
        """(name, kind, help, value) for a server's ``/metrics``."""
        with self._lock:
            held = self._old.tokens + self._young.tokens
            seqs = self._old.sequences + self._young.sequences
            lookups, hits = self.lookups, self.hits
        return [
            ("tsspec_suffix_store_tokens", "gauge", "tokens of earlier sequences the suffix store holds", held),
            ("tsspec_suffix_store_budget_tokens", "gauge", "the suffix store's token budget", self.budget),
            ("tsspec_suffix_store_sequences", "gauge", "earlier sequences the suffix store holds", seqs),
            ("tsspec_suffix_lookups_total", "counter", "suffix store lookups (one per proposal)", lookups),
            ("tsspec_suffix_hits_total", "counter", "lookups that found the sequence's suffix in the store", hits),
            ("tsspec_suffix_hit_ratio", "gauge", "hits per lookup so far", hits / lookups if lookups else 0.0),
        ]


class SuffixSpeculator:
    """n-gram over the sequence in hand, and suffix lookup over the engine's earlier sequences."""

    name = "suffix"
    default_min_draft_prob = 0.0  # n-gram's: the sequence's own lookup is n-gram's (``own``)
    needs_hidden_state = False
    can_arm_after_prefix_reuse = True  # the token history is complete whatever the KV cache did
    default_accept_rule = "match"

    def __init__(self, store: SuffixStore, max_draft_tokens: int = 8, min_draft_prob: float | None = None,
                 min_order: int = 2, max_order: int = 8, tree: int = 0) -> None:
        if tree < 0:
            raise ValueError(f"tree must be >= 0 nodes, got {tree}")
        self.store = store
        # the sequence in hand: n-gram's own index and its match-length rule (pmin), as n-gram keeps them
        self.own = NGramSpeculator(max_draft_tokens, None, min_order, max_order)
        self.min_draft_prob = min_draft_prob  # checked here, so that a bad value names suffix
        self.max_draft_tokens = max_draft_tokens
        self.tree = tree
        self._ended = True
        self.proposals = 0
        self.from_store = 0  # proposals drafted from earlier sequences
        self.from_self = 0  # proposals drafted from this sequence

    @property
    def taps(self) -> tuple[int, ...]:
        return ()

    @property
    def min_draft_prob(self) -> float:
        """``--spec-pmin``: held by ``own`` (it scales the required match length there), one value."""
        return self.own.min_draft_prob

    @min_draft_prob.setter
    def min_draft_prob(self, value: float | None) -> None:
        try:
            self.own.min_draft_prob = value
        except ValueError as e:  # the message names the speculator the user chose, not the one inside
            raise ValueError(str(e).replace(f"for {self.own.name}", f"for {self.name}")) from None

    def begin(self, prompt: Sequence[int], hidden: torch.Tensor | None) -> None:
        self.own.begin(prompt, hidden)
        self._ended = False

    def propose(self, ctx: DraftContext) -> Draft:
        own = self.own
        own.sync(ctx.history)
        self.proposals += 1
        k = min(ctx.max_tokens, self.max_draft_tokens)
        own_order, chain = own.index.lookup_order(k, own.required_order)
        order, conts = self.store.continuations(ctx.history, k, max(own.required_order, own_order + 1))
        if order > own_order and conts:
            tokens, parents = most_followed(conts, k, self.tree)
            if tokens:
                self.from_store += 1
                return Draft(tokens=tokens, parents=parents if self.tree else None)
        if chain:
            self.from_self += 1
        return Draft(tokens=chain)

    def commit(self, tokens: Sequence[int], hidden: torch.Tensor | None, start_pos: int) -> None:
        self.own.commit(tokens, hidden, start_pos)

    def end_sequence(self, tokens: Sequence[int]) -> None:
        """The sequence ended with ``tokens`` (prompt and output): into the store, once."""
        if not self._ended:
            self._ended = True
            self.store.add(tokens)

    def reset(self) -> None:
        self.own.reset()
        self._ended = True

    def report(self) -> str:
        s = self.store
        return (f"suffix: {self.proposals} proposals, {self.from_store} from earlier sequences, "
                f"{self.from_self} from this one; store {s.tokens} tokens of {s.sequences_added} sequences, "
                f"{s.hits}/{s.lookups} lookups found")
