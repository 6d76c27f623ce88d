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

Its parts: ``requests`` (the request bodies checked, OpenAI-style errors), ``scheduler`` (the model's
thread), ``service`` (``Server``: the engine, the prefix cache, the scheduler) and ``app`` (the HTTP
routes and streaming).
"""

from .app import create_app, stream
from .requests import MAX_STOP_STRINGS, APIError
from .scheduler import Job, Metrics, Scheduler
from .service import DEFAULT_MAX_TOKENS, DEFAULT_PARALLEL, DEFAULT_QUEUE, DEFAULT_SLOTS, Server

__all__ = ["APIError", "DEFAULT_MAX_TOKENS", "DEFAULT_PARALLEL", "DEFAULT_QUEUE", "DEFAULT_SLOTS", "Job",
           "MAX_STOP_STRINGS", "Metrics", "Scheduler", "Server", "create_app", "stream"]
