"""The verify curve with every row on the prompt routes, beside the shared products: could the routes serve verify rows?

    TSSPEC_PROMPT_TILES=1 python scripts/route_verify_curve.py [-m qwen2.5-coder-1.5b] [--rows 1,5,9,17] [--passes 7]

ms of a forward of r rows (all logits, as a verify takes them) on a 128-token cache, rewound after
each, with the rows marked as prompt rows (the routes' arithmetic, on the tiles) and unmarked (the
shared products), the two interleaved in alternating order each pass; medians, each as a multiple
of the shared one-row step. Verify rows cannot take the routes today (a decode row, which keeps the
shared arithmetic, must give the bits the same row gives in a verify); this measures what they
would cost if every row did. Without ``TSSPEC_PROMPT_TILES=1`` both columns are the shared products.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_vs_llamacpp import TsspecBench  # noqa: E402  (a sibling script: its model and text loader)

from tsspec import kernels  # noqa: E402
from tsspec.hub import model_path  # noqa: E402

CONTEXT = 128


def curve(target, ids: list[int], rows: list[int], passes: int) -> dict[tuple[int, bool], list[float]]:
    """ms of each forward of r rows after CONTEXT cached tokens, marked (True) and not; one untimed pass first"""
    cache = target.make_cache()
    cache.reserve(CONTEXT + max(rows) + 1)
    target.forward(ids[:CONTEXT], cache, prompt=True)
    draft = ids[CONTEXT : CONTEXT + max(rows)]
    ms: dict[tuple[int, bool], list[float]] = {(r, p): [] for r in rows for p in (False, True)}
    for n in range(passes + 1):
        for r in rows:
            for marked in ((False, True) if n % 2 else (True, False)):
                t0 = time.perf_counter()
                target.forward(draft[:r], cache, all_logits=True, prompt=marked)
                if n:
                    ms[(r, marked)].append((time.perf_counter() - t0) * 1000.0)
                cache.trim(cache.length - CONTEXT)
    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b", help="a known model name")
    ap.add_argument("--rows", default="1,5,9,17", help="row counts, comma-separated")
    ap.add_argument("--passes", type=int, default=7, help="timed passes over every row count")
    a = ap.parse_args()
    rows = sorted({int(v) for v in a.rows.split(",")} | {1})
    tb = TsspecBench.load(a.model, model_path(a.model), CONTEXT + max(rows))
    print(f"{a.model}: prompt routes {kernels.prompt_tiles_status()}; context {CONTEXT}, {a.passes} passes")
    ms = curve(tb.target, tb.prompt, rows, a.passes)
    step = statistics.median(ms[(1, False)])
    for r in rows:
        shared, routes = statistics.median(ms[(r, False)]), statistics.median(ms[(r, True)])
        print(f"  {r:3d} rows: shared {shared:7.1f} ms ({shared / step:.2f}x the step)   "
              f"routes {routes:7.1f} ms ({routes / step:.2f}x)   routes / shared {routes / shared:.3f}")


if __name__ == "__main__":
    main()
