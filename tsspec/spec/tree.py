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

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..sampling import Sampler, Stream, argmax, argmax_rows, keyed_uniform


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


def prune_indices(tokens: Sequence[int], parents: Sequence[int], max_nodes: int, max_depth: int,
                  drawable: int | None = None) -> list[int]:
    """The nodes ``prune`` keeps, as indices into the tree (increasing)."""
    keep: list[int] = []
    kept: set[int] = set()
    for i, (t, p, d) in enumerate(zip(tokens, parents, depths(parents))):
        if len(keep) >= max_nodes:
            break
        if d > max_depth or (p >= 0 and p not in kept) or (drawable is not None and not 0 <= t < drawable):
            continue
        keep.append(i)
        kept.add(i)
    return keep


def subtree(tokens: Sequence[int], parents: Sequence[int], keep: Sequence[int]) -> tuple[list[int], list[int]]:
    """The nodes ``keep`` (increasing, each one's parent kept too) as a tree, renumbered."""
    at = {i: j for j, i in enumerate(keep)}
    return [int(tokens[i]) for i in keep], [-1 if parents[i] < 0 else at[parents[i]] for i in keep]


def prune(tokens: Sequence[int], parents: Sequence[int], max_nodes: int, max_depth: int,
          drawable: int | None = None) -> tuple[list[int], list[int]]:
    """The tree cut to its first ``max_nodes`` tokens of depth at most ``max_depth`` (parents first,
    so what remains is still a tree), renumbered; with ``drawable``, a node whose id has no token
    (at or past it) goes, and everything under it (it can never be accepted)."""
    return subtree(tokens, parents, prune_indices(tokens, parents, max_nodes, max_depth, drawable))


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


def accept_stream(j: int) -> int:
    """The keyed stream of the residual rule's accept test for a node's child j (in order): a
    chain's (``Stream.ACCEPT``) for the first, one stream apart for each later one, so that no two
    tests of one position decide on the same number."""
    return int(Stream.ACCEPT) if j == 0 else int(Stream.SIBLING_ACCEPT) + 16 * (j - 1)


def walk_residual(logits: torch.Tensor, tokens: Sequence[int], parents: Sequence[int], probs: torch.Tensor,
                  sampler: Sampler, position: int, history: Sequence[int]) -> tuple[list[int], int]:
    """``walk`` under the residual rule, for sampling: recursive rejection over each node's
    children (SpecInfer's rule). ``probs[i]`` is the distribution node i's token was proposed
    from: the drafter's q where it was drawn from q, a one-hot where it was picked (a point mass).
    At a node the target is the trunk's distribution r; child i is accepted with probability
    min(1, r(x) / q_i(x)) (its own keyed number, ``accept_stream``), and on rejection r becomes
    max(0, r - q_i), renormalised (a point mass: r without x). When every child is rejected the
    token is drawn from what is left of r; at a leaf the bonus is a plain draw. Each token is then
    distributed exactly as the trunk's: as long as a child's proposal was made with numbers apart
    from the ones this rule and the trunk's plain draws use (``Stream.TREE_DRAFT``). A chain of one
    child a node accepts exactly what ``verify.verify_residual`` accepts."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        children.setdefault(p + 1, []).append(i)
    seed = sampler.params.seed
    hist = list(history)
    path: list[int] = []
    row = 0
    while True:
        pos = position + len(path)
        kids = children.get(row)
        if not kids:
            return path, sampler.sample(logits[row], pos, hist)
        r = sampler.probs(logits[row], hist)
        nxt = None
        for j, i in enumerate(kids):
            x, q = int(tokens[i]), probs[i]
            qx = float(q[x])
            if qx > 0 and keyed_uniform(seed, pos, accept_stream(j)) * qx < float(r[x]):
                nxt = i
                break
            left = torch.clamp(r - q, min=0.0)
            total = float(left.sum())
            if total > 0.0:  # else r == q up to rounding: any draw from r is exact
                r = left / total
        if nxt is None:
            return path, sampler.draw(r, pos, Stream.RESIDUAL)
        path.append(nxt)
        hist.append(int(tokens[nxt]))
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


def best_indices(parents: Sequence[int], scores: Sequence[float], budget: int) -> list[int]:
    """The ``budget`` best-scored nodes of a candidate tree, as increasing indices. A score is a
    node's chance of being reached (its parent's times its own), so a child never outscores its
    parent and the best nodes (ties to the earlier node) hold every ancestor of each: what EAGLE-2
    keeps of a tree its drafter grew. Pure."""
    keep: list[int] = []
    kept: set[int] = set()
    for i in sorted(sorted(range(len(parents)), key=lambda i: (-scores[i], i))[: max(budget, 0)]):
        if parents[i] >= 0 and parents[i] not in kept:  # a child scored above its parent: not a chance
            continue
        keep.append(i)
        kept.add(i)
    return keep


@dataclass
class Growth:
    """How a drafter grows a tree (``grow``): at most ``budget`` nodes and ``depth`` levels; each node
    proposes ``branch`` tokens, and the ``width`` best new nodes of a depth are expanded; a node less
    likely than ``floor`` to be reached is not proposed (``keep_first``: save the root's first);
    ``pmin`` > 0: a node whose drafter's top probability is below it proposes nothing."""

    budget: int
    depth: int
    width: int
    branch: int
    floor: float
    keep_first: bool = True
    pmin: float = 0.0


def grow(root: torch.Tensor, how: Growth, expand: Callable[[list[int], list[int], list[int]], torch.Tensor],
         sampler: Sampler | None, position: int, history: list[int] | None, stream: int,
         ) -> tuple[list[int], list[int], list[torch.Tensor | None]]:
    """A tree grown as EAGLE-2 grows one, from ``root`` (the drafter's logits [vocab] after the last
    emitted token). Each node proposes the ``branch`` tokens its drafter row finds likeliest (its own
    draw first: greedy, the argmax after the sampler's penalties; sampling, a keyed draw on
    ``stream`` at the node's position), each scored by the chance of reaching it (its parent's score
    times its probability; under sampling a node's own draw keeps its parent's score: the trunk draws
    at the same number on the plain stream and takes it wherever their distributions are close).
    At each depth the ``width`` best new nodes, scored above the budget's worst so far, are expanded:
    ``expand(nodes, tokens, parents)`` returns their drafter rows [len(nodes), vocab] (the tree so far
    in ``tokens``/``parents``). The draft is the best-scored ``budget`` nodes (``best_indices``).

    -> (tokens, parents, drawn_from) of the draft, ``drawn_from[i]`` the distribution node i was drawn
    from (sampling, its parent's own draw), else None (picked)."""
    sampling = sampler is not None and not sampler.greedy
    penalized = sampler is not None and sampler.params.has_penalties
    toks: list[int] = []
    pars: list[int] = []
    scores: list[float] = []
    drawn: list[torch.Tensor | None] = []
    frontier = [(-1, root)]
    for depth in range(how.depth):
        pos = position + depth  # the sequence position this depth's tokens take
        fresh = []
        for node, row in frontier:
            plain_q = None  # the row's own softmax, where the pmin test takes it (greedy reuses it)
            if how.pmin > 0.0:
                plain_q = torch.softmax(row.float(), dim=-1)
                if float(plain_q.max()) < how.pmin:
                    continue
            h = None
            if penalized:  # the penalties' window over this node's path
                path, at = [], node
                while at >= 0:
                    path.append(toks[at])
                    at = pars[at]
                h = list(history or ()) + path[::-1]
            if sampling:
                q = sampler.probs(row, h)
                first = sampler.draw(q, pos, stream)
            else:
                x = sampler.penalize(row, h) if penalized else row
                q = plain_q if plain_q is not None and not penalized else torch.softmax(x.float(), dim=-1)
                first = argmax(x)
            top = torch.topk(q, min(how.branch + 1, q.numel())).indices.tolist()
            above = 1.0 if node < 0 else scores[node]
            for t in [first, *(t for t in top if t != first)][: how.branch]:
                score = above if sampling and t == first else above * float(q[t])
                if (toks or not how.keep_first) and (score < how.floor or score <= 0.0):
                    continue
                toks.append(int(t))
                pars.append(node)
                scores.append(score)
                drawn.append(q if sampling and t == first else None)
                fresh.append(len(toks) - 1)
        if depth + 1 >= how.depth or not fresh:
            break
        # a node scored below the budget's worst so far cannot bring a child into the tree
        cut = sorted(scores, reverse=True)[how.budget - 1] if len(scores) >= how.budget else 0.0
        nodes = [i for i in sorted(fresh, key=lambda i: (-scores[i], i)) if scores[i] > cut][: how.width]
        if not nodes:
            break
        rows = expand(nodes, toks, pars)
        frontier = [(i, rows[r]) for r, i in enumerate(nodes)]
    keep = best_indices(pars, scores, how.budget)
    tokens, parents = subtree(toks, pars, keep)
    return tokens, parents, [drawn[i] for i in keep]


def proposals(tokens: Sequence[int], drawn_from: Sequence[torch.Tensor | None], vocab: int) -> torch.Tensor:
    """A grown tree's ``Draft.probs`` for the residual rule: row i the distribution node i was drawn
    from, or a one-hot where it was picked (a point mass, ``walk_residual``)."""
    rows = torch.zeros(len(tokens), vocab)
    for i, (t, q) in enumerate(zip(tokens, drawn_from)):
        if q is not None:
            rows[i] = q
        else:
            rows[i, t] = 1.0
    return rows


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
