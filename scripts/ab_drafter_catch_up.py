"""A draft model's catch-up on the prompt routes against the shared products, paired per prompt.

    TSSPEC_PROMPT_TILES=1 python scripts/ab_drafter_catch_up.py [-m qwen2.5-coder-0.5b] [-w grounded] [--reps 2]

Times a draft model's first ``propose`` on each prompt of a built-in workload (its catch-up over the
prompt, at most its window, then 4 drafted tokens) with the catch-up marked as prompt rows
(``draft_model.ROUTE_ROWS`` as shipped) and unmarked (the shared products), in alternating order;
the best of ``--reps`` a side, then the ratio per prompt and their median. Without
``TSSPEC_PROMPT_TILES=1`` both sides take the shared products (the ratio is noise).
"""

from __future__ import annotations

import argparse
import statistics
import time

from tsspec import kernels
from tsspec.bench.workloads import get_workload
from tsspec.hub import model_path
from tsspec.models import load_model
from tsspec.sampling import Sampler
from tsspec.spec import draft_model as dm
from tsspec.spec.protocols import DraftContext
from tsspec.tokenizer import Tokenizer

OFF = 1 << 62  # no forward is that long: nothing marked


def first_propose_s(drafter, ids: list[int], route_rows: int) -> float:
    """Seconds of a fresh draft model's first propose after the prompt ``ids``."""
    dm.ROUTE_ROWS = route_rows
    spec = dm.DraftModelSpeculator(drafter, vocab_size=drafter.cfg.vocab_size, max_draft_tokens=4)
    spec.begin(ids[:-1], None)
    ctx = DraftContext(last_token=ids[-1], position=len(ids) - 1, max_tokens=4, history=ids, sampler=Sampler())
    t0 = time.perf_counter()
    spec.propose(ctx)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-0.5b", help="the draft model (a known name)")
    ap.add_argument("-w", "--workload", default="grounded", help="a built-in workload")
    ap.add_argument("--reps", type=int, default=2, help="runs a side per prompt (the best is kept)")
    a = ap.parse_args()
    shipped = dm.ROUTE_ROWS
    path = model_path(a.model)
    drafter, tok = load_model(path), Tokenizer.from_gguf(path)
    print(f"prompt routes: {kernels.prompt_tiles_status()}; marked from {shipped} rows")
    ratios = []
    for i, prompt in enumerate(get_workload(a.workload).prompts):
        ids = tok.encode(prompt.text)
        t: dict[int, list[float]] = {shipped: [], OFF: []}
        for _ in range(a.reps):
            for rows in ((shipped, OFF) if i % 2 else (OFF, shipped)):
                t[rows].append(first_propose_s(drafter, ids, rows))
        on, off = min(t[shipped]), min(t[OFF])
        ratios.append(on / off)
        print(f"{i}: {len(ids)} tokens: marked {on * 1e3:.0f} ms, shared {off * 1e3:.0f} ms, {on / off:.3f}x", flush=True)
    dm.ROUTE_ROWS = shipped
    print(f"median {statistics.median(ratios):.3f}x the time over {len(ratios)} prompts")


if __name__ == "__main__":
    main()
