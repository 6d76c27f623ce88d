"""Per-step trace of a real decode: each step's kind, rows, wall time and the governor's verdict.

    python scripts/trace_steps.py [--out steps.jsonl] -- bench -m smollm2-135m --chat -w code \
        --config ngram -n 64 --reps 1

Runs the given ``tsspec`` command in this process with ``DecodeState.finish`` wrapped, so every decode
step of every sequence is logged as one JSON line: the sequence's ordinal, the step's index within
it, whether a draft was asked for (``proposed``), how many tokens it drafted and emitted, the
forward's and the whole step's milliseconds, the governor's state before and after, and how many
decoding sequences shared the step (``shared``: a server's or a batch's, 1 alone). Then prints,
per step index, the median plain-step time over sequences: the shape of the first steps after a
prompt's forward, which is what the governor's first probe measures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from tsspec.errors import BadInput
from tsspec.paths import check_output_file
from tsspec.spec import loop


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="write the steps as JSON lines here")
    ap.add_argument("--head", type=int, default=12, help="step indices to summarise")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the tsspec command line")
    a = ap.parse_args()
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        ap.error("give a tsspec command after --")
    if a.out:
        try:  # refused now, not after the run
            check_output_file(a.out, f"--out {a.out}")
        except BadInput as e:
            ap.error(str(e))

    steps: list[dict] = []
    seq_ids: dict[int, tuple[int, int]] = {}  # id(sequence) -> (ordinal, steps so far)
    begun = [0]
    orig_begin, orig_finish = loop.DecodeState.begin, loop.DecodeState.finish

    def begin(self, prompt):
        begun[0] += 1
        seq_ids[id(self)] = (begun[0], 0)
        return orig_begin(self, prompt)

    def finish(self, rows, out, forward_ms, shared=1):
        if rows.prefill:
            return orig_finish(self, rows, out, forward_ms, shared)
        gov = self.governor
        before = gov.state if gov is not None else None
        t0 = time.perf_counter()
        emitted = orig_finish(self, rows, out, forward_ms, shared)
        n, i = seq_ids.get(id(self), (-1, 0))
        seq_ids[id(self)] = (n, i + 1)
        steps.append({
            "seq": n, "step": i, "proposed": rows.proposed, "drafted": len(rows.draft.tokens),
            "emitted": len(emitted), "forward_ms": round(forward_ms, 3),
            "step_ms": round(rows.prepare_ms + forward_ms + (time.perf_counter() - t0) * 1e3, 3),
            "state": before, "after": gov.state if gov is not None else None, "shared": shared,
        })
        return emitted

    loop.DecodeState.begin, loop.DecodeState.finish = begin, finish
    from tsspec.cli import main as tsspec_main
    try:
        tsspec_main(cmd)
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    if a.out:
        with open(a.out, "w") as f:
            for s in steps:
                f.write(json.dumps(s) + "\n")
    by_index: dict[int, list[float]] = {}
    for s in steps:
        if not s["proposed"] and s["step"] < a.head:
            by_index.setdefault(s["step"], []).append(s["forward_ms"])
    print("\nplain steps by index after the prompt's forward (median forward ms over sequences, n):",
          file=sys.stderr)
    for i in sorted(by_index):
        v = by_index[i]
        print(f"  step {i:3d}: {statistics.median(v):8.3f} ms  (n={len(v)})", file=sys.stderr)


if __name__ == "__main__":
    main()
