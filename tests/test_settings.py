"""Settings resolved once: ``tsspec.env`` is the only reader of the environment, and a run is
composed in one place, ``tsspec.session.Session``, from the frozen configuration it resolves."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from tiny import write_tiny_model
from tsspec.errors import BadInput
from tsspec.generate import Engine
from tsspec.options import SpecOptions
from tsspec.sampling import Sampler
from tsspec.session import Session, Speculation
from tsspec.settings import RunConfig, cache_root, kernels_enabled, llama_cpp_dir, recorded_env, resolve_run
from tsspec.spec.ngram import NGramSpeculator

PACKAGE = Path(__file__).resolve().parents[1] / "tsspec"


def test_only_the_env_module_reads_the_environment():
    readers = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "env.py" and path.parent == PACKAGE:
            continue
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            code = line.split("#", 1)[0]
            if re.search(r"\bos\.environ\b|\bgetenv\(|\benviron\.get\(", code) and "``" not in code:
                readers.append(f"{path.relative_to(PACKAGE.parent)}:{i}: {line.strip()}")
    assert not readers, "\n".join(readers)


def test_defaults_from_an_empty_environment():
    c = resolve_run(env={})
    # "auto" resolves to CUDA where torch sees a usable GPU (the lent GPU machine), else the CPU
    assert c.device in ("cpu", "cuda") and c == dataclasses.replace(RunConfig(), device=c.device)
    assert (c.weights, c.draft_weights, c.dflash_conv, c.dflash_selector, c.verify_snapshots) == (
        "auto", "auto", True, True, True)
    assert c.spec == SpecOptions() and not c.spec.enabled and c.warnings == ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.weights = "f32"  # type: ignore[misc]


def c0() -> RunConfig:
    """The defaults, on whatever device "auto" resolves to here."""
    return dataclasses.replace(RunConfig(), device=resolve_run(env={}).device)


def test_each_variable_and_flag_resolves():
    env = {"TSSPEC_WEIGHTS": " F32 ", "TSSPEC_DRAFT_WEIGHTS": "int4", "TS_DFLASH_CONV": "0",
           "TS_DFLASH_SELECTOR": "off", "TS_Q35_VERIFY_SNAPSHOTS": "no", "TS_SPEC_DRAFT": "3"}
    c = resolve_run(env=env, speculation={"enabled": True}, ctx_size=64, threads=1, model="m.gguf")
    assert (c.weights, c.draft_weights) == ("f32", "int4")
    assert not (c.dflash_conv or c.dflash_selector or c.verify_snapshots)
    assert c.spec.enabled and c.spec.draft == 3 and c.spec.draft_explicit
    assert (c.ctx_size, c.threads, c.model) == (64, 1, "m.gguf")
    # the flag beats the variable, which then is not even looked at
    assert resolve_run(weights="bf16", env={"TSSPEC_WEIGHTS": "int3"}).weights == "bf16"
    # a command without speculation flags (bench) does not read TS_SPEC_*/TS_MTP_*
    assert not resolve_run(env={"TS_SPEC_SPEC": "1", "TS_MTP_DRAFT": "lots"}).spec.enabled
    assert resolve_run(env={"TS_DFLASH_CONV": " On "}).dflash_conv
    # the empty string is unset; anything else must be valid
    assert resolve_run(env={"TS_DFLASH_CONV": "", "TSSPEC_WEIGHTS": "", "TSSPEC_DRAFT_WEIGHTS": ""}) == c0()
    assert set(c.provenance()) == {f.name for f in dataclasses.fields(RunConfig)} - {"warnings"}


@pytest.mark.parametrize("kwargs, env, needle", [
    ({"weights": "int3"}, {}, "--weights 'int3': expected one of"),
    ({}, {"TSSPEC_WEIGHTS": "int3"}, "TSSPEC_WEIGHTS='int3': expected one of"),
    ({}, {"TSSPEC_DRAFT_WEIGHTS": "q8"}, "TSSPEC_DRAFT_WEIGHTS='q8': expected one of"),
    ({"ctx_size": 8}, {}, "--ctx-size must be >= 16"),
    ({"threads": 0}, {}, "--threads must be between 1 and"),
    ({"speculation": {}}, {"TS_MTP_DRAFT": "lots"}, "TS_MTP_DRAFT"),
    ({}, {"TS_DFLASH_CONV": "of"}, "TS_DFLASH_CONV='of': expected 0/1"),  # a typo is not "on"
    ({}, {"TS_Q35_VERIFY_SNAPSHOTS": " "}, "TS_Q35_VERIFY_SNAPSHOTS=' '"),
    ({}, {"TSSPEC_WEIGHTS": " "}, "TSSPEC_WEIGHTS=' ': expected one of"),
    ({"device": "gpu"}, {}, "--device 'gpu': expected one of auto, cpu, cuda"),
    ({}, {"TSSPEC_DEVICE": "1"}, "TSSPEC_DEVICE='1': expected one of auto, cpu, cuda"),
])
def test_bad_values_are_one_line(kwargs, env, needle):
    with pytest.raises(BadInput) as e:
        resolve_run(env=env, **kwargs)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_process_wide_switches(tmp_path):
    assert cache_root({}) is None and cache_root({"TSSPEC_CACHE": str(tmp_path)}) == tmp_path
    assert kernels_enabled({}) and not kernels_enabled({"TSSPEC_KERNELS": "0"})
    assert kernels_enabled({"TSSPEC_KERNELS": ""}) and cache_root({"TSSPEC_CACHE": ""}) is None
    for raw in ("maybe", " "):
        with pytest.raises(BadInput, match="TSSPEC_KERNELS"):
            kernels_enabled({"TSSPEC_KERNELS": raw})
    with pytest.raises(BadInput, match="TSSPEC_CACHE=' ': a blank path"):
        cache_root({"TSSPEC_CACHE": " "})
    assert llama_cpp_dir({"LLAMA_CPP_DIR": str(tmp_path)}) == tmp_path
    assert recorded_env({"TS_DFLASH_CONV": "0", "TSSPEC_WEIGHTS": "f32", "HOME": "/"}) == {
        "TSSPEC_WEIGHTS": "f32", "TS_DFLASH_CONV": "0"}


def test_deep_code_does_not_read_the_environment(monkeypatch, tmp_path):
    from tsspec.models import load_model
    from tsspec.weights import load_format

    monkeypatch.setenv("TSSPEC_WEIGHTS", "f32")
    assert load_format(None) == "auto"
    m = load_model(write_tiny_model(tmp_path / "m.gguf", "llama", quant="Q8_0"))
    assert m.blocks[0].qkv.fmt != "f32"


# ----------------------------------------------------------------------------- the session


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("session") / "m.gguf", "llama", seed=3)


def test_session_composes_a_run(model_path):
    config = resolve_run(model=str(model_path), weights="f32", ctx_size=128,
                         speculation={"enabled": True, "type": "ngram", "draft": 4})
    s = Session.open(config)
    assert s.path == model_path and s.target.max_context == 128
    assert s.target.blocks[0].qkv.fmt == "f32"
    spec = s.speculation()
    assert isinstance(spec.plan.speculator, NGramSpeculator) and spec.plan.window == 4 and spec.plan.accept_rule is None
    assert spec.plan.governor is not None and spec.notes == ()
    assert s.speculation(SpecOptions(enabled=False)) == Speculation()
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    plain = s.engine().generate(prompt, sampler=Sampler(), max_tokens=12, ignore_eos=True)
    fast = s.engine(spec)
    assert isinstance(fast, Engine) and fast.plan is spec.plan  # the session's plan, passed on unchanged
    assert fast.generate(prompt, sampler=Sampler(), max_tokens=12, ignore_eos=True).token_ids == plain.token_ids
    names = [name for name, _ok, _why in s.explain()]
    assert "ngram" in names and s.auto_order() == ["draft-head", "ngram"]


def test_session_attaches_a_draft_model(model_path, tmp_path):
    drafter_path = write_tiny_model(tmp_path / "d.gguf", "llama", seed=3, n_layers=1)
    s = Session.open(resolve_run(model=str(model_path), env={"TSSPEC_DRAFT_WEIGHTS": "bf16"}))
    warned: list[str] = []
    s._warn = warned.append
    spec = s.speculation(SpecOptions(enabled=True, draft_model=str(drafter_path)))
    assert spec.plan.speculator.name == "draft-model"
    assert spec.plan.window == 4  # the draft model's measured preference, under the default 8
    assert s.load_drafter(drafter_path).model.blocks[0].qkv.fmt == "bf16"
    assert s.speculation(SpecOptions(enabled=True, draft=6, draft_explicit=True,
                                     draft_model=str(drafter_path))).plan.window == 6


def test_the_device_resolves(monkeypatch):
    from tsspec.kernels import device

    assert resolve_run(device="cpu").device == "cpu"
    assert resolve_run(env={"TSSPEC_DEVICE": " CPU "}).device == "cpu"
    assert resolve_run(device="cpu", env={"TSSPEC_DEVICE": "gpu"}).device == "cpu"  # the flag wins, unread
    # where cuda cannot run: auto is the CPU, and cuda asked for is one line saying why
    monkeypatch.setattr(device, "cuda_unusable", lambda: "torch sees no CUDA GPU")
    assert resolve_run(env={}).device == "cpu" and resolve_run(device="auto").device == "cpu"
    for kwargs, env, said in (({"device": "cuda"}, {}, "--device cuda"),
                              ({}, {"TSSPEC_DEVICE": "Cuda"}, "TSSPEC_DEVICE='Cuda'")):
        with pytest.raises(BadInput, match=f"^{re.escape(said)}: torch sees no CUDA GPU$"):
            resolve_run(env=env, **kwargs)
    # where it can: auto picks it, unless a CPU weight format is asked for; cuda then refuses that
    monkeypatch.setattr(device, "cuda_unusable", lambda: None)
    monkeypatch.setattr(device, "no_nvidia_device", lambda: False)
    assert resolve_run(env={}).device == "cuda" and resolve_run(device="cuda").device == "cuda"
    assert resolve_run(weights="bf16").device == "cpu"
    with pytest.raises(BadInput, match="GPU path runs the file's own GGUF blocks"):
        resolve_run(device="cuda", env={"TSSPEC_WEIGHTS": "f32"})


def test_auto_is_the_cpu_without_asking_torch_where_no_nvidia_device_exists(monkeypatch):
    """No NVIDIA device node or driver on Linux: "auto" is the CPU, and torch is not asked (a plain
    run then never imports it); with one, torch decides as before."""
    from tsspec.kernels import device

    asked, real = [], device.no_nvidia_device
    monkeypatch.setattr(device, "cuda_unusable", lambda: asked.append(1))  # None: usable
    monkeypatch.setattr(device, "no_nvidia_device", lambda: True)
    assert device.resolve("auto") == "cpu" and asked == []
    monkeypatch.setattr(device, "no_nvidia_device", lambda: False)
    assert device.resolve("auto") == "cuda" and asked == [1]
    import glob

    monkeypatch.setattr(device.sys, "platform", "linux")
    monkeypatch.setattr(glob, "glob", lambda pattern: [])
    monkeypatch.setattr(device.os.path, "exists", lambda p: p == "/proc/driver/nvidia")
    assert real() is False
    monkeypatch.setattr(device.os.path, "exists", lambda p: False)
    assert real() is True
    monkeypatch.setattr(device.sys, "platform", "darwin")
    assert real() is False  # elsewhere torch is asked


def test_no_gpu_reasons_are_sentences(monkeypatch):
    import torch

    from tsspec.kernels import device

    monkeypatch.setattr(torch.version, "cuda", None)
    assert "built without CUDA" in device.cuda_missing()
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device.cuda_missing() == "torch sees no CUDA GPU"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert device.cuda_missing() is None
    monkeypatch.setitem(__import__("sys").modules, "triton", None)  # an import that fails
    assert "triton is not importable" in device.triton_missing() and device.cuda_unusable() is not None
