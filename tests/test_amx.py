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

The self-check that TSSPEC_AMX=1 runs at load (tiles against the reference) also runs here through
the emulation, so a crash in its own code (numpy 2 refused its 0-d view once, and that cost every
AMX machine the whole native library) is caught on CPUs without AMX. The hardware tests (real
tiles against the emulation, a model's tokens with TSSPEC_AMX=0 and =1, a 600-token prompt on 2
threads) need a CPU with AMX and the kernel's permission; they skip with that reason elsewhere.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from test_kernels import QUANT_TYPES, random_blocks, tiles_as_loaded
from tiny import write_tiny_model
from tsspec import kernels
from tsspec.models import load_model

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"native kernels: {kernels.unavailable_reason()}")

HAS_AMX = "amx_int8" in kernels.cpu_flags().split()
HW = pytest.mark.skipif(not kernels.amx_usable(),
                        reason=f"needs AMX tiles the kernel grants (this machine: {kernels.amx_status()})")


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
    tiles_as_loaded()


def test_self_check_runs_on_every_cpu():
    """The load-time self-check's own code (random rows with sane scales, every type, the tiles
    against the reference on 1 and 2 threads), through the emulation: it must run and pass here."""
    assert kernels.amx_self_check(kernels.lib(), hardware=False) is None


def test_self_check_catches_a_wrong_product(monkeypatch):
    """The self-check compares bits: a tile product that differs is named, not passed."""
    real = kernels.lib()

    class Wrong:
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def tsq_matmul_amx(tid, w, packed, rb, n, k, xq, m, y, ldy, threads, emulate):
            rc = real.tsq_matmul_amx(tid, w, packed, rb, n, k, xq, m, y, ldy, threads, emulate)
            if threads == 2:  # one wrong element on two threads only
                ctypes.c_float.from_address(y).value += 1.0
            return rc

    assert kernels.amx_self_check(Wrong(), hardware=False) == "Q4_0, 2 threads"


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


@pytest.mark.skipif(kernels.amx_usable(), reason="this machine can run the AMX tiles (auto leaves them off)")
def test_forcing_amx_where_it_cannot_run_is_one_line(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", "llama", quant="Q4_0", d_model=64, ffn_dim=128, vocab_size=320)
    r = run_cli(["generate", "-m", str(path), "-p", "hi", "-n", "2"], {"TSSPEC_AMX": "1"}, tmp_path)
    assert r.returncode != 0
    assert f"TSSPEC_AMX=1: AMX cannot run here: {kernels.amx_status()}" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_status_says_why(tmp_path):
    """In this process: 'not on this CPU' where CPUID has none; where it has AMX, auto's reason for
    leaving the tiles off (or why they cannot run), and "in use" when the suite runs under
    TSSPEC_AMX=1. TSSPEC_AMX=0 says it is off, in a fresh process."""
    from tsspec.env import amx_mode

    status = kernels.amx_status()
    if not HAS_AMX:
        assert status == "not on this CPU"
    elif amx_mode() == "1":
        assert status == "in use"
    else:  # auto leaves the tiles off: they are measured slower than VNNI at every row count
        assert status in (kernels.AMX_AUTO_OFF, "permission refused", "not enabled by the operating system")
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


@pytest.mark.parametrize("type_name", QUANT_TYPES)
@pytest.mark.parametrize("packed", [False, True], ids=["stored", "repacked"])
def test_tiles_equal_the_simd_path_up_to_256_rows(type_name, packed):
    """Rows 1..256 (every count up to 17, then tiles and short tiles up to 256), 1 and 2 threads: the
    tiles (the hardware where this CPU has AMX, else their emulation) against the level's own SIMD
    product, bit for bit."""
    n, k = 35, 512
    raw = random_blocks(type_name, n, k, seed=31)
    w = kernels.repack(type_name, raw, k) if packed else raw
    x = torch.randn(256, k, generator=torch.Generator().manual_seed(32)) * 2
    xq_all = kernels.quantize(x)
    row = xq_all.numel() // 256
    for m in (*range(1, 18), 31, 48, 100, 129, 256):
        xq = xq_all[: m * row]
        simd = torch.zeros(m, n)
        kernels.matmul(type_name, w, k, x[:m], xq, simd, packed=packed)
        for threads in (1, 2):
            tiles = torch.full((m, n), float("nan"))
            kernels.matmul_tiles(type_name, w, k, xq, tiles, packed=packed, threads=threads,
                                 emulate=not kernels.amx_usable())
            assert torch.equal(bits(tiles), bits(simd)), (type_name, m, threads)


@HW
def test_amx_on_and_off_give_the_same_tokens(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", "qwen2", quant="Q4_K", d_model=256, ffn_dim=512, vocab_size=320)
    outs = []
    for mode in ("0", "1"):
        r = run_cli(["generate", "-m", str(path), "-p", "one two three", "-n", "24", "--json"], {"TSSPEC_AMX": mode},
                    tmp_path)
        assert r.returncode == 0, r.stderr
        outs.append(json.loads(r.stdout)["token_ids"])
    assert outs[0] == outs[1] and len(outs[0]) == 24


@HW
@pytest.mark.parametrize("spec", [[], ["--spec", "--spec-type", "ngram"]], ids=["greedy", "ngram"])
def test_a_long_prompt_on_two_threads_through_the_tiles(tmp_path, spec):
    """TSSPEC_AMX=1 on a 600-token prompt (every product of the prompt's chunks on the tiles,
    OpenMP workers included) gives TSSPEC_AMX=0's tokens, greedy and with n-gram speculation."""
    path = write_tiny_model(tmp_path / "m.gguf", "qwen2", quant="Q4_K", d_model=256, ffn_dim=512, vocab_size=320,
                            ctx=1024)
    prompt = tmp_path / "p.txt"
    prompt.write_text(" ".join(f"w{i % 97}" for i in range(300)))
    outs = []
    for mode in ("0", "1"):
        r = run_cli(["generate", "-m", str(path), "-f", str(prompt), "-n", "24", "--json", *spec],
                    {"TSSPEC_AMX": mode, "OMP_NUM_THREADS": "2"}, tmp_path)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["prompt_tokens"] >= 600
        outs.append(out["token_ids"])
    assert outs[0] == outs[1] and len(outs[0]) == 24
