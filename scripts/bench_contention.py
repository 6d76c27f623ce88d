"""Decode speed under CPU contention for several OpenMP spin settings (libgomp's GOMP_SPINCOUNT).

The native kernels run ~150 OpenMP parallel regions a token; between them libgomp's threads wait by
spinning (300,000 iterations by default, milliseconds) before they sleep. On a machine where other
work holds the cores, a thread spinning for a partner the scheduler has taken off the CPU burns its
time slice, so a step can take a scheduler slice per region. This script measures it:

    python scripts/bench_contention.py [-m smollm2-135m] [--spins 300000,30000,10000] [--rounds 4]

For each load (``none``: nothing else running; ``busy``: two single-threaded busy loops, one per
core, started for the load and stopped after it) and each round, every spin setting runs ``tsspec
generate`` once in its own process (order rotating per round), greedy, ``--ignore-eos``; the
decode speed it reports is recorded. Printed: the median tok/s per (load, spin) with its range, and
the median of the per-round ratios to the first setting. Spread is over rounds, on this machine, in
this session; the figures are not for comparison across machines.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PROMPT = "Write a story about a robot who learns to paint."


def run_once(model: str, tokens: int, spin: str, threads: int | None) -> float:
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    env["GOMP_SPINCOUNT"] = spin
    argv = [sys.executable, "-m", "tsspec", "generate", "-m", model, "-p", PROMPT, "-n", str(tokens),
            "--ignore-eos", "--json"]
    if threads:
        argv += ["-t", str(threads)]
    p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        raise SystemExit(f"tsspec generate failed ({p.returncode}): {p.stderr.strip()[-500:]}")
    return float(json.loads(p.stdout)["decode_tok_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("-n", "--tokens", type=int, default=64)
    ap.add_argument("--spins", default="300000,30000,10000",
                    help="GOMP_SPINCOUNT values; the first is the baseline of the ratios (300000: libgomp's own default)")
    ap.add_argument("--loads", default="none,busy")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("-t", "--threads", type=int, default=None)
    a = ap.parse_args()
    spins = [s.strip() for s in a.spins.split(",") if s.strip()]
    if not spins or not all(s.isdigit() for s in spins):
        raise SystemExit(f"--spins: comma-separated non-negative integers, got {a.spins!r}")
    loads = [x.strip() for x in a.loads.split(",")]
    if any(x not in ("none", "busy") for x in loads):
        raise SystemExit(f"--loads: none and/or busy, got {a.loads!r}")
    run_once(a.model, 4, spins[0], a.threads)  # the model pulled and the kernels built before timing
    for load in loads:
        busy = []
        if load == "busy":
            busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
            time.sleep(1.0)
        try:
            got: dict[str, list[float]] = {s: [] for s in spins}
            for r in range(a.rounds):
                order = spins[r % len(spins):] + spins[: r % len(spins)]
                for s in order:
                    got[s].append(run_once(a.model, a.tokens, s, a.threads))
        finally:
            for p in busy:
                p.kill()
                p.wait()
        base = got[spins[0]]
        for s in spins:
            v = got[s]
            ratio = statistics.median(x / b for x, b in zip(v, base))
            print(f"load {load:4s} GOMP_SPINCOUNT={s:>7s}: decode {statistics.median(v):7.1f} tok/s "
                  f"(rounds {min(v):.1f}-{max(v):.1f}), ratio to {spins[0]}: {ratio:.2f}", flush=True)


if __name__ == "__main__":
    main()
