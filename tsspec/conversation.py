"""A multi-turn conversation over one loaded model: the chat template each turn, and a kept cache.

The terminal knows nothing of this module's internals and this module knows nothing of terminals:
``tsspec chat`` renders what a ``Turn`` reports.

Each turn renders the whole conversation through the model's chat template and tokenizes it. The
conversation keeps one cache across turns and remembers the tokens it holds; the new prompt
usually extends them (the last reply's tokens are already in the cache but its final one), so
only the new tokens are forwarded. Where the rendering departs from what the cache holds (a
template that re-renders the reply differently, a reply cut at a stop string, an edited system
message) the cache is trimmed back to the common prefix; a cache that cannot be trimmed that far (a
hybrid trunk's recurrent state can only undo its last forward) starts over. Either way the output
equals a fresh run over the whole rendered prompt: reuse changes the cost, never the tokens.

Speculation: one speculator serves the whole conversation (``begin`` is called with the whole
prompt every turn). One that can arm after a reused prefix (n-gram, block drafters) drafts from the
second turn on (so does a draft model, which restarts its own cache on the recent tokens); one that
cannot (a per-token draft head) is left out of turns that reuse the cache, and the turn says so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from .chat import chat_prompt_ids
from .errors import BadInput
from .generate import Engine, check_fits
from .prefix_cache import PrefixCache
from .sampling import Sampler
from .spec.stats import SpecStats


@dataclass
class Turn:
    """What one reply did."""

    text: str
    token_ids: list[int]
    stop_reason: str  # "eos" | "stop" | "length" | "interrupted"
    prompt_tokens: int  # the whole rendered conversation
    reused: int  # of those, already in the cache
    prefilled: int  # forwarded this turn
    stats: SpecStats = field(default_factory=SpecStats)

    def to_dict(self) -> dict:
        s = self.stats
        return {"text": self.text, "token_ids": self.token_ids, "stop_reason": self.stop_reason,
                "prompt_tokens": self.prompt_tokens, "reused_tokens": self.reused,
                "prefilled_tokens": self.prefilled, "generated_tokens": len(self.token_ids),
                "prefill_ms": s.prefill_ms, "decode_ms": s.decode_ms, "spec": s.to_dict()}


class Conversation:
    """Messages, the kept cache and the tokens it holds, over an ``Engine`` (trunk, tokenizer and
    an optional speculator and governor)."""

    def __init__(self, engine: Engine, *, system: str | None = None, template_kwargs: dict | None = None):
        tok = engine.tokenizer
        if not tok.chat_template:
            why = getattr(tok, "chat_template_problem", None) or "tokenizer.chat_template"
            raise BadInput(f"the model has no chat template ({why}); tsspec chat needs one")
        self.engine = engine
        self.system = system
        self.template_kwargs = dict(template_kwargs or {})
        self.messages: list[dict[str, Any]] = []
        self.prefix = PrefixCache(engine.target.make_cache)  # one kept cache and the tokens it holds
        self.turns: list[Turn] = []

    # -- the conversation -------------------------------------------------------------------------
    def all_messages(self) -> list[dict[str, Any]]:
        head = [{"role": "system", "content": self.system}] if self.system is not None else []
        return head + self.messages

    def reset(self) -> None:
        """Forget the messages and the cache (the system message stays)."""
        self.messages = []
        self.turns = []
        self.prefix.clear()

    def set_system(self, text: str | None) -> None:
        """A new system message; the next turn re-renders, and the cache keeps what still matches."""
        self.system = text

    def render(self, messages: list[dict[str, Any]]) -> list[int]:
        return chat_prompt_ids(self.engine.tokenizer, messages, **self.template_kwargs)

    @staticmethod
    def _check_fits(n: int, max_tokens: int, ctx: int, *, at_least: bool = False) -> None:
        try:
            check_fits(n, max_tokens, ctx, at_least=at_least)
        except BadInput as e:
            raise BadInput(f"the conversation is full: {e}; /reset starts a new one") from None

    def reply(self, user: str, *, sampler: Sampler, max_tokens: int, stop: Sequence[str] = (),
              on_text: Callable[[str], None] | None = None, on_step: Callable[[SpecStats], None] | None = None,
              interrupted: Callable[[], bool] | None = None) -> Turn:
        """Add the user's message, generate the reply, add it; -> what the turn did."""
        messages = self.all_messages() + [{"role": "user", "content": user}]
        tok, ctx = self.engine.tokenizer, self.engine.target.max_context
        # the contents' fewest possible tokens first: a 26 MB line took 24 s to render and tokenize
        # before this same refusal
        self._check_fits(sum(tok.min_tokens(m["content"]) for m in messages), max_tokens, ctx, at_least=True)
        prompt = self.render(messages)
        self._check_fits(len(prompt), max_tokens, ctx)
        cache, reused = self.prefix.take(prompt)
        try:
            result = self.engine.generate(prompt, sampler=sampler, max_tokens=max_tokens, stop=stop,
                                          on_text=on_text, on_step=on_step, cache=cache, interrupted=interrupted)
        except BaseException:  # a second Ctrl-C may land mid-forward: keep the memory, not the state
            cache.reset()
            self.prefix.give([], cache)
            raise
        self.prefix.give(prompt + result.generated_ids, cache, len(prompt))
        self.messages.append({"role": "user", "content": user})
        self.messages.append({"role": "assistant", "content": result.text})
        turn = Turn(result.text, result.token_ids, result.stop_reason, len(prompt), reused, len(prompt) - reused,
                    result.stats)
        self.turns.append(turn)
        return turn

    # -- saving -----------------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """The conversation as JSON: the messages (system first) and each turn's counters."""
        from .paths import check_output_file

        path = check_output_file(path, f"cannot save to {path}")  # '~' expanded: no shell did it at the prompt
        data = {"messages": self.all_messages(), "turns": [
            {k: v for k, v in t.to_dict().items() if k not in ("token_ids", "spec")} for t in self.turns]}
        try:
            path.write_text(json.dumps(data, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
        except OSError as e:
            raise BadInput(f"cannot save to {path}: {e.strerror or e}") from None
        return path
