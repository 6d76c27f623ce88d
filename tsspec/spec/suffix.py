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
* Where neither the sequence nor the store has a suffix to match (just past a value the earlier
  sequences never held: a new city, a new address), the speculator **follows** the stored sequence
  its last store draft came from: it finds its newest token a little further along that sequence
  (``FOLLOW_WINDOW`` tokens; its previous token too where it can) and drafts what came after it
  there. An agent's second weather request after ``"city": "Oslo`` drafts ``", "unit": "`` from the
  first one's ``"city": "Lisbon", "unit": "celsius"``, where a suffix match needs two tokens of the
  new text before it finds anything.
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

__all__ = ["SuffixStore", "SuffixSpeculator", "most_followed", "DEFAULT_BUDGET", "FOLLOW_WINDOW"]

DEFAULT_BUDGET = 1 << 16  # tokens of earlier sequences kept
SEPARATOR = -1  # between sequences in the store's index: no token, so no n-gram spans two
# how far along the followed sequence its newest token is looked for: past a drafted window (8) and
# the new text a request writes in place of the stored one (the agent workload's values, 1-6 tokens)
FOLLOW_WINDOW = 16


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

    def read(self, start: int, depth: int) -> list[int]:
        """Up to ``depth`` tokens from ``start``, never past its sequence's end."""
        idx = self.index
        cont = []
        for j in range(start, min(start + depth, len(idx))):
            t = idx[j]
            if t == SEPARATOR:
                break
            cont.append(t)
        return cont

    def continuations(self, suffix: tuple[int, ...], depth: int, limit: int) -> list[tuple[list[int], int]]:
        """What followed the newest ``limit`` occurrences of ``suffix`` here, newest first, each up to
        ``depth`` tokens and never past its sequence's end, with where it starts."""
        out = []
        for e in reversed(self.index.ends_of(suffix)[-limit:] if limit > 0 else ()):
            cont = self.read(e, depth)
            if cont:
                out.append((cont, e))
        return out

    def find(self, start: int, last: int, prev: int | None, window: int) -> int | None:
        """Where ``last`` next occurs from ``start`` on, within ``window`` tokens and its sequence:
        the first occurrence after ``prev`` if there is one, else the first; None where it does not."""
        idx = self.index
        first = None
        for j in range(start, min(start + window, len(idx))):
            t = idx[j]
            if t == SEPARATOR:
                break
            if t == last:
                if prev is None or (j > 0 and idx[j - 1] == prev):
                    return j
                if first is None:
                    first = j
        return first


Anchor = tuple[_Generation, int]  # a place in the store: a generation and a position in its index


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

    def lookup(self, history: Sequence[int], depth: int, min_order: int, per_match: int = 32
               ) -> tuple[int, list[tuple[list[int], Anchor]]]:
        """``(n, found)``: for the longest suffix of ``history`` of order >= ``min_order`` found in the
        store, what followed its newest ``per_match`` occurrences (each up to ``depth`` tokens, cut at
        the end of its sequence), newest first, each with its ``Anchor`` (where it starts in the
        store, for ``follow``); ``(0, [])`` when none is found."""
        with self._lock:
            self.lookups += 1
            lo = max(min_order, self.min_order)
            tail = tuple(int(t) for t in history[-self.max_order :])
            for n in range(min(self.max_order, len(tail)), lo - 1, -1):
                suffix = tail[len(tail) - n :]
                found = [(c, (self._young, e)) for c, e in self._young.continuations(suffix, depth, per_match)]
                found += [(c, (self._old, e))
                          for c, e in self._old.continuations(suffix, depth, per_match - len(found))]
                if found:
                    self.hits += 1
                    return n, found
            return 0, []

    def follow(self, anchor: "Anchor", history: Sequence[int], depth: int, window: int = FOLLOW_WINDOW
               ) -> tuple[list[int], "Anchor | None"]:
        """``(draft, anchor)``: along the stored sequence at ``anchor``, the next occurrence of
        ``history``'s last token within ``window`` tokens (after its previous token where one such
        is there) and up to ``depth`` tokens that followed it, with the anchor of the draft's first
        token; ``([], anchor)`` where the token is not there (new text goes on: the place is
        kept); ``([], None)`` where the anchor's generation has been dropped since (so that no
        speculator holds a dropped generation's memory past its next proposal)."""
        gen, start = anchor
        last = int(history[-1])
        prev = int(history[-2]) if len(history) > 1 else None
        with self._lock:
            if gen is not self._young and gen is not self._old:
                return [], None
            j = gen.find(start, last, prev, window)
            draft = gen.read(j + 1, depth) if j is not None else []
        return (draft, (gen, j + 1)) if draft else ([], anchor)

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
        self._anchor: Anchor | None = None  # where the last store draft began: what ``follow`` reads on from
        self.proposals = 0
        self.from_store = 0  # proposals drafted from earlier sequences
        self.followed = 0  # of them, drafted by following a stored sequence past new text
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
        self._anchor = None

    def propose(self, ctx: DraftContext) -> Draft:
        own = self.own
        own.sync(ctx.history)
        self.proposals += 1
        k = min(ctx.max_tokens, self.max_draft_tokens)
        own_order, chain = own.index.lookup_order(k, own.required_order)
        order, found = self.store.lookup(ctx.history, k, max(own.required_order, own_order + 1))
        if order > own_order and found:
            tokens, parents = most_followed([c for c, _ in found], k, self.tree)
            if tokens:
                self.from_store += 1
                # the newest occurrence that went on with the draft's first token: the one to follow
                self._anchor = next(a for c, a in found if c[0] == tokens[0])
                return Draft(tokens=tokens, parents=parents if self.tree else None)
        if chain:
            self.from_self += 1
            return Draft(tokens=chain)
        if self._anchor is not None:
            tokens, self._anchor = self.store.follow(self._anchor, ctx.history, k)
            if tokens:
                self.from_store += 1
                self.followed += 1
                return Draft(tokens=tokens)
        return Draft(tokens=[])

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
        self._anchor = None

    def report(self) -> str:
        s = self.store
        return (f"suffix: {self.proposals} proposals, {self.from_store} from earlier sequences, "
                f"{self.from_self} from this one, {self.followed} by following an earlier one; "
                f"store {s.tokens} tokens of {s.sequences_added} sequences, {s.hits}/{s.lookups} lookups found")
