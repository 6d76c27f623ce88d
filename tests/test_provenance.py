"""Provenance recorded with every measurement (tsspec/bench/provenance.py)."""

from __future__ import annotations

from tiny import write_tiny_model
from tsspec.bench import provenance
from tsspec.models import load_model
from tsspec.settings import resolve_run

CPUINFO = ("processor : 0\nmodel name : AMD EPYC 9654 96-Core Processor\n"
           "flags : fpu sse2 avx2 fma f16c avx512f avx512bw avx512vl avx512_vnni avx512_bf16 sha_ni\n"
           "processor : 1\nmodel name : other\n")


def test_cpu_model_and_flags_from_cpuinfo():
    assert provenance.cpu_model(CPUINFO) == "AMD EPYC 9654 96-Core Processor"
    assert provenance.cpu_model("processor : 0\n") == ""
    assert provenance.cpu_flags(CPUINFO) == ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                                             "avx512_vnni", "avx512_bf16"]
    assert provenance.cpu_flags("") == []


def test_parse_porcelain_keeps_leading_status_column():
    text = " M tsspec/weights.py\n?? tsspec/kernels/\nM  scripts/x.py\n"
    assert provenance.parse_porcelain(text) == [" M tsspec/weights.py", "?? tsspec/kernels/", "M  scripts/x.py"]
    assert provenance.parse_porcelain("") == []


def test_spec_env_takes_every_tsspec_variable_and_nothing_else():
    env = {"TSSPEC_WEIGHTS": "auto", "TS_SPEC_DRAFT": "4", "TS_MTP_DRAFT": "2", "HOME": "/root", "TSS": "x"}
    assert provenance.spec_env(env) == {"TSSPEC_WEIGHTS": "auto", "TS_MTP_DRAFT": "2", "TS_SPEC_DRAFT": "4"}


def test_git_state_outside_a_checkout(tmp_path):
    assert provenance.git_state(tmp_path) == {"commit": None, "dirty": None, "dirty_files": []}


def test_weight_formats_count_what_was_used(tmp_path, monkeypatch):
    """The recorded format is what the products run on (it once said bf16 for native runs)."""
    path = write_tiny_model(tmp_path / "m.gguf", arch="llama", quant="Q8_0")
    formats = provenance.weight_formats(load_model(path))
    assert formats and all(k.startswith("gguf:") for k in formats), formats
    monkeypatch.setenv("TSSPEC_WEIGHTS", "f32")  # read by tsspec.settings, passed to the loader
    assert set(provenance.weight_formats(load_model(path, fmt=resolve_run().weights))) == {"f32"}
