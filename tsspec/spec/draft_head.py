"""Per-token draft-head speculation (NextN/MTP; EAGLE-shaped heads fit unchanged).

Contract:

* The head chains its own hidden output one token per pass: draft d1 from (last token, the trunk
  row that produced it), d2 from (d1, the head's own output), and so on.
* Confidence gate: a draft token is proposed only while the head's top-1 probability, computed over
  its top-10 logits (as llama.cpp's MTP draft sampler does), is at least ``min_draft_prob``
  (``--spec-pmin``, default 0.75). A head may bring its own choice instead: ``pick(logits) ->
  (token, confidence)`` (a head scoring a reduced vocabulary maps its argmax to a trunk id and
  reads its calibrated softmax), compared cumulatively when ``cumulative_gate`` (draft while the
  chance that every draft so far lands stays at least ``min_draft_prob``), with its own
  ``default_min_draft_prob``. A head that gates cumulatively (its confidences are calibrated: a
  trained head, whose softmax is how often its drafts land) and was given no ``--spec-pmin`` gates
  instead at the cost governor's gate once the governor has measured one (``DraftContext.min_prob``:
  the least chance of landing for which a drafted token pays at the measured cost of a row, low on a
  trunk whose verify rows are cheap). Under greedy decoding a draft is the head's argmax. Under sampling it
  is drawn from the head's distribution after the sampler's transforms (over the trunk's vocabulary:
  ``trunk_logits`` maps a reduced one), on the position's stream ``DRAFT_STREAM``, and the draft
  carries that q, so the ``residual`` rule can use it; the default ``match`` rule keeps the output
  identical to plain decoding either way.
* Catch-up is folded: the head's cache rows for the tokens that landed since the last proposal are
  rewritten from the trunk's exact hidden rows in the SAME forward as the first draft step (one
  head forward over n_accepted + 1 rows, as llama.cpp runs its MTP block), so no separate catch-up
  call is made. ``head_len`` is how many head-cache rows are exact; it equals the trunk's committed
  length after every proposal.
* Token trees (``tree`` nodes, ``--spec-tree``): a head whose step reads only its token and its
  parent's hidden row (``independent_rows``: an EAGLE-shaped head) grows its tree as a draft model
  does (``tree.grow``): the best new nodes of a depth step together in one ``step_rows``, a node
  drafted while its chance of being reached is at least the gate. Another head (a NextN layer, with
  its own cache) names at each depth its best other token (over the trunk's vocabulary), and the
  likeliest of those join the chain as sibling leaves (``tree.sibling_leaves``).
* It reads the residual after the trunk's last layer (``taps = (n_layers,)``) and cannot arm after a
  reused KV prefix: a head that never saw the prefix's hidden rows would chain garbage.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..sampling import Stream, argmax, best_other

DRAFT_STREAM = Stream.PLAIN  # common random numbers with the trunk's plain draw, as a draft model's
from .protocols import Draft, DraftContext, DraftHeadKind, MinDraftProb
from .tree import SIBLING_MIN, Growth, grow, sibling_leaves

TOP_K_GATE = 10
DEFAULT_PMIN = 0.75
# a grown tree (a head whose rows are independent): the best TREE_WIDTH new nodes of a depth step
# together, each proposing its TREE_BRANCH likeliest tokens (as a draft model's trees)
TREE_WIDTH = 3
TREE_BRANCH = 3


def gate_confidence(logits: torch.Tensor) -> float:
    """Top-1 probability over the top-10 logits [vocab]."""
    return pick_top(logits)[1]


def pick_top(logits: torch.Tensor) -> tuple[int, float]:
    """(argmax, top-1 probability over the top-10 logits) from one top-k pass over [vocab]; the
    argmax is the lowest index among tied maxima, as ``torch.argmax`` gives it."""
    top = torch.topk(logits.float(), min(TOP_K_GATE, logits.numel()))
    v = top.values
    tok = int(top.indices[0]) if v.numel() == 1 or v[0] > v[1] else argmax(logits)
    return tok, float(torch.softmax(v, dim=-1)[0])


class DraftHeadSpeculator:
    name = "draft-head"
    min_draft_prob = MinDraftProb()
    default_min_draft_prob = DEFAULT_PMIN
    needs_hidden_state = True
    can_arm_after_prefix_reuse = False  # the head's cache needs every position's trunk row
    default_accept_rule = "match"

    def __init__(self, head, n_layers: int, max_draft_tokens: int = 8, min_draft_prob: float | None = None,
                 tree: int = 0, sibling_min: float = SIBLING_MIN):
        if max_draft_tokens < 1:
            raise ValueError(f"max_draft_tokens must be >= 1, got {max_draft_tokens}")
        if tree < 0:
            raise ValueError(f"tree must be >= 0 nodes, got {tree}")
        self.tree = tree  # node budget of a tree draft (0: chains)
        self.sibling_min = sibling_min  # a sibling's least chance where the governor has no gate
        self.head = head  # weights; this sequence's head cache is ``state``
        self.state = head.new_state()
        self.n_layers = n_layers
        self.max_draft_tokens = max_draft_tokens
        self._cumulative = bool(getattr(head, "cumulative_gate", False))
        # --spec-pmin given: it holds. Else a head that gates cumulatively (its confidences multiply
        # as chances of landing: calibrated) gates at the cost governor's measured gate
        # (DraftContext.min_prob) once there is one, and at its own default until then.
        self.gate_follows_cost = min_draft_prob is None and self._cumulative
        if min_draft_prob is None:  # the head's own default, else the algorithm's
            min_draft_prob = getattr(head, "default_min_draft_prob", None)
        self.min_draft_prob = min_draft_prob  # validated; None: the default
        self._pick = getattr(head, "pick", pick_top)
        self._from_trunk = getattr(head, "from_trunk", lambda rows: rows)
        self._trunk_logits = getattr(head, "trunk_logits", lambda logits: logits)
        # a head whose step reads only its token and its parent's row grows its trees (several
        # nodes a step); another hangs its second guesses beside its chain as leaves
        self.grows = bool(getattr(head, "independent_rows", False)) and hasattr(head, "step_rows")
        # counters one report line can print
        self.proposals = 0
        self.head_calls = 0
        self.drafted = 0
        self.gated = 0  # proposals cut short by the confidence gate
        self.reset()

    @classmethod
    def build(cls, target, head, options, tree: int = 0):
        """The speculator, or a decline reason an operator can act on."""
        if getattr(head, "kind", None) is not DraftHeadKind.PER_TOKEN:
            return "the draft head is not a per-token (NextN/MTP) head"
        return cls(head, target.n_layers, max_draft_tokens=options.draft, min_draft_prob=options.pmin, tree=tree)

    @property
    def taps(self) -> tuple[int, ...]:
        return (self.n_layers,)

    # -- state: exact trunk rows not yet folded into the head ------------------------------------
    # Rows are kept as the trunk tapped them and mapped by the head's ``from_trunk`` only when a
    # proposal takes them: a parked stretch pays one list append per token, not a norm.
    def reset(self) -> None:
        self._rows: list[torch.Tensor] = []  # tapped trunk rows for positions _base, _base+1, ...
        self._base = 0
        self.head_len = 0  # head-cache rows 0..head_len-1 are exact
        self._gap = False
        self.state.reset()

    def begin(self, prompt: Sequence[int], hidden: torch.Tensor | None) -> None:
        self.reset()
        if hidden is None:
            self._gap = True
            return
        self._rows = list(hidden)

    def commit(self, tokens: Sequence[int], hidden: torch.Tensor | None, start_pos: int) -> None:
        if hidden is None or start_pos != self._base + len(self._rows):
            self._gap = True  # a position the head never saw: stop drafting until the next begin
            return
        self._rows.extend(hidden)  # as tapped; mapped into the head's space when a proposal takes them

    def _take(self, lo: int, hi: int) -> torch.Tensor:
        return self._from_trunk(torch.stack(self._rows[lo - self._base : hi - self._base]))

    # -- proposing ------------------------------------------------------------------------------
    def propose(self, ctx: DraftContext) -> Draft:
        self.proposals += 1
        P = ctx.position  # ctx.last_token takes this position; trunk rows exist for 0..P-1
        if self._gap or self._base + len(self._rows) < P or self.head_len >= P:
            return Draft()
        lo = self.head_len
        tokens = [int(t) for t in ctx.history[lo + 1 : P + 1]]  # positions lo+1 .. P (last included)
        logits, h = self.head.catch_up_and_step(tokens, self._take(lo, P), lo + 1, self.state)
        self.head_calls += 1
        self.head_len = P
        # rows below P are folded into the head cache; keep only what the next catch-up needs
        self._rows = self._rows[P - self._base :]
        self._base = P
        k = min(ctx.max_tokens, self.max_draft_tokens)
        sampler = ctx.sampler
        sampling = sampler is not None and not sampler.greedy
        gate = ctx.min_prob if self.gate_follows_cost and ctx.min_prob is not None else self.min_draft_prob
        if self.tree and self.grows and self._cumulative:
            penalized = sampler is not None and sampler.params.has_penalties
            return self._grow(ctx, logits, h, k, gate, sampler.draft_history(ctx.history) if penalized else None)
        hist = sampler.draft_history(ctx.history) if sampling else None
        out: list[int] = []
        probs: list[torch.Tensor] = []
        chances: list[tuple[float, float, int]] = []  # per depth, for the tree's sibling leaves
        chance = 1.0
        while True:
            tok, p = self._pick(logits)
            chance = chance * p if self._cumulative else p
            if chance < gate:
                self.gated += 1
                break
            if sampling:  # drawn from q, the distribution the residual rule corrects for
                q = sampler.probs(self._trunk_logits(logits), hist)
                tok = sampler.draw(q, P + 1 + len(out), DRAFT_STREAM)
                probs.append(q)
                hist.append(tok)
            if self.tree:
                chances.append(best_other(q if sampling else torch.softmax(self._trunk_logits(logits).float(), -1), tok))
            out.append(tok)
            if len(out) >= k:
                break
            logits, h = self.head.draft_step(tok, h, P + len(out), self.state)
            self.head_calls += 1
        self.drafted += len(out)
        if self.tree and out:
            floor = ctx.min_prob if ctx.min_prob is not None else self.sibling_min
            nodes, parents = sibling_leaves(out, chances, self.tree, floor)
            if len(nodes) != len(out):  # siblings joined (or the chain was cut to the budget)
                return Draft(nodes, None, parents=parents)
        return Draft(out, torch.stack(probs) if probs else None)

    def _grow(self, ctx: DraftContext, logits: torch.Tensor, h: torch.Tensor, k: int, gate: float,
              hist: list[int] | None) -> Draft:
        """A tree grown as a draft model grows one (``tree.grow``): the best new nodes of a depth step
        together (``step_rows`` on their tokens and their parents' hidden rows), a node drafted
        while its chance of being reached is at least the gate, as the chain's cumulative gate
        reads it."""
        hs = {-1: h}

        def expand(nodes: list[int], toks: list[int], pars: list[int]) -> torch.Tensor:
            rows, hnew = self.head.step_rows([toks[i] for i in nodes], torch.stack([hs[pars[i]] for i in nodes]))
            self.head_calls += 1
            for r, i in enumerate(nodes):
                hs[i] = hnew[r]
            return torch.stack([self._trunk_logits(x) for x in rows])

        how = Growth(self.tree, k, TREE_WIDTH, TREE_BRANCH, gate, keep_first=False)
        tokens, parents, _ = grow(self._trunk_logits(logits), how, expand, ctx.sampler, ctx.position + 1, hist,
                                  DRAFT_STREAM)
        self.drafted += len(tokens)
        if not tokens:
            self.gated += 1
            return Draft()
        return Draft(tokens, None, parents=parents)
