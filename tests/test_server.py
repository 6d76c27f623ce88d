"""``tsspec serve``'s application, in process (starlette's TestClient): OpenAI-shaped responses,
streaming, the prefix cache, metrics, errors, and texts that do not depend on what else is served."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
from starlette.testclient import TestClient

from tiny import write_tiny_model
from tsspec.spec.plan import SpecPlan
from tsspec.chat import chat_prompt_ids
from tsspec.generate import Engine
from tsspec.models import load_model
from tsspec.sampling import Sampler, SamplingParams
from tsspec.prefix_cache import PrefixCache
from tsspec.server import Server, create_app
from tsspec.spec.loop import decode
from tsspec.spec.ngram import NGramSpeculator
from tsspec.tokenizer import Tokenizer

SYSTEM = {"role": "system", "content": "You answer in one short sentence about fruit and colors."}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("serve") / "m.gguf", "qwen2", seed=4, vocab_size=400, ctx=1024)
    return load_model(path), Tokenizer.from_gguf(path)


def make(tiny, spec=None, slots=4, parallel=4, queue=64):
    """``spec``: a speculator factory (each sequence served gets its own instance), or None."""
    model, tok = tiny
    engine = Engine(model, tok, SpecPlan(spec() if spec else None, window=4), new_plan=(lambda: SpecPlan(spec(), window=4)) if spec else None)
    server = Server(engine, model_id="m", slots=slots, default_max_tokens=8, parallel=parallel, queue=queue)
    return server, TestClient(create_app(server))


def ngram():
    return NGramSpeculator(max_draft_tokens=4)


def ask(client, messages, **kw):
    r = client.post("/v1/chat/completions", json={"messages": messages, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def test_chat_completion_is_the_plain_run_and_openai_shaped(tiny):
    model, tok = tiny
    server, client = make(tiny)
    msgs = [SYSTEM, {"role": "user", "content": "apple?"}]
    body = ask(client, msgs, max_tokens=10)
    assert body["object"] == "chat.completion" and body["model"] == "m"
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] in ("stop", "length")
    prompt = chat_prompt_ids(tok, msgs)
    want = decode(model, Sampler(), prompt, 10)
    assert body["usage"]["prompt_tokens"] == len(prompt)
    assert body["usage"]["completion_tokens"] == len(want) or choice["finish_reason"] == "stop"
    assert body["tsspec"]["reused_tokens"] == 0 and body["tsspec"]["prefilled_tokens"] == len(prompt)
    assert client.get("/v1/models").json()["data"][0]["id"] == "m"
    assert client.get("/health").json() == {"status": "ok"}


def test_the_next_turn_reuses_the_prefix_and_equals_a_fresh_run(tiny):
    model, tok = tiny
    server, client = make(tiny, spec=ngram)
    msgs = [SYSTEM, {"role": "user", "content": "apple?"}]
    first = ask(client, msgs, max_tokens=12)
    msgs += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
             {"role": "user", "content": "and banana?"}]
    second = ask(client, msgs, max_tokens=12)
    assert second["tsspec"]["reused_tokens"] > 0
    fresh_server, fresh_client = make(tiny)
    assert ask(fresh_client, msgs, max_tokens=12)["choices"] == second["choices"]
    text = client.get("/metrics").text
    assert "tsspec_requests_total 2" in text and "tsspec_prompt_tokens_reused_total" in text
    reused = [line for line in text.splitlines() if line.startswith("tsspec_prompt_tokens_reused_total")]
    assert float(reused[0].split()[1]) == second["tsspec"]["reused_tokens"]


def test_streaming_gives_the_same_text(tiny):
    server, client = make(tiny)
    msgs = [SYSTEM, {"role": "user", "content": "cherry?"}]
    whole = ask(client, msgs, max_tokens=10)["choices"][0]["message"]["content"]
    with client.stream("POST", "/v1/chat/completions",
                       json={"messages": msgs, "temperature": 0, "max_tokens": 10, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == whole
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length") and "usage" in chunks[-1]
    # plain completions stream too
    with client.stream("POST", "/v1/completions", json={"prompt": "red green", "max_tokens": 5, "stream": True,
                                                        "temperature": 0}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["object"] == "text_completion"


def test_same_request_same_text_alone_or_among_concurrent_others(tiny):
    """Batch invariance and exact prefix reuse: a request's text does not depend on what else is
    served, greedy or seeded."""
    server, client = make(tiny, spec=ngram, slots=2)
    reqs = [{"messages": [SYSTEM, {"role": "user", "content": f"fruit number {i}?"}], "max_tokens": 8,
             "temperature": 0.9 if i % 2 else 0, "seed": 100 + i} for i in range(8)]
    alone = []
    for r in reqs:
        _, fresh = make(tiny)
        alone.append(fresh.post("/v1/chat/completions", json=r).json()["choices"][0]["message"]["content"])
    with ThreadPoolExecutor(max_workers=8) as pool:
        together = list(pool.map(lambda r: client.post("/v1/chat/completions", json=r).json(), reqs))
    assert [t["choices"][0]["message"]["content"] for t in together] == alone
    again = client.post("/v1/chat/completions", json=reqs[3]).json()  # after the others, from a kept cache
    assert again["choices"][0]["message"]["content"] == alone[3] and again["tsspec"]["reused_tokens"] > 0


@pytest.mark.parametrize("body, status, param", [
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": -1}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "top_p": 0}, 400, "top_p"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": [1]}, 400, "stop"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, 400, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "seed": -3}, 400, "seed"),
    ({"messages": [{"role": "user", "content": "x"}], "model": "gpt-4"}, 404, "model"),
    ({"messages": [{"role": "user", "content": "x"}], "presence_penalty": 3}, 400, "presence_penalty"),
    ({"messages": [{"role": "user", "content": "x"}], "frequency_penalty": "lots"}, 400, "frequency_penalty"),
    ({"messages": [{"role": "user", "content": "x"}], "top_k": -1}, 400, "top_k"),
    ({"messages": [{"role": "user", "content": "x"}], "min_p": 1}, 400, "min_p"),
    ({"messages": [{"role": "user", "content": "x"}], "repeat_penalty": 0}, 400, "repeat_penalty"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True}, 400, "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, 400, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 100}}, 400, "logit_bias"),
    ({"prompt": "x", "echo": True}, 400, "echo"),
    ({"prompt": "x", "best_of": 3}, 400, "best_of"),
    # wrong types that were read by truthiness: "false" streamed, 0/false/{} meant no stop, true meant n=1
    ({"prompt": "x", "stream": "false"}, 400, "stream"),
    ({"messages": [{"role": "user", "content": "x"}], "stream": 1}, 400, "stream"),
    ({"prompt": "x", "stop": 0}, 400, "stop"),
    ({"prompt": "x", "stop": False}, 400, "stop"),
    ({"prompt": "x", "stop": {}}, 400, "stop"),
    ({"prompt": "x", "n": True}, 400, "n"),
    ({"prompt": "x", "n": 1.0}, 400, "n"),
])
def test_bad_requests_get_openai_errors(tiny, body, status, param):
    _, client = make(tiny)
    r = client.post("/v1/completions" if "prompt" in body else "/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"]
    if param == "max_tokens" and status == 400 and body.get("max_tokens") == 10**6:
        assert err["code"] == "context_length_exceeded"


def test_a_request_without_max_tokens_gets_the_room_the_context_leaves(tiny):
    """The server's default max_tokens (``serve -n``) is capped at what the prompt leaves of the
    context: a request that named no max_tokens was refused with "plus max_tokens (N) exceeds"."""
    server, client = make(tiny)
    ctx = server.engine.target.max_context
    r = client.post("/v1/completions", json={"prompt": [7] * (ctx - 3), "temperature": 0})
    assert r.status_code == 200, r.text
    assert 1 <= r.json()["usage"]["completion_tokens"] <= 3
    r = client.post("/v1/completions", json={"prompt": [5] * ctx})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "prompt" and "fills the context" in r.json()["error"]["message"]
    # a max_tokens the request names is its own: still refused when it does not fit
    r = client.post("/v1/completions", json={"prompt": [5] * (ctx - 3), "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    # null max_tokens defers to max_completion_tokens
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": None, "max_completion_tokens": 2,
                                             "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2


def test_a_prompt_far_past_the_context_is_refused_before_tokenizing(tiny):
    """A 26 MB prompt was tokenized on the event loop (every other request waited) only to be refused
    for its length; its fewest possible tokens are now checked first."""
    import time

    _, client = make(tiny)
    text = "the cat sat. " * 2_000_000
    for route, body, param in (("/v1/completions", {"prompt": text}, "prompt"),
                               ("/v1/completions", {"prompt": text, "max_tokens": 4}, "max_tokens"),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}, "messages")):
        t = time.perf_counter()
        r = client.post(route, json=body)
        assert time.perf_counter() - t < 10, route
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == param and "at least" in err["message"]


@pytest.mark.parametrize("spec", [None, ngram])
def test_penalties_and_samplers_reach_the_sampler(tiny, spec):
    """presence/frequency/repeat penalties, top_k and min_p were ignored without a word: a request
    with them now gets exactly what ``tsspec generate`` gives with the same settings."""
    model, tok = tiny
    extra = {"presence_penalty": 1.5, "frequency_penalty": 0.8, "repeat_penalty": 1.3, "repeat_last_n": 16,
             "top_k": 20, "min_p": 0.05}
    _, client = make(tiny, spec=spec)
    eng = Engine(model, tok)
    for temperature in (0, 0.9):
        body = {"prompt": "red green blue red green blue red", "max_tokens": 24, "temperature": temperature,
                "seed": 7, **extra}
        got = text_of(client, "/v1/completions", body)
        params = SamplingParams(temperature=temperature, seed=7, **extra)
        assert got == eng.generate(tok.encode(body["prompt"]), sampler=Sampler(params), max_tokens=24).text
        if temperature == 0:  # the penalties change this greedy text: the test sees whether they were applied
            bare = {k: v for k, v in body.items() if k not in extra}
            assert text_of(client, "/v1/completions", bare) != got


def test_malformed_bodies_and_unknown_routes(tiny):
    _, client = make(tiny)
    r = client.post("/v1/chat/completions", content=b"{not json")
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json=[1, 2])
    assert r.status_code == 400
    r = client.post("/v1/completions", json={"prompt": [10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert client.get("/v1/nothing").status_code == 404 and "error" in client.get("/v1/nothing").json()
    assert client.get("/v1/completions").status_code == 405
    metrics = client.get("/metrics").text
    assert "tsspec_request_errors_total 3" in metrics


def test_prefix_cache_lru_and_trim(tiny):
    model, _ = tiny
    pc = PrefixCache(model.make_cache, slots=2)
    c, n = pc.take([1, 2, 3, 4])
    assert n == 0 and c.length == 0
    model.forward([1, 2, 3, 4, 5], c)
    pc.give([1, 2, 3, 4, 5], c)
    c2, n = pc.take([1, 2, 3, 9, 9])
    assert c2 is c and n == 3 and c.length == 3  # trimmed to the common prefix
    pc.give([1, 2, 3], c2)
    c3, n = pc.take([1, 2, 3])  # the whole prompt is held: one token is left to forward
    assert n == 2 and c3.length == 2
    pc.give([1, 2], c3)
    for i in range(3):  # more than `slots`: the least recently used goes
        c, _ = pc.take([50 + i])
        model.forward([50 + i], c)
        pc.give([50 + i], c)
    assert len(pc.entries) == 2 and all(t[0][0] >= 51 for t in pc.entries.values())


def test_serve_refuses_an_address_in_use_with_one_line(tmp_path):
    import socket

    from clirun import run

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = run("serve", "-m", str(tmp_path / "never-loaded.gguf"), "--port", str(port))
    assert r.exit_code == 2 and "cannot listen on" in r.output and "Traceback" not in r.output
    assert len([x for x in r.output.splitlines() if x.strip()]) == 1


# ----------------------------------------------------------------------------- decoded together


class SharedForwards:
    """Counts the shared forwards of a model (and the sequences in each) while installed."""

    def __init__(self, model):
        self.model, self.sizes = model, []

    def __enter__(self):
        inner = self.model.forward_batch

        def counted(items):
            self.sizes.append(len(items))
            return inner(items)

        self.model.forward_batch = counted
        return self

    def __exit__(self, *exc):
        del self.model.forward_batch


def concurrent_requests(n=8, max_tokens=24):
    """Chat and plain completions, streaming and not, greedy and seeded, each its own prompt and seed."""
    reqs = []
    for i in range(n):
        body = {"max_tokens": max_tokens, "temperature": 0.9 if i % 2 else 0, "seed": 300 + i,
                "stream": i % 3 == 0}
        if i % 4 == 3:
            body["prompt"] = f"red green blue {i} red green"
            reqs.append(("/v1/completions", body))
        else:
            body["messages"] = [SYSTEM, {"role": "user", "content": f"fruit {i} and color {i}?"}]
            reqs.append(("/v1/chat/completions", body))
    return reqs


def text_of(client, route, body) -> str:
    if not body.get("stream"):
        r = client.post(route, json=body)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        return c["message"]["content"] if "message" in c else c["text"]
    with client.stream("POST", route, json=body) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("error" not in c for c in chunks), chunks
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    return "".join(c["choices"][0]["delta"].get("content", "") if "delta" in c["choices"][0]
                   else c["choices"][0]["text"] for c in chunks)


@pytest.mark.parametrize("spec", [None, ngram])
def test_eight_concurrent_clients_are_decoded_together_and_each_gets_its_lone_text(tiny, spec):
    """8 clients at once, chat and completions, streaming and not, greedy and seeded: the server
    decodes them together (their rows share forwards) and every response equals what the same
    request gets alone on a fresh server, and what Engine.generate (``tsspec generate``) gives."""
    model, tok = tiny
    reqs = concurrent_requests()
    alone = []
    for route, body in reqs:
        _, fresh = make(tiny, spec=spec)
        alone.append(text_of(fresh, route, body))
    # the lone texts are the engine's own (as `tsspec generate` runs it)
    eng = Engine(model, tok)
    for (route, body), want in zip(reqs, alone):
        ids = (chat_prompt_ids(tok, body["messages"]) if "messages" in body else tok.encode(body["prompt"]))
        sampler = Sampler(SamplingParams(temperature=body["temperature"], seed=body["seed"]))
        assert eng.generate(ids, sampler=sampler, max_tokens=body["max_tokens"]).text == want
    server, client = make(tiny, spec=spec, parallel=8, slots=2)
    with SharedForwards(model) as shared:
        for _ in range(2):  # twice: the second round also meets kept caches from the first
            with ThreadPoolExecutor(max_workers=8) as pool:
                together = list(pool.map(lambda rb: text_of(client, *rb), reqs))
            assert together == alone
    assert shared.sizes and max(shared.sizes) > 1, "the requests were never decoded together"
    assert server.scheduler.load() == (0, 0)
    metrics = client.get("/metrics").text
    assert "tsspec_requests_running 0" in metrics and "tsspec_requests_waiting 0" in metrics
    assert f"tsspec_requests_total {2 * len(reqs)}" in metrics


def test_hundred_requests_from_eight_clients_none_lost_or_cut(tiny):
    """The issue's load: 8 clients at once, 100 requests in all, each its own prompt and seed (varied
    lengths and budgets, n-gram speculation, some with stop strings): every response is the text
    Engine.generate gives alone, with its finish reason and token count."""
    model, tok = tiny
    reqs = []
    for i in range(100):
        body = {"max_tokens": 4 + (i * 7) % 29, "temperature": (i % 3) * 0.45, "seed": 1000 + i,
                "stream": i % 4 == 1}
        if i % 5 == 2:
            body["stop"] = ["e"]
        if i % 2:
            body["prompt"] = f"{i} red green blue " * (1 + i % 5)
            reqs.append(("/v1/completions", body))
        else:
            body["messages"] = [SYSTEM, {"role": "user", "content": f"fruit {i}? " * (1 + i % 4)}]
            reqs.append(("/v1/chat/completions", body))
    eng = Engine(model, tok)
    alone = []
    for route, body in reqs:
        ids = chat_prompt_ids(tok, body["messages"]) if "messages" in body else tok.encode(body["prompt"])
        sampler = Sampler(SamplingParams(temperature=body["temperature"], seed=body["seed"]))
        alone.append(eng.generate(ids, sampler=sampler, max_tokens=body["max_tokens"], stop=body.get("stop", ())).text)
    server, client = make(tiny, spec=ngram, parallel=8, slots=4)
    with ThreadPoolExecutor(max_workers=8) as pool:
        together = list(pool.map(lambda rb: text_of(client, *rb), reqs))
    bad = [i for i, (a, b) in enumerate(zip(alone, together)) if a != b]
    assert not bad, f"{len(bad)} responses differ from their lone text, first request {bad[0]}"
    assert server.metrics.requests == 100 and server.metrics.shared_steps > 0
    assert server.scheduler.load() == (0, 0)


def test_full_queue_is_refused_at_once_with_503(tiny):
    import threading

    server, client = make(tiny, parallel=1, queue=0)
    release, started = threading.Event(), threading.Event()

    def hold(_text):  # the running request holds the scheduler until released
        started.set()
        release.wait(30)

    job = server.submit(chat_prompt_ids(tiny[1], [{"role": "user", "content": "x"}]), Sampler(), 4, [],
                        on_text=hold)
    try:
        assert started.wait(30)
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "y"}]})
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_busy"
        r = client.post("/v1/completions", json={"prompt": "y", "stream": True})
        assert r.status_code == 503  # refused before a stream starts
    finally:
        release.set()
    result, _ = job.future.result(30)
    assert result.token_ids
    assert client.post("/v1/completions", json={"prompt": "y", "max_tokens": 3}).status_code == 200


def test_a_client_that_goes_away_frees_its_place(tiny):
    """A stream whose client left stops at the next token; its cache goes back to the prefix cache,
    and a job whose client left while it waited is never started."""
    import threading

    server, _ = make(tiny, parallel=1, queue=4)
    gone = threading.Event()
    texts = []

    def on_text(t):
        texts.append(t)
        gone.set()  # the client leaves after the first piece

    prompt = chat_prompt_ids(tiny[1], [SYSTEM, {"role": "user", "content": "long story?"}])
    job = server.submit(prompt, Sampler(), 200, [], on_text=on_text, interrupted=gone.is_set)
    never = threading.Event()
    never.set()
    waiting = server.submit(prompt, Sampler(), 200, [], interrupted=never.is_set)
    result, _ = job.future.result(30)
    assert result.stop_reason == "interrupted" and len(result.token_ids) < 200
    with pytest.raises(Exception, match="went away"):
        waiting.future.result(30)
    assert server.scheduler.load() == (0, 0) and len(server.prefix.entries) == 1
    # a non-streaming request whose handler was cancelled (its client left): its future is
    # cancelled, its run stops, and the scheduler goes on serving
    left = server.submit(prompt, Sampler(), 200, [])
    left.future.cancel()
    result, _ = server.submit(prompt, Sampler(), 5, []).future.result(30)
    assert len(result.token_ids) <= 5 and server.scheduler.load() == (0, 0)


def test_speculation_needs_a_speculator_per_sequence(tiny):
    model, tok = tiny
    with pytest.raises(ValueError, match="new_plan"):
        Server(Engine(model, tok, SpecPlan(ngram())), model_id="m")


def test_a_server_drafts_from_earlier_requests_by_default_and_each_text_is_its_own(tmp_path):
    """``serve --spec`` with ``auto`` and no drafter takes the suffix speculator: one store for the
    server's lifetime, fed by every finished request and read by the concurrent ones. Four clients at
    once, twice over, greedy and seeded: each response equals the request's plain text on a fresh
    engine; the second round drafts from the first round's answers (hits in /metrics)."""
    from tsspec.session import Session
    from tsspec.settings import resolve_run
    from tsspec.spec.suffix import SuffixSpeculator

    path = write_tiny_model(tmp_path / "m.gguf", "qwen2", seed=4, vocab_size=400, ctx=1024)
    session = Session.open(resolve_run(model=str(path), weights="f32",
                                       speculation={"enabled": True, "type": "auto", "draft": 4}))
    assert isinstance(session.speculation().plan.speculator, NGramSpeculator)  # one-shot runs keep n-gram
    spec = session.speculation(long_lived=True)
    assert isinstance(spec.plan.speculator, SuffixSpeculator)
    # every request's governor leaves its parks where the others' see them (one engine's), and no other's
    another = spec.new_plan()
    assert another.governor is not spec.plan.governor
    assert another.governor.shared_parks is spec.plan.governor.shared_parks is not None
    assert session.speculation(long_lived=True).plan.governor.shared_parks is not spec.plan.governor.shared_parks
    server = Server(session.engine(spec), model_id="m", parallel=4, slots=2)
    client = TestClient(create_app(server))
    plain = Engine(session.target, session.tokenizer)
    reqs = concurrent_requests(n=4, max_tokens=32)
    alone = []
    for route, body in reqs:
        tok = session.tokenizer
        ids = chat_prompt_ids(tok, body["messages"]) if "messages" in body else tok.encode(body["prompt"])
        sampler = Sampler(SamplingParams(temperature=body["temperature"], seed=body["seed"]))
        alone.append(plain.generate(ids, sampler=sampler, max_tokens=body["max_tokens"]).text)
    store = spec.shared["suffix-store"]
    for round_ in range(2):
        with ThreadPoolExecutor(max_workers=4) as pool:
            together = list(pool.map(lambda rb: text_of(client, *rb), reqs))
        assert together == alone, f"round {round_}"
        if round_ == 0:
            first_hits = store.hits
    assert store.sequences_added == 2 * len(reqs)
    assert store.hits > first_hits  # the repeated requests found their earlier answers
    metrics = client.get("/metrics").text
    held = re.search(r"^tsspec_suffix_store_tokens (\d+)$", metrics, re.M)
    assert held and 0 < int(held.group(1)) <= store.budget
    assert re.search(r"^tsspec_suffix_hits_total [1-9]", metrics, re.M)
    assert "# TYPE tsspec_suffix_hit_ratio gauge" in metrics
