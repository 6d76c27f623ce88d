"""``Server``: one loaded model serving completions, up to ``parallel`` decoded together, with a
prefix cache of the caches recent requests left (see the package docstring)."""

from __future__ import annotations

import time
from typing import Callable

from ..chat import chat_prompt_ids
from ..errors import BadInput
from ..generate import Engine, GenerationResult
from ..prefix_cache import PrefixCache
from ..sampling import Sampler
from ..spec.plan import PLAIN, PlanFactory
from .requests import APIError
from .scheduler import Job, Metrics, Scheduler

DEFAULT_SLOTS = 4
DEFAULT_PARALLEL = 4
DEFAULT_QUEUE = 64
DEFAULT_MAX_TOKENS = 256


class Server:
    """One loaded model serving completions, up to ``parallel`` decoded together, with a prefix cache."""

    def __init__(self, engine: Engine, *, model_id: str, slots: int = DEFAULT_SLOTS,
                 default_max_tokens: int = DEFAULT_MAX_TOKENS, template_kwargs: dict | None = None,
                 parallel: int = DEFAULT_PARALLEL, queue: int = DEFAULT_QUEUE):
        self.engine = engine
        self.model_id = model_id
        self.prefix = PrefixCache(engine.target.make_cache, slots)
        self.default_max_tokens = default_max_tokens
        self.template_kwargs = dict(template_kwargs or {})
        self.metrics = Metrics()
        self.created = int(time.time())
        if not engine.plan.speculates:
            self.new_plan: PlanFactory = lambda: PLAIN
        elif engine.new_plan is not None:
            self.new_plan = engine.new_plan
        else:  # one speculator instance holds one sequence's state: concurrent sequences need their own
            raise ValueError("serving with speculation needs an Engine built with new_plan "
                             "(a fresh speculator and governor per sequence)")
        self.scheduler = Scheduler(self, parallel, queue)

    def rollback_bytes(self) -> int:
        """The rollback memory held now by every kept and running cache, as allocated (a hybrid
        trunk's per-row recurrent states; 0 for KV caches, whose trim is arithmetic)."""
        for _ in range(8):  # the scheduler's thread changes both while we look: read again
            try:
                caches = [c for _, c in list(self.prefix.entries.values())]
                caches += [j.cache for j in list(self.scheduler.active) if j.cache is not None]
                return sum(c.rollback_bytes() for c in caches)
            except RuntimeError:
                continue
        return 0

    def submit(self, prompt: list[int], sampler: Sampler, max_tokens: int, stop: list[str],
               on_text: Callable[[str], None] | None = None,
               interrupted: Callable[[], bool] | None = None) -> Job:
        """Queue a generation after ``prompt`` (refused at once when it cannot fit the context or the
        queue is full); its ``future`` ends with (result, prompt tokens reused)."""
        self.check_context(len(prompt), max_tokens)
        job = Job(list(prompt), sampler, max_tokens, list(stop), on_text, interrupted)
        self.scheduler.submit(job)
        return job

    def complete(self, prompt: list[int], sampler: Sampler, max_tokens: int, stop: list[str],
                 on_text: Callable[[str], None] | None = None,
                 interrupted: Callable[[], bool] | None = None) -> tuple[GenerationResult, int]:
        """Generate after ``prompt`` on the best kept cache, waiting for it; -> (result, prompt tokens reused)."""
        return self.submit(prompt, sampler, max_tokens, stop, on_text, interrupted).future.result()

    # -- what a request needs of the loaded model ------------------------------------------------------
    def check_context(self, n_prompt: int, max_tokens: int | None, *, at_least: bool = False,
                      param: str = "max_tokens") -> None:
        """The prompt's ``n_prompt`` tokens (``at_least``: a lower bound, ``Tokenizer.min_tokens``, taken
        before tokenizing a text too long to fit anyway) and ``max_tokens`` (None: the request gives
        none, so at least one) fit the context; else a 400 naming ``param``."""
        ctx = self.engine.target.max_context
        if n_prompt + (max_tokens or 1) > ctx:
            size = f"at least {n_prompt}" if at_least else f"{n_prompt}"
            plus = f" plus max_tokens ({max_tokens})" if max_tokens is not None else ""
            raise APIError(400, f"the prompt ({size} tokens){plus} exceeds the context of {ctx} tokens",
                           param="max_tokens" if max_tokens is not None else param, code="context_length_exceeded")

    def budget(self, prompt: list[int], max_tokens: int | None, param: str = "messages") -> int:
        """The request's max_tokens; when it gives none, the server's default, capped at the room the
        prompt leaves in the context (a request that named no max_tokens is not refused over one)."""
        if max_tokens is not None:
            return max_tokens
        room = self.engine.target.max_context - len(prompt)
        if room < 1:
            raise APIError(400, f"the prompt ({len(prompt)} tokens) fills the context of "
                           f"{self.engine.target.max_context} tokens", param=param, code="context_length_exceeded")
        return min(self.default_max_tokens, room)

    def chat_prompt(self, body: dict, max_tokens: int | None = None) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "messages must be a non-empty list", param="messages")
        clean = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer"):
                raise APIError(400, f"messages[{i}] needs a role of system, user or assistant", param="messages")
            content = m.get("content", "")
            if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise APIError(400, f"messages[{i}].content: only text parts are supported", param="messages")
                content = "".join(p["text"] for p in content)
            if not isinstance(content, str):
                raise APIError(400, f"messages[{i}].content must be a string", param="messages")
            role = "system" if m["role"] == "developer" else m["role"]
            clean.append({"role": role, "content": content})
        tok = self.engine.tokenizer
        # the contents' fewest possible tokens first: a 5 MB prompt took seconds to tokenize on the
        # event loop (every other request and /health waited) only to be refused for its length
        self.check_context(sum(tok.min_tokens(m["content"]) for m in clean), max_tokens, at_least=True,
                           param="messages")
        try:
            return chat_prompt_ids(self.engine.tokenizer, clean, **self.template_kwargs)
        except BadInput as e:
            raise APIError(400, str(e), param="messages") from None

    def text_prompt(self, body: dict, max_tokens: int | None = None) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            self.check_context(self.engine.tokenizer.min_tokens(prompt), max_tokens, at_least=True, param="prompt")
            return self.engine.tokenizer.encode(prompt)
        vocab = self.engine.target.vocab_size
        if (isinstance(prompt, list) and prompt
                and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt)):
            return list(prompt)
        raise APIError(400, f"prompt must be a non-empty string or a list of token ids below {vocab}",
                       param="prompt")
