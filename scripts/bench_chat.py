#!/usr/bin/env python3
"""Multi-turn chat: what a kept cache and speculation armed on later turns buy, paired per turn.

    python scripts/bench_chat.py [-m qwen2.5-coder-0.5b] [--rounds 3] [--tokens 96] [--json FILE]

Three configurations run the same scripted conversations (greedy, so every configuration produces
the same replies, which the script checks), interleaved per conversation, ``--rounds`` times:

* ``fresh``: every turn prefills the whole rendered conversation (a server without prefix reuse);
* ``reuse``: the conversation's kept cache; each turn forwards only what it lacks;
* ``reuse+ngram``: the same, with n-gram speculation (it arms from the second turn).

Time per turn is prefill + decode (end to end). The report gives, for turns 2 and later, the median
over rounds per turn, then the geometric mean over turns of each configuration's ratio to
``fresh`` and to ``reuse``, with the range over turns, and turn 1's speculative speed-up (reuse+ngram
over reuse), which later turns must not fall below. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys

from tsspec.spec.plan import SpecPlan
from tsspec.conversation import Conversation
from tsspec.generate import Engine
from tsspec.hub import ensure_model
from tsspec.models import load_model
from tsspec.sampling import Sampler
from tsspec.settings import resolve_run
from tsspec.spec.governor import SpeculationCostGovernor
from tsspec.spec.ngram import NGramSpeculator
from tsspec.tokenizer import Tokenizer

CONVERSATIONS = [
    ["Write a Python function `merge_intervals(intervals)` that merges overlapping intervals.",
     "Add type hints and a docstring to that function.",
     "Now write three pytest tests for it.",
     "Rename the function to `merge_ranges` everywhere, and show the whole file again."],
    ["Write a Python class `LRUCache` with `get` and `put`, using an OrderedDict.",
     "Make the capacity a constructor argument and raise ValueError if it is not positive.",
     "Show the whole class again with a `__len__` method added."],
    ["Explain what a hash table is in three sentences.",
     "Now explain how collisions are handled, in three sentences.",
     "Summarize both answers in one paragraph."],
]
CONFIGS = ("fresh", "reuse", "reuse+ngram")


def run_conversation(model, tok, turns: list[str], config: str, tokens: int) -> list[dict]:
    spec = NGramSpeculator() if config == "reuse+ngram" else None
    engine = Engine(model, tok, SpecPlan(spec, governor=SpeculationCostGovernor() if spec else None, window=8))
    conv = Conversation(engine)
    out = []
    for user in turns:
        if config == "fresh":
            conv.prefix.clear()
        t = conv.reply(user, sampler=Sampler(), max_tokens=tokens)
        s = t.stats
        out.append({"ms": s.prefill_ms + s.decode_ms, "prefill_ms": s.prefill_ms, "decode_ms": s.decode_ms,
                    "prompt": t.prompt_tokens, "reused": t.reused, "generated": len(t.token_ids),
                    "tokens": t.token_ids, "drafted": s.drafted, "accepted": s.accepted})
    return out


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--json", help="write every measurement here")
    a = ap.parse_args()
    path = ensure_model(a.model)
    model = load_model(path, fmt=resolve_run().weights)
    tok = Tokenizer.from_gguf(path)
    runs: dict[tuple[int, str], list[list[dict]]] = {}
    for r in range(a.rounds):
        for ci, turns in enumerate(CONVERSATIONS):
            order = CONFIGS if (r + ci) % 2 == 0 else tuple(reversed(CONFIGS))
            for config in order:
                runs.setdefault((ci, config), []).append(run_conversation(model, tok, turns, config, a.tokens))
                print(f"round {r + 1} conversation {ci + 1} {config}", file=sys.stderr)
    # exactness: every configuration gave the same replies
    for ci in range(len(CONVERSATIONS)):
        ref = [t["tokens"] for t in runs[(ci, "fresh")][0]]
        for config in CONFIGS:
            for rep in runs[(ci, config)]:
                if [t["tokens"] for t in rep] != ref:
                    sys.exit(f"conversation {ci + 1}: {config} replied differently from fresh")
    print(f"\n{a.model}: {len(CONVERSATIONS)} conversations, {a.rounds} rounds, up to {a.tokens} tokens per reply; "
          "replies identical in every configuration")
    print(f"{'conv/turn':<10}{'prompt':>7}{'reused':>7}" + "".join(f"{c + ' ms':>17}" for c in CONFIGS)
          + f"{'accept':>8}")
    ratios = {("reuse", "fresh"): [], ("reuse+ngram", "fresh"): [], ("reuse+ngram", "reuse"): []}
    first_spec: list[float] = []  # turn 1's speculative speed-up, what later turns must not fall below
    for ci, turns in enumerate(CONVERSATIONS):
        for ti in range(len(turns)):
            med = {c: statistics.median(rep[ti]["ms"] for rep in runs[(ci, c)]) for c in CONFIGS}
            t = runs[(ci, "reuse+ngram")][0][ti]
            acc = f"{100 * t['accepted'] / t['drafted']:.0f}%" if t["drafted"] else "-"
            print(f"{ci + 1}/{ti + 1:<8}{t['prompt']:>7}{t['reused']:>7}"
                  + "".join(f"{med[c]:>17.0f}" for c in CONFIGS) + f"{acc:>8}")
            if ti >= 1:
                for (x, y) in ratios:
                    ratios[(x, y)].append(med[y] / med[x])
            else:
                first_spec.append(med["reuse"] / med["reuse+ngram"])
    print("\nturns 2 and later: speed-up (time of the second over the first), geometric mean [min, max] over turns")
    for (x, y), v in ratios.items():
        print(f"  {x} vs {y}: {geomean(v):.2f}x [{min(v):.2f}, {max(v):.2f}] over {len(v)} turns")
    later = ratios[("reuse+ngram", "reuse")]
    print(f"turn 1: reuse+ngram vs reuse: {geomean(first_spec):.2f}x [{min(first_spec):.2f}, {max(first_spec):.2f}] "
          f"over {len(first_spec)} conversations; turns 2 and later "
          f"{'do not fall below' if geomean(later) >= geomean(first_spec) else 'FALL BELOW'} it ({geomean(later):.2f}x)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "rounds": a.rounds, "tokens": a.tokens,
                       "runs": {f"{ci}/{c}": v for (ci, c), v in runs.items()}}, f)


if __name__ == "__main__":
    main()
