"""The AMX tile backend (tsspec/kernels/amx.c) and its switch, TSSPEC_AMX.

The tile backend must give every product the bits the plain C reference and the VNNI path give:
one arithmetic whichever instruction takes the integer sums. Its C emulation of the tile
instruction runs on every CPU, so these hold everywhere:

* every quantized type, stored and repacked, rows 1..64 (tails of a 16-row tile), an odd number
  of weight rows (a short panel), a short last group, threads 1 and 2: tiles == reference == VNNI;
* a whole model with the tiles taking every product of 2 rows or more: a 9-row verify equals 9
  single steps (which stay on the other path), and the logits equal the tiles-off logits bitwise;
* TSSPEC_AMX: auto/0/1 are read, a bad value and =1 on a machine that cannot run the tiles are
  one error line each, and ``amx_status`` says why the tiles are or are not used.

The hardware tests (real tiles against the emulation, a model's tokens with TSSPEC_AMX=0 and =1)
need a CPU with AMX and the kernel's permission; they skip with that reason elsewhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from test_kernels import QUANT_TYPES, random_blocks
from tiny import write_tiny_model
from tsspec import kernels
from tsspec.models import load_model

pytestmark = pytest.mark.skipif(not kernels.simd(), reason=f"native kernels: {kernels.unavailable_reason()}")

HAS_AMX = "amx_int8" in kernels.cpu_flags().split()
HW = pytest.mark.skipif(kernels.amx_status() != "in use",
                        reason=f"needs the AMX tiles in use here (this machine: {kernels.amx_status()})")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("type_name", QUANT_TYPES)
@pytest.mark.parametrize("packed", [False, True], ids=["stored", "repacked"])
def test_tiles_equal_reference_and_vnni(type_name, packed):
    n, k = 37, 640 if type_name not in ("Q4_K", "Q6_K") else 768  # 37: a short panel; 640: a short group
    raw = random_blocks(type_name, n, k, seed=11)
    w = kernels.repack(type_name, raw, k) if packed else raw
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(12)) * 3
    xq_all = kernels.quantize(x)
    row = xq_all.numel() // 64
    for m in (1, 2, 3, 15, 16, 17, 33, 64):
        xq = xq_all[: m * row]
        ref, vnni = torch.zeros(m, n), torch.zeros(m, n)
        kernels.matmul(type_name, w, k, x[:m], xq, ref, packed=packed, use_simd=False)
        kernels.matmul(type_name, w, k, x[:m], xq, vnni, packed=packed)
        assert torch.equal(bits(ref), bits(vnni)), (type_name, m)
        for threads in (1, 2):
            tiles = torch.full((m, n), float("nan"))
            kernels.matmul_tiles(type_name, w, k, xq, tiles, packed=packed, threads=threads)
            assert torch.equal(bits(tiles), bits(ref)), (type_name, m, threads)


def test_tiles_write_into_a_wider_output():
    """ldy wider than the product (the block engine's stacked parts): only the product's columns
    are written."""
    n, k, m = 20, 256, 5
    raw = random_blocks("Q4_0", n, k, seed=3)
    x = torch.randn(m, k)
    xq = kernels.quantize(x)
    y = torch.full((m, n + 7), -1.0)
    kernels.matmul_tiles("Q4_0", raw, k, xq, y[:, :], threads=2)
    ref = torch.zeros(m, n)
    kernels.matmul("Q4_0", raw, k, x, xq, ref, use_simd=False)
    assert torch.equal(bits(y[:, :n]), bits(ref))
    assert bool((y[:, n:] == -1.0).all())


def test_float_types_are_not_taken_by_the_tiles():
    raw = random_blocks("F16", 8, 64, seed=1)
    with pytest.raises(ValueError, match="tile backend cannot"):
        kernels.matmul_tiles("F16", raw, 64, torch.zeros(64, dtype=torch.uint8), torch.zeros(1, 8))


@pytest.fixture
def emulated_tiles():
    """Every quantized product of 2 rows or more through the emulated tiles, then back."""
    kernels.use_tiles(2, min_rows=2)
    yield
    kernels.use_tiles(1 if kernels.amx_status() == "in use" else 0)


@pytest.mark.parametrize("arch,quant", [("llama", "Q4_0"), ("qwen2", "Q8_0"), ("gemma3", "Q4_0"), ("qwen3", "Q8_0")])
def test_model_verify_through_tiles_equals_single_steps(tmp_path, arch, quant, emulated_tiles):
    """A k+1-row forward with its products on the (emulated) tiles gives each row the bits the
    one-row steps give on the VNNI path: batch invariance across backends, the contract that keeps
    speculative output equal to plain output."""
    path = write_tiny_model(tmp_path / "m.gguf", arch, quant=quant, d_model=128, ffn_dim=256, vocab_size=320)
    m = load_model(path, n_ctx=128)
    assert m.fused is not None
    ids = [int(t) for t in np.random.default_rng(5).integers(0, 300, size=20)]
    c1 = m.make_cache()
    m.forward(ids[:11], c1)
    verify = m.forward(ids[11:], c1, all_logits=True).logits  # 9 rows: the tiles
    c2 = m.make_cache()
    m.forward(ids[:11], c2)
    steps = torch.cat([m.forward([t], c2).logits for t in ids[11:]])  # 1 row each: VNNI
    assert torch.equal(bits(verify), bits(steps))
    kernels.use_tiles(0)
    c3 = m.make_cache()
    m.forward(ids[:11], c3)
    off = m.forward(ids[11:], c3, all_logits=True).logits
    assert torch.equal(bits(verify), bits(off))


def run_cli(args, env_extra, tmp_path):
    env = {**os.environ, **env_extra, "TSSPEC_CACHE": os.environ.get("TSSPEC_CACHE", str(tmp_path / "cache"))}
    return subprocess.run([sys.executable, "-m", "tsspec", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def test_bad_tsspec_amx_is_one_line(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", "llama", quant="Q4_0", d_model=64, ffn_dim=128, vocab_size=320)
    r = run_cli(["generate", "-m", str(path), "-p", "hi", "-n", "2"], {"TSSPEC_AMX": "sometimes"}, tmp_path)
    assert r.returncode != 0
    assert "TSSPEC_AMX='sometimes': expected auto, 0 or 1" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.skipif(kernels.amx_status() == "in use", reason="this machine runs the AMX tiles")
def test_forcing_amx_where_it_cannot_run_is_one_line(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", "llama", quant="Q4_0", d_model=64, ffn_dim=128, vocab_size=320)
    r = run_cli(["generate", "-m", str(path), "-p", "hi", "-n", "2"], {"TSSPEC_AMX": "1"}, tmp_path)
    assert r.returncode != 0
    assert f"TSSPEC_AMX=1: AMX cannot run here: {kernels.amx_status()}" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_status_says_why(tmp_path):
    """In this process (TSSPEC_AMX unset or auto): in use exactly where the CPU has AMX and it was
    granted; 'not on this CPU' where CPUID has none. TSSPEC_AMX=0 says it is off, in a fresh process."""
    status = kernels.amx_status()
    if not HAS_AMX:
        assert status == "not on this CPU"
    else:
        assert status in ("in use", "permission refused", "not enabled by the operating system") or \
            status.startswith("self-check failed")
    code = "from tsspec import kernels; print(kernels.amx_status())"
    env = {**os.environ, "TSSPEC_AMX": "0"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.stdout.strip() == "off (TSSPEC_AMX=0)", r.stderr


def test_info_reports_the_product_path(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", "llama", quant="Q4_0", d_model=64, ffn_dim=128, vocab_size=320)
    r = run_cli(["info", str(path), "--no-load"], {"TSSPEC_AMX": "0"}, tmp_path)
    assert r.returncode == 0, r.stderr
    assert "AMX: off (TSSPEC_AMX=0)" in r.stdout


@HW
@pytest.mark.parametrize("type_name", QUANT_TYPES)
def test_hardware_tiles_equal_the_emulation(type_name):
    n, k = 53, 768
    raw = random_blocks(type_name, n, k, seed=21)
    x = torch.randn(40, k)
    xq = kernels.quantize(x)
    for threads in (1, 2):
        hw, emu = torch.zeros(40, n), torch.zeros(40, n)
        kernels.matmul_tiles(type_name, raw, k, xq, hw, threads=threads, emulate=False)
        kernels.matmul_tiles(type_name, raw, k, xq, emu, threads=threads)
        assert torch.equal(bits(hw), bits(emu))


@HW
def test_amx_on_and_off_give_the_same_tokens(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", "qwen2", quant="Q4_K", d_model=128, ffn_dim=256, vocab_size=320)
    outs = []
    for mode in ("0", "1"):
        r = run_cli(["generate", "-m", str(path), "-p", "one two three", "-n", "24", "--json"], {"TSSPEC_AMX": mode},
                    tmp_path)
        assert r.returncode == 0, r.stderr
        outs.append(json.loads(r.stdout)["token_ids"])
    assert outs[0] == outs[1] and len(outs[0]) == 24
