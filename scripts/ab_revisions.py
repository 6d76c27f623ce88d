#!/usr/bin/env python3
"""Paired decode-speed comparison of two git revisions of tsspec: is a refactor free?

    python scripts/ab_revisions.py --base REV [--models smollm2-135m ...] [--rounds 8] [--tokens 64]

The base revision is checked out into a temporary git worktree. Each round runs one process per
revision, in alternating order (ABBA...), and each process loads a model and decodes the same four
prompts greedily, plain and with n-gram speculation (window 8). The report gives, per prompt, the
median decode time of each revision and their ratio, then the median ratio over prompts; and it
checks both revisions emit the same tokens. Run it on a quiet machine: nothing else on the CPUs.

With ``--verify-rows 1,5,9,16`` each process also times forwards of r rows (all logits, as a verify
runs them) on top of a 128-token cache, rewinding after each, 7 passes; the report gives each
revision's ratio of an r-row forward to a 1-row one (median over rounds) and new/base per r.

A process reuses one cache across its prompts when the revision has caches (``make_cache``), as
``tsspec.generate.Engine`` does; older revisions kept one cache inside the model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXTS = [
    "The history of computing is a story of abstraction layered on abstraction. Early machines were "
    "programmed by rewiring panels; stored programs made software possible.",
    "def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n    pivot = xs[0]\n",
    "Summarize: The cat sat on the mat. The cat sat on the mat because the mat was warm. The dog",
    'import numpy as np\n\ndef normalize(v):\n    """Return v scaled to unit length."""\n',
]


def verify_curve(m, tok, rows: list[int], context: int = 128, passes: int = 7) -> dict[str, float]:
    """ms per forward of r rows on a ``context``-token cache (median of ``passes``), r in ``rows``:
    bench_vs_llamacpp's timing, beside this script."""
    from bench_vs_llamacpp import time_forwards

    ids = tok.encode(" ".join(TEXTS) * 4)[: context + max(rows)]
    return {str(r): statistics.median(v) for r, v in time_forwards(m, ids, context, rows, passes).items()}


def run_one(model: str, tokens: int, rows: list[int] | None = None) -> dict:
    """In the revision under test (on ``sys.path``): decode times per prompt and mode."""
    from tsspec.hub import ensure_model
    from tsspec.models import load_model
    from tsspec.sampling import Sampler
    from tsspec.spec.loop import decode
    from tsspec.spec.ngram import NGramSpeculator
    from tsspec.spec.stats import SpecStats
    from tsspec.tokenizer import Tokenizer

    path = ensure_model(model)
    m = load_model(path, fmt="auto")
    tok = Tokenizer.from_gguf(path)
    cache = m.make_cache() if hasattr(m, "make_cache") else None
    out = {}
    for i, text in enumerate(TEXTS):
        ids = tok.encode(text)
        for mode in ("plain", "ngram"):
            spec = NGramSpeculator(max_draft_tokens=8) if mode == "ngram" else None
            st = SpecStats()
            kw = {}
            if cache is not None:
                cache.reset()
                kw["cache"] = cache
            try:  # revisions since the speculation plan (issue 39) take one value; older ones keywords
                from tsspec.spec.plan import SpecPlan
            except ImportError:
                got = decode(m, Sampler(), ids, tokens, speculator=spec, window=8, stats=st, **kw)
            else:
                got = decode(m, Sampler(), ids, tokens, SpecPlan(spec, window=8), stats=st, **kw)
            out[f"{i}/{mode}"] = {"decode_ms": st.decode_ms, "tokens": got}
    if rows:
        out["curve"] = verify_curve(m, tok, rows)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the git revision to compare the working tree against")
    ap.add_argument("--models", nargs="+", default=["smollm2-135m"])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--verify-rows", default="", help="also time r-row forwards, e.g. 1,5,9,16 (1 is added)")
    ap.add_argument("--run-one", help=argparse.SUPPRESS)
    a = ap.parse_args()
    try:
        rows = sorted({1, *(int(x) for x in a.verify_rows.split(",") if x.strip())}) if a.verify_rows else []
    except ValueError:
        ap.error(f"--verify-rows: not a comma-separated list of row counts: {a.verify_rows!r}")
    if any(r < 1 or r > 64 for r in rows):
        ap.error("--verify-rows: row counts are 1..64")
    if a.run_one:
        print(json.dumps(run_one(a.run_one, a.tokens, rows)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(base), a.base], check=True)
        try:
            trees = {"base": base, "new": ROOT}
            for model in a.models:
                compare(model, trees, a.rounds, a.tokens, rows)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False)


def compare(model: str, trees: dict, rounds: int, tokens: int, rows: list[int]) -> None:
    runs: dict[str, list[dict]] = {"base": [], "new": []}
    for r in range(rounds):
        for name in (("base", "new") if r % 2 == 0 else ("new", "base")):
            env = dict(os.environ, PYTHONPATH=str(trees[name]))
            p = subprocess.run([sys.executable, __file__, "--base", "-", "--run-one", model, "--tokens", str(tokens),
                                "--verify-rows", ",".join(map(str, rows))],
                               env=env, cwd=trees[name], capture_output=True, text=True)
            if p.returncode:
                sys.exit(f"{name} failed:\n{p.stderr[-2000:]}")
            runs[name].append(json.loads(p.stdout.strip().splitlines()[-1]))
    print(f"\n{model}: {rounds} rounds, {tokens} tokens, decode ms (median over rounds)")
    for mode in ("plain", "ngram"):
        ratios = []
        for key in runs["base"][0]:
            if key == "curve" or not key.endswith(mode):
                continue
            b = statistics.median(x[key]["decode_ms"] for x in runs["base"])
            n = statistics.median(x[key]["decode_ms"] for x in runs["new"])
            same = all(x[key]["tokens"] == runs["base"][0][key]["tokens"] for x in runs["base"] + runs["new"])
            ratios.append(n / b)
            print(f"  {key:<8} base {b:8.1f}  new {n:8.1f}  new/base {n / b:.3f}  same tokens: {same}")
        print(f"  {mode}: median new/base over {len(ratios)} prompts {statistics.median(ratios):.3f}")
    if rows:
        print(f"  verify: ms of an r-row forward at context 128 (median over rounds), ratio to r = 1")
        med = {name: {r: statistics.median(x["curve"][str(r)] for x in runs[name]) for r in rows} for name in runs}
        for r in rows:
            b, n = med["base"][r], med["new"][r]
            print(f"  r={r:<3} base {b:8.2f} ms ({b / med['base'][1]:.2f}x)  new {n:8.2f} ms ({n / med['new'][1]:.2f}x)"
                  f"  new/base {n / b:.3f}")


if __name__ == "__main__":
    main()
