#!/usr/bin/env python3
"""Paired speed of the native attention (kernels/blocks.c's attend_heads) at two revisions.

    python scripts/ab_attention.py --base REV [--new REV] [--shapes 256x4x512,128x2x2048]
                                   [--rounds 15] [--json FILE]

A shape is head dimension x query heads taken together (R: the query heads of one KV head that a
work item holds, 1-4 with AVX-512) x positions attended. Each revision's kernel sources are
compiled with a small harness (the flags tsspec builds with, this machine's level) into its own
program; the programs run in turn, the order flipped every round, and each reports its best time
of a few calls per round. Both must give the same outputs bit for bit (a hash of every output
float), since an attention change is meant to move no bit. The report gives each side's median
microseconds per call and the median and quartiles of new/base over rounds.

What it does not time: the rope, the cache writes, threads (one core), and the model around the
attention; scripts/ab_kernels.py times whole forwards.
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
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(int argc, char **argv) {
    const long hd = atol(argv[1]), n = atol(argv[3]);
    const int R = atoi(argv[2]), calls = atoi(argv[4]);
    float *kb = malloc(sizeof(float) * hd * (n + 8)), *vb = malloc(sizeof(float) * hd * (n + 8));
    for (long i = 0; i < hd * (n + 8); i++) {
        kb[i] = (float)((i * 2654435761u) % 1000) / 1000.f - 0.5f;
        vb[i] = (float)((i * 40503u) % 1000) / 1000.f - 0.5f;
    }
    float *q[4], *sc[4], *o[4];
    for (int r = 0; r < 4; r++) {
        q[r] = malloc(sizeof(float) * hd); sc[r] = malloc(sizeof(float) * (n + 8)); o[r] = malloc(sizeof(float) * hd);
        for (long i = 0; i < hd; i++) q[r][i] = (float)(((i + r * 7) * 97) % 100) / 100.f - 0.5f;
    }
    double best = 1e9;
    for (int t = 0; t < calls; t++) {
        const double t0 = now();
        attend_heads(R, (const float *const *)q, kb, vb, 0, n - 1, hd, n, NULL, sc, o);
        const double dt = now() - t0;
        if (dt < best) best = dt;
    }
    unsigned long long hash = 1469598103934665603ull;
    for (int r = 0; r < R; r++) {
        const unsigned char *b = (const unsigned char *)o[r];
        for (long i = 0; i < (long)sizeof(float) * hd; i++) hash = (hash ^ b[i]) * 1099511628211ull;
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


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    shapes = []
    for part in text.split(","):
        try:
            hd, r, n = (int(v) for v in part.lower().split("x"))
        except ValueError:
            raise ScriptError(f"--shapes: {part!r} is not HDxRxN (e.g. 128x4x2048)") from None
        if hd < 8 or hd % 8 or not 1 <= r <= 4 or n < 1:
            raise ScriptError(f"--shapes: {part!r} needs a head dimension that is a multiple of 8, R 1-4, N >= 1")
        shapes.append((hd, r, n))
    return shapes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="git revision of the base source")
    ap.add_argument("--new", default=None, help="git revision of the new source (default: the working tree)")
    ap.add_argument("--shapes", default="256x4x512,256x2x512,128x4x2048,128x2x2048,64x3x1024,128x1x2048")
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
            for hd, r, n in shapes:
                times = {"base": [], "new": []}
                hashes = set()
                for i in range(a.rounds):
                    for side in (("base", "new") if i % 2 == 0 else ("new", "base")):
                        out = subprocess.run([str(exe[side]), str(hd), str(r), str(n), str(a.calls)],
                                             capture_output=True, text=True, check=True).stdout.split()
                        times[side].append(float(out[0]))
                        hashes.add(out[1])
                if len(hashes) != 1:
                    raise ScriptError(f"{hd}x{r}x{n}: the two builds give different outputs")
                ratios = sorted(nw / b for nw, b in zip(times["new"], times["base"]))
                q = statistics.quantiles(ratios, n=4)
                row = {"base_us": statistics.median(times["base"]), "new_us": statistics.median(times["new"]),
                       "ratio": statistics.median(ratios), "quartiles": [q[0], q[2]], "rounds": a.rounds}
                report["shapes"][f"{hd}x{r}x{n}"] = row
                print(f"hd={hd} R={r} n={n}: base {row['base_us']:.2f} us, new {row['new_us']:.2f} us, "
                      f"new/base {row['ratio']:.3f} (quartiles {q[0]:.3f}-{q[2]:.3f}, {a.rounds} rounds)", flush=True)
            if a.json:
                Path(a.json).write_text(json.dumps(report, indent=2) + "\n")
    except (ScriptError, subprocess.CalledProcessError) as e:
        print(f"ab_attention: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
