#!/usr/bin/env python3
"""Issue 47's super-block tile routes, measured before they are built (needs a CPU with AMX-BF16).

    python scripts/bf16_route.py [--rounds 7] [--rows 1,9,16,64,512] [--json FILE]

Builds scripts/bf16_q4k.c (a stand-alone model of Q4_K products on the tiles with one float step
per 256-element super-block, in a BF16, an INT8 and a scheduled INT8 form; its header says the
arithmetic), then:

1. checks every form against their exact integer reference bit for bit (random blocks, rows 1..40,
   the extreme codes and scales included): this is what says the route is exact on the hardware,
   not only on paper;
2. times them (one thread, or --threads), against tsspec's own products on the same shapes (qwen2.5-coder-1.5b's
   layer matrices, random Q4_K rows, repacked as tsspec stores them): the VNNI path, and the
   present tile panel on the hardware. Paired: the sides take turns within a round, the order
   rotated each round; medians over rounds. The inputs' B operands are prepared beforehand and not
   timed (their cost is per input row: the same place tsspec's own input quantization sits, which
   is also left out of its timing here).

Reports per shape and row count the median ms of each path (and of the INT8 form's unpack alone),
the routes' time against VNNI at the same rows, and against VNNI's one-row product: the verify-cost
question of issue 47. A layer's figure sums qwen2.5-coder-1.5b's seven matrices (all taken as Q4_K;
the file keeps some in Q6_K). The AMX tile path is tsspec's own panel on the hardware (``tiles
today``), shown where this CPU has the tiles and for 2 rows or more.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# qwen2.5-coder-1.5b, one layer: (name, n, k, how many)
LAYER = [("q/o", 1536, 1536, 2), ("k/v", 256, 1536, 2), ("gate/up", 8960, 1536, 2), ("down", 1536, 8960, 1)]

WBLOCK = np.dtype([("qs", np.uint8, 128), ("sh", np.uint8, 8), ("sl", np.uint8, 8), ("m", np.uint8, 8),
                   ("d", np.float32), ("dmin", np.float32), ("m16", np.int16, 8)])


SIDES = {"route": "bf16", "route8": "int8", "route8b": "int8-scheduled", "unpack8": "int8 unpack alone",
         "vnni": "vnni", "tiles": "tiles today"}


class ScriptError(Exception):
    pass


def build() -> ctypes.CDLL:
    src = ROOT / "scripts" / "bf16_q4k.c"
    out = Path(tempfile.mkdtemp()) / "bf16_q4k.so"
    importlib.import_module("torch")  # first: the model's OpenMP is then torch's libgomp, as tsspec's kernels' is

    r = subprocess.run(["gcc", "-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC",
                        str(src), "-o", str(out)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise ScriptError(f"cannot build {src.name}: {r.stderr.strip()[:400]}")
    h = ctypes.CDLL(str(out))
    P, L = ctypes.c_void_p, ctypes.c_long
    h.bf16_init.restype = ctypes.c_int
    h.bf16_prepare.argtypes = [P, P, L, L, P, P, P]
    h.bf16_matmul.argtypes = [P, L, L, P, P, P, L, P, ctypes.c_int]
    h.bf16_reference.argtypes = [P, L, L, P, P, L, P]
    h.i8_prepare.argtypes = [P, P, L, L, P, P]
    h.i8_matmul.argtypes = [P, L, L, P, P, L, P, ctypes.c_int, ctypes.c_int]
    h.i8b_prepare.argtypes = [P, P, L, L, P, P, P]
    h.i8b_matmul.argtypes = [P, L, L, P, P, P, L, P, ctypes.c_int]
    for f in (h.bf16_prepare, h.bf16_matmul, h.bf16_reference, h.i8_prepare, h.i8_matmul, h.i8b_prepare, h.i8b_matmul):
        f.restype = None
    if h.bf16_init() != 0:
        raise ScriptError("the kernel refused the AMX tile data (arch_prctl XTILEDATA)")
    return h


def ptr(a: np.ndarray) -> int:
    return a.ctypes.data


def random_weights(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    w = np.zeros((n, k // 256), dtype=WBLOCK)
    w["qs"] = rng.integers(0, 256, w["qs"].shape, dtype=np.uint8)
    w["sh"] = rng.integers(0, 8, w["sh"].shape, dtype=np.uint8)
    w["sl"] = rng.integers(0, 8, w["sl"].shape, dtype=np.uint8)
    w["m"] = rng.integers(0, 64, w["m"].shape, dtype=np.uint8)
    w["m16"] = w["m"]
    w["d"] = rng.uniform(1e-4, 1e-2, w["d"].shape).astype(np.float32)
    w["dmin"] = rng.uniform(1e-4, 1e-2, w["dmin"].shape).astype(np.float32)
    return w


def random_inputs(m: int, k: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    x = rng.integers(-127, 128, (m, k), dtype=np.int8)
    dx = rng.uniform(1e-3, 1e-1, (m, k // 256)).astype(np.float32)
    return x, dx


# per form: its B-side buffers (name, elements per input tile and super-block, dtype), in the order
# its prepare and matmul functions take them, and those functions' names
FORMS = {
    "bf16": ((("bt", 4096, np.uint16), ("bm", 256, np.uint16), ("dxv", 16, np.float32)), "bf16_prepare", "bf16_matmul"),
    "int8": ((("bq", 4096, np.int8), ("dxv", 16, np.float32)), "i8_prepare", "i8_matmul"),
    "int8-scheduled": ((("bq", 4096, np.int8), ("xp", 64, np.int32), ("dxv", 16, np.float32)), "i8b_prepare",
                       "i8b_matmul"),
}


class Prepared:
    """A form's operands for m input rows: ceil(m / 16) input tiles, one after another."""

    def __init__(self, h: ctypes.CDLL, form: str, x: np.ndarray, dx: np.ndarray):
        bufs, prepare, self.matmul = FORMS[form]
        m, k = x.shape
        nsb, nt = k // 256, (m + 15) // 16
        self.h, self.m, self.k, self.form = h, m, k, form
        self.bufs = [np.zeros(nt * nsb * size, dtype=dt) for _, size, dt in bufs]
        for t in range(nt):
            xs, ds = np.ascontiguousarray(x[16 * t:16 * t + 16]), np.ascontiguousarray(dx[16 * t:16 * t + 16])
            getattr(h, prepare)(ptr(xs), ptr(ds), k, xs.shape[0],
                                *[ptr(b[t * nsb * size:]) for b, (_, size, _) in zip(self.bufs, bufs)])

    def run(self, w: np.ndarray, y: np.ndarray, threads: int = 1, unpack_only: bool = False) -> None:
        if unpack_only and self.form != "int8":
            raise ScriptError(f"unpack_only: only the int8 form times its unpack alone, not {self.form}")
        extra = (int(unpack_only),) if self.form == "int8" else ()
        getattr(self.h, self.matmul)(ptr(w), w.shape[0], self.k, *[ptr(b) for b in self.bufs], self.m, ptr(y), threads,
                                     *extra)


def check(h: ctypes.CDLL) -> dict:
    """The route against its exact integer reference, bit for bit."""
    rng = np.random.default_rng(47)
    cases = []
    for m, n, k in [(1, 16, 256), (9, 32, 512), (16, 48, 768), (17, 32, 1536), (40, 64, 512)]:
        w = random_weights(n, k, rng)
        x, dx = random_inputs(m, k, rng)
        # the extremes too: every code 15 and every scale 7 against inputs of +-127
        if m == 40:
            w["qs"][:8] = 255
            w["sh"][:8] = 7
            w["sl"][:8] = 7
            x[:4] = 127
            x[4:8] = -127
        ref = np.zeros((m, n), dtype=np.float32)
        h.bf16_reference(ptr(w), n, k, ptr(x), ptr(dx), m, ptr(ref))
        for form in FORMS:
            y = np.full((m, n), np.nan, dtype=np.float32)
            Prepared(h, form, x, dx).run(w, y, threads=1 + m % 2)
            same = bool(np.array_equal(y.view(np.int32), ref.view(np.int32)))
            cases.append({"form": form, "rows": m, "n": n, "k": k, "bit_equal": same})
            if not same:
                bad = int(np.count_nonzero(y.view(np.int32) != ref.view(np.int32)))
                raise ScriptError(f"the {form} route differs from its exact reference at rows={m} n={n} k={k}: "
                                  f"{bad} of {m * n} outputs")
    return {"cases": cases}


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--rows", default="1,9,16,64,512")
    ap.add_argument("--threads", type=int, default=1, help="threads for every side (default 1)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    try:
        rows = [int(r) for r in a.rows.split(",")]
    except ValueError:
        rows = []
    if not rows or min(rows) < 1:
        print(f"error: --rows takes positive numbers separated by commas, not {a.rows!r}", file=sys.stderr)
        return 2
    if a.rounds < 1 or a.threads < 1:
        print("error: --rounds and --threads must be >= 1", file=sys.stderr)
        return 2
    try:
        h = build()
        verdict = check(h)
    except ScriptError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print("exact: every form equals its integer reference bit for bit on", len(verdict["cases"]), "cases")

    import torch

    from tsspec import kernels

    torch.set_num_threads(a.threads)
    if kernels.lib() is None:
        print(f"error: tsspec's kernels are unavailable: {kernels.unavailable_reason()}", file=sys.stderr)
        return 1
    tiles = kernels.amx_usable()
    rng = np.random.default_rng(0)
    results = []
    for name, n, k, count in LAYER:
        w_route = random_weights(n, k, rng)
        blocks = rng.integers(0, 256, (n, k // 256 * 144), dtype=np.uint8)
        w_gguf = kernels.repack("Q4_K", kernels._sane_scales("Q4_K", blocks), k)
        for m in rows:
            xf = torch.randn(m, k)
            xq = kernels.quantize(xf)
            x, dx = random_inputs(m, k, rng)
            prep, prep8, prep8b = (Prepared(h, f, x, dx) for f in FORMS)
            y = np.zeros((m, n), dtype=np.float32)
            yt = torch.zeros(m, n)
            sides = {
                "route": lambda: prep.run(w_route, y, a.threads),
                "route8": lambda: prep8.run(w_route, y, a.threads),
                "route8b": lambda: prep8b.run(w_route, y, a.threads),
                "unpack8": lambda: prep8.run(w_route, y, a.threads, unpack_only=True),
                "vnni": lambda: kernels.matmul("Q4_K", w_gguf, k, xf, xq, yt, packed=True, threads=a.threads),
            }
            if tiles and m > 1:
                sides["tiles"] = lambda: kernels.matmul_tiles("Q4_K", w_gguf, k, xq, yt, packed=True,
                                                              threads=a.threads, emulate=False)
            times: dict[str, list[float]] = {s: [] for s in sides}
            order = list(sides)
            for s in order:
                sides[s]()  # warm
            for r in range(a.rounds):
                rot = order[r % len(order):] + order[:r % len(order)]
                for s in rot:
                    times[s].append(timed(sides[s]))
            med = {s: statistics.median(v) for s, v in times.items()}
            results.append({"matrix": name, "n": n, "k": k, "count": count, "rows": m, "ms": med})
            cells = [f"{SIDES[s_]} {v:7.2f}" + ("" if s_ == "vnni" else f" ({v / med['vnni']:.2f})")
                     for s_, v in med.items()]
            print(f"{name:8s} {n:5d}x{k:<5d} rows {m:4d}: " + "  ".join(cells), flush=True)
    print(f"\none layer of qwen2.5-coder-1.5b (all Q4_K), ms at {a.threads} thread(s), (and against VNNI's one row):")
    one = sum(r["ms"]["vnni"] * r["count"] for r in results if r["rows"] == 1) if 1 in rows else None
    layer = []
    for m in rows:
        at_m = [r for r in results if r["rows"] == m]
        tot = {s_: sum(r["ms"][s_] * r["count"] for r in at_m) for s_ in at_m[0]["ms"]}
        line = {"rows": m, **{f"{s_}_ms": v for s_, v in tot.items()}}
        if one:
            line.update({f"{s_}_vs_vnni_1row": v / one for s_, v in tot.items()})
        layer.append(line)
        print(f"rows {m:4d}: " + "  ".join(f"{SIDES[s_]} {v:7.2f}" + (f" ({v / one:.2f}x)" if one else "")
                                            for s_, v in tot.items()))
    unpack = {m: sum(r["ms"]["unpack8"] * r["count"] for r in results if r["rows"] == m) for m in rows}
    print("the INT8 form's unpack alone (no tile product, no float step), ms a layer:",
          ", ".join(f"{m} rows {v:.2f}" + (f" ({v / one:.2f}x VNNI@1)" if one else "") for m, v in unpack.items()))
    if a.json:
        a.json.write_text(json.dumps({"check": verdict, "shapes": results, "layer": layer,
                                      "int8_unpack_only_ms": unpack, "rounds": a.rounds, "threads": a.threads,
                                      "cpu_flags_amx": tiles}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
