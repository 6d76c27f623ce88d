"""The lean path (``tsspec.models.lean``): a plain greedy run on the native kernels without torch.

It must give the torch model's bits (the same C calls on the same values), take exactly the runs
and files it can, and leave torch unimported on the way to a first token."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from tiny import ARCHS, write_tiny_model

from tsspec import kernels
from tsspec.gguf_file import GGUFFile
from tsspec.models import load_model
from tsspec.models import lean
from tsspec.models.config import rope_tables
from tsspec.models.ops import rope_tables as torch_rope_tables
from tsspec.options import SpecOptions
from tsspec.sampling import Sampler
from tsspec.sampling_params import SamplingParams
from tsspec.settings import RunConfig

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the lean path runs on the native kernels")

# a prompt longer than one prefill chunk (256) and than a cache's first capacity (512 positions)
LONG = [(7 * i + 3) % 250 + 3 for i in range(600)]


def _bits(x) -> np.ndarray:
    a = x.numpy() if isinstance(x, torch.Tensor) else x
    return np.ascontiguousarray(a, dtype=np.float32).view(np.int32)


def _pair(path, n_ctx=1024):
    g = GGUFFile(path)
    return load_model(GGUFFile(path), n_ctx=n_ctx), lean.load(g, n_ctx, kernels.thread_count())


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("quant,tied", [(None, True), ("Q4_K", False), ("Q8_0", True)])
def test_lean_logits_are_the_torch_models_bit_for_bit(tmp_path, arch, quant, tied):
    """A 600-token prompt (three prefill chunks, a cache that grows) and greedy steps: every row's
    logits equal the torch model's on its native runner, on every architecture the lean path takes."""
    path = write_tiny_model(tmp_path / f"{arch}.gguf", arch, quant=quant, tied=tied, ctx=1024)
    model, trunk = _pair(path)
    assert model.runner.name == "native"
    tc, lc = model.make_cache(), trunk.make_cache()
    for chunk in (LONG[:256], LONG[256:512], LONG[512:]):
        want = model.forward(chunk, tc).logits[-1]
        got = trunk.forward(chunk, lc)
        assert np.array_equal(_bits(got), _bits(want))
    assert lc.length == tc.length == len(LONG) and lc.capacity == tc.capacity
    tok = int(np.argmax(got))
    for _ in range(4):
        want = model.forward([tok], tc).logits[-1]
        got = trunk.forward([tok], lc)
        assert np.array_equal(_bits(got), _bits(want))
        tok = int(np.argmax(got))


def test_lean_generation_equals_the_torch_engines(tmp_path):
    """Through ``Engine.generate``: the same ids, text and stop reason as the torch model's plain run."""
    from tsspec.generate import Engine
    from tsspec.tokenizer import Tokenizer

    path = write_tiny_model(tmp_path / "q.gguf", "qwen2", quant="Q4_K", ctx=1024)
    model, trunk = _pair(path)
    tok = Tokenizer.from_metadata(GGUFFile(path).metadata)
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 8)
    from tsspec.spec.plain import LeanDecode

    got = Engine(trunk, tok, decoder=LeanDecode).generate(ids, sampler=SamplingParams(), max_tokens=40,
                                                           ignore_eos=True)
    want = Engine(model, tok).generate(ids, sampler=Sampler(), max_tokens=40, ignore_eos=True)
    assert got.token_ids == want.token_ids and got.text == want.text and got.stop_reason == want.stop_reason
    assert got.stats.plain_steps == want.stats.plain_steps == 39
    assert got.stats.prompt_tokens == len(ids) and got.stats.prefill_ms > 0


def test_lean_draws_only_greedily(tmp_path):
    path = write_tiny_model(tmp_path / "l.gguf", "llama")
    trunk = lean.load(GGUFFile(path), None, 1)
    from tsspec.spec.plain import LeanDecode

    with pytest.raises(ValueError, match="greedily"):
        LeanDecode(trunk, SamplingParams(temperature=0.7), cache=trunk.make_cache(), stats=None, drawable=None)
    with pytest.raises(ValueError, match="greedily"):
        LeanDecode(trunk, Sampler(SamplingParams(repeat_penalty=1.1)), cache=trunk.make_cache(), stats=None,
                   drawable=None)


def test_lean_refuses_what_the_torch_model_refuses(tmp_path):
    from tsspec.errors import BadInput

    path = write_tiny_model(tmp_path / "l.gguf", "llama", ctx=64)
    trunk = lean.load(GGUFFile(path), None, 1)
    with pytest.raises(BadInput, match="out of range"):
        trunk.forward([300], trunk.make_cache())
    with pytest.raises(BadInput, match="do not fit the context of 64"):
        trunk.forward(list(range(65)), trunk.make_cache())


def test_which_runs_the_lean_path_takes():
    greedy = SamplingParams()
    plain = RunConfig(spec=SpecOptions(enabled=False))
    assert lean.declines(plain, greedy) is None
    assert lean.declines(RunConfig(spec=SpecOptions(enabled=True)), greedy) == "speculation is on"
    assert "temperature" in lean.declines(plain, SamplingParams(temperature=0.5))
    assert "penalties" in lean.declines(plain, SamplingParams(presence_penalty=0.5))
    assert "weights bf16" in lean.declines(RunConfig(spec=SpecOptions(enabled=False), weights="bf16"), greedy)


def test_which_files_the_lean_path_takes(tmp_path):
    """A soft-capped head, or a matrix the kernels do not multiply (found before anything loads),
    sends the run to the torch model."""
    import gguf
    from tiny import rewrite_metadata

    def cap(kv):
        kv["gemma3.final_logit_softcapping"] = (30.0, gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.FLOAT32)

    capped = rewrite_metadata(write_tiny_model(tmp_path / "g.gguf", "gemma3"), tmp_path / "gc.gguf", cap)
    with pytest.raises(lean.Declined, match="soft-capped"):
        lean.load(GGUFFile(capped), None, 1)
    g = GGUFFile(write_tiny_model(tmp_path / "l.gguf", "llama"))
    cfg = __import__("tsspec.models.llama", fromlist=["config"]).config(g)
    assert lean.LeanTrunk.declines(g, cfg) is None
    with pytest.raises(lean.Declined, match="do not take"):
        lean.LeanLinear([type("W", (), {"type_name": "IQ2_XS", "shape": (32, 64)})()])


def test_rope_tables_are_one_definition():
    """The torch model's rope tables are the numpy ones the lean path computes, bit for bit."""
    for base, dim in ((10000.0, 64), (1000000.0, 128)):
        c, s = rope_tables(base, dim, 2048)
        tc, ts = torch_rope_tables(base, dim, 2048)
        assert np.array_equal(_bits(tc), _bits(c)) and np.array_equal(_bits(ts), _bits(s))
        assert c.dtype == np.float32 and c.shape == (2048, dim // 2)


def test_thread_count_follows_torch_where_it_is_imported():
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert kernels.thread_count() == 1
    finally:
        torch.set_num_threads(n)
    assert kernels.default_threads() >= 1
    from tsspec.env import omp_threads

    assert omp_threads({"OMP_NUM_THREADS": " 3,2"}) == 3 and omp_threads({}) is None
    assert omp_threads({"OMP_NUM_THREADS": "0"}) is None and omp_threads({"OMP_NUM_THREADS": "many"}) is None


def _cli(args: list[str], tmp_path) -> dict:
    """``tsspec generate`` in a fresh interpreter: its JSON and whether torch was imported."""
    code = ("import sys, io, contextlib, json\n"
            "from tsspec.cli import run\n"
            "buf = io.StringIO()\n"
            "with contextlib.redirect_stdout(buf):\n"
            f"    rc = run({args!r})\n"
            "print(json.dumps({'rc': rc, 'out': buf.getvalue(), 'torch': 'torch' in sys.modules}))\n")
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith(("TS_SPEC", "TS_MTP"))}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_plain_greedy_generate_never_imports_torch(tmp_path):
    """The scripted one-prompt case: ``generate --no-spec`` reaches its tokens without torch, and
    they are the tokens of the torch path (the same run with n-gram speculation, which equals plain)."""
    path = str(write_tiny_model(tmp_path / "m.gguf", "gemma3", quant="Q4_0", ctx=512))
    base = ["generate", "-m", path, "-p", "the quick brown fox", "-n", "12", "--ignore-eos", "--json"]
    plain = _cli([*base, "--no-spec"], tmp_path)
    assert plain["rc"] == 0 and plain["torch"] is False
    spec = _cli([*base, "--spec", "--spec-type", "ngram"], tmp_path)
    assert spec["rc"] == 0 and spec["torch"] is True
    a, b = json.loads(plain["out"]), json.loads(spec["out"])
    assert a["token_ids"] == b["token_ids"] and len(a["token_ids"]) == 12 and a["text"] == b["text"]
    assert a["load_ms"] > 0 and a["first_token_ms"] > 0


REAL_MODELS = ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]


@pytest.mark.real_model
@pytest.mark.parametrize("name", REAL_MODELS)
def test_lean_logits_on_the_real_models(name, real_model_path, real_model_threads):
    """On each real model: a 300-token prompt and 6 greedy steps give the torch model's logits bit
    for bit on the lean trunk (the file's own tokenizer, its own embedding and head layout)."""
    from tsspec.tokenizer import Tokenizer

    path = real_model_path(name)
    model, trunk = _pair(path, n_ctx=2048)
    tok = Tokenizer.from_metadata(GGUFFile(path).metadata)
    text = ("def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
            "The fibonacci numbers grow like powers of the golden ratio. ") * 6
    ids = tok.encode(text)[:300]
    tc, lc = model.make_cache(), trunk.make_cache()
    want, got = model.forward(ids, tc).logits[-1], trunk.forward(ids, lc)
    assert np.array_equal(_bits(got), _bits(want))
    for _ in range(6):
        t = int(np.argmax(got[: tok.vocab_size]))
        want, got = model.forward([t], tc).logits[-1], trunk.forward([t], lc)
        assert np.array_equal(_bits(got), _bits(want))


def test_other_trunks_and_a_run_without_kernels_take_the_torch_model(tmp_path, monkeypatch):
    """A hybrid (recurrent) trunk is not the llama block: declined by name, and the session loads the
    torch model for it; without the native kernels no run is for the lean path."""
    from tiny_hybrid import write_hybrid

    from tsspec.session import Session

    path, _ = write_hybrid(tmp_path / "h.gguf")
    with pytest.raises(lean.Declined, match="not the llama block"):
        lean.load(GGUFFile(path), None, 1)
    config = RunConfig(model=str(path), spec=SpecOptions(enabled=False))
    session = Session.open(config, progress=False, lean=True)
    assert not session.lean and session.target.__class__.__name__ != "LeanTrunk"
    tiny = Session.open(RunConfig(model=str(write_tiny_model(tmp_path / "t.gguf", "qwen3")),
                                  spec=SpecOptions(enabled=False)), progress=False, lean=True)
    assert tiny.lean and isinstance(tiny.target, lean.LeanTrunk)
    with pytest.raises(ValueError, match="decodes plainly"):
        tiny.speculation(SpecOptions(enabled=True))
    monkeypatch.setattr(kernels, "_force_off", True)
    assert "native kernels unavailable" in lean.declines(RunConfig(spec=SpecOptions(enabled=False)), SamplingParams())


def test_many_prompts_on_the_lean_path_equal_the_torch_path(tmp_path):
    """``--prompts``: one engine, its cache reset between prompts, the same tokens as the torch run."""
    path = str(write_tiny_model(tmp_path / "m.gguf", "llama", quant="Q8_0", ctx=512))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "text": "the cat sat"}\n{"id": "b", "text": "on the mat and the dog"}\n')
    base = ["generate", "-m", path, "--prompts", str(prompts), "-n", "10", "--ignore-eos", "--json"]
    plain = _cli(base, tmp_path)
    spec = _cli([*base, "--spec", "--spec-type", "ngram"], tmp_path)
    assert plain["torch"] is False and spec["torch"] is True
    a = [json.loads(x) for x in plain["out"].splitlines()]
    b = [json.loads(x) for x in spec["out"].splitlines()]
    assert [x["id"] for x in a] == ["a", "b"] and [x["token_ids"] for x in a] == [x["token_ids"] for x in b]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_lean_logits_through_the_tiles_equal_vnnis(tmp_path, arch):
    """The lean path's products through the (emulated, on every CPU) AMX tiles: a multi-row prompt
    whose products the tiles take gives the bits the SIMD path gives (TSSPEC_AMX 0 and 1 alike)."""
    path = write_tiny_model(tmp_path / "m.gguf", arch, quant="Q4_0", d_model=128, ffn_dim=256, vocab_size=320,
                            ctx=256)
    trunk = lean.load(GGUFFile(path), None, 2)
    ids = [int(t) for t in np.random.default_rng(3).integers(0, 300, size=40)]
    want = trunk.forward(ids, trunk.make_cache())
    was = kernels.amx_status() == "in use"
    kernels.use_tiles(2, min_rows=2)
    try:
        got = trunk.forward(ids, trunk.make_cache())
    finally:
        kernels.use_tiles(1 if was else 0)
    assert np.array_equal(_bits(got), _bits(want))


def test_without_torch_the_kernels_share_its_openmp_runtime_and_thread_count(tmp_path):
    """Loaded before torch (the lean path), the kernels bind torch's own libgomp.so.1, so importing
    torch later leaves one OpenMP runtime in the process; and the thread count they take without torch
    is the one torch then reports by default."""
    code = ("import sys\n"
            "from tsspec import kernels\n"
            "assert kernels.lib() is not None and 'torch' not in sys.modules\n"
            "n = kernels.thread_count()\n"
            "import torch\n"
            "gomp = {l.split()[-1] for l in open('/proc/self/maps') if 'libgomp' in l}\n"
            "print(len(gomp), n, torch.get_num_threads())\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "OMP_NUM_THREADS"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    libs, ours, torchs = map(int, r.stdout.split())
    assert libs == 1 and ours == torchs
