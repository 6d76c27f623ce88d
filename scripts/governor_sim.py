"""The speculation cost governor on synthetic workloads: decode time of plain / governed speculation.

    python scripts/governor_sim.py [-n 64] [--seeds 400] [--set warmup=1 --set park_base=16 ...]

The governor reads no clock (``tsspec/spec/governor.py``), so its policy can be judged apart from
any machine: each case below is a cost model measured on this project's CPUs (a verify row costs
``row`` of a plain step, a drafter's token ``drafter``; a parked drafter's catch-up ``catchup`` per
token it missed, reported to the governor as one-off setup; the plain step right after a proposal
``evict`` more, while the trunk's weights come back into cache) and an acceptance pattern
(``geometric``: each draft token taken with probability a until the first miss, as a drafter's
fade; ``whole``: a draft taken entirely with probability q, else not at all, as n-gram copies
behave). ``match`` is the chance that a proposal drafts anything (an n-gram finds no earlier
occurrence most of the time on prose; a head's confidence gate cuts some); one that drafts nothing
still costs a drafter step and is reported as the loop reports it, speculative with ``drafted=0``.
The sequences run one after another through one governor, as a bench's prompts do through one
engine (a park carries into the next sequence). Prints, per case, the ratio of plain decode time to
governed decode time (above 1: speculation pays) for the default configuration and for each
``--set`` variant; a paired real-machine measurement is ``tsspec bench``. The trained-head cases
reproduce the bench within a few hundredths (qwen2.5-coder-1.5b's head on code: 1.06 here against
1.05 measured, before the probe verdict leaned on the cost model; smollm2's: 0.99 against 0.98).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
from typing import Callable

from tsspec.spec.governor import GovernorConfig, SpeculationCostGovernor


def geometric(a: float) -> Callable[[random.Random, int], int]:
    def accepted(rng: random.Random, k: int) -> int:
        n = 0
        while n < k and rng.random() < a:
            n += 1
        return n
    return accepted


def whole(q: float, run: int = 12) -> Callable[[random.Random, int], int]:
    return lambda rng, k: min(k, run) if rng.random() < q else 0


SMOLLM_TRANSIENT = (0.85, 5.8)  # see slowdown()

# name: (acceptance, row, drafter, match, catchup, evict[, transient]); rows and drafter costs from docs/RESULTS.md
# (the Zen 4 kind: a verify row 0.38 of a step) and, for the trained heads, from per-step traces on
# the Intel kind (qwen2.5-coder-1.5b: a plain step 42.7 ms, a proposal +1.5-3.5 ms, a verify row
# +3.5 ms; smollm2-135m: 2.6 ms, +0.5 ms, +0.7 ms, and the plain step after a proposal +0.9 ms
# while the trunk's weights come back into cache)
CASES = {
    "qwen1.5 ngram prose": (geometric(0.3), 0.38, 0.0, 0.4, 0.0, 0.0),
    "qwen1.5 ngram code": (geometric(0.75), 0.38, 0.0, 0.7, 0.0, 0.0),
    "qwen1.5 draft prose": (geometric(0.55), 0.38, 0.45, 1.0, 0.1, 0.0),
    "qwen1.5 draft code": (geometric(0.85), 0.38, 0.45, 1.0, 0.1, 0.0),
    "qwen1.5 ngram whole .3": (whole(0.3), 0.38, 0.0, 0.7, 0.0, 0.0),
    "qwen1.5 ngram whole .5": (whole(0.5), 0.38, 0.0, 0.7, 0.0, 0.0),
    "smollm ngram whole .7": (whole(0.7), 0.29, 0.0, 0.7, 0.0, 0.0),
    "qwen1.5 head code": (geometric(0.4), 0.08, 0.06, 0.85, 0.0, 0.0),
    "qwen1.5 head prose": (geometric(0.3), 0.08, 0.06, 0.7, 0.0, 0.0),
    "smollm head code": (geometric(0.42), 0.27, 0.2, 0.8, 0.0, 0.35),
    "smollm head prose": (geometric(0.2), 0.27, 0.2, 0.6, 0.0, 0.35),
    # the same two, and a winning n-gram, with smollm2's sequence-start transient (``slowdown``)
    "smollm head code +t": (geometric(0.42), 0.27, 0.2, 0.8, 0.0, 0.35, SMOLLM_TRANSIENT),
    "smollm head prose +t": (geometric(0.2), 0.27, 0.2, 0.6, 0.0, 0.35, SMOLLM_TRANSIENT),
    "smollm ngram whole .7 +t": (whole(0.7), 0.29, 0.0, 0.7, 0.0, 0.0, SMOLLM_TRANSIENT),
    "smollm ngram whole .3 +t": (whole(0.3), 0.29, 0.0, 0.5, 0.0, 0.0, SMOLLM_TRANSIENT),
}


def slowdown(t: float, transient: tuple[float, float] | None) -> float:
    """How much slower a step runs ``t`` plain steps' worth of time after a prompt's forward: the
    sequence-start transient ``(amount, scale)``, ``1 + amount * exp(-(t / scale) ** 2)``. Measured
    on smollm2-135m (Intel kind, ``scripts/trace_steps.py``): the first plain step after a 120-token
    prompt at 1.84x a settled one, then 1.68, 1.51, 1.34, 1.22, 1.17, 1.09 ..., fitted by (0.85, 5.8);
    the same after any ~100 ms of dense AVX-512 work (a torch matmul in L1 does it too), not after a
    stream of memory alone, and not at all on the memory-bound qwen2.5-coder files."""
    if transient is None:
        return 1.0
    amount, scale = transient
    return 1.0 + amount * math.exp(-((t / scale) ** 2))


def plain_time(n: int, transient: tuple[float, float] | None) -> float:
    """A plain decode of ``n`` tokens (the first drawn by the prompt's forward): n - 1 steps."""
    t = 0.0
    for _ in range(n - 1):
        t += slowdown(t, transient)
    return t


def simulate(config: GovernorConfig, case, *, n: int, window: int, seeds: int,
             transient: tuple[float, float] | None = None) -> float:
    accept, row, drafter, match, catchup, evict = case[:6]
    if transient is None and len(case) > 6:
        transient = case[6]
    plain_total = spec_total = 0.0
    gov = SpeculationCostGovernor(config)  # one engine's: a park carries into the next sequence
    for seed in range(seeds):
        rng = random.Random(seed)
        gov.begin_sequence()
        out, t, missed, after = 1, 0.0, 0, False
        while out < n:
            k = min(gov.draft_length(window), n - out - 1)
            if k > 0 and gov.should_draft():
                # asked: a lookup or one drafter step, then a draft of k or nothing (a gate cut it)
                setup = catchup * min(missed, 256)  # the drafter's catch-up, over its 256-token window
                missed = 0
                if rng.random() < match:
                    ms, emitted, drafted = 1.0 + (row + drafter) * k + setup, accept(rng, k) + 1, k
                else:
                    ms, emitted, drafted = 1.0 + drafter + setup, 1, 0
                ms *= slowdown(t, transient)
                gov.record(True, ms, emitted, drafted, setup_ms=setup)
                after = True
            else:
                ms, emitted = (1.0 + (evict if after else 0.0)) * slowdown(t, transient), 1
                missed += 1
                after = False
                gov.record(False, ms, emitted)
            t += ms
            out += emitted
        plain_total += plain_time(n, transient)
        spec_total += t
    return plain_total / spec_total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=64, help="tokens per sequence")
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--seeds", type=int, default=400)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a GovernorConfig field for a variant (repeat; each --set is one variant)")
    args = ap.parse_args()
    variants = {"default": GovernorConfig()}
    fields = {f.name: f.type for f in dataclasses.fields(GovernorConfig)}
    for item in args.set:
        key, _, value = item.partition("=")
        if key not in fields:
            raise SystemExit(f"--set {item}: GovernorConfig has no field {key!r} ({', '.join(fields)})")
        variants[item] = dataclasses.replace(GovernorConfig(), **{key: (float if "float" in str(fields[key]) else int)(value)})
    width = max(len(v) for v in variants) + 2
    print(f"plain / governed decode time, {args.n} tokens, window {args.window}, {args.seeds} seeds")
    print(" " * 24 + "".join(f"{v:>{width}s}" for v in variants))
    for name, case in CASES.items():
        print(f"{name:24s}" + "".join(f"{simulate(c, case, n=args.n, window=args.window, seeds=args.seeds):{width}.3f}"
                                     for c in variants.values()))


if __name__ == "__main__":
    main()
