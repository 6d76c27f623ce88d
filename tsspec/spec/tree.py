"""Token trees: several guesses verified in one forward, exactly.

A tree draft is ``tokens`` with ``parents``: token i's parent as an index among the tokens, -1 for
one that follows the last emitted token directly; parents come before their children, and siblings
carry distinct tokens (a trie). The trunk forwards ``[last, *tokens]`` as a tree (row 0 the last
token, row i + 1 token i, ``ForwardItem.parents``), so each row's logits are those a chain verify of
its path would give (the trunk's contract, tests/test_tree.py).

Acceptance (``walk``) starts at row 0 and at each row draws the trunk's token exactly as plain
decoding draws it at that position (greedy, or the seeded draw keyed on position and history); it
moves to the child holding that token, and where none does, the draw is the correction. Every token
emitted is a trunk draw at its position, so the output is plain decoding's, token for token. A chain
is the tree whose every token's parent is the one before, and ``walk`` then accepts exactly what
``verify.verify_match`` accepts.

Pure functions only: the loop (``loop.py``) drives them, the speculators build the trees.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..sampling import Sampler, argmax_rows


def check(tokens: Sequence[int], parents: Sequence[int]) -> None:
    """A ValueError unless ``parents`` make ``tokens`` a trie (parents first, distinct siblings)."""
    if len(tokens) != len(parents):
        raise ValueError(f"a tree of {len(tokens)} tokens needs as many parents, got {len(parents)}")
    seen = set()
    for i, (t, p) in enumerate(zip(tokens, parents)):
        if not -1 <= p < i:
            raise ValueError(f"tree token {i}: parent {p} does not come before it")
        if (p, t) in seen:
            raise ValueError(f"tree token {i}: a sibling already holds token {t}")
        seen.add((p, t))


def depths(parents: Sequence[int]) -> list[int]:
    """Each token's depth: 1 for a child of the last emitted token."""
    d: list[int] = []
    for p in parents:
        d.append(1 if p < 0 else d[p] + 1)
    return d


def prune(tokens: Sequence[int], parents: Sequence[int], max_nodes: int, max_depth: int,
          drawable: int | None = None) -> tuple[list[int], list[int]]:
    """The tree cut to its first ``max_nodes`` tokens of depth at most ``max_depth`` (parents first,
    so what remains is still a tree), renumbered; with ``drawable``, a node whose id has no token
    (at or past it) goes, and everything under it (it can never be accepted)."""
    keep: dict[int, int] = {}
    toks, pars = [], []
    for i, (t, p, d) in enumerate(zip(tokens, parents, depths(parents))):
        if len(toks) >= max_nodes:
            break
        if d > max_depth or (p >= 0 and p not in keep) or (drawable is not None and not 0 <= t < drawable):
            continue
        keep[i] = len(toks)
        toks.append(int(t))
        pars.append(-1 if p < 0 else keep[p])
    return toks, pars


def path_tokens(tokens: Sequence[int], parents: Sequence[int], path: Sequence[int]) -> list[int]:
    return [int(tokens[i]) for i in path]


def walk(logits: torch.Tensor, tokens: Sequence[int], parents: Sequence[int], sampler: Sampler, position: int,
         history: Sequence[int]) -> tuple[list[int], int]:
    """The accepted path (token indices, root first) and the token drawn after it (the correction,
    or the bonus at a leaf). ``logits`` [1 + len(tokens), vocab]: row 0 the last emitted token's,
    row i + 1 token i's; ``position``: where the first drafted token sits; ``history``: the tokens
    before it (prompt and emitted, the last included)."""
    children: dict[int, dict[int, int]] = {}
    for i, (t, p) in enumerate(zip(tokens, parents)):
        children.setdefault(p + 1, {})[int(t)] = i
    greedy = sampler.greedy and not sampler.params.has_penalties
    drawn = argmax_rows(logits) if greedy else None  # every row at once: a plain step's argmax
    hist = list(history)
    path: list[int] = []
    row = 0
    while True:
        tok = drawn[row] if greedy else sampler.sample(logits[row], position + len(path), hist)
        nxt = children.get(row, {}).get(tok)
        if nxt is None:
            return path, tok
        path.append(nxt)
        hist.append(tok)
        row = nxt + 1


# a sibling leaf's least chance of being the trunk's token, where the governor has no gate yet
SIBLING_MIN = 0.05


def sibling_leaves(chain: Sequence[int], chances: Sequence[tuple[float, float, int]], nodes: int,
                   floor: float) -> tuple[list[int], list[int]]:
    """A chain with sibling leaves, as a tree draft ``(tokens, parents)``: ``chances[i]`` is, at
    depth i, the drafter's probability of the chain's token, and its best other token with that
    token's probability ``(p_chain, p_other, other)``. A sibling's score is the product of the chain's
    probabilities above it times its own; the best scores of at least ``floor`` join as leaves, the
    whole tree at most ``nodes`` tokens (the chain first, cut to ``nodes``). Pure."""
    chain = [int(t) for t in chain[:max(nodes, 0)]]
    tokens, parents = list(chain), [i - 1 for i in range(len(chain))]
    scored, above = [], 1.0
    for i, (p_chain, p_other, other) in enumerate(chances[: len(chain)]):
        score = above * p_other
        if score >= floor and other != chain[i]:
            scored.append((score, i, int(other)))
        above *= p_chain
    for _, i, other in sorted(scored, key=lambda x: (-x[0], x[1]))[: max(nodes - len(chain), 0)]:
        tokens.append(other)
        parents.append(i - 1)
    return tokens, parents


class Trie:
    """A tree draft built by inserting chains (continuations), sharing common prefixes, up to a
    node budget; insertion order is the order the nodes take."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self._child: dict[tuple[int, int], int] = {}

    @property
    def full(self) -> bool:
        return len(self.tokens) >= self.budget

    def insert(self, chain: Sequence[int]) -> None:
        """Add ``chain`` below the root, as far as the budget allows."""
        at = -1
        for t in chain:
            key = (at, int(t))
            nxt = self._child.get(key)
            if nxt is None:
                if self.full:
                    return
                nxt = len(self.tokens)
                self.tokens.append(int(t))
                self.parents.append(at)
                self._child[key] = nxt
            at = nxt
