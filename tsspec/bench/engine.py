"""Binding the engine-agnostic bench method to tsspec's own engine.

One ``tsspec.session.Session`` (the trunk loaded once) is shared by every configuration (each run
starts from an empty cache); each configuration gets its own speculator and governor from the
session, exactly as ``generate`` gets them, so a bench row measures what a user would run.
"""

from __future__ import annotations

from typing import Callable

from ..errors import TsspecError
from ..generate import Engine
from ..options import DRAFT_DEFAULT, SpecOptions
from ..sampling import Sampler
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


def make_run_one(
    session,
    *,
    sampler: Sampler,
    max_tokens: int,
    encode: Callable[[str], list[int]],
    default_draft_model: str | None = None,
    ignore_eos: bool = False,
    peer=None,
) -> Callable[[BenchConfig, Prompt], RunRecord]:
    """``run_one`` for the bench: tsspec's configurations on the ``session``'s trunk; a peer engine's
    (``peer``, a started ``tsspec.bench.llama_server.Peer``) on the same prompt ids and budget."""
    engines: dict[str, Engine] = {}
    encoded: dict[str, list[int]] = {}

    def engine_for(c: BenchConfig) -> Engine:
        if c.name not in engines:
            engines[c.name] = session.engine(session.speculation(spec_options(c, default_draft_model)))
        return engines[c.name]

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
        res = engine_for(c).generate(encoded[p.text], sampler=sampler, max_tokens=max_tokens, ignore_eos=ignore_eos)
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
