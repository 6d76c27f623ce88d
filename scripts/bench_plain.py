#!/usr/bin/env python3
"""Plain greedy decode and prefill speed on the real models (median of repeated runs).

    python scripts/bench_plain.py [MODEL ...] [--reps 5] [--tokens 64] [--prompt-tokens 128]

Decode tok/s excludes the prefill; prefill tok/s is measured on a prompt of --prompt-tokens tokens.
This machine is shared and noisy: read the medians, and compare configurations with `tsspec bench`.
"""

from __future__ import annotations

import argparse
import statistics

from tsspec.hub import KNOWN_MODELS, ensure_model
from tsspec.models import load_model
from tsspec.settings import resolve_run
from tsspec.sampling import Sampler
from tsspec.spec.loop import decode
from tsspec.spec.stats import SpecStats
from tsspec.tokenizer import Tokenizer

TEXT = (
    "The history of computing is a story of abstraction layered on abstraction. Early machines were "
    "programmed by rewiring panels; stored programs made software possible; compilers let people "
    "write in something closer to mathematics; operating systems hid the hardware; networks joined "
    "machines into systems that no single person understands. "
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=list(KNOWN_MODELS))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    args = ap.parse_args()
    for name in args.models:
        path = ensure_model(name)
        target = load_model(path, fmt=resolve_run().weights)  # TSSPEC_WEIGHTS, read by tsspec.settings
        tok = Tokenizer.from_gguf(path)
        ids = tok.encode(TEXT * 8)[: args.prompt_tokens]
        sampler = Sampler()
        decode(target, sampler, ids, 8)  # warm-up
        dec, pre = [], []
        for _ in range(args.reps):
            st = SpecStats()
            decode(target, sampler, ids, args.tokens, stats=st)
            dec.append(st.decode_tok_s)
            pre.append(st.prefill_tok_s)
        print(
            f"{name:20s} decode {statistics.median(dec):6.1f} tok/s (min {min(dec):.1f}, max {max(dec):.1f})"
            f"   prefill {statistics.median(pre):7.1f} tok/s   weights {target.weight_bytes() / 1e6:.0f} MB",
            flush=True,
        )


if __name__ == "__main__":
    main()
