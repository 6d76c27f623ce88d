"""The GPU check's CPU-only parts (scripts/gpu_check.py, run by scripts/gpu_check.sh on a lent GPU):
its files have the known models' exact matrix shapes and quant types, its dry run measures and
prints the table on the CPU (spec == plain holds there too), and its arguments are checked."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

import gpu_check_module as gc


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    yield


@pytest.mark.parametrize("name", list(gc.MODELS))
def test_written_files_have_the_models_shapes_and_types(name, tmp_path):
    spec = gc.MODELS[name]
    path = gc.write_model(name, tmp_path / "m.gguf", layers=2, vocab=512)
    r = gguf.GGUFReader(str(path))
    t = {x.name: (x.tensor_type.name, tuple(int(s) for s in reversed(x.shape.tolist()))) for x in r.tensors}
    d, hd, f = spec["d_model"], spec["head_dim"], spec["ffn"]
    q, kv = spec["n_heads"] * hd, spec["n_kv"] * hd
    assert t["token_embd.weight"] == (spec["embd"], (512, d))
    assert ("output.weight" in t) == (not spec["tied"])
    # layer 0 stands for real layer 0, layer 1 for real layer 2: one of each type of a mix
    for li, real in enumerate(gc.layer_indices(spec, 2)):
        alt = real in spec["alt_layers"]
        for m, shape in dict(attn_q=(q, d), attn_k=(kv, d), attn_v=(kv, d), attn_output=(d, q),
                             ffn_gate=(f, d), ffn_up=(f, d), ffn_down=(d, f)).items():
            want = spec["alt"].get(m, spec["types"][m]) if alt else spec["types"][m]
            assert t[f"blk.{li}.{m}.weight"] == (want, shape), (name, li, m)
    # the random blocks dequantize to sane weights of about the asked-for spread
    from gguf.quants import dequantize

    ten = next(x for x in r.tensors if x.name == "blk.1.ffn_down.weight")
    w = dequantize(np.asarray(ten.data), ten.tensor_type)
    assert np.isfinite(w).all() and 0.2 < w.std() * np.sqrt(f) < 5


def test_dry_run_prints_the_table(tmp_path, capsys):
    out_json = tmp_path / "rows.json"
    assert gc.main(["--dry-run", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    for name in gc.MODELS:
        assert name in out
    assert out.count(" yes (") == len(gc.MODELS) and "verify curve" in out
    import json

    rows = json.loads(out_json.read_text())
    assert [r["model"] for r in rows] == list(gc.MODELS)
    for r in rows:
        assert r["path_kind"] == "cpu" and r["spec"]["equal"] and r["spec"]["verifies"] > 3
        assert 0 < r["spec"]["accepted"] < r["spec"]["drafted"]
        assert sorted(map(int, r["verify_ms"])) == list(range(1, 17))


def test_table_arithmetic():
    row = dict(model="m", weight_bytes=4.8e9, hbm_limit_ms=1.0, decode_tok_s=500.0,
               verify_ms={k: 2.0 + k / 16 for k in gc.VERIFY_ROWS}, torch_bf16_ms={1: 1.5, 16: 1.7},
               spec=dict(equal=True, accepted=10, drafted=20))
    table = gc.format_table([row], 4.8e12)
    line = next(x for x in table.splitlines() if x.startswith("m "))
    assert "1000tok/s" in line and "50.0%" in line and " 1.45 " in line and "yes (10/20)" in line


def test_arguments_are_checked(capsys):
    assert gc.main(["--dry-run", "--steps", "0"]) == 2
    assert "--steps must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gc.main(["--models", "nope"])
    capsys.readouterr()
    import torch

    if not torch.cuda.is_available():
        assert gc.main([]) == 2
        assert capsys.readouterr().err.startswith("error: no CUDA GPU")
