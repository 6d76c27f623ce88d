"""Every entry point turns hostile input into one ``error:`` line and its exit code: prompts that are
not UTF-8 (argv, stdin, a --prompts line, the file itself), template kwargs that clash or nest too
deep, chat templates that loop or grow without bound, out-of-range flags, and a cache or model file
the operating system refuses."""

from __future__ import annotations

import hashlib
import time

import pytest
from clirun import entry, run
from tiny import write_tiny_model
from tsspec import hub
from tsspec.chat import build_messages, parse_template_kwargs, render_chat
from tsspec.errors import BadInput, ModelFileError


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("hostile") / "tiny.gguf", arch="llama", seed=3))


def one_error(r, code, needle):
    assert r.exit_code == code, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    lines = [x for x in r.stderr.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    assert needle in lines[0], lines[0]


# ----------------------------------------------------------------------------- prompts


def test_prompt_argument_with_undecodable_bytes(model):
    # Python keeps argv bytes that are not UTF-8 as lone surrogates
    one_error(run("generate", "-m", model, "-p", "caf\udce9", "-n", "2"), 2, "-p prompt is not valid UTF-8")


def test_stdin_prompt_that_is_not_utf8(model):
    one_error(run("generate", "-m", model, "-n", "2", input=b"caf\xe9 au lait"), 2, "stdin is not UTF-8")
    r = run("generate", "-m", model, "-n", "2", "--quiet", input="caf\u00e9".encode())
    assert r.exit_code == 0, r.output


def test_prompts_file_not_utf8_or_with_surrogate_escapes(model, tmp_path):
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(b'{"text": "caf\xe9"}\n')
    one_error(run("generate", "-m", model, "--prompts", str(bad), "-n", "2"), 2, "is not UTF-8 text")
    esc = tmp_path / "escape.jsonl"
    esc.write_text('{"text": "ok"}\n{"text": "bad \\ud800 half"}\n')
    one_error(run("generate", "-m", model, "--prompts", str(esc), "-n", "2"), 2, ":2: the text is not valid UTF-8")
    deep = tmp_path / "deep.jsonl"
    deep.write_text("[" * 100000 + "]" * 100000 + "\n")
    one_error(run("generate", "-m", model, "--prompts", str(deep), "-n", "2"), 2, "nested too deeply")


def test_a_byte_order_mark_is_not_prompt_text(model, tmp_path):
    """A file saved with a UTF-8 BOM (Windows editors) gave the model the BOM as prompt tokens, and a
    --prompts file with one failed its first line as "not JSON"; -f, stdin and --prompts drop it."""
    import json

    def ids(*args, input=None):
        r = run("generate", "-m", model, "-n", "3", "--json", *args, input=input)
        assert r.exit_code == 0, r.output
        out = json.loads(r.stdout)
        return out["prompt_tokens"], out["token_ids"]

    want = ids("-p", "hello world")
    bom = tmp_path / "bom.txt"
    bom.write_bytes(b"\xef\xbb\xbfhello world")
    assert ids("-f", str(bom)) == want
    assert ids(input=b"\xef\xbb\xbfhello world") == want
    jl = tmp_path / "bom.jsonl"
    jl.write_bytes(b'\xef\xbb\xbf{"id": "a", "text": "hello world"}\n')
    r = run("generate", "-m", model, "-n", "3", "--quiet", "--prompts", str(jl))
    assert r.exit_code == 0, r.output
    from tsspec.bench.workloads import load_prompts

    assert [p.text for p in load_prompts(jl)] == ["hello world"]


def test_prompts_file_with_a_prompt_too_is_refused(model, tmp_path):
    """--prompts with -p or -f ran the file and dropped the other prompt without a word."""
    jl = tmp_path / "p.jsonl"
    jl.write_text('{"text": "one"}\n')
    one_error(run("generate", "-m", model, "-n", "2", "--prompts", str(jl), "-p", "hi"), 2,
              "give the prompts with --prompts or -p, not both")
    one_error(run("generate", "-m", model, "-n", "2", "--prompts", str(jl), "-f", str(jl)), 2,
              "give the prompts with --prompts or -f, not both")


def test_prompts_file_lines_are_checked_before_any_is_run(model, tmp_path):
    """An empty "text" on line 3 was found only after lines 1-2 ran, as "the prompt is empty" with no
    line; "id": null became the id "None"."""
    import json

    jl = tmp_path / "p.jsonl"
    jl.write_text('{"text": "one"}\n{"text": "two"}\n{"text": ""}\n')
    r = run("generate", "-m", model, "-n", "2", "--json", "--prompts", str(jl))
    one_error(r, 2, f"{jl}:3: the text is empty")
    assert r.stdout == ""  # nothing generated before the refusal
    jl.write_text('{"id": null, "text": "one"}\n{"id": "b", "text": "two"}\n')
    r = run("generate", "-m", model, "-n", "2", "--json", "--prompts", str(jl))
    assert r.exit_code == 0, r.output
    assert [json.loads(x)["id"] for x in r.stdout.splitlines()] == ["1", "b"]
    # ids key the results: a repeat (an explicit id, or a line's number standing in for one) is refused
    for text, line, pid in (('{"id": "a", "text": "one"}\n{"id": "a", "text": "two"}\n', 2, "a"),
                            ('{"text": "one"}\n{"id": 1, "text": "two"}\n', 2, "1")):
        jl.write_text(text)
        r = run("generate", "-m", model, "-n", "2", "--json", "--prompts", str(jl))
        one_error(r, 2, f"{jl}:{line}: the id '{pid}' is line 1's too")
        assert r.stdout == ""


def test_a_drafter_named_like_markup_is_named_in_its_note(tmp_path):
    """The drafter's note printed its file name as rich markup ('x[b]y.gguf' lost '[b]'), wrapped at
    the console's width."""
    from tiny_dflash import write_tiny_dflash

    trunk = write_tiny_model(tmp_path / "trunk.gguf", "qwen3", seed=1)
    drafter = write_tiny_dflash(tmp_path / "x[b]y.gguf", trunk)
    r = run("generate", "-m", str(trunk), "-p", "hi", "-n", "2", "--quiet", "--draft-model", str(drafter))
    assert r.exit_code == 0, r.output
    notes = [x for x in r.stderr.splitlines() if x.startswith("note:")]
    assert notes and notes[0].startswith("note: x[b]y.gguf: "), r.stderr


def test_system_and_stop_must_be_text(model):
    one_error(run("generate", "-m", model, "-p", "hi", "--stop", "\udcff", "-n", "2"), 2, "--stop is not valid UTF-8")


def test_tokenizer_refuses_lone_surrogates(model):
    from tsspec.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(model)
    with pytest.raises(BadInput, match="not valid UTF-8"):
        tok.encode("a\ud800b")


# ----------------------------------------------------------------------------- chat


@pytest.mark.parametrize("text, needle", [
    ('{"messages": []}', "messages cannot be set here"),
    ('{"bos_token": "x", "eos_token": "y"}', "bos_token, eos_token cannot be set here"),
    ('{"add_generation_prompt": false}', "add_generation_prompt cannot be set here"),
    ('{"a": ' * 50000 + "1" + "}" * 50000, "nested too deeply"),
    ('{"a": "\\udc80"}', "not valid UTF-8"),
])
def test_template_kwargs_refused(text, needle):
    with pytest.raises(BadInput, match=needle):
        parse_template_kwargs(text)


def test_template_kwargs_reserved_key_through_the_cli(model):
    one_error(run("generate", "-m", model, "-p", "hi", "--chat", "--chat-template-kwargs", '{"messages": 1}'),
              2, "messages cannot be set here")


@pytest.mark.parametrize("template, needle", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "time budget of 0.5 s"),
    # loops that never call anything: stopped by the watchdog, on any thread
    ("{% for i in 'x' * 30000 %}{% for j in 'y' * 30000 %}{% endfor %}{% endfor %}", "time budget of 0.5 s"),
    ("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}",
     "time budget of 0.5 s"),
    ("{{ 'x' * 10 ** 9 }}", "output budget of 1000"),
    ("{{ 'x' | center(10 ** 9) }}", "output budget of 1000"),
    ("{{ 'x'.ljust(10 ** 9) }}", "output budget of 1000"),
    ("{{ 7 ** (10 ** 9) }}", "output budget of 1000"),
    ("{% for i in range(3000) %}{{ 'y' * 900 }}{% endfor %}", "output budget of 1000"),
])
def test_template_budget(template, needle):
    t = time.perf_counter()
    with pytest.raises(BadInput, match=needle):
        # the size cases with a small output budget; the time cases with the default one
        render_chat(template, build_messages("hi"), seconds=0.5, max_chars=1000 if "output" in needle else None)
    assert time.perf_counter() - t < 3


def test_budget_leaves_ordinary_templates_alone():
    template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                "{% for i in range(3) | reverse %}{{ i }}{% endfor %}{{ range(5) | list | length }}{{ 'ab' * 2 }}")
    assert render_chat(template, build_messages("hi", system="s"), seconds=0.5) == "<system>s<user>hi210" + "5abab"
    # the default output budget grows with the messages: a long prompt is not a runaway template
    long = "z" * 2_000_000
    assert render_chat("{{ messages[0].content }}", build_messages(long)) == long


def test_sandbox_escapes_still_refused():
    for template in ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "{{ messages.append(1) }}",
                     "{{ cycler.__init__.__globals__ }}"):
        with pytest.raises(BadInput, match="failed to render"):
            render_chat(template, build_messages("hi"))


# ----------------------------------------------------------------------------- flags


@pytest.mark.parametrize("args, needle", [
    (["--threads", "100000"], "--threads must be between 1 and"),
    (["--threads", "0"], "--threads must be between 1 and"),
    (["--temp", "inf"], "--temp must be a finite number"),
    (["--temp", "nan"], "--temp must be a finite number"),
    (["--repeat-penalty", "inf"], "--repeat-penalty must be a finite number"),
])
def test_out_of_range_flags(model, args, needle):
    one_error(run("generate", "-m", model, "-p", "hi", "-n", "2", *args), 2, needle)


# ----------------------------------------------------------------------------- files and cache


def test_cache_that_is_a_file(tmp_path):
    f = tmp_path / "cachefile"
    f.write_text("not a directory")
    for args in (["models"], ["pull", "smollm2-135m"], ["generate", "-m", "smollm2-135m", "-p", "hi"]):
        one_error(run(*args, env={"TSSPEC_CACHE": str(f)}), 2, "$TSSPEC_CACHE")
    one_error(run("models", env={"TSSPEC_CACHE": str(f / "sub")}), 2, "cannot be created")


def test_read_only_cache_that_holds_the_model(tmp_path, monkeypatch):
    monkeypatch.setenv("TSSPEC_CACHE", str(tmp_path))
    data = b"GGUF fake model bytes"
    m = hub.KnownModel(name="fake-ro", description="fake", arch="llama", parts=(hub.WheelPart("p", "1", "m"),),
                       sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    monkeypatch.setitem(hub.KNOWN_MODELS, "fake-ro", m)
    hub.model_path("fake-ro").write_bytes(data)

    def read_only(*a, **k):
        raise PermissionError(13, "Permission denied", str(tmp_path))

    monkeypatch.setattr(hub, "_write_sidecar", read_only)
    monkeypatch.setattr(hub, "_lock", read_only)
    assert hub.ensure_model("fake-ro", progress=False) == hub.model_path("fake-ro")  # adopted, unwritten
    monkeypatch.setattr(hub, "is_cached", lambda name: True)
    assert hub.pull("fake-ro", progress=False) == hub.model_path("fake-ro")  # no lock taken
    with pytest.raises(hub.TsspecError, match="cannot write fake-ro into the cache .*Permission denied"):
        hub.pull("fake-ro", force=True, progress=False)


def test_unreadable_model_file(model, monkeypatch):
    from tsspec import gguf_file

    def denied(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(gguf_file, "open", denied, raising=False)
    with pytest.raises(ModelFileError, match="cannot read model file .*Permission denied"):
        gguf_file.GGUFFile(model)
    one_error(run("info", model), 3, "Permission denied")


# ----------------------------------------------------------------------------- huge prompts


def test_min_tokens_is_a_lower_bound(model):
    import random

    from tsspec.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(model)
    rng = random.Random(0)
    alphabet = "the cat sat on mat. \u00e9\u4e2d\U0001f600<|im_end|>\n"
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 200)))
        assert tok.min_tokens(text) <= len(tok.encode(text, add_special=False))


def test_prompt_far_past_the_context_is_refused_before_tokenizing(model):
    t = time.perf_counter()
    r = run("generate", "-m", model, "-p", "the cat sat. " * 2_000_000, "-n", "2", "-c", "64")
    one_error(r, 2, "prompt (at least")
    assert time.perf_counter() - t < 20  # tokenizing 26 MB would take far longer


def test_an_empty_stop_is_refused(model):
    """--stop '' matched before the first token: an empty reply and exit 0. Now one error line."""
    one_error(run("generate", "-m", model, "-p", "hi", "-n", "2", "--stop", ""), 2, "--stop cannot be empty")
    one_error(run("chat", "-m", model, "-n", "2", "--stop", "", input=b"hi\n"), 2, "--stop cannot be empty")


def test_a_seed_outside_64_bits_is_refused(model):
    """The draws key on the seed's 64 bits: --seed -1 ran as 2^64-1 and --seed 2^64 as 0, silently."""
    for seed in ("-1", str(2**64)):
        one_error(run("generate", "-m", model, "-p", "hi", "-n", "2", "--temp", "1", "--seed", seed), 2,
                  "--seed must be in [0, 2^64)")
    r = run("generate", "-m", model, "-p", "hi", "-n", "2", "--quiet", "--temp", "1", "--seed", str(2**64 - 1))
    assert r.exit_code == 0, r.output


# ----------------------------------------------------------------------------- every numeric flag

NUMERIC_FLAGS = ("-n", "--temp", "--top-k", "--top-p", "--min-p", "--repeat-penalty", "--repeat-last-n",
                 "--presence-penalty", "--frequency-penalty", "--seed", "-c", "-t", "--spec-draft", "--spec-pmin")
EDGE_VALUES = ("-1", "0", "nan", "inf", "-inf", "1e30", "99999999999999999999", "x")


def test_numeric_flag_edges_never_trace(model):
    """Every numeric flag of generate at every edge value, through the real entry point: a clean run,
    or one error line and exit 2 (a usage error where the parser could not read the value as the
    flag's type, else the command's refusal); never a traceback or a crash."""
    outcomes = {"ran": 0, "refused": 0, "usage": 0}
    for flag in NUMERIC_FLAGS:
        for value in EDGE_VALUES:
            code, out, err = entry("generate", "-m", model, "-p", "the cat", "-n", "2", "--quiet", "--spec",
                                   "--spec-type", "ngram", flag, value)
            what = f"{flag} {value}: exit {code} {err[-300:]}"
            assert "Traceback" not in out + err, what
            if code == 0:
                outcomes["ran"] += 1
                continue
            lines = [x for x in err.strip().splitlines() if x.strip()]
            assert code == 2 and len(lines) == 1 and lines[0].startswith("error:"), what
            outcomes["usage" if "Invalid value" in lines[0] else "refused"] += 1
    print(f"\nflag edges: {sum(outcomes.values())} cases, {outcomes}")
    assert outcomes["refused"] > 0 and outcomes["usage"] > 0
