#!/usr/bin/env python3
"""Acceptance of a distilled draft head under sampling, with the ``match`` and ``residual`` rules.

    python scripts/head_sampling_acceptance.py HEAD.gguf [-m smollm2-135m] [--seeds 3] [-n 48]

Four chat prompts x ``--seeds`` seeds at temperatures 0.7 and 1.0, each rule in turn; prints drafted
and accepted tokens, the acceptance rate and tokens per verify. ``match`` emits exactly plain
sampling's tokens; ``residual`` keeps plain sampling's distribution (tests/test_distill.py checks
both). Counts only, no timing: a speed comparison is ``tsspec bench``.
"""

from __future__ import annotations

import argparse

import torch

from tsspec.spec.plan import SpecPlan
from tsspec.chat import chat_prompt_ids
from tsspec.drafters import load_drafter
from tsspec.hub import model_path
from tsspec.models import load_model
from tsspec.sampling import Sampler, SamplingParams
from tsspec.spec.draft_head import DraftHeadSpeculator
from tsspec.spec.loop import decode
from tsspec.spec.stats import SpecStats
from tsspec.tokenizer import Tokenizer

PROMPTS = ["Write a Python function that returns the n-th Fibonacci number.", "Explain what a hash map is.",
           "Write a bash loop that renames every .txt file to .md.", "Why is the sky blue?"]


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("head", help="a head written by `tsspec distill`")
    ap.add_argument("-m", "--model", default="smollm2-135m", help="its trunk: known name or GGUF path")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("-n", type=int, default=48, help="tokens per sequence")
    ap.add_argument("-t", "--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    path = a.model if a.model.endswith(".gguf") else model_path(a.model)
    trunk, tok = load_model(path), Tokenizer.from_gguf(path)
    head = load_drafter(a.head, trunk).draft_head
    for temp in (0.7, 1.0):
        for rule in ("match", "residual"):
            st = SpecStats()
            for q in PROMPTS:
                ids = chat_prompt_ids(tok, [{"role": "user", "content": q}])
                for seed in range(a.seeds):
                    spec = DraftHeadSpeculator(head, trunk.n_layers, max_draft_tokens=4)
                    decode(trunk, Sampler(SamplingParams(temperature=temp, seed=seed)), ids, a.n, SpecPlan(spec, window=4, accept_rule=rule), stats=st)
            print(f"temperature {temp} {rule:8s} drafted {st.drafted} accepted {st.accepted} "
                  f"rate {st.acceptance_rate:.3f} tokens/verify {st.tokens_per_verify:.2f}", flush=True)


if __name__ == "__main__":
    main()
