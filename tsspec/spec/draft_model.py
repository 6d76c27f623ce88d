"""A separate draft model: a small language model with the trunk's vocabulary drafts, the trunk verifies.

Contract:

* The drafter is a full ``TransformerModel`` (weights) with this speculator's own cache. The cache
  holds a stretch of the committed sequence (prompt + tokens the trunk kept) starting at
  ``offset``, followed, during a propose, by the tokens it is drafting. ``commit`` trims it to the
  longest prefix that is still committed; committed tokens it has not seen yet are *pending*.
* Lazy and windowed: ``begin`` forwards nothing. The first ``propose`` catches up, and a catch-up
  longer than ``context`` tokens (the first one after a long prompt, the first after a long parked
  stretch, a sequence outgrowing the drafter's context) restarts the drafter's cache on the last
  ``context`` tokens only (drafter positions count from ``offset``). A drafter the governor keeps
  parked thus costs nothing, and every (re)start costs at most ``context`` drafter rows, which the
  governor sees in the step that pays them.
* ``propose`` forwards the pending tokens together with ``ctx.last_token`` in one multi-row
  forward (the catch-up folded into the first draft step: after a fully accepted draft the last
  draft token and the trunk's bonus token go through together), then drafts autoregressively,
  one row per token, up to ``ctx.max_tokens``.
* A recurrent drafter (a hybrid such as Qwen 3.5, whose state cannot step back over one-row
  forwards) keeps a copy of its state after each catch-up (``HybridCache.snapshot``) and returns to
  it at the commit when drafts were rejected; the drafts that landed go through again with the next
  catch-up (it trimmed its cache as an attention drafter does, and stopped with an error at the
  first rejected draft).
* Early stop (``min_draft_prob``, ``--spec-pmin``): before a token is added to the draft, the
  top-1 probability of the drafter's own softmax (temperature 1, no sampler transforms) must
  reach ``min_draft_prob``; otherwise the draft ends there. The default is 0.0 (never stop
  early): on the Qwen2.5-Coder 0.5B -> 1.5B pair the drafter agrees on ~90% of code tokens, and a
  rejected tail costs the trunk little (a 5-9 row verify costs about a 1-row step) while a drafter
  step costs about a third of one, so the window, not pmin, is the knob
  (``scripts/bench_draft_model.py --pmin`` measures other values; not yet swept on prose).
* Under greedy decoding the drafted token is the argmax (after the sampler's penalties, if any)
  and ``Draft.probs`` is None: verification is ``match`` and needs no distribution. Under
  sampling, ``Draft.probs[i]`` is ``ctx.sampler.probs(logits_i, history + drafts[:i])``: the
  drafter's distribution after the very transforms the trunk's rows get, which is what the
  ``residual`` rule needs. The token is drawn from it with the keyed draw of ``Sampler.draw`` at
  its own position on stream ``DRAFT_STREAM``.
* ``DRAFT_STREAM`` is 0, the stream a plain draw of that position uses: the drafter and the trunk
  then invert their CDFs at the same uniform (common random numbers), so under ``match`` they pick
  the same token whenever their distributions are close, with no effect on the output (``match``
  emits the trunk's own draws). For ``residual`` the draft stays independent of the accept (1)
  and residual (2) streams, and a position's stream-0 number decides nothing emitted until that
  position is drafted or drawn for real, so the rule stays exact (``tests/test_residual.py``).
* Token trees (``tree`` nodes, ``--spec-tree``; 0: chains) grow as EAGLE-2 grows them
  (``_grow``): every node proposes the drafter's ``TREE_BRANCH`` likeliest next tokens (its own
  draw first, the chain's token), scored by the chance of reaching them (the drafter's
  probabilities down the path); at each depth the ``TREE_WIDTH`` best new nodes go through the
  drafter in one forward whose rows attend to their ancestors' rows, written by the forwards
  before it (``ForwardItem.base``); the draft is the best-scored nodes within the budget, none less
  likely than the governor's gate (``DraftContext.min_prob``, else ``SIBLING_MIN``) but the root's
  first. So where the drafter's first guess is wrong and its second right, the branch under the
  second is drafted too. The tree's rows stay in the drafter's cache: ``commit`` moves the
  accepted path's into place (``KVCache.keep_path``) and drops the rest. A drafter that cannot
  forward trees (a recurrent one) drafts chains. Under ``residual`` a sampled tree carries each
  node's proposal distribution (``Draft.probs``: q where the node is the drafter's own draw, made
  on ``Stream.TREE_DRAFT``, a one-hot where it was picked beside it), and the loop verifies it by
  recursive rejection over siblings (``tree.walk_residual``).
* A cut vocabulary (``head_prefix``, ``TSSPEC_DRAFT_VOCAB``; 0: the whole one): the drafter's LM
  head computes only the first ``head_prefix`` ids (byte-pair vocabularies number the common tokens
  first) and the ids of the sequence's prompt and of every token the trunk wrote since (from its
  commit on), the rest -inf (``models.head_rows.HeadRows``), so it never drafts an id outside them
  and a drafter step streams less of its head. Where the trunk writes many ids the cut lacked (more
  than ``MISS_SHARE`` of its last tokens: text in another script), the head goes whole for the rest
  of the sequence. Drafts stay guesses the trunk verifies: output is unchanged; under sampling
  ``Draft.probs`` is the distribution over the kept ids, the one the draft was drawn from.
* ``default_accept_rule`` is ``match``: output identical to plain decoding, greedy or seeded.
  ``--spec-accept residual`` accepts more under sampling and keeps the trunk's distribution, but
  a seeded run no longer reproduces the plain run's text.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Sequence

import torch

from ..models.cache import common_prefix
from ..models.head_rows import HeadRows
from ..sampling import Stream, argmax
from .protocols import Draft, DraftContext, MinDraftProb
from .tree import SIBLING_MIN, Growth, grow, proposals

PREFILL_CHUNK = 256
# drafter rows a (re)start forwards at most. A catch-up over a whole prompt cost 10-20% of an
# end-to-end call (qwen2.5-coder 0.5B drafting for 1.5B, 48 tokens), but a drafter cut to the last
# 64 tokens agreed with an identical trunk on only half its drafts (tiny random models, whose every
# token depends on the whole context): the window bounds the cost of a restart without cutting
# ordinary prompts short
DEFAULT_CONTEXT = 256
DRAFT_STREAM = Stream.PLAIN  # see module doc: common random numbers with the trunk's plain draw
DEFAULT_MIN_DRAFT_PROB = 0.0
# a tree's growth per depth: the best ``TREE_WIDTH`` nodes of the newest depth go through the
# drafter together (one forward of that many rows), each proposing its ``TREE_BRANCH`` likeliest
# next tokens
TREE_WIDTH = 3
TREE_BRANCH = 3
# drafter forwards of at least this many rows (catch-ups over a prompt or a parked stretch) are
# marked as prompt rows, so that they take the prompt routes where those are on
# (``TSSPEC_PROMPT_TILES=1``): a drafter's rows never reach the output, so either arithmetic
# serves it. Fewer rows keep the shared products, which the routes beat only from between 17 and 33
# rows (a forward on a 128-token cache, AMX Xeon, scripts/route_verify_curve.py: qwen2.5-coder-0.5b
# 1.21x the shared time at 17 rows, 0.85x at 33; smollm2-135m 1.27x and 0.95x; docs/RESULTS.md)
ROUTE_ROWS = 32
DEFAULT_HEAD_PREFIX = 65536  # the first ids a drafter chooses among besides its sequence's (0: all)
# a cut head goes whole for the rest of a sequence where more than ``MISS_SHARE`` of the last
# ``MISS_WINDOW`` tokens the trunk wrote (at least ``MISS_MIN`` of them) were outside it when they
# came, so that no draft could have had them (text in another script: qwen2.5's CJK tokens sit
# past id 100,000). A prompt's rare ids are not counted: they are kept from ``begin`` on
MISS_WINDOW = 256
MISS_MIN = 32
MISS_SHARE = 0.03


class DraftModelSpeculator:
    """Drafts with a small language model that shares the trunk's token ids."""

    name = "draft-model"
    min_draft_prob = MinDraftProb()
    default_min_draft_prob = DEFAULT_MIN_DRAFT_PROB
    needs_hidden_state = False
    can_arm_after_prefix_reuse = True  # its cache restarts on the last `context` tokens of any history
    default_accept_rule = "match"

    def __init__(self, model, *, vocab_size: int, max_draft_tokens: int = 8,
                 min_draft_prob: float | None = None, context: int = DEFAULT_CONTEXT, tree: int = 0,
                 sibling_min: float = SIBLING_MIN, tree_width: int = TREE_WIDTH,
                 tree_branch: int = TREE_BRANCH, residual: bool = False, head_prefix: int = 0) -> None:
        if max_draft_tokens < 1:
            raise ValueError(f"max_draft_tokens must be >= 1, got {max_draft_tokens}")
        if context < 1:
            raise ValueError(f"context must be >= 1, got {context}")
        if tree < 0:
            raise ValueError(f"tree must be >= 0 nodes, got {tree}")
        if head_prefix < 0:
            raise ValueError(f"head_prefix must be >= 0 ids (0: the whole vocabulary), got {head_prefix}")
        if tree_width < 1 or tree_branch < 1:
            raise ValueError(f"a tree grows by >= 1 node and >= 1 token a node, got {tree_width}, {tree_branch}")
        self.tree = tree  # node budget of a tree draft (0: chains)
        self.sibling_min = sibling_min  # a node's least chance of being reached where the governor has no gate
        self.tree_width, self.tree_branch = tree_width, tree_branch
        # the residual rule verifies its drafts: a sampled tree then carries each node's proposal
        # distribution, its draws on their own stream (``tree.walk_residual``)
        self.residual = residual
        # a drafter that forwards token trees (not a recurrent one) grows them; another drafts chains
        self.grows = bool(getattr(model, "batches_sequences", False))
        # room a (re)start leaves after its window: the rows of the longest draft, a grown tree's
        # several a depth (a tree at a short drafter's end overflowed its context)
        self.context = max(1, min(context, model.max_context - self._rows_after(max_draft_tokens) - 1))
        # the tree the last proposal grew in the drafter's cache, until its commit keeps the
        # accepted path's rows: (base slot, its nodes' tokens, their parents)
        self._grown: tuple[int, list[int], list[int]] | None = None
        self.model = model  # the drafter LM (weights); its cache below is this speculator's state
        # the drafter chooses among the first ``head_prefix`` ids and the ids its sequence used (module
        # doc); 0: the whole vocabulary (asked, or a drafter whose forward cannot cut it)
        cut = getattr(model, "cuts_vocab", False) and 0 < head_prefix < model.cfg.vocab_size
        self.head_prefix = head_prefix if cut else 0
        self._head = self._new_head()
        self.cache = model.make_cache()
        self.vocab_size = vocab_size  # the trunk's logit width: drafts and probs live in it
        self.max_draft_tokens = max_draft_tokens
        self.min_draft_prob = min_draft_prob  # validated; None: the default
        self._committed: list[int] = []  # what the trunk's KV holds
        self._cached: list[int] = []  # what the drafter's KV holds (== cache.length tokens)
        self._offset = 0  # the sequence position of the drafter's cache position 0
        # a recurrent drafter's state cannot step back over its one-row draft forwards: a copy of it
        # after the catch-up (``HybridCache.snapshot``), returned to at the commit
        self._recurrent = hasattr(self.cache, "snapshot")
        self._snap = None
        self.restarts = 0
        # counters one report line can print
        self.proposals = 0
        self.drafted = 0
        self.forwards = 0
        self.forward_rows = 0
        self.draft_ms = 0.0
        self.tree_nodes = 0  # nodes of the trees drafted
        self.widened = 0  # sequences whose cut head went whole (``_note_written``)

    @property
    def taps(self) -> tuple[int, ...]:
        return ()

    @property
    def pending(self) -> list[int]:
        """Committed tokens the drafter's cache does not hold yet (forwarded by the next propose)."""
        return self._committed[self._offset + len(self._cached):]

    @property
    def offset(self) -> int:
        return self._offset

    @property
    def cached_tokens(self) -> list[int]:
        return list(self._cached)

    def _new_head(self) -> HeadRows | None:
        self._fed = deque(maxlen=MISS_WINDOW)  # per token the trunk wrote: whether the cut head lacked it
        return HeadRows(self.model, self.head_prefix) if self.head_prefix else None

    def _note_written(self, tokens: Sequence[int]) -> None:
        """``tokens`` the trunk wrote: kept from now on; a cut head that lacked too many goes whole."""
        if self._head is None:
            return
        now: set[int] = set()  # an id lacked twice in these tokens is lacked once
        for t in tokens:
            t = int(t)
            self._fed.append(not self._head.keeps(t) and t not in now)
            now.add(t)
        self._head.add(now)
        if len(self._fed) >= MISS_MIN and sum(self._fed) > MISS_SHARE * len(self._fed):
            self._head = None
            self.widened += 1

    def _cut(self) -> dict:
        """The forward's ``vocab`` argument where the head is cut (a drafter that cannot cut it takes none)."""
        return {"vocab": self._head} if self._head is not None else {}

    # -- the drafter's cache ---------------------------------------------------------------------
    def _forward(self, tokens: Sequence[int]) -> torch.Tensor:
        """Append ``tokens`` to the drafter's cache; -> logits of the last row, in the trunk's width."""
        kw = self._cut()
        if len(tokens) >= ROUTE_ROWS and getattr(self.model, "marks_prompt_rows", False):
            kw["prompt"] = True
        out = self.model.forward(list(tokens), self.cache, **kw)
        self._cached.extend(int(t) for t in tokens)
        self.forwards += 1
        self.forward_rows += len(tokens)
        return self._fit(out.logits[-1:])[0]

    def _fit(self, rows: torch.Tensor) -> torch.Tensor:
        """Drafter logits [n, drafter vocab] in the trunk's width."""
        v = self.vocab_size
        if rows.shape[1] > v:  # padding rows beyond the trunk's vocabulary can never be drafted
            return rows[:, :v]
        if rows.shape[1] < v:
            return torch.cat([rows, rows.new_full((rows.shape[0], v - rows.shape[1]), float("-inf"))], dim=1)
        return rows

    def _rows_after(self, k: int) -> int:
        """Drafter rows a draft of depth ``k`` may add after its catch-up: a chain's k, a grown tree's
        ``tree_width`` a depth below its roots."""
        return self.tree_width * max(k - 1, 0) if self.tree and self.grows else k

    def _drop_grown(self) -> None:
        """Forget a grown tree's rows (a proposal that no commit followed)."""
        if self._grown is not None:
            base = self._grown[0]
            self._grown = None
            if self.cache.length > base:
                self.cache.trim(self.cache.length - base)

    def _keep_grown(self) -> None:
        """After a commit: keep the rows of the grown tree's nodes that landed (a path from its
        root, moved into place after the cached tokens), forget the rest."""
        base, toks, pars = self._grown
        self._grown = None
        if self.cache.length != base + len(toks) or len(self._cached) != base:  # not the cache it grew in
            self.cache.trim(max(self.cache.length - base, 0))
            return
        rows, at = [], -1
        for t in self._committed[self._offset + base:]:
            nxt = next((j for j in range(at + 1, len(toks)) if pars[j] == at and toks[j] == t), None)
            if nxt is None:
                break
            rows.append(nxt)
            at = nxt
        self.cache.keep_path(base, rows)
        self._cached.extend(toks[j] for j in rows)

    def _rewind_to_committed(self) -> None:
        keep = common_prefix(self._cached, self._committed[self._offset:])
        snap, self._snap = self._snap, None
        if keep >= len(self._cached):
            return
        if not self._recurrent:
            self.cache.trim(self.cache.length - keep)
        elif snap is not None and snap[0] <= keep:
            # back to before the drafts: the ones that landed go through again with the next catch-up
            self.cache.restore(snap)
            keep = snap[0]
        else:
            keep = self.cache.keep(keep)  # where it can return, else it starts over
        del self._cached[keep:]

    def sync(self) -> None:
        """Forward every pending committed token now (the loop never needs this; tests do)."""
        pending = self.pending
        for i in range(0, len(pending), PREFILL_CHUNK):
            self._forward(pending[i : i + PREFILL_CHUNK])

    # -- Speculator -------------------------------------------------------------------------------
    def begin(self, prompt: Sequence[int], hidden: torch.Tensor | None) -> None:
        self.reset()
        self._committed = [int(t) for t in prompt]  # forwarded by the first propose, if one comes
        if self._head is not None:
            self._head.add(self._committed)  # an id the prompt used is one it may draft

    def _restart(self, position: int) -> None:
        """Start the drafter's cache over on the last ``context`` committed tokens before ``position``."""
        self.cache.reset()
        self._grown = None
        self._snap = None
        self._cached = []
        self._offset = max(0, position - (self.context - 1))
        self.restarts += 1

    def propose(self, ctx: DraftContext) -> Draft:
        t0 = time.perf_counter()
        self.proposals += 1
        self._drop_grown()
        tail = [int(t) for t in ctx.history[max(ctx.position - 8, 0) : ctx.position]]
        if len(self._committed) != ctx.position or self._committed[-8:] != tail:
            # begin() was skipped or the sequence changed under us: take the history as committed
            self._committed = [int(t) for t in ctx.history[: ctx.position]]
            if self._head is not None:
                self._head.add(self._committed)
            self._rewind_to_committed()
        k = min(ctx.max_tokens, self.max_draft_tokens)
        if len(self.pending) >= self.context or ctx.position - self._offset + self._rows_after(k) + 1 > self.model.max_context:
            self._restart(ctx.position)
        room = self.model.max_context - (ctx.position - self._offset + 1)  # after the catch-up
        while k > 0 and self._rows_after(k) > room:  # a drafter whose whole context is short
            k -= 1
        if k <= 0:
            return Draft()
        # catch-up folded into the first step: pending committed tokens + last token, one forward
        catch_up = self.pending + [int(ctx.last_token)]
        t_catch = time.perf_counter()
        long_catch_up = len(catch_up) > self.max_draft_tokens + 1  # more than a verify leaves behind
        while len(catch_up) > PREFILL_CHUNK:  # a long catch-up (after a parked stretch) in chunks
            self._forward(catch_up[:PREFILL_CHUNK])
            catch_up = catch_up[PREFILL_CHUNK:]
        logits = self._forward(catch_up)  # [vocab] the row that predicts position + 1
        if self._recurrent and k > 1:
            self._snap = self.cache.snapshot()
        # after a parked stretch or a restart: one-off work, which the governor budgets apart
        setup_ms = (time.perf_counter() - t_catch) * 1000.0 if long_catch_up else 0.0

        sampler = ctx.sampler
        sampling = sampler is not None and not sampler.greedy
        penalized = sampler is not None and sampler.params.has_penalties
        # the history only matters to the penalties: their window, only when they run
        hist = sampler.draft_history(ctx.history) if penalized else None
        if self.tree and self.grows:
            tokens, parents, proposed = self._grow(ctx, logits, k, hist)
            self.drafted += len(tokens)
            self.tree_nodes += len(tokens)
            self.draft_ms += (time.perf_counter() - t0) * 1000.0
            return Draft(tokens, proposed, setup_ms=setup_ms, parents=parents if tokens else None)
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        for i in range(k):
            if self.min_draft_prob > 0.0:
                top = float(torch.softmax(logits.float(), dim=-1).max())
                if top < self.min_draft_prob:
                    break
            pos = ctx.position + 1 + i  # the sequence position this draft token would take
            if sampling:
                q = sampler.probs(logits, hist)  # [vocab]
                tok = sampler.draw(q, pos, DRAFT_STREAM)
                probs.append(q)
            else:  # greedy: the trunk's own argmax rule, penalties included
                tok = argmax(sampler.penalize(logits, hist) if penalized else logits)
            tokens.append(tok)
            if hist is not None:
                hist.append(tok)
            if i + 1 < k:
                logits = self._forward([tok])
        self.drafted += len(tokens)
        self.draft_ms += (time.perf_counter() - t0) * 1000.0
        return Draft(tokens, torch.stack(probs) if probs else None, setup_ms=setup_ms)

    def _grow(self, ctx: DraftContext, logits: torch.Tensor, k: int, hist: list[int] | None
              ) -> tuple[list[int], list[int], torch.Tensor | None]:
        """A tree of at most ``tree`` nodes and ``k`` depths, grown as EAGLE-2 grows one: each node
        proposes the ``tree_branch`` tokens the drafter finds likeliest after its path (its own draw
        first: the chain's token), scored by the chance of reaching it (the drafter's probabilities
        down its path; under sampling its own draw scores as its parent does); at each depth the ``tree_width`` best new nodes go through the drafter
        together, one forward whose rows attend to their ancestors' rows in the drafter's cache
        (``ForwardItem.base``); the best-scored nodes are the draft (``tree.best_indices``). A node
        less likely than the governor's gate (``DraftContext.min_prob``, else ``sibling_min``) is
        not proposed, save the root's first. The rows stay in the drafter's cache for ``commit`` to
        keep the accepted path's. ``logits``: the drafter's row after the last emitted token.

        -> (tokens, parents, proposals): ``proposals`` None, or, when the residual rule verifies a
        sampled tree, each node's proposal distribution (``Draft.probs``): q for a node's own draw
        (made on ``Stream.TREE_DRAFT``), a one-hot for the tokens picked beside it."""
        sampler = ctx.sampler
        residual = sampler is not None and not sampler.greedy and self.residual
        base = self.cache.length
        ftoks: list[int] = []  # the drafter's tree rows: tokens, parents (as rows)
        fpars: list[int] = []
        row_of: dict[int, int] = {}

        def expand(nodes: list[int], toks: list[int], pars: list[int]) -> torch.Tensor:
            for i in nodes:
                row_of[i] = len(ftoks)
                fpars.append(row_of[pars[i]] if pars[i] >= 0 else -1)
                ftoks.append(toks[i])
            out = self.model.forward([toks[i] for i in nodes], self.cache, all_logits=True, parents=list(fpars),
                                     base=base, **self._cut())
            self._grown = (base, ftoks, fpars)
            self.forwards += 1
            self.forward_rows += len(nodes)
            return self._fit(out.logits)

        how = Growth(self.tree, k, self.tree_width, self.tree_branch,
                     ctx.min_prob if ctx.min_prob is not None else self.sibling_min, pmin=self.min_draft_prob)
        tokens, parents, drawn = grow(logits, how, expand, sampler, ctx.position + 1, hist,
                                      Stream.TREE_DRAFT if residual else DRAFT_STREAM)
        return tokens, parents, proposals(tokens, drawn, self.vocab_size) if residual and tokens else None

    def commit(self, tokens: Sequence[int], hidden: torch.Tensor | None, start_pos: int) -> None:
        """``tokens`` landed in the trunk at ``start_pos``..: the drafter's cache keeps only those."""
        if start_pos > len(self._committed):
            # a gap it never saw: the next propose takes the history as committed and restarts
            return
        del self._committed[start_pos:]
        self._committed.extend(int(t) for t in tokens)
        self._note_written(tokens)
        if self._grown is not None:
            self._keep_grown()
        self._rewind_to_committed()

    def reset(self) -> None:
        self.cache.reset()
        self._head = self._new_head()
        self._grown = None
        self._snap = None
        self._committed = []
        self._cached = []
        self._offset = 0

    def report(self) -> str:
        per = self.forward_rows / self.forwards if self.forwards else 0.0
        trees = f" ({self.tree_nodes} in trees)" if self.tree_nodes else ""
        return (f"draft-model: {self.proposals} proposals, {self.drafted} tokens drafted{trees}, "
                f"{self.forwards} drafter forwards ({per:.2f} rows each), {self.draft_ms:.0f} ms"
                + (f", head cut to the first {self.head_prefix} ids and the ones fed (whole in {self.widened} "
                   "sequences)" if self.head_prefix else ""))
