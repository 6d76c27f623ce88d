"""The HTTP side of ``tsspec serve``: the OpenAI routes over a ``Server`` (starlette), one JSON
response or server-sent events, and the answers' shapes (``usage``, the ``tsspec`` extension)."""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import time
import uuid
from typing import Any, Iterator

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from ..errors import BadInput
from ..generate import GenerationResult
from .requests import APIError, check_model, sampling, streaming
from .service import Server

log = logging.getLogger("uvicorn.error")  # serve's log: the server's own lines go with uvicorn's


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


async def _read_json(request: Request) -> dict:
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



async def _completions(server: Server, request: Request, chat: bool) -> Response:
    """One completion request: checked, queued, then answered whole or streamed."""
    body = await _read_json(request)
    check_model(body, server.model_id)
    sampler, max_tokens, stop = sampling(body)
    streams = streaming(body)
    # rendered and tokenized on a worker thread: a template's seconds of budget (or a long
    # prompt's tokenizing) stalled the event loop, /health and every other client with it
    prompt = await asyncio.to_thread(server.chat_prompt if chat else server.text_prompt, body, max_tokens)
    max_tokens = server.budget(prompt, max_tokens, "messages" if chat else "prompt")
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    kind = "chat.completion" if chat else "text_completion"
    if streams:
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


def _metrics_text(server: Server) -> str:
    """Prometheus text: the served totals, then the gauges read now."""
    running, waiting = server.scheduler.load()
    gauges = "".join(f"# HELP {name} {help_}\n# TYPE {name} gauge\n{name} {value}\n" for name, help_, value in (
        ("tsspec_requests_running", "requests being decoded (together)", running),
        ("tsspec_requests_waiting", "requests waiting for a place", waiting),
        ("tsspec_rollback_bytes", "rollback memory held by the kept and running caches, as allocated "
         "(a hybrid trunk's per-row states; 0 for KV caches)", server.rollback_bytes())))
    for kept in list(server.engine.shared.values()):  # what the speculators keep across requests
        for name, kind, help_, value in getattr(kept, "gauges", lambda: [])():
            gauges += f"# HELP {name} {help_}\n# TYPE {name} {kind}\n{name} {value:g}\n"
    return server.metrics.prometheus() + gauges


def create_app(server: Server) -> Starlette:
    """The OpenAI routes over ``server``; every error is an OpenAI-style JSON body."""
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

    async def chat_completions(request: Request) -> Response:
        return await _completions(server, request, chat=True)

    async def text_completions(request: Request) -> Response:
        return await _completions(server, request, chat=False)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": server.model_id, "object": "model", "created": server.created, "owned_by": "tsspec"}]})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(_metrics_text(server), media_type="text/plain; version=0.0.4")

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
