"""The one decoding loop: draft, verify, accept, roll back, commit.

It serves every target and every speculator through their protocols and never asks which one it
drives. With no speculator, or while the governor has parked drafting, or when the speculator has
nothing to propose, a step is a plain one-row forward: exactly what plain decoding does, so a
parked speculative run costs what plain decoding costs.

Positions: the token drawn from the trunk row that processed position ``p`` sits at position
``p + 1``; the sampler keys its draw on that position, so a verify row and a plain step agree.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from ..sampling import Sampler
from .protocols import Draft, DraftContext, SpecTarget, Speculator
from .stats import SpecStats
from .verify import verify

PREFILL_CHUNK = 256


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000.0


def prefill(target: SpecTarget, prompt: Sequence[int], taps: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Forward the prompt in chunks; -> (last row's logits [vocab], tap rows [len(prompt), F] or None)."""
    hidden = []
    out = None
    for i in range(0, len(prompt), PREFILL_CHUNK):
        out = target.forward(prompt[i : i + PREFILL_CHUNK], all_logits=False, taps=taps or None)
        if taps:
            hidden.append(out.hidden)
    return out.logits[-1], (torch.cat(hidden) if taps else None)


def decode(
    target: SpecTarget,
    sampler: Sampler,
    prompt: Sequence[int],
    max_tokens: int,
    *,
    speculator: Speculator | None = None,
    governor=None,
    window: int = 8,
    accept_rule: str | None = None,
    on_token: Callable[[int], bool] | None = None,
    on_step: Callable[[SpecStats], None] | None = None,
    stats: SpecStats | None = None,
) -> list[int]:
    """Generate up to ``max_tokens`` tokens after ``prompt``; returns them.

    ``on_token(tok) -> stop`` is called for every emitted token in order; returning True ends the
    run after that token. ``on_step(stats)`` is called after every step (for a live display).
    """
    stats = stats if stats is not None else SpecStats()
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    if max_tokens <= 0:
        return []
    taps = tuple(speculator.taps) if speculator is not None and speculator.needs_hidden_state else ()
    rule = accept_rule or (speculator.default_accept_rule if speculator is not None else "match")
    stats.speculator = speculator.name if speculator is not None else None
    stats.window = window if speculator is not None else 0
    stats.prompt_tokens = len(prompt)
    if governor is not None:
        governor.reset()

    # -- prefill and the first token -------------------------------------------------------------
    t0 = time.perf_counter()
    target.reset()
    target.ensure_capacity(len(prompt) + 1)
    logits, prompt_hidden = prefill(target, prompt, taps)
    history = list(prompt)
    last = sampler.sample(logits, len(prompt), history)
    history.append(last)
    hidden_last = prompt_hidden[-1] if prompt_hidden is not None else None
    if speculator is not None:
        speculator.begin(prompt, prompt_hidden)
    stats.prefill_ms = _ms(t0)
    out_tokens = [last]
    stats.generated = 1
    stop = on_token(last) if on_token else False

    t_decode = time.perf_counter()
    while not stop and len(out_tokens) < max_tokens:
        step_t0 = time.perf_counter()
        pos = target.cache_len  # last token takes this position
        remaining = max_tokens - len(out_tokens)
        draft = Draft()
        drafting = speculator is not None and (governor is None or governor.should_draft())
        # sized only when a draft will be asked for: a parked stretch pays no sizing per token
        k_max = 0 if not drafting else min(window if governor is None else governor.draft_length(window),
                                           remaining - 1, target.max_context - pos - 1)
        if k_max > 0:
            t = time.perf_counter()
            ctx = DraftContext(last, pos, k_max, history, hidden_last, sampler)
            draft = speculator.propose(ctx)
            if len(draft.tokens) > k_max:
                draft = Draft(draft.tokens[:k_max], None if draft.probs is None else draft.probs[:k_max])
            stats.add_phase("draft", _ms(t))

        if not draft.tokens:
            # plain step: one row, exactly as plain decoding
            t = time.perf_counter()
            out = target.forward([last], taps=taps or None)
            emitted = [sampler.sample(out.logits[-1], pos + 1, history)]
            stats.add_phase("plain", _ms(t))
            stats.plain_steps += 1
            if speculator is not None:
                t = time.perf_counter()
                speculator.commit([last], out.hidden, pos)
                stats.add_phase("commit", _ms(t))
            hidden_last = out.hidden[-1] if out.hidden is not None else None
            speculative = False
        else:
            k = len(draft.tokens)
            t = time.perf_counter()
            target.snapshot()
            stats.add_phase("snapshot", _ms(t))
            t = time.perf_counter()
            out = target.forward([last, *draft.tokens], all_logits=True, taps=taps or None)
            stats.add_phase("verify", _ms(t))
            t = time.perf_counter()
            verdict = verify(rule, out.logits, draft.tokens, draft.probs, sampler, pos + 1, history)
            stats.add_phase("accept", _ms(t))
            n_acc = verdict.accepted
            stats.record_verify(k, n_acc)
            kept = [last, *draft.tokens[:n_acc]]
            t = time.perf_counter()
            hidden_rows = out.hidden
            if n_acc < k:
                if target.verify_persists_kv:
                    target.rewind(pos + len(kept))
                else:  # recurrent state absorbed the rejected tail: restore and re-advance
                    target.restore()
                    target.rewind(pos)
                    redo = target.forward(kept, all_logits=False, taps=taps or None)
                    hidden_rows = redo.hidden
            stats.add_phase("rollback", _ms(t))
            t = time.perf_counter()
            hid = hidden_rows[: len(kept)] if hidden_rows is not None else None
            speculator.commit(kept, hid, pos)
            stats.add_phase("commit", _ms(t))
            hidden_last = hid[-1] if hid is not None else None
            emitted = verdict.emitted(draft.tokens)
            speculative = True

        for tok in emitted:
            out_tokens.append(tok)
            history.append(tok)
            last = tok
            if on_token is not None and on_token(tok):
                stop = True
                break
            if len(out_tokens) >= max_tokens:
                break
        stats.generated = len(out_tokens)
        if governor is not None:
            governor.record(speculative, _ms(step_t0), len(emitted), len(draft.tokens) if speculative else None)
            stats.governor_state = governor.state
            stats.governor_parks = governor.parks
        stats.decode_ms = _ms(t_decode)
        if on_step is not None:
            on_step(stats)
    stats.decode_ms = _ms(t_decode)
    return out_tokens
