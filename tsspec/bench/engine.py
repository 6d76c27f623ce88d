"""Binding the engine-agnostic bench method to tsspec's own engine.

One ``tsspec.session.Session`` (the trunk loaded once) is shared by every configuration (each run
starts from an empty cache, or with ``keep_cache`` from what the configuration's run before left:
``KeptPrompt``, a ``PrefixCache``); each configuration gets its own speculator and governor from the session, exactly
as ``generate`` gets them, so a bench row measures what a user would run.
"""

from __future__ import annotations

from typing import Callable

from ..errors import BadInput, TsspecError
from ..generate import Engine
from ..options import DRAFT_DEFAULT, SpecOptions
from ..prefix_cache import PrefixCache
from ..sampling import Sampler
from ..spec.protocols import arms_after_prefix_reuse
from .configs import BenchConfig
from .runner import RunRecord
from .workloads import Prompt


def spec_options(c: BenchConfig, default_draft_model: str | None) -> SpecOptions:
    if c.algo == "plain":
        return SpecOptions(enabled=False)
    return SpecOptions(
        enabled=True,
        type=c.algo,
        draft=c.draft or DRAFT_DEFAULT,
        draft_explicit=c.draft is not None,
        pmin=c.pmin,
        draft_model=c.draft_model or (default_draft_model if c.algo in ("draft-model", "block", "draft-head", "cascade") else None),
        accept=c.accept or "auto",
        adaptive=True if c.adaptive is None else c.adaptive,
        tree=c.tree or 0,
    )


class KeptPrompt:
    """A configuration's kept cache between its runs (``bench --keep-cache``): the project's
    ``PrefixCache`` with one slot, as a chat keeps its conversation's, so a run forwards only what
    its prompt does not share with the run before (an agent workload's instruction once). A run of
    the same prompt again (the baseline's second slot) reuses only what its first run did, so every
    run of a prompt starts alike whatever the slot order."""

    def __init__(self, make_cache) -> None:
        self.pool = PrefixCache(make_cache)
        self.prompt: list[int] = []  # the prompt of the last run taken
        self.reused = 0  # what its first run reused

    def take(self, ids: list[int]):
        """The cache for a run over ``ids``, cut to what it may reuse."""
        cache, n = self.pool.take(ids)
        if ids == self.prompt:
            cache.keep(min(n, self.reused))
        else:
            self.prompt, self.reused = list(ids), n
        return cache

    def give(self, ids: list[int], generated: list[int], cache) -> None:
        """The run over ``ids`` finished with ``generated``: its cache back (prompt rows only while
        they round otherwise than generated ones, ``PrefixCache.give``)."""
        self.pool.give(ids + generated, cache, len(ids))

    def drop(self, cache) -> None:
        """A run that failed: its cache's state is unknown."""
        cache.reset()
        self.pool.give([], cache)
        self.prompt = []


def make_run_one(
    session,
    *,
    sampler: Sampler,
    max_tokens: int,
    encode: Callable[[str], list[int]],
    default_draft_model: str | None = None,
    ignore_eos: bool = False,
    peer=None,
    keep_cache: bool = False,
) -> Callable[[BenchConfig, Prompt], RunRecord]:
    """``run_one`` for the bench: tsspec's configurations on the ``session``'s trunk; a peer engine's
    (``peer``, a started ``tsspec.bench.llama_server.Peer``) on the same prompt ids and budget.
    ``keep_cache``: each tsspec configuration keeps its prompt rows between runs (``KeptPrompt``)."""
    engines: dict[str, Engine] = {}
    kept: dict[str, KeptPrompt] = {}
    encoded: dict[str, list[int]] = {}

    def engine_for(c: BenchConfig) -> Engine:
        if c.name not in engines:
            eng = session.engine(session.speculation(spec_options(c, default_draft_model)))
            spec = eng.plan.speculator
            if keep_cache and spec is not None and not arms_after_prefix_reuse(spec):
                raise BadInput(f"--keep-cache: {c.name} ({spec.name}) cannot draft after a reused prefix "
                               "(it needs every position's trunk row); bench it without --keep-cache")
            engines[c.name] = eng
            if keep_cache:
                kept[c.name] = KeptPrompt(eng.target.make_cache)
        return engines[c.name]

    def generate(c: BenchConfig, ids: list[int]):
        eng = engine_for(c)
        if not keep_cache:
            return eng.generate(ids, sampler=sampler, max_tokens=max_tokens, ignore_eos=ignore_eos)
        k = kept[c.name]
        cache = k.take(ids)
        try:
            res = eng.generate(ids, sampler=sampler, max_tokens=max_tokens, ignore_eos=ignore_eos, cache=cache)
        except BaseException:
            k.drop(cache)
            raise
        k.give(ids, res.generated_ids, cache)
        return res

    def run_peer(c: BenchConfig, ids: list[int]) -> RunRecord:
        if peer is None:
            raise TsspecError(f"{c.name}: no {c.engine} peer was started")
        r = peer.run(c, ids, max_tokens, ignore_eos=ignore_eos)
        if r["n"] and not r["tokens"]:
            raise TsspecError(f"{c.name}: the server returned no token ids (return_tokens unsupported?)")
        counters = {"drafted": r["drafted"], "accepted": r["accepted"], "server_tok_s": r["tok_s"]}
        # llama-server counts the first token (sampled from the prompt's forward) over the time of the
        # later ones; tsspec's decode speed is the tokens after the first over that time: same here
        tok_s = (r["n"] - 1) / r["decode_s"] if r["decode_s"] > 0 else 0.0
        return RunRecord(text=r["text"], token_ids=r["tokens"], n_tokens=r["n"], decode_s=r["decode_s"],
                         tok_s=tok_s, counters=counters, prefill_s=r["prefill_s"])

    def run_one(c: BenchConfig, p: Prompt) -> RunRecord:
        if p.text not in encoded:
            encoded[p.text] = encode(p.text)
        if c.engine != "tsspec":
            return run_peer(c, encoded[p.text])
        res = generate(c, encoded[p.text])
        s = res.stats
        counters = {
            "drafted": s.drafted,
            "accepted": s.accepted,
            "verify_calls": s.verify_calls,
            "plain_steps": s.plain_steps,
            "governor_parks": s.governor_parks,
            "phase_ms": dict(s.phase_ms),
        }
        if s.acceptance_rate is not None:
            counters["acceptance_rate"] = s.acceptance_rate
        if s.tokens_per_verify is not None:
            counters["tokens_per_verify"] = s.tokens_per_verify
        return RunRecord(
            text=res.text,
            token_ids=list(res.token_ids),
            n_tokens=len(res.token_ids),
            decode_s=s.decode_ms / 1000,
            tok_s=s.decode_tok_s,
            counters=counters,
            prefill_s=s.prefill_ms / 1000,
        )

    return run_one
