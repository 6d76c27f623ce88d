#!/usr/bin/env python3
"""Prefill with prompt rows on the tile routes against the default products, paired.

    python scripts/ab_prompt_tiles.py [--models qwen2.5-coder-1.5b ...] [--tokens 512] [--rounds 8]
                                      [--k-only] [--q4k-only] [--json FILE]

One process per model, one model load: each round prefills the same prompt (``--tokens`` of
README.md's text, as prompt rows, in the chunks a run takes on each side) into a fresh cache once with
the routes off (every row on the default arithmetic: TSSPEC_PROMPT_TILES=0) and once with prompt rows'
Q4_K and Q6_K (super-block route) and Q4_0, Q5_0 and Q8_0 (32-element route) products on the AMX tiles
(TSSPEC_PROMPT_TILES=1; ``--k-only`` adds a side with the super-block route alone, ``--q4k-only`` one with
Q4_K's only), each side first in turn, so the host's slow and fast phases fall on all alike. Reports each
side's median tokens a second, and the median and quartiles over rounds of each side's time over the
route-off time. Needs a CPU with AMX. The sides round differently by design; the script reports how
far the last row's logits move (cosine, and whether the argmax agrees).
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


def prompt_tokens(model, n: int) -> list[int]:
    from tsspec.tokenizer import Tokenizer

    text = (ROOT / "README.md").read_text()
    ids = list(Tokenizer.from_gguf(model.path).encode(text))
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def prefill(model, ids: list[int]):
    from tsspec.spec.run import prefill_chunk

    cache = model.make_cache()
    out = None
    n = prefill_chunk()  # as a run takes them: larger chunks while the route is on
    for a in range(0, len(ids), n):
        out = model.forward(ids[a : a + n], cache, prompt=True)
    return out.logits[-1]


SIDE_TYPES = {"tiles-k": ["Q4_K", "Q6_K"], "tiles-q4k": ["Q4_K"]}  # the rest take every type the routes take


def use(side: str) -> None:
    """the routes as ``side`` takes them: off, tiles (every type they take), tiles-k (the super-block
    route's Q4_K and Q6_K alone) or tiles-q4k (Q4_K alone)"""
    from tsspec import kernels

    kernels.use_prompt_tiles("off" if side == "off" else "tiles")
    kernels.prompt_tiles_types(SIDE_TYPES.get(side, list(kernels.PROMPT_ROUTE_TYPES)))


def run(name: str, tokens: int, rounds: int, sides: tuple[str, ...] = ("off", "tiles")) -> dict:
    import torch

    from tsspec.hub import resolve_model
    from tsspec.models import load_model

    model = load_model(resolve_model(name, progress=False))
    ids = prompt_tokens(model, tokens)
    times: dict[str, list[float]] = {side: [] for side in sides}
    last = {}
    for side in sides:  # warm each
        use(side)
        last[side] = prefill(model, ids)
    for r in range(rounds):
        for i in range(len(sides)):  # each side first in turn
            side = sides[(r + i) % len(sides)]
            use(side)
            t = time.perf_counter()
            prefill(model, ids)
            times[side].append(time.perf_counter() - t)
    use("off")
    res = {"model": name, "tokens": len(ids), "rounds": rounds, "times_s": times,
           "off_tok_s": len(ids) / statistics.median(times["off"])}
    line = f"{name}: {len(ids)} tokens, off {res['off_tok_s']:.1f} tok/s"
    for side in sides[1:]:
        ratios = sorted(b / a for a, b in zip(times["off"], times[side]))
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        a, b = last["off"].float(), last[side].float()
        key = side.replace("-", "_")
        res |= {f"{key}_tok_s": len(ids) / statistics.median(times[side]),
                f"{key}_over_off_time": statistics.median(ratios), f"{key}_quartiles": [q[0], q[2]],
                f"{key}_last_row_cosine": torch.nn.functional.cosine_similarity(a, b, 0).item(),
                f"{key}_same_argmax": bool(a.argmax() == b.argmax())}
        line += (f"; {side} {res[key + '_tok_s']:.1f} tok/s, time {res[key + '_over_off_time']:.3f}x off "
                 f"[{q[0]:.3f}-{q[2]:.3f}], last row cosine {res[key + '_last_row_cosine']:.5f}, same argmax "
                 f"{res[key + '_same_argmax']}")
    print(line, flush=True)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["qwen2.5-coder-1.5b", "gemma3-270m", "smollm2-135m"])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--k-only", action="store_true",
                    help="also run the super-block route alone (Q4_K and Q6_K; the legacy types on the default "
                         "arithmetic)")
    ap.add_argument("--q4k-only", action="store_true",
                    help="also run the route with Q4_K products only (every other type on the default arithmetic)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from tsspec import kernels

    if not (kernels.available() and kernels.amx_usable() and kernels.sb_tiles_built()):
        print("ab_prompt_tiles: needs the native kernels on a CPU with AMX the kernel grants", file=sys.stderr)
        return 2
    sides = ("off", "tiles") + (("tiles-k",) if args.k_only else ()) + (("tiles-q4k",) if args.q4k_only else ())
    out = [run(m, args.tokens, args.rounds, sides) for m in args.models]
    if args.json:
        args.json.write_text(json.dumps({"cpu_flags_amx": True, "threads": kernels.thread_count(), "runs": out},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
