#!/usr/bin/env python3
"""What a verify would cost in the super-block arithmetic on the AMX tiles: a measured projection.

    python scripts/verify_rows_sb.py [--model qwen2.5-coder-1.5b] [--rows 9 17] [--context 128]
                                     [--rounds 8] [--json FILE]

Verify rows keep the shared arithmetic today (a verify row must round as a decode step does), so the
tiles cannot take them. Were every row on the super-block arithmetic (issue 47's plan: decode, verify
and prompt rows alike), a verify of N rows would cost what N rows forwarded through that route cost
now. This script times exactly that on a real model, paired in one process, over a ``--context``-token
cache: one decode step (1 row, default arithmetic), N rows as a verify takes them today (all logits,
default arithmetic), and the same N rows marked as prompt rows with the route on the tiles (all
logits). Reports each side's median over rounds and the ratios to the one-row step. A projection for
the verify only: the one-row step in the super-block arithmetic (a VNNI kernel for it) is not built,
so the step in the ratio is today's. Needs a CPU with AMX.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--rows", type=int, nargs="+", default=[9, 17])
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from tsspec import kernels
    from tsspec.hub import resolve_model
    from tsspec.models import load_model

    if not (kernels.available() and kernels.amx_usable() and kernels.sb_tiles_built()):
        print("verify_rows_sb: needs the native kernels on a CPU with AMX the kernel grants", file=sys.stderr)
        return 2
    model = load_model(resolve_model(args.model, progress=False))
    ctx = [int(t) % 1000 + 100 for t in range(args.context)]
    draft = [int(t) % 500 + 200 for t in range(max(args.rows))]
    cache = model.make_cache()
    model.forward(ctx, cache)

    def timed(rows: int, side: str) -> float:
        kernels.use_prompt_tiles("tiles" if side == "tiles" else "off")
        t = time.perf_counter()
        model.forward(draft[:rows], cache, all_logits=rows > 1, prompt=side == "tiles")
        dt = time.perf_counter() - t
        kernels.use_prompt_tiles("off")
        cache.trim(rows)  # back to the context, as a rejected verify leaves it
        return dt

    sides = [(1, "step")] + [(n, s) for n in args.rows for s in ("today", "tiles")]
    times: dict[str, list[float]] = {f"{n}:{s}": [] for n, s in sides}
    for n, s in sides:  # warm
        timed(n, s)
    for r in range(args.rounds):
        for i in range(len(sides)):
            n, s = sides[(r + i) % len(sides)]
            times[f"{n}:{s}"].append(timed(n, s))
    med = {k: statistics.median(v) for k, v in times.items()}
    res = {"model": args.model, "context": args.context, "rounds": args.rounds, "threads": kernels.thread_count(),
           "median_s": med, "times_s": times}
    print(f"{args.model}, {args.context}-token cache, {args.rounds} rounds: "
          f"one-row step {med['1:step'] * 1e3:.1f} ms")
    for n in args.rows:
        for s in ("today", "tiles"):
            ratios = sorted(b / a for a, b in zip(times["1:step"], times[f"{n}:{s}"]))
            res[f"{n}:{s}_over_step"] = statistics.median(ratios)
            print(f"  {n} rows, {'shared arithmetic (today)' if s == 'today' else 'super-block route on the tiles'}: "
                  f"{med[f'{n}:{s}'] * 1e3:.1f} ms, {statistics.median(ratios):.2f}x the step "
                  f"[{ratios[len(ratios) // 4]:.2f}-{ratios[(3 * len(ratios)) // 4]:.2f}]")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
