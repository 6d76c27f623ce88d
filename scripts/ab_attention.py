#!/usr/bin/env python3
"""Paired speed of the native attention (kernels/blocks.c's attend_rows; attend_heads before it) at two revisions.

    python scripts/ab_attention.py --base REV [--new REV] [--shapes 256x4x512,128x2x2048x8]
                                   [--rounds 15] [--json FILE]

A shape is head dimension x query heads taken together (R: the query heads of one KV head that a
work item holds, 1-4 with AVX-512) x positions attended [x rows: consecutive prompt rows, the last
at the last position, 1 by default; a source with row blocks (attend_rows) takes them together]. Each revision's kernel sources are
compiled with a small harness (the flags tsspec builds with, this machine's level) into its own
program; the programs run in turn, the order flipped every round, and each reports its best time
of a few calls per round. Both must give the same outputs bit for bit (a hash of every output
float), since an attention change is meant to move no bit. The report gives each side's median
microseconds per call and the median and quartiles of new/base over rounds.

What it does not time: the rope, the cache writes, threads (one core), and the model around the
attention; scripts/ab_kernels.py times whole forwards. Each side's time is per call of all the rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

HARNESS = r"""
#include <stdio.h>
#include <time.h>
#include "blocks.c"
#ifndef ATT_ROWS
#define ATT_ROWS 1
#endif
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
/* B rows at positions n - B .. n - 1, each attending over [0, its position]: attend_rows where the
 * source has it (row blocks), else attend_heads row by row */
static void run(int R, int B, const float *const *q, const float *kb, const float *vb, const long *hi, long hd,
                float *const *sc, float *const *o) {
#if ATT_ROWS > 1
    for (int b0 = 0; b0 < B; b0 += ATT_ROWS) {
        const int nb = B - b0 < ATT_ROWS ? B - b0 : ATT_ROWS;
        attend_rows(R, nb, q + b0 * ATT_HEADS, kb, vb, 0, hi + b0, hd, 0, NULL, sc + b0 * ATT_HEADS, o + b0 * ATT_HEADS);
    }
#else
    for (int b = 0; b < B; b++)
        attend_heads(R, q + b * ATT_HEADS, kb, vb, 0, hi[b], hd, 0, NULL, sc + b * ATT_HEADS, o + b * ATT_HEADS);
#endif
}
int main(int argc, char **argv) {
    const long hd = atol(argv[1]), n = atol(argv[3]);
    const int R = atoi(argv[2]), B = atoi(argv[4]), calls = atoi(argv[5]);
    float *kb = malloc(sizeof(float) * hd * (n + 8)), *vb = malloc(sizeof(float) * hd * (n + 8));
    for (long i = 0; i < hd * (n + 8); i++) {
        kb[i] = (float)((i * 2654435761u) % 1000) / 1000.f - 0.5f;
        vb[i] = (float)((i * 40503u) % 1000) / 1000.f - 0.5f;
    }
    const float **q = calloc((size_t)B * ATT_HEADS, sizeof(float *));
    float **sc = calloc((size_t)B * ATT_HEADS, sizeof(float *)), **o = calloc((size_t)B * ATT_HEADS, sizeof(float *));
    long *hi = malloc(sizeof(long) * B);
    for (int b = 0; b < B; b++) {
        hi[b] = n - B + b;
        for (int r = 0; r < R; r++) {
            float *qr = malloc(sizeof(float) * hd);
            for (long i = 0; i < hd; i++) qr[i] = (float)(((i + r * 7 + b * 13) * 97) % 100) / 100.f - 0.5f;
            q[b * ATT_HEADS + r] = qr;
            sc[b * ATT_HEADS + r] = malloc(sizeof(float) * (n + 8));
            o[b * ATT_HEADS + r] = malloc(sizeof(float) * hd);
        }
    }
    double best = 1e9;
    for (int t = 0; t < calls; t++) {
        const double t0 = now();
        run(R, B, q, kb, vb, hi, hd, sc, o);
        const double dt = now() - t0;
        if (dt < best) best = dt;
    }
    unsigned long long hash = 1469598103934665603ull;
    for (int b = 0; b < B; b++)
        for (int r = 0; r < R; r++) {
            const unsigned char *c = (const unsigned char *)o[b * ATT_HEADS + r];
            for (long i = 0; i < (long)sizeof(float) * hd; i++) hash = (hash ^ c[i]) * 1099511628211ull;
        }
    printf("%.3f %016llx\n", best * 1e6, hash);
    return 0;
}
"""


class ScriptError(Exception):
    pass


def build(rev: str | None, out: Path) -> Path:
    from ab_kernels import source_at

    from tsspec import kernels

    src = source_at(rev)
    if "blocks.c" not in src:
        raise ScriptError(f"no kernels/blocks.c at {rev!r}")
    out.mkdir(parents=True, exist_ok=True)
    for name, data in src.items():
        (out / name).write_bytes(data)
    (out / "harness.c").write_text(HARNESS)
    level = kernels._choose_levels()[0]
    cc = kernels._compiler()
    if cc is None:
        raise ScriptError("no C compiler (cc/gcc) found")
    others = [str(out / n) for n in src if n.endswith(".c") and n != "blocks.c"]
    err = ""
    for flags in kernels.level_flags(level):
        flags = [f for f in flags if f not in ("-fPIC", "-shared", "-std=c11")]
        exe = out / "attn"
        r = subprocess.run([cc, *flags, "-std=gnu11", str(out / "harness.c"), *others, "-o", str(exe), "-lm"],
                           capture_output=True, text=True)
        if r.returncode == 0:
            return exe
        err = r.stderr.strip().splitlines()[-1:] if r.stderr else ""
    raise ScriptError(f"harness build failed at {rev or 'the working tree'}: {err}")


def parse_shapes(text: str) -> list[tuple[int, int, int, int]]:
    shapes = []
    for part in text.split(","):
        try:
            vals = [int(v) for v in part.lower().split("x")]
            hd, r, n, b = vals if len(vals) == 4 else (*vals, 1)
        except ValueError:
            raise ScriptError(f"--shapes: {part!r} is not HDxRxN or HDxRxNxROWS (e.g. 128x4x2048x8)") from None
        if hd < 8 or hd % 8 or not 1 <= r <= 4 or not 1 <= b <= n:
            raise ScriptError(f"--shapes: {part!r} needs a head dimension that is a multiple of 8, R 1-4, 1 <= ROWS <= N")
        shapes.append((hd, r, n, b))
    return shapes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="git revision of the base source")
    ap.add_argument("--new", default=None, help="git revision of the new source (default: the working tree)")
    ap.add_argument("--shapes", default="256x4x512,256x2x512,128x4x2048,128x2x2048,64x3x1024,128x1x2048,"
                                        "256x4x512x16,128x4x2048x16,128x2x2048x16,64x3x1024x16")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=20, help="calls per round (each side's best is its time)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    try:
        shapes = parse_shapes(a.shapes)
        if a.rounds < 2 or a.calls < 1:
            raise ScriptError("--rounds must be at least 2 and --calls at least 1")
        with tempfile.TemporaryDirectory() as tmp:
            exe = {"base": build(a.base, Path(tmp) / "base"), "new": build(a.new, Path(tmp) / "new")}
            report = {"base": a.base, "new": a.new or "working tree", "shapes": {}}
            for hd, r, n, rows in shapes:
                times = {"base": [], "new": []}
                hashes = set()
                for i in range(a.rounds):
                    for side in (("base", "new") if i % 2 == 0 else ("new", "base")):
                        out = subprocess.run([str(exe[side]), str(hd), str(r), str(n), str(rows), str(a.calls)],
                                             capture_output=True, text=True, check=True).stdout.split()
                        times[side].append(float(out[0]))
                        hashes.add(out[1])
                if len(hashes) != 1:
                    raise ScriptError(f"{hd}x{r}x{n}x{rows}: the two builds give different outputs")
                ratios = sorted(nw / b for nw, b in zip(times["new"], times["base"]))
                q = statistics.quantiles(ratios, n=4)
                row = {"base_us": statistics.median(times["base"]), "new_us": statistics.median(times["new"]),
                       "ratio": statistics.median(ratios), "quartiles": [q[0], q[2]], "rounds": a.rounds}
                report["shapes"][f"{hd}x{r}x{n}x{rows}"] = row
                print(f"hd={hd} R={r} n={n} rows={rows}: base {row['base_us']:.2f} us, new {row['new_us']:.2f} us, "
                      f"new/base {row['ratio']:.3f} (quartiles {q[0]:.3f}-{q[2]:.3f}, {a.rounds} rounds)", flush=True)
            if a.json:
                Path(a.json).write_text(json.dumps(report, indent=2) + "\n")
    except (ScriptError, subprocess.CalledProcessError) as e:
        print(f"ab_attention: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
