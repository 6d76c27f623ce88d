"""A draft model's one-row step with its LM head whole against cut to the first N ids.

    python scripts/draft_head_step.py [-m qwen2.5-coder-0.5b] [--prefixes 98304,81920,65536] [--rounds 40]

Each round forwards four one-row steps after a 128-token context with the whole head and with each
cut (``models.head_rows.HeadRows``), in turn, and prints the median ms a step per head: what a cut
saves a drafter step on this machine (the ids a sequence used would add a few rows more).
"""

from __future__ import annotations

import argparse
import statistics
import time

from tsspec.hub import resolve_model
from tsspec.models import load_model
from tsspec.models.head_rows import HeadRows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--prefixes", default="98304,81920,65536", help="comma-separated cuts (ids)")
    ap.add_argument("--rounds", type=int, default=40)
    args = ap.parse_args()
    m = load_model(resolve_model(args.model))
    heads = {"whole": None} | {str(n): HeadRows(m, int(n)) for n in args.prefixes.split(",")}
    cache = m.make_cache()
    m.forward(list(range(100, 228)), cache)
    base = cache.length
    times: dict[str, list[float]] = {k: [] for k in heads}
    for _ in range(args.rounds):
        for name, head in heads.items():
            kw = {} if head is None else {"vocab": head}
            cache.length = base
            t = time.perf_counter()
            for i in range(4):
                m.forward([500 + i], cache, **kw)
            times[name].append((time.perf_counter() - t) / 4 * 1000.0)
    whole = statistics.median(times["whole"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:>8}: {med:6.2f} ms a step ({med / whole:.3f} of the whole head's)")


if __name__ == "__main__":
    main()
