"""Suffix speculation: draft from what this engine has already read and written, across requests.

An agent loop repeats its tool-call JSON, its boilerplate and its own earlier answers from request
to request; n-gram lookup sees only the sequence in hand. The suffix speculator also looks up the
current suffix in a store of the earlier sequences (prompt and output) of the same engine: a
``generate --prompts`` batch, a chat, a bench configuration, a server's lifetime.

Contract:

* ``SuffixStore`` holds finished sequences, oldest first, up to ``budget`` tokens (the oldest are
  evicted, and the index rebuilt, when the budget is passed). Its index is an ``NGramIndex`` over
  the sequences laid end to end with a separator that is no token, so no n-gram spans two of them.
  One lock guards it: a reader never sees a half-added sequence.
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
from collections import deque
from typing import Sequence

import torch

from .ngram import NGramIndex, NGramSpeculator
from .protocols import Draft, DraftContext, MinDraftProb

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


class SuffixStore:
    """Earlier sequences of one engine, indexed for suffix lookups; bounded, thread-safe."""

    def __init__(self, budget: int = DEFAULT_BUDGET, min_order: int = 2, max_order: int = 8) -> None:
        if budget < 1:
            raise ValueError(f"budget must be >= 1 token, got {budget}")
        self.budget = budget
        self._lock = threading.Lock()
        self._seqs: deque[list[int]] = deque()
        self._index = NGramIndex(min_order, max_order, periodic=False)
        self.sequences_added = 0
        self.lookups = 0
        self.hits = 0

    @property
    def tokens(self) -> int:
        """Tokens held (separators not counted)."""
        with self._lock:
            return sum(len(s) for s in self._seqs)

    def add(self, tokens: Sequence[int]) -> None:
        """A finished sequence (prompt and output); the oldest go when the budget is passed."""
        seq = [int(t) for t in tokens][-self.budget :]
        if not seq:
            return
        with self._lock:
            self._seqs.append(seq)
            self.sequences_added += 1
            held = sum(len(s) for s in self._seqs)
            if held > self.budget:
                while held > self.budget:
                    held -= len(self._seqs.popleft())
                self._index.clear()
                for s in self._seqs:
                    self._index.extend(s)
                    self._index.append(SEPARATOR)
            else:
                self._index.extend(seq)
                self._index.append(SEPARATOR)

    def continuations(self, history: Sequence[int], depth: int, min_order: int, per_match: int = 32
                      ) -> tuple[int, list[list[int]]]:
        """``(n, conts)``: for the longest suffix of ``history`` of order >= ``min_order`` found in
        the store, what followed its newest ``per_match`` occurrences (each up to ``depth`` tokens,
        cut at the end of its sequence); ``(0, [])`` when none is found."""
        idx = self._index
        with self._lock:
            self.lookups += 1
            lo = max(min_order, idx.min_order)
            tail = [int(t) for t in history[-idx.max_order :]]
            for n in range(min(idx.max_order, len(tail)), lo - 1, -1):
                ends = idx._ends[n - idx.min_order].get(tuple(tail[len(tail) - n :]))
                if not ends:
                    continue
                conts = []
                for e in reversed(ends[-per_match:]):
                    cont = []
                    for j in range(e, min(e + depth, len(idx))):
                        t = idx[j]
                        if t == SEPARATOR:
                            break
                        cont.append(t)
                    if cont:
                        conts.append(cont)
                if conts:
                    self.hits += 1
                    return n, conts
            return 0, []


class SuffixSpeculator:
    """n-gram over the sequence in hand, and suffix lookup over the engine's earlier sequences."""

    name = "suffix"
    min_draft_prob = MinDraftProb()
    default_min_draft_prob = 0.0
    needs_hidden_state = False
    can_arm_after_prefix_reuse = True  # the token history is complete whatever the KV cache did
    default_accept_rule = "match"

    def __init__(self, store: SuffixStore, max_draft_tokens: int = 8, min_draft_prob: float | None = None,
                 min_order: int = 2, max_order: int = 8, tree: int = 0) -> None:
        if tree < 0:
            raise ValueError(f"tree must be >= 0 nodes, got {tree}")
        self.store = store
        # the sequence in hand: n-gram's own index and its match-length rule (pmin), as n-gram keeps them
        self.own = NGramSpeculator(max_draft_tokens, min_draft_prob, min_order, max_order)
        self.max_draft_tokens = max_draft_tokens
        self.min_draft_prob = min_draft_prob
        self.tree = tree
        self._ended = True
        self.proposals = 0
        self.from_store = 0  # proposals drafted from earlier sequences
        self.from_self = 0  # proposals drafted from this sequence

    @property
    def taps(self) -> tuple[int, ...]:
        return ()

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
