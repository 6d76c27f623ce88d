"""Text in, text out: tokenization, stop conditions and streaming around ``spec.loop.decode``.

The engine knows nothing about terminals; the CLI renders what it reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

from .errors import BadInput
from .spec.plan import PLAIN, PlanFactory, SpecPlan
from .spec.run import Run
from .spec.stats import SpecStats

if TYPE_CHECKING:  # a plain greedy run on a lean trunk imports neither (nor torch through them)
    from .sampling import Sampler
    from .spec.loop import DecodeState


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    stop_reason: str  # "eos" | "stop" | "length" | "interrupted"
    stats: SpecStats = field(default_factory=SpecStats)
    eos_token: int | None = None  # the end-of-sequence token that ended the run (not in token_ids)

    @property
    def generated_ids(self) -> list[int]:
        """Every token the run appended to the sequence (and so to a kept cache's history): the
        reply's ids plus the end-of-sequence token that ended it."""
        return self.token_ids + ([] if self.eos_token is None else [self.eos_token])

    def to_dict(self) -> dict:
        s = self.stats
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": len(self.token_ids),
            "stop_reason": self.stop_reason,
            "prefill_ms": s.prefill_ms,
            "decode_ms": s.decode_ms,
            "prefill_tok_s": s.prefill_tok_s,
            "decode_tok_s": s.decode_tok_s,
            "spec": s.to_dict(),
        }


def check_fits(prompt_tokens: int, max_tokens: int, max_context: int, *, at_least: bool = False) -> None:
    """``at_least``: ``prompt_tokens`` is a lower bound (``Tokenizer.min_tokens``), checked before
    tokenizing a text too long to fit anyway."""
    if prompt_tokens == 0 and not at_least:
        raise BadInput("the prompt is empty")
    if prompt_tokens + max_tokens > max_context:
        size = f"at least {prompt_tokens}" if at_least else f"{prompt_tokens}"
        raise BadInput(
            f"prompt ({size} tokens) plus --max-tokens ({max_tokens}) exceeds the context "
            f"of {max_context} tokens; shorten the prompt, lower --max-tokens or raise --ctx-size"
        )


class TextGeneration:
    """One prompt's generation as text: a loop ``Run`` whose tokens are turned into text as they come
    (end-of-sequence, stop strings held back until they cannot start one, streaming pieces), and the
    ``GenerationResult`` it ends with. ``Engine.generate`` drives one alone; a server's scheduler
    steps several together (``spec.loop.step_together``): the same tokens and text either way."""

    def __init__(self, seq: DecodeState, prompt_ids: Sequence[int], max_tokens: int, eos: frozenset, stream,
                 stop: Sequence[str], on_text: Callable[[str], None] | None,
                 on_step: Callable[[SpecStats], None] | None, interrupted: Callable[[], bool] | None):
        self.prompt_len = len(prompt_ids)
        self.eos, self.stream, self.stop = eos, stream, list(stop)
        self.on_text, self.interrupted = on_text, interrupted
        self.pieces: list[str] = []
        self.reason = "length"
        self.held = ""
        self.max_stop = max((len(x) for x in stop), default=0)
        self.run = Run(seq, list(prompt_ids), max_tokens, on_token=self._on_token, on_step=on_step)

    @property
    def stats(self) -> SpecStats:
        return self.run.seq.stats

    def _on_token(self, t: int) -> bool:
        if t in self.eos:
            self.reason = "eos"
            return True
        new = self.stream.push(t)
        if not new:
            return self._stopped()
        if self.stop:
            # hold back text that could be the start of a stop string
            buf = self.held + new
            for x in self.stop:
                i = buf.find(x)
                if i >= 0:
                    self._emit(buf[:i])
                    self.held = ""
                    self.reason = "stop"
                    return True
            keep = self.max_stop - 1
            cut = max(len(buf) - keep, 0)
            self._emit(buf[:cut])
            self.held = buf[cut:]
        else:
            self._emit(new)
        return self._stopped()

    def _stopped(self) -> bool:
        if self.interrupted is not None and self.interrupted():
            self.reason = "interrupted"
            return True
        return False

    def _emit(self, text: str) -> None:
        if text:
            self.pieces.append(text)
            if self.on_text is not None:
                self.on_text(text)

    def result(self) -> GenerationResult:
        """After the run is done: the text, ids and why it ended."""
        ids = self.run.finish()
        eos_token = None
        if self.reason == "eos" and ids and ids[-1] in self.eos:
            ids, eos_token = ids[:-1], ids[-1]
        if self.reason != "stop":
            self._emit(self.held + self.stream.flush())
        return GenerationResult("".join(self.pieces), ids, self.prompt_len, self.reason, self.stats, eos_token)


class Engine:
    """A loaded target + tokenizer, and how it speculates (a ``SpecPlan``), reused across prompts.

    ``plan`` serves one prompt at a time (``generate``). Prompts decoded at the same time (a
    server's) each need their own speculator and governor: ``new_plan()`` makes a fresh plan over
    the same loaded weights (``Session.engine`` passes the session's)."""

    def __init__(self, target, tokenizer, plan: SpecPlan = PLAIN, *, new_plan: PlanFactory | None = None,
                 shared: dict | None = None, decoder: Callable | None = None):
        self.target = target
        # what decodes a sequence: ``decoder(target, sampler, plan, cache=, stats=, drawable=)``;
        # None: the loop's ``DecodeState`` (a lean trunk's session passes ``spec.plain.LeanDecode``)
        self.decoder = decoder
        self.tokenizer = tokenizer
        self.plan = plan
        self.new_plan = new_plan
        # what the speculators keep across this engine's sequences (``Speculation.shared``); a
        # server shows the gauges of what in it has them (``gauges()``)
        self.shared = {} if shared is None else shared
        # one cache for every prompt, reset between them: a freshly allocated one decodes about 5%
        # slower on smollm2-135m (measured, fresh vs reused, same process), and prompts run one at a time
        self._cache = None

    def begin(
        self,
        prompt_ids: Sequence[int],
        *,
        sampler: Sampler,
        max_tokens: int,
        cache,
        stop: Sequence[str] = (),
        ignore_eos: bool = False,
        on_text: Callable[[str], None] | None = None,
        on_step: Callable[[SpecStats], None] | None = None,
        interrupted: Callable[[], bool] | None = None,
        plan: SpecPlan = PLAIN,
    ) -> TextGeneration:
        """A generation on ``cache`` (holding a prefix of ``prompt_ids``, or empty), not started:
        ``gen.run.start()``, then step it alone or with others until ``gen.run.done``, then
        ``gen.result()``. ``plan``: this sequence's own (default: plain)."""
        check_fits(len(prompt_ids), max_tokens, self.target.max_context)
        tok = self.tokenizer
        eos = frozenset() if ignore_eos else tok.eos_ids
        decoder = self.decoder
        if decoder is None:
            from .spec.loop import DecodeState as decoder  # imported here: a lean run imports no torch
        seq = decoder(self.target, sampler, plan, cache=cache, stats=SpecStats(), drawable=tok.vocab_size)
        return TextGeneration(seq, prompt_ids, max_tokens, eos, tok.stream(), stop, on_text, on_step, interrupted)

    def generate(
        self,
        prompt_ids: Sequence[int],
        *,
        sampler: Sampler,
        max_tokens: int,
        stop: Sequence[str] = (),
        ignore_eos: bool = False,
        on_text: Callable[[str], None] | None = None,
        on_step: Callable[[SpecStats], None] | None = None,
        cache=None,
        interrupted: Callable[[], bool] | None = None,
    ) -> GenerationResult:
        """``cache``: a kept cache holding a prefix of ``prompt_ids`` (a conversation's earlier turns),
        extended in place; default: the engine's own, reset. ``interrupted() -> True`` stops the run
        at the next token (stop reason "interrupted"), leaving the cache consistent."""
        if cache is None:
            if self._cache is None:
                self._cache = self.target.make_cache()
            cache = self._cache
            cache.reset()
        gen = self.begin(prompt_ids, sampler=sampler, max_tokens=max_tokens, cache=cache, stop=stop,
                         ignore_eos=ignore_eos, on_text=on_text, on_step=on_step, interrupted=interrupted,
                         plan=self.plan)
        gen.run.drive()
        return gen.result()
