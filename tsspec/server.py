"""``tsspec serve``: an OpenAI-compatible HTTP server over one loaded model (starlette + uvicorn).

Endpoints: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (``stream`` with server-sent
events, or one JSON response), ``GET /v1/models``, ``GET /health``, and ``GET /metrics``
(Prometheus text: requests, tokens, prefix reuse, speculation). Every completion carries a
``tsspec`` field: tokens reused from the prefix cache and prefilled, the speculator, drafted and
accepted tokens.

One loaded trunk (and drafter) serves every request. One thread (``Scheduler``) is the only
thread that touches the model: ``tsspec serve`` runs it on the main thread, the one that loaded the
model, with the HTTP side in a thread of its own, because the native kernels' OpenMP runtime keeps a
team of worker threads per thread that calls it, and two teams on a 2-core machine make it stop
spinning between parallel regions (a decode step then ran at 0.65x its speed; see
``Scheduler.run``). In process (tests, embedding) the scheduler starts its own thread. It admits up to ``parallel`` requests in arrival order, each with its
own cache, speculator and governor, and steps them together: each step, the rows of every admitted
sequence (a chunk of its prompt, a plain row, or a verify's last token and draft) share one trunk forward
(``spec.loop.step_together``; attention stays per sequence), then each accepts, trims, commits and
streams its text. A request that finds ``parallel`` running waits in a queue of at most ``queue``;
beyond that it is answered 503 at once. A client that goes away mid-stream stops its sequence at
the next token (or before it is admitted) and frees its place.

A prefix cache keeps the caches of recent requests (``slots``, least recently used first out), keyed
by the tokens each holds; a request takes the one sharing its longest prefix, so a conversation's
next turn, or requests sharing a system prompt, forward only what is new. A request's tokens never
depend on what else is served: the same request with the same seed returns the same text alone or
among others, because prefix reuse, speculation and the rows a forward shares change the cost of a
run, never its tokens (the trunk's rows are batch invariant; see the README).
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from .chat import chat_prompt_ids
from .errors import BadInput
from .generate import Engine, GenerationResult, TextGeneration
from .prefix_cache import PrefixCache
from .sampling import Sampler, SamplingParams
from .spec.loop import step_together

log = logging.getLogger("uvicorn.error")  # serve's log: the server's own lines go with uvicorn's

DEFAULT_SLOTS = 4
DEFAULT_PARALLEL = 4
DEFAULT_QUEUE = 64
DEFAULT_MAX_TOKENS = 256
MAX_STOP_STRINGS = 4


class APIError(Exception):
    """An OpenAI-style error: HTTP status, message, type, offending parameter and code."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


# ----------------------------------------------------------------------------- the engine side


@dataclass
class Metrics:
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    generated_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    verify_calls: int = 0
    decode_ms: float = 0.0
    steps: int = 0  # scheduler steps
    shared_steps: int = 0  # of those, steps in which several sequences shared the forward

    def prometheus(self) -> str:
        rows = [
            ("tsspec_requests_total", "counter", "completions served", self.requests),
            ("tsspec_request_errors_total", "counter", "requests answered with an error", self.errors),
            ("tsspec_prompt_tokens_total", "counter", "prompt tokens of served completions", self.prompt_tokens),
            ("tsspec_prompt_tokens_reused_total", "counter", "prompt tokens taken from the prefix cache",
             self.reused_tokens),
            ("tsspec_generated_tokens_total", "counter", "tokens generated", self.generated_tokens),
            ("tsspec_spec_drafted_tokens_total", "counter", "draft tokens sent to verification", self.drafted),
            ("tsspec_spec_accepted_tokens_total", "counter", "draft tokens accepted", self.accepted),
            ("tsspec_spec_verify_calls_total", "counter", "verify forwards", self.verify_calls),
            ("tsspec_decode_seconds_total", "counter", "time spent decoding", self.decode_ms / 1000.0),
            ("tsspec_steps_total", "counter", "decoding steps of the scheduler", self.steps),
            ("tsspec_shared_steps_total", "counter", "steps that stepped several sequences together (their rows "
             "in one forward where the trunk batches sequences)",
             self.shared_steps),
        ]
        out = []
        for name, kind, help_, value in rows:
            out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value:g}"]
        return "\n".join(out) + "\n"


@dataclass
class Job:
    """One request on its way through the scheduler; ``future`` ends with (result, prompt tokens
    reused) or the error."""

    prompt: list[int]
    sampler: Sampler
    max_tokens: int
    stop: list[str]
    on_text: Callable[[str], None] | None = None
    interrupted: Callable[[], bool] | None = None
    future: Future = field(default_factory=Future)
    gen: TextGeneration | None = None
    cache: Any = None
    reused: int = 0

    def gone(self) -> bool:
        """Its client left: a stream's consumer went away, or the awaiting handler was cancelled
        (which cancels ``future``)."""
        return self.future.cancelled() or (self.interrupted is not None and self.interrupted())

    def settle(self, result: Any = None, error: BaseException | None = None) -> None:
        """End ``future``, unless a departed client's cancel got there first."""
        if self.future.done():
            return
        try:
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(result)
        except InvalidStateError:  # cancelled between the check and the set
            pass


class Scheduler:
    """The one thread that runs the model: admits waiting jobs up to ``parallel``, steps every
    admitted one together, and settles each job's future when its run ends."""

    def __init__(self, server: "Server", parallel: int, queue_bound: int):
        if parallel < 1 or queue_bound < 0:
            raise ValueError("parallel must be >= 1 and the queue bound >= 0")
        self.server = server
        self.parallel = parallel
        self.queue_bound = queue_bound
        self.cv = threading.Condition()
        self.waiting: deque[Job] = deque()
        self.active: list[Job] = []  # the scheduler thread's own
        self._thread: threading.Thread | None = None  # ``run``'s caller, or started by the first request
        self._stop = threading.Event()

    def submit(self, job: Job) -> None:
        """Queue ``job``, or refuse it (503) when the queue is full."""
        with self.cv:
            if self._stop.is_set():
                raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
            if len(self.waiting) >= self.queue_bound + max(0, self.parallel - len(self.active)):
                raise APIError(503, f"the server is busy ({self.parallel} requests running, {len(self.waiting)} "
                               "waiting); retry later", type="server_error", code="server_busy")
            self.waiting.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="tsspec-scheduler", daemon=True)
                self._thread.start()
            self.cv.notify()

    def load(self) -> tuple[int, int]:
        """(running, waiting)."""
        with self.cv:
            return len(self.active), len(self.waiting)

    def run(self) -> None:
        """Be the scheduler on the calling thread until ``stop`` (from any thread), then answer every
        request still running or waiting with 503.

        ``tsspec serve`` calls this on its main thread, the one that loaded the model. The kernels'
        OpenMP runtime (libgomp) gives every thread that starts a parallel region its own team of
        workers, and once it manages more threads than there are CPUs it stops letting idle workers
        spin between regions, so each of a forward's hundreds of regions waits for workers to wake:
        a qwen2.5-coder-0.5b decode step stepped from a second thread ran at about 0.65x the speed
        of the same step on the thread that loaded the model (45 vs 66-70 tok/s)."""
        with self.cv:
            if self._thread is not None:
                raise RuntimeError("the scheduler is already running")
            self._thread = threading.current_thread()
        try:
            self._loop()
        finally:
            self._drain(APIError(503, "the server is shutting down", type="server_error", code="shutting_down"))

    def stop(self) -> None:
        """Make ``run`` return (its loop checks between steps)."""
        with self.cv:
            self._stop.set()
            self.cv.notify_all()

    def _drain(self, error: APIError) -> None:
        with self.cv:
            jobs = self.active + list(self.waiting)
            self.active, self.waiting = [], deque()
        for job in jobs:
            job.cache = None  # the process is ending: no kept cache to give back
            job.settle(error=error)

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self.cv:
                while not self.waiting and not self.active:
                    if self._stop.is_set():
                        return
                    self.cv.wait()
                admit = []
                while self.waiting and len(self.active) + len(admit) < self.parallel:
                    admit.append(self.waiting.popleft())
            for i, job in enumerate(admit):
                try:
                    self._admit(job)
                except KeyboardInterrupt:  # the rest are answered by ``run``'s drain, with those waiting
                    with self.cv:
                        self.waiting.extendleft(reversed([j for j in admit[i:] if j not in self.active]))
                    raise
            live = [j for j in self.active if not j.gen.run.done]
            if live:
                try:
                    step_together([j.gen.run for j in live])
                    self.server.metrics.steps += 1
                    self.server.metrics.shared_steps += len(live) > 1
                except KeyboardInterrupt:  # the server is stopping: ``run`` answers them all with 503
                    raise
                except BaseException as e:  # noqa: BLE001 - every sequence of the step is answered
                    for j in live:
                        self._fail(j, e)
            for j in [j for j in self.active if j.gen.run.done]:
                self._retire(j)

    def _admit(self, job: Job) -> None:
        """Take a kept cache and build the job's sequence (its own speculator and governor); its
        prefill runs in the following steps, beside the other sequences' rows."""
        srv = self.server
        if job.gone():  # its client left while it waited
            job.settle(error=APIError(499, "the client went away", code="client_gone"))
            return
        job.cache, job.reused = srv.prefix.take(job.prompt)
        try:
            speculator, governor = srv.new_speculation()
            job.gen = srv.engine.begin(job.prompt, sampler=job.sampler, max_tokens=job.max_tokens, cache=job.cache,
                                       stop=job.stop, on_text=job.on_text, interrupted=job.gone,
                                       speculator=speculator, governor=governor)
            self.active.append(job)
            job.gen.run.begin()  # its prompt's chunks share the next steps' forwards
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # noqa: BLE001
            self._fail(job, e)

    def _fail(self, job: Job, e: BaseException) -> None:
        if job in self.active:
            self.active.remove(job)
        if job.cache is not None:  # the cache may be mid-forward: give its memory back empty
            job.cache.reset()
            self.server.prefix.give([], job.cache)
            job.cache = None
        job.settle(error=e)

    def _retire(self, job: Job) -> None:
        self.active.remove(job)
        try:
            result = job.gen.result()
        except BaseException as e:  # noqa: BLE001
            self._fail(job, e)
            return
        srv = self.server
        srv.prefix.give(job.prompt + result.generated_ids, job.cache)
        job.cache = None
        m, s = srv.metrics, result.stats
        m.requests += 1
        m.prompt_tokens += len(job.prompt)
        m.reused_tokens += job.reused
        m.generated_tokens += len(result.token_ids)
        m.drafted += s.drafted
        m.accepted += s.accepted
        m.verify_calls += s.verify_calls
        m.decode_ms += s.decode_ms
        job.settle((result, job.reused))


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
        if engine.speculator is None:
            self.new_speculation: Callable[[], tuple] = lambda: (None, None)
        elif engine.new_speculation is not None:
            self.new_speculation = engine.new_speculation
        else:  # one speculator instance holds one sequence's state: concurrent sequences need their own
            raise ValueError("serving with speculation needs an Engine built with new_speculation "
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

    # -- request parsing ----------------------------------------------------------------------------
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

    def check_model(self, body: dict) -> None:
        name = body.get("model")
        if name is not None and name not in (self.model_id, "default"):
            raise APIError(404, f"model {name!r} is not served here (this server serves {self.model_id!r})",
                           type="invalid_request_error", param="model", code="model_not_found")

    def sampling(self, body: dict) -> tuple[Sampler, int | None, list[str]]:
        """-> (sampler, the request's max_tokens or None when it gives none, stop strings)."""
        temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
        top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
        if top_p == 0.0:
            raise APIError(400, "top_p must be in (0, 1]", param="top_p")
        # OpenAI's penalties, and the samplers llama.cpp's server also takes by these names
        presence = _number(body, "presence_penalty", 0.0, -2.0, 2.0)
        frequency = _number(body, "frequency_penalty", 0.0, -2.0, 2.0)
        repeat = _number(body, "repeat_penalty", 1.0, 0.0, 1e6)
        if repeat == 0.0:
            raise APIError(400, "repeat_penalty must be a number > 0", param="repeat_penalty")
        min_p = _number(body, "min_p", 0.0, 0.0, 1.0)
        if min_p == 1.0:
            raise APIError(400, "min_p must be in [0, 1)", param="min_p")
        top_k = _integer(body, "top_k", 0)
        repeat_last_n = _integer(body, "repeat_last_n", 64)
        for key, unused in (("logprobs", (None, False)), ("top_logprobs", (None, 0)), ("echo", (None, False)),
                            ("best_of", (None, 1)), ("logit_bias", (None, {})), ("suffix", (None, ""))):
            if body.get(key) not in unused:  # asked for, and the answer would silently lack it
                raise APIError(400, f"{key} is not supported by tsspec serve: send the request without it",
                               param=key)
        seed = body.get("seed", 0)
        if seed is None:
            seed = 0
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
            raise APIError(400, "seed must be a non-negative integer", param="seed")
        if body.get("tools") or body.get("functions"):
            raise APIError(400, "tool and function calling is not supported by tsspec serve: send the request "
                           "without 'tools'", param="tools")
        n = body.get("n")
        if n is not None and (type(n) is not int or n != 1):  # 1.0 and true are not the count 1
            raise APIError(400, "only n = 1 is supported", param="n")
        max_tokens = body.get("max_tokens")
        if max_tokens is None:  # {"max_tokens": null, "max_completion_tokens": 3} means 3
            max_tokens = body.get("max_completion_tokens")
        if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                       or max_tokens < 1):
            raise APIError(400, "max_tokens must be a positive integer", param="max_tokens")
        stop = body.get("stop")
        if stop is None or stop == "":  # "" is OpenAI's "no stop string"; 0, false or {} are not
            stop = []
        if isinstance(stop, str):
            stop = [stop]
        if (not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS
                or not all(isinstance(x, str) and x for x in stop)):
            raise APIError(400, f"stop must be a string or a list of at most {MAX_STOP_STRINGS} non-empty strings",
                           param="stop")
        try:
            sampler = Sampler(SamplingParams(temperature=temperature, top_p=top_p, seed=seed, top_k=top_k, min_p=min_p,
                                             repeat_penalty=repeat, presence_penalty=presence,
                                             frequency_penalty=frequency, repeat_last_n=repeat_last_n))
        except (ValueError, BadInput) as e:
            raise APIError(400, str(e)) from None
        return sampler, max_tokens, stop

    def streaming(self, body: dict) -> bool:
        """``stream``: a JSON boolean (or null); the string "false" is truthy and would stream."""
        value = body.get("stream")
        if value is not None and not isinstance(value, bool):
            raise APIError(400, "stream must be true or false", param="stream")
        return bool(value)

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


def _number(body: dict, key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key, default)
    if v is None:
        v = default
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not lo <= float(v) <= hi:
        raise APIError(400, f"{key} must be a number in [{lo:g}, {hi:g}]", param=key)
    return float(v)


def _integer(body: dict, key: str, default: int) -> int:
    v = body.get(key, default)
    if v is None:
        v = default
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise APIError(400, f"{key} must be a non-negative integer", param=key)
    return v


def _finish_reason(result: GenerationResult) -> str:
    return "length" if result.stop_reason == "length" else "stop"


def _extension(result: GenerationResult, prompt: list[int], reused: int) -> dict:
    s = result.stats
    return {"reused_tokens": reused, "prefilled_tokens": len(prompt) - reused, "speculator": s.speculator,
            "drafted_tokens": s.drafted, "accepted_tokens": s.accepted, "verify_calls": s.verify_calls,
            "decode_tok_s": round(s.decode_tok_s, 2), "prefill_ms": round(s.prefill_ms, 2),
            "decode_ms": round(s.decode_ms, 2)}


def _usage(prompt: list[int], result: GenerationResult) -> dict:
    n = len(result.token_ids)
    return {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}


# ----------------------------------------------------------------------------- the HTTP side


def create_app(server: Server) -> Starlette:
    async def read_json(request: Request) -> dict:
        try:
            raw = await request.body()
        except ClientDisconnect:  # gone mid-body, after headers that promised more: a log line, not 50
            log.warning("%s %s: the client closed the connection before the body was complete",
                        request.method, request.url.path)
            raise APIError(400, "the request body ended early (the client closed the connection)") from None
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            raise APIError(400, "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        return body

    def failing(handler):
        async def wrapped(request: Request) -> Response:
            try:
                return await handler(request)
            except APIError as e:
                server.metrics.errors += 1
                return e.response()
            except BadInput as e:
                server.metrics.errors += 1
                return APIError(400, str(e)).response()
        return wrapped

    async def completions(request: Request, chat: bool) -> Response:
        body = await read_json(request)
        server.check_model(body)
        sampler, max_tokens, stop = server.sampling(body)
        streaming = server.streaming(body)
        # rendered and tokenized on a worker thread: a template's seconds of budget (or a long
        # prompt's tokenizing) stalled the event loop, /health and every other client with it
        prompt = await asyncio.to_thread(server.chat_prompt if chat else server.text_prompt, body, max_tokens)
        max_tokens = server.budget(prompt, max_tokens, "messages" if chat else "prompt")
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        kind = "chat.completion" if chat else "text_completion"
        if streaming:
            q: queue.Queue = queue.Queue()
            gone = threading.Event()
            # queued here, so a full queue or a context overflow is refused before the stream starts
            job = server.submit(prompt, sampler, max_tokens, stop, on_text=lambda s: q.put(("text", s)),
                                interrupted=gone.is_set)
            job.future.add_done_callback(lambda f: q.put(("end", f)))
            return StreamingResponse(stream(server, rid, kind, chat, prompt, q, gone),
                                     media_type="text/event-stream")
        job = server.submit(prompt, sampler, max_tokens, stop)
        result, reused = await asyncio.wrap_future(job.future)
        choice: dict[str, Any] = {"index": 0, "finish_reason": _finish_reason(result), "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": result.text}
        else:
            choice["text"] = result.text
        return JSONResponse({"id": rid, "object": kind, "created": int(time.time()), "model": server.model_id,
                             "choices": [choice], "usage": _usage(prompt, result),
                             "tsspec": _extension(result, prompt, reused)})

    async def chat_completions(request: Request) -> Response:
        return await completions(request, chat=True)

    async def text_completions(request: Request) -> Response:
        return await completions(request, chat=False)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": server.model_id, "object": "model", "created": server.created, "owned_by": "tsspec"}]})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def metrics(request: Request) -> Response:
        running, waiting = server.scheduler.load()
        gauges = "".join(f"# HELP {name} {help_}\n# TYPE {name} gauge\n{name} {value}\n" for name, help_, value in (
            ("tsspec_requests_running", "requests being decoded (together)", running),
            ("tsspec_requests_waiting", "requests waiting for a place", waiting),
            ("tsspec_rollback_bytes", "rollback memory held by the kept and running caches, as allocated "
             "(a hybrid trunk's per-row states; 0 for KV caches)", server.rollback_bytes())))
        return PlainTextResponse(server.metrics.prometheus() + gauges, media_type="text/plain; version=0.0.4")

    routes = [
        Route("/v1/chat/completions", failing(chat_completions), methods=["POST"]),
        Route("/v1/completions", failing(text_completions), methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]

    async def not_found(request: Request, exc) -> Response:
        status = getattr(exc, "status_code", 404)
        return APIError(status, f"{request.method} {request.url.path}: {getattr(exc, 'detail', 'not found')}",
                        code="not_found" if status == 404 else None).response()

    async def internal(request: Request, exc) -> Response:
        server.metrics.errors += 1
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").response()

    return Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found, Exception: internal})


def stream(server: Server, rid: str, kind: str, chat: bool, prompt: list[int], q: queue.Queue,
           gone: threading.Event) -> Iterator[str]:
    """Server-sent events: the scheduler hands text over ``q`` as the sequence decodes, then the
    job's future; a client that goes away sets ``gone``, which stops its sequence at the next token."""
    created = int(time.time())

    def chunk(delta: dict | str | None, finish: str | None, extra: dict | None = None) -> str:
        if chat:
            choice = {"index": 0, "delta": delta if isinstance(delta, dict) else {}, "finish_reason": finish,
                      "logprobs": None}
        else:
            choice = {"index": 0, "text": delta if isinstance(delta, str) else "", "finish_reason": finish,
                      "logprobs": None}
        obj = {"id": rid, "object": f"{kind}.chunk" if chat else kind, "created": created,
               "model": server.model_id, "choices": [choice], **(extra or {})}
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    try:
        if chat:
            yield chunk({"role": "assistant", "content": ""}, None)
        while True:
            kind_, item = q.get()
            if kind_ == "text":
                yield chunk({"content": item} if chat else item, None)
                continue
            e = item.exception()
            if e is not None:
                if not isinstance(e, APIError):
                    e = APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error")
                server.metrics.errors += 1
                err = {"error": {"message": e.message, "type": e.type, "code": e.code}}
                yield f"data: {json.dumps(err)}\n\n"
                break
            result, reused = item.result()
            yield chunk({} if chat else "", _finish_reason(result),
                        {"usage": _usage(prompt, result), "tsspec": _extension(result, prompt, reused)})
            break
        yield "data: [DONE]\n\n"
    finally:
        gone.set()
