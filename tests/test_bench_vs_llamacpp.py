"""Pure helpers of scripts/bench_vs_llamacpp.py: llama-bench JSON, round order, ratios, the curve."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "bench_vs_llamacpp.py"
_spec = importlib.util.spec_from_file_location("bench_vs_llamacpp", _PATH)
bvl = importlib.util.module_from_spec(_spec)
sys.modules["bench_vs_llamacpp"] = bvl  # dataclasses look their module up by name
_spec.loader.exec_module(bvl)

# trimmed from a real `llama-bench -m smollm2-135m.gguf -t 2 -p 0 -n 8 -r 1 -o json` (b11434)
RECORD = {
    "build_commit": "unknown", "build_number": 11434, "cpu_info": "AMD EPYC", "gpu_info": "",
    "backends": "CPU", "model_filename": "/m/smollm2-135m.gguf", "model_type": "llama 256M Q4_1",
    "model_size": 96576768, "model_n_params": 134515008, "n_batch": 2048, "n_ubatch": 512,
    "n_threads": 2, "n_prompt": 0, "n_gen": 8, "n_depth": 0, "test_time": "2026-11-30T22:47:48Z",
    "avg_ns": 7790097355, "stddev_ns": 0, "avg_ts": 1.026945, "stddev_ts": 0.0,
    "samples_ns": [7790097355], "samples_ts": [1.02694],
}


def test_parse_llama_bench_json():
    (r,) = bvl.parse_llama_bench_json(json.dumps([RECORD]))
    assert (r.n_prompt, r.n_gen, r.n_threads, r.build_number) == (0, 8, 2, 11434)
    assert r.build_commit == "unknown" and r.model_type == "llama 256M Q4_1"
    assert r.samples_ts == (1.02694,) and r.avg_ts == pytest.approx(1.026945)


def test_parse_llama_bench_json_several_and_missing_samples():
    rec = {k: v for k, v in RECORD.items() if k != "samples_ts"}
    out = bvl.parse_llama_bench_json(json.dumps([RECORD, rec]))
    assert len(out) == 2 and out[1].samples_ts == ()


@pytest.mark.parametrize("text", ["", "not json", "{}", json.dumps([{"n_gen": 1}]), json.dumps([1])])
def test_parse_llama_bench_json_rejects(text):
    with pytest.raises(ValueError):
        bvl.parse_llama_bench_json(text)


def test_llama_bench_argv():
    argv = bvl.llama_bench_argv("/b/llama-bench", "/m/x.gguf", 2, 0, 64, 3, ["-fa", "on"])
    assert argv == ["/b/llama-bench", "-m", "/m/x.gguf", "-t", "2", "-p", "0", "-n", "64", "-r", "3",
                    "-o", "json", "-fa", "on"]
    argv = bvl.llama_bench_argv("/b/llama-bench", "/m/x.gguf", 2, 0, 64, 3, depth=512)
    assert argv[argv.index("-d") + 1] == "512" and argv.index("-d") < argv.index("-o")


def test_depth_flag_is_checked():
    assert bvl.parse_args(["--depth", "256"]).depth == 256
    assert bvl.parse_args([]).depth == 0
    with pytest.raises(SystemExit):
        bvl.parse_args(["--depth", "-1"])


def test_round_orders_alternate():
    o = bvl.round_orders(4)
    assert o[0] == o[2] == (bvl.TSSPEC, bvl.LLAMA) and o[1] == o[3] == (bvl.LLAMA, bvl.TSSPEC)
    assert bvl.round_orders(0) == []


def test_compare():
    c = bvl.compare([50.0, 60.0, 40.0], [100.0, 100.0, 80.0])
    assert c["tsspec"]["median"] == 50.0 and c["llama"]["median"] == 100.0
    assert c["ratio"] == pytest.approx(0.5)
    assert c["round_ratios"] == pytest.approx([0.5, 0.6, 0.5])
    assert (c["round_ratio_min"], c["round_ratio_max"]) == pytest.approx((0.5, 0.6))
    assert c["round_ratio_geomean"] == pytest.approx((0.5 * 0.6 * 0.5) ** (1 / 3))
    with pytest.raises(ValueError):
        bvl.compare([1.0], [1.0, 2.0])
    with pytest.raises(ValueError):
        bvl.compare([], [])


def test_curve_table():
    t = bvl.curve_table({2: [4.0, 5.0, 6.0], 1: [2.0, 3.0, 2.5], 5: [10.0]})
    assert [row["rows"] for row in t] == [1, 2, 5]
    assert t[0]["ratio_to_1"] == 1.0 and t[1]["ratio_to_1"] == pytest.approx(2.0)
    assert t[1]["ms_per_row"] == pytest.approx(2.5) and (t[1]["ms_min"], t[1]["ms_max"]) == (4.0, 6.0)
    assert t[2]["note"] == "k=4" and t[0]["note"] == ""
    assert bvl.curve_table({3: [1.0]})[0]["ratio_to_1"] is None


def test_recorded_sha256_reads_the_sidecar(tmp_path):
    from tsspec.hub import recorded_sha256

    h = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    model = tmp_path / "m.gguf"
    assert recorded_sha256(model) is None
    (tmp_path / "m.gguf.sha256").write_text(f"{h.upper()}  m.gguf\n")
    assert recorded_sha256(model) == h


def test_llama_tool_missing_names_the_build(tmp_path):
    from tsspec.bench.llama_server import llama_tool
    from tsspec.errors import BadInput

    with pytest.raises(BadInput, match="build_llamacpp.sh"):
        llama_tool("llama-bench", tmp_path)
    exe = tmp_path / "llama-bench"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    assert llama_tool("llama-bench", tmp_path) == exe


