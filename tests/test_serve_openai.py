"""The official ``openai`` Python client against a real ``tsspec serve`` process on loopback: chat and
completions, streaming and not, greedy and seeded, with n-gram speculation on. Every text is the one
``Engine.generate`` (what ``tsspec generate`` runs) gives for the same prompt and sampling; streamed
pieces join to the non-streamed text; the client's typed objects parse every response (usage, finish
reasons, the ``tsspec`` extension field) and its error classes carry the server's OpenAI-style errors.
"""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai", reason="the openai client is in the test extra: pip install -e '.[test]'")

from serve_proc import serve  # noqa: E402
from tiny import write_tiny_model  # noqa: E402
from tsspec.chat import chat_prompt_ids  # noqa: E402
from tsspec.generate import Engine  # noqa: E402
from tsspec.models import load_model  # noqa: E402
from tsspec.sampling import Sampler, SamplingParams  # noqa: E402
from tsspec.tokenizer import Tokenizer  # noqa: E402

SYSTEM = {"role": "system", "content": "You answer in one short sentence about fruit and colors."}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(client, model path): one real server process for the module, n-gram speculation on and drafting
    every step: with the cost governor on, whether a draft is tried depends on how fast the machine ran
    the last steps, and the tests below assert that speculation ran and was taken."""
    path = write_tiny_model(tmp_path_factory.mktemp("serve_openai") / "tiny.gguf", "qwen2", seed=5,
                            vocab_size=400, ctx=1024)
    with serve(path, "--parallel", "4", "-t", "1", "--spec", "--spec-type", "ngram",
               "--no-spec-adaptive") as (_, port):
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120), path


@pytest.fixture(scope="module")
def engine(served):
    path = served[1]
    return Engine(load_model(path), Tokenizer.from_gguf(path))


def _want(engine, *, prompt=None, messages=None, max_tokens, temperature=0.0, seed=0, stop=()):
    ids = chat_prompt_ids(engine.tokenizer, messages) if messages is not None else engine.tokenizer.encode(prompt)
    sampler = Sampler(SamplingParams(temperature=temperature, seed=seed))
    return engine.generate(ids, sampler=sampler, max_tokens=max_tokens, stop=stop), len(ids)


def test_models_list_names_the_served_file(served):
    client, path = served
    models = client.models.list()
    assert [m.id for m in models.data] == [path.stem]
    assert models.data[0].owned_by == "tsspec"


@pytest.mark.parametrize("temperature,seed", [(0.0, 0), (0.9, 17)], ids=["greedy", "seeded"])
def test_chat_completion_stream_and_not_equal_generate(served, engine, temperature, seed):
    client, path = served
    messages = [SYSTEM, {"role": "user", "content": "red apple, green apple, red apple?"}]
    want, n_prompt = _want(engine, messages=messages, max_tokens=20, temperature=temperature, seed=seed)

    r = client.chat.completions.create(model=path.stem, messages=messages, max_tokens=20,
                                       temperature=temperature, seed=seed)
    assert r.object == "chat.completion" and r.model == path.stem
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == n_prompt and r.usage.completion_tokens == len(want.token_ids)
    assert r.usage.total_tokens == n_prompt + len(want.token_ids)
    ext = r.model_extra["tsspec"]  # the extension field, kept by the client's models
    assert ext["reused_tokens"] + ext["prefilled_tokens"] == n_prompt

    pieces, finish, usage = [], None, None
    with client.chat.completions.create(model=path.stem, messages=messages, max_tokens=20, temperature=temperature,
                                        seed=seed, stream=True) as events:
        for ev in events:
            assert ev.object == "chat.completion.chunk"
            if ev.choices and ev.choices[0].delta.content:
                pieces.append(ev.choices[0].delta.content)
            if ev.choices and ev.choices[0].finish_reason:
                finish = ev.choices[0].finish_reason
            if ev.usage is not None:
                usage = ev.usage
    assert "".join(pieces) == want.text
    assert len(pieces) > 1, "the reply came in one piece: it was not streamed"
    assert finish == r.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == len(want.token_ids)


@pytest.mark.parametrize("temperature,seed", [(0.0, 0), (0.8, 3)], ids=["greedy", "seeded"])
def test_completion_stream_and_not_equal_generate(served, engine, temperature, seed):
    client, path = served
    prompt = "red green blue the cat sat on the mat red green blue the cat"
    want, n_prompt = _want(engine, prompt=prompt, max_tokens=24, temperature=temperature, seed=seed)

    r = client.completions.create(model=path.stem, prompt=prompt, max_tokens=24, temperature=temperature, seed=seed)
    assert r.object == "text_completion"
    assert r.choices[0].text == want.text
    assert r.usage.prompt_tokens == n_prompt and r.usage.completion_tokens == len(want.token_ids)
    ext = r.model_extra["tsspec"]
    assert ext["speculator"] == "ngram" and ext["verify_calls"] > 0 and ext["accepted_tokens"] > 0

    pieces = []
    for ev in client.completions.create(model=path.stem, prompt=prompt, max_tokens=24, temperature=temperature,
                                        seed=seed, stream=True):
        if ev.choices:
            pieces.append(ev.choices[0].text)
    assert "".join(pieces) == want.text


def test_stop_strings_through_the_client(served, engine):
    client, path = served
    prompt = "red green blue the cat sat on the mat"
    full, _ = _want(engine, prompt=prompt, max_tokens=24)
    stop = full.text[3:5]  # a string the greedy reply does contain
    want, _ = _want(engine, prompt=prompt, max_tokens=24, stop=(stop,))
    r = client.completions.create(model=path.stem, prompt=prompt, max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].text == want.text and stop not in r.choices[0].text
    assert r.choices[0].finish_reason == "stop"


def test_errors_arrive_as_the_clients_error_classes(served):
    client, path = served
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert "no-such-model" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=path.stem, prompt="x", max_tokens=4, temperature=-1)
    assert "temperature" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:  # longer than the context
        client.completions.create(model=path.stem, prompt="red " * 2000, max_tokens=4)
    assert "context" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:  # an agent's tools are refused, not silently dropped
        client.chat.completions.create(model=path.stem, messages=[{"role": "user", "content": "x"}], tools=[
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}])
    assert "tool" in e.value.message
    # and the server still serves
    assert client.completions.create(model=path.stem, prompt="red", max_tokens=2, temperature=0).choices
