"""Paired benchmark: plain greedy decoding vs the draft-model speculator, on the real Qwen pair.

For each prompt and draft window, runs plain and speculative decoding ``--reps`` times, alternating
which goes first, on the same prompt and the same (greedy) continuation: a run's speed-up is the
ratio of its pair's decode times, and the table reports the median of those ratios. Every
speculative run's tokens are checked against the plain run's.

    python scripts/bench_draft_model.py                      # windows 1..8, code + prose, 128 tokens
    python scripts/bench_draft_model.py --windows 4 6 --pmin 0.3 --prompts code
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from tsspec.spec.plan import SpecPlan
from tsspec.drafters import DrafterOptions, load_drafter
from tsspec.hub import ensure_model
from tsspec.models import load_model
from tsspec.settings import resolve_run
from tsspec.spec.registry import REGISTRY
from tsspec.options import SpecOptions
from tsspec.sampling import Sampler
from tsspec.spec.loop import decode
from tsspec.spec.stats import SpecStats
from tsspec.tokenizer import Tokenizer

PROMPTS = {
    "code": (
        "<|im_start|>user\nWrite a Python function `merge_intervals(intervals)` that merges "
        "overlapping intervals and returns them sorted, with a docstring and type hints.<|im_end|>\n"
        "<|im_start|>assistant\n"
    ),
    "prose": (
        "<|im_start|>user\nWrite a short story about a lighthouse keeper who finds a message in a "
        "bottle.<|im_end|>\n<|im_start|>assistant\n"
    ),
}


def run(target, sampler, prompt, n, spec=None, window=0):
    st = SpecStats()
    toks = decode(target, sampler, prompt, n, SpecPlan(spec, window=window or 8), stats=st)
    return toks, st


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trunk", default="qwen2.5-coder-1.5b")
    ap.add_argument("--drafter", default="qwen2.5-coder-0.5b")
    ap.add_argument("--windows", type=int, nargs="+", default=list(range(1, 9)))
    ap.add_argument("--prompts", nargs="+", default=list(PROMPTS), choices=list(PROMPTS))
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--pmin", type=float, default=None)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (1 is far steadier than 2 on a shared 2-core machine)")
    args = ap.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    trunk_path = ensure_model(args.trunk)
    config = resolve_run()  # TSSPEC_WEIGHTS / TSSPEC_DRAFT_WEIGHTS, read by tsspec.settings
    target = load_model(trunk_path, fmt=config.weights)
    drafter = load_drafter(ensure_model(args.drafter), target, DrafterOptions(weights=config.draft_weights))
    tok = Tokenizer.from_gguf(trunk_path)
    print(f"# loaded {args.trunk} <- {args.drafter} in {time.perf_counter() - t0:.0f}s; "
          f"notes={drafter.notes} warnings={drafter.warnings}", flush=True)
    sampler = Sampler()
    # warm the kernels on both models once, outside the timings
    run(target, sampler, tok.encode("hello"), 4)
    print("| prompt | window | pmin | tokens/verify | acceptance | plain tok/s | spec tok/s | speed-up (median of pairs) "
          "| identical | spec phase ms (draft / verify / accept / commit / plain) |")
    print("|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for name in args.prompts:
        prompt = tok.encode(PROMPTS[name])
        for w in args.windows:
            spec = REGISTRY.create("draft-model", target, SpecOptions(draft=w, pmin=args.pmin), drafter)
            ratios, tpv, acc, ptps, stps, same = [], [], [], [], [], True
            phases = {p: 0.0 for p in ("draft", "verify", "accept", "commit", "plain")}
            for r in range(args.reps):
                order = ("plain", "spec") if r % 2 == 0 else ("spec", "plain")
                res = {}
                for which in order:
                    res[which] = run(target, sampler, prompt, args.tokens, spec if which == "spec" else None, w)
                (pt, ps), (st_, ss) = res["plain"], res["spec"]
                same &= pt == st_
                ratios.append(ps.decode_ms / ss.decode_ms)
                tpv.append(ss.tokens_per_verify or 0.0)
                acc.append(ss.acceptance_rate or 0.0)
                ptps.append(ps.decode_tok_s)
                stps.append(ss.decode_tok_s)
                for p in phases:
                    phases[p] += ss.phase_ms[p] / args.reps
            ph = " / ".join(f"{phases[p]:.0f}" for p in phases)
            print(f"| {name} | {w} | {spec.min_draft_prob:g} | {statistics.mean(tpv):.2f} | {statistics.mean(acc):.2f} "
                  f"| {statistics.median(ptps):.2f} | {statistics.median(stps):.2f} | {statistics.median(ratios):.2f}x "
                  f"| {'yes' if same else 'NO'} | {ph} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
