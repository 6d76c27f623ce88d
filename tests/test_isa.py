"""The native kernels' instruction-set levels (TSSPEC_ISA) against the plain C reference.

Every level this machine runs (``kernels.cpu_levels()``: AVX-512 VNNI, AVX2, NEON, always the
scalar reference) is built as a library of its own and must give every product the reference's
bits: every type, stored and repacked, 1..64 rows, 1 and 2 threads, the extreme codes that bound
AVX2's saturating int16 step included. A whole model forwarded under each level in a process of its
own gives the same logits bit for bit, so the same tokens. The ARM levels are checked under qemu by
scripts/arm_check.sh (tests/test_arm_check.py, marked slow).

Also: TSSPEC_ISA's words, a level this CPU lacks (one error line, exit 2), how the CPU's flags map to
levels, and that ``tsspec info`` names the level that runs.
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

from test_kernels import FLOAT_TYPES, QUANT_TYPES, fresh_kernels, random_blocks
from tiny import write_tiny_model
from tsspec import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"native kernels: {kernels.unavailable_reason()}")

HERE = kernels.cpu_levels()
SIMD_LEVELS = [lv for lv in HERE if lv != "scalar"]


@pytest.fixture(scope="module")
def libs():
    return {name: kernels.load_level(name) for name in HERE}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def product(h, type_name, w, k, x, xq, m, *, packed=False, threads=1, reference=False) -> torch.Tensor:
    n, rb = w.shape
    y = torch.full((m, n), float("nan"))
    rc = h.tsq_matmul(kernels.TYPE_IDS[type_name], w.ctypes.data, 1 if packed else 0, rb, n, k, x.data_ptr(),
                      0 if xq is None else xq.data_ptr(), m, y.data_ptr(), n, threads, 0 if reference else 1)
    assert rc == 0
    return y


def test_the_levels_here_include_the_best_one_and_the_reference(libs):
    assert HERE[-1] == "scalar"
    for name, h in libs.items():
        assert h.tsq_isa() == kernels.LEVELS[name].isa
    assert kernels.level() == HERE[0] or os.environ.get("TSSPEC_ISA")


@pytest.mark.parametrize("level", SIMD_LEVELS or ["none"])
@pytest.mark.parametrize("type_name", QUANT_TYPES + FLOAT_TYPES)
def test_every_level_equals_the_reference_bitwise(libs, level, type_name):
    if level == "none":
        pytest.skip("this CPU runs the scalar level only")
    h, ref_h = libs[level], libs["scalar"]
    # 608: a short last group for the legacy types; K-quants need whole super-blocks
    k = 768 if type_name in ("Q4_K", "Q6_K") else 608 if type_name not in FLOAT_TYPES else 603
    n = 67  # a thread share that is not whole tiles, and an odd weight row
    raw = random_blocks(type_name, n, k, seed=31)
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(32)) * 2
    xq = kernels.quantize(x) if type_name in QUANT_TYPES else None
    forms = [(raw, False)] + ([(kernels.repack(type_name, raw, k), True)] if type_name in QUANT_TYPES else [])
    for w, packed in forms:
        ref = product(ref_h, type_name, w, k, x, xq, 64, packed=packed, reference=True)
        for m in (1, 2, 3, 4, 5, 8, 9, 16, 17, 33, 64):
            for threads in (1, 2):
                got = product(h, type_name, w, k, x, xq, m, packed=packed, threads=threads)
                assert torch.equal(bits(got), bits(ref[:m])), (level, type_name, packed, m, threads)


def extreme_blocks(type_name: str, n: int, k: int, seed: int) -> np.ndarray:
    """Weights whose codes are all at the type's extremes (every nibble 15 or 0, Q6_K's 63 or 0,
    Q8_0's -128 or 127, Q5_0's fifth bit set or clear), with sane scales."""
    rng = np.random.default_rng(seed)
    raw = random_blocks(type_name, n, k, seed=seed)
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    elems, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    b = raw.reshape(-1, size)
    hi = rng.random(b.shape[0]) < 0.5  # per block: all high codes, or all low

    def fill(lo_off, hi_off, high_byte, low_byte):
        b[:, lo_off:hi_off] = np.where(hi[:, None], high_byte, low_byte)

    if type_name == "Q4_0":
        fill(2, 18, 0xFF, 0x00)
    elif type_name == "Q4_1":
        fill(4, 20, 0xFF, 0x00)
    elif type_name == "Q5_0":
        fill(2, 6, 0xFF, 0x00)
        fill(6, 22, 0xFF, 0x00)
    elif type_name == "Q8_0":
        fill(2, 34, 0x80, 0x7F)  # -128 and 127
    elif type_name == "Q4_K":
        b[:, 4:16] = 63  # sub-block scales and mins at their largest 6-bit values (low bits)
        fill(16, 144, 0xFF, 0x00)
    elif type_name == "Q6_K":
        fill(0, 192, 0xFF, 0x00)
        b[:, 192:208] = np.where(hi[:, None], 127, 0x80)  # int8 scales +127 / -128
    return raw


@pytest.mark.parametrize("level", SIMD_LEVELS or ["none"])
@pytest.mark.parametrize("type_name", QUANT_TYPES)
def test_extreme_codes_against_extreme_inputs(libs, level, type_name):
    """The largest codes against inputs of +-127 (every element of a block at the block's max, so
    its int8 codes are all +127 or all -127): where AVX2's vpmaddubsw would saturate if the bound
    in avx2.h did not hold, the level must still equal the reference."""
    if level == "none":
        pytest.skip("this CPU runs the scalar level only")
    k = 512
    raw = extreme_blocks(type_name, 24, k, seed=5)
    signs = torch.from_numpy(np.random.default_rng(6).choice([-1.0, 1.0], size=(6, k // 32, 1)).astype(np.float32))
    x = (signs * torch.ones(6, k // 32, 32) * 3.0).reshape(6, k)
    x[5] = -x[5]
    xq = kernels.quantize(x)  # every code +-127
    for w, packed in ((raw, False), (kernels.repack(type_name, raw, k), True)):
        ref = product(libs["scalar"], type_name, w, k, x, xq, 6, packed=packed, reference=True)
        got = product(libs[level], type_name, w, k, x, xq, 6, packed=packed)
        assert torch.isfinite(ref).all()
        assert torch.equal(bits(got), bits(ref)), (level, type_name, packed)


LOGITS_SCRIPT = r"""
import sys, numpy as np, torch
from tsspec import kernels
from tsspec.models import load_model
m = load_model(sys.argv[1], n_ctx=64)
assert kernels.level() == sys.argv[3], (kernels.level(), sys.argv[3])
assert getattr(m, "fused", None) is not None or sys.argv[4] == "any"
ids = [int(t) for t in np.random.default_rng(3).integers(0, 300, size=14)]
c = m.make_cache()
m.forward(ids[:5], c)
verify = m.forward(ids[5:], c, all_logits=True).logits
np.save(sys.argv[2], verify.numpy())
"""


@pytest.mark.skipif(len(HERE) < 2, reason="one level here")
@pytest.mark.parametrize("arch,quant,heads", [("llama", "Q4_1", (4, 2)), ("qwen2", "Q4_K", (4, 2)),
                                              ("gemma3", "Q6_K", (4, 2)), ("qwen3", "Q5_0", (4, 2)),
                                              ("qwen2", "Q8_0", (4, 2)), ("qwen2", "Q4_K", (12, 2)),
                                              ("gemma3", "Q5_0", (4, 1))])
def test_a_model_gives_the_same_logits_at_every_level(tmp_path, arch, quant, heads):
    """Blocks, attention, activations, norms and products under every level here, each in its own
    process (TSSPEC_ISA): the logits of a prompt and a 9-row verify are the same bits. (The levels
    take a KV head's query heads 4, 2 and 1 at a time: 6 and 4 query heads a KV head included.)"""
    path = write_tiny_model(tmp_path / "m.gguf", arch, quant=quant, d_model=256, ffn_dim=512, vocab_size=320,
                            n_heads=heads[0], n_kv_heads=heads[1], head_dim=64 if arch != "gemma3" else None)
    outs = {}
    for lv in HERE:
        word = "neon" if lv.startswith("neon") else lv
        env = {**os.environ, "TSSPEC_ISA": word, "OMP_NUM_THREADS": "2"}
        r = subprocess.run([sys.executable, "-c", LOGITS_SCRIPT, str(path), str(tmp_path / f"{lv}.npy"), lv, "fused"],
                           capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr
        outs[lv] = np.load(tmp_path / f"{lv}.npy")
    first = outs[HERE[0]]
    for lv, o in outs.items():
        assert np.array_equal(o.view(np.int32), first.view(np.int32)), (HERE[0], lv)


def run_cli(args, env_extra, tmp_path, timeout=300):
    env = {**os.environ, **env_extra, "TSSPEC_CACHE": os.environ.get("TSSPEC_CACHE", str(tmp_path / "cache"))}
    return subprocess.run([sys.executable, "-m", "tsspec", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("isa") / "m.gguf", "llama", quant="Q4_0", d_model=64,
                            ffn_dim=128, vocab_size=320)


@pytest.mark.parametrize("value", ["sse9", "AVX2x", "1"])
def test_a_bad_tsspec_isa_is_one_line(tmp_path, tiny_file, value):
    r = run_cli(["generate", "-m", str(tiny_file), "-p", "hi", "-n", "2"], {"TSSPEC_ISA": value}, tmp_path)
    assert r.returncode == 2
    assert f"TSSPEC_ISA={value!r}: expected auto, avx512, avx2, neon, scalar" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_a_level_this_cpu_lacks_is_one_line(tmp_path, tiny_file):
    lacking = next(w for w in ("avx512", "neon", "avx2") if not any(n in HERE for n in kernels.ISA_CHOICES[w]))
    r = run_cli(["generate", "-m", str(tiny_file), "-p", "hi", "-n", "2"], {"TSSPEC_ISA": lacking}, tmp_path)
    assert r.returncode == 2, r.stderr
    assert f"TSSPEC_ISA={lacking}: this CPU cannot run it (it runs {', '.join(HERE)})" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("word", ["scalar", "auto"] + [lv if not lv.startswith("neon") else "neon" for lv in SIMD_LEVELS])
def test_info_and_json_name_the_level(tmp_path, tiny_file, word):
    r = run_cli(["info", str(tiny_file), "--no-load"], {"TSSPEC_ISA": word}, tmp_path)
    assert r.returncode == 0, r.stderr
    label = kernels.LEVELS[HERE[0] if word == "auto" else kernels.ISA_CHOICES[word][0] if word != "neon"
                           else next(n for n in HERE if n.startswith("neon"))].label
    assert f"native, {label}" in r.stdout
    g = run_cli(["generate", "-m", str(tiny_file), "-p", "hi", "-n", "4", "--json", "--no-spec", "--ignore-eos"], {"TSSPEC_ISA": word},
                tmp_path)
    assert g.returncode == 0, g.stderr
    assert "note:" not in g.stderr  # the native path ran: no fallback notice
    assert len(json.loads(g.stdout)["token_ids"]) == 4


@pytest.mark.parametrize("machine,flags,want", [
    ("x86_64", "flags : fpu sse2 avx2 fma f16c bmi2", ["avx2", "scalar"]),  # Zen 2/3, Intel client
    ("x86_64", "flags : fpu sse2 avx2 fma f16c avx512f avx512bw avx512vl avx512_vnni amx_int8 amx_tile",
     ["avx512", "avx2", "scalar"]),  # Sapphire Rapids
    ("x86_64", "flags : fpu sse2 avx", ["scalar"]),  # Sandy Bridge: no AVX2
    ("x86_64", "flags : avx2 f16c", ["scalar"]),  # no FMA: not x86-64-v3
    ("aarch64", "Features : fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp asimddp",
     ["neon-dotprod", "neon", "scalar"]),  # Graviton 2
    ("aarch64", "Features : fp asimd evtstrm crc32", ["neon", "scalar"]),  # Cortex-A72 (Graviton 1)
    ("riscv64", "isa : rv64imafdc", ["scalar"]),
])
def test_cpu_flags_map_to_levels(machine, flags, want):
    assert kernels.cpu_levels(flags, machine) == want


def test_a_level_that_fails_to_build_costs_that_level_only(monkeypatch):
    """An auto choice whose best level cannot be built takes the next and says why."""
    best = kernels.LEVELS[HERE[0]]
    broken = kernels.Level(best.name, best.isa, (("-march=no-such-cpu-xyz",),), best.label)
    monkeypatch.setitem(kernels.LEVELS, best.name, broken)
    fresh_kernels(monkeypatch)
    if len(HERE) < 2:
        assert kernels.lib() is None
        return
    assert kernels.lib() is not None
    assert kernels.level() == HERE[1]
    line = kernels.products_line()
    assert f"native, {kernels.LEVELS[HERE[1]].label}" in line and f"{best.label}: " in line and "not built" in line


# Each x86 level with a -march that gives it its instructions, whatever this CPU has: the code of a
# level that this machine does not run (the AVX-512 branches on an AMD AVX2 CPU, the AVX2-only ones
# on an AVX-512 one) is otherwise never even compiled here.
X86_SYNTAX_MARCH = {"avx512": "-march=sapphirerapids", "avx2": "-march=x86-64-v3", "scalar": "-march=x86-64"}


@pytest.mark.skipif(os.uname().machine.lower() not in ("x86_64", "amd64"),
                    reason="x86 compiler flags: this is not an x86 machine (ARM's levels: tests/test_arm_check.py)")
@pytest.mark.parametrize("level", sorted(X86_SYNTAX_MARCH))
def test_every_x86_level_compiles_on_any_x86(level, tmp_path):
    cc = kernels._compiler()
    assert cc is not None  # the module is skipped where no native library loads
    srcs = kernels.sources()
    for name, data in srcs.items():
        (tmp_path / name).write_bytes(data)
    for name in sorted(srcs):
        if not name.endswith(".c"):
            continue
        r = subprocess.run([cc, "-fsyntax-only", "-fopenmp", "-std=c11", X86_SYNTAX_MARCH[level],
                            f"-DTSQ_ISA={kernels.LEVELS[level].isa}", str(tmp_path / name)],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, f"{level}: {name}: {r.stderr.strip()[:2000]}"
