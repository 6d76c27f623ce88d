#!/usr/bin/env python3
"""Time to the first token and peak memory of a one-prompt run: tsspec beside llama.cpp.

    python scripts/bench_startup.py [MODEL ...] [--rounds 5] [--threads 2] [--cold/--no-cold]
        [--tokens 1] [--llama-bin DIR] [--json OUT]

A scripted user runs one process per prompt, so what such a call pays before its first token is
paid every time. Each round runs, on the same GGUF file, back to back in alternating order (AB,
BA, ...):

* tsspec: ``python -m tsspec generate -m FILE -p Hi -n N --no-spec -q --ignore-eos`` (a process of its own);
* llama.cpp: ``llama-completion -m FILE -p Hi -n N -no-cnv --ignore-eos`` (its defaults otherwise, warm-up
  run included). N is ``--tokens``: 1 times the first token, 32 a short run's peak memory. Where
  llama.cpp dies by a signal (its default repacked buffers raise SIGILL on a virtual machine that
  advertises AMX but refuses a process its tiles), it runs with ``--no-repack`` from then on, and the
  JSON says so (``llama_no_repack``) with the signal.

Reported per model and side: the median wall time over rounds (the process from start to exit, so
the first token plus the exit), the median peak resident memory (``ru_maxrss`` of that child,
from ``os.wait4``), and tsspec / llama.cpp as the ratio of the medians with the per-round min-max.

``--cold`` (default on where it works) first drops the model file's pages from the page cache
(``posix_fadvise(DONTNEED)``; it works on a file no process maps, without root), so each side
reads the file from the disk; the warm rows run with it cached. MODEL is a name from
``tsspec.hub.KNOWN_MODELS`` (default: all four).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tsspec.bench import provenance
from tsspec.bench.llama_server import llama_tool
from tsspec.hub import KNOWN_MODELS, model_path

SIDES = ("tsspec", "llama.cpp")


def drop_from_page_cache(path: Path) -> bool:
    """Ask the kernel to forget ``path``'s cached pages; True if it could be asked."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    except (OSError, AttributeError):
        return False
    finally:
        os.close(fd)


def warm_page_cache(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass


class Killed(Exception):
    """A child died by a signal (its message says which and how it ended)."""


# llama.cpp's plain CPU buffers: what it runs where its default repacked ones die (SIGILL on a
# virtual machine that advertises AMX but does not let a process use its tiles)
LLAMA_NO_REPACK = "--no-repack"


def run(argv: list[str], env: dict[str, str]) -> tuple[float, float, int]:
    """(wall seconds, peak RSS in MB, exit status) of one child process; ``Killed`` where a signal
    ended it, an exit with the message where it failed otherwise."""
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    err = p.stderr.read().decode(errors="replace") if p.stderr else ""
    p.stderr.close()
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode < 0:
        raise Killed(f"{argv[0]} killed by signal {-p.returncode}: {err.strip()[-300:]}")
    if p.returncode != 0:
        sys.exit(f"bench_startup: {argv[0]} failed ({p.returncode}): {err.strip()[-500:]}")
    return wall, usage.ru_maxrss / 1024.0, p.returncode


def commands(model: Path, threads: int, llama: Path, tokens: int) -> dict[str, list[str]]:
    n = str(tokens)
    return {
        "tsspec": [sys.executable, "-m", "tsspec", "generate", "-m", str(model), "-p", "Hi", "-n", n,
                   "--no-spec", "-q", "-t", str(threads), "--ignore-eos"],
        "llama.cpp": [str(llama), "-m", str(model), "-p", "Hi", "-n", n, "-t", str(threads), "-no-cnv", "--ignore-eos",
                      "--temp", "0"],
    }


def bench_model(name: str, rounds: int, threads: int, llama: Path, cold: bool, tokens: int) -> dict:
    path = model_path(name)
    if not path.exists():
        sys.exit(f"bench_startup: {name} is not cached (tsspec pull {name})")
    cmds = commands(path, threads, llama, tokens)
    env = dict(os.environ)
    modes = ["warm", "cold"] if cold else ["warm"]
    out: dict = {"model": name, "file": str(path), "commands": cmds}
    for mode in modes:
        samples: dict[str, list[tuple[float, float]]] = {s: [] for s in SIDES}
        warm_page_cache(path)
        for r in range(rounds):
            order = SIDES if r % 2 == 0 else SIDES[::-1]
            for side in order:
                if mode == "cold" and not drop_from_page_cache(path):
                    sys.exit("bench_startup: cannot drop the file from the page cache here (--no-cold)")
                try:
                    wall, rss, _ = run(cmds[side], env)
                except Killed as e:
                    if side != "llama.cpp" or LLAMA_NO_REPACK in cmds[side]:
                        sys.exit(f"bench_startup: {e}")
                    # its default build's repacked buffers died here: its plain ones from now on
                    print(f"  llama.cpp died ({e}); running it with {LLAMA_NO_REPACK} from here", file=sys.stderr)
                    cmds[side] = cmds[side] + [LLAMA_NO_REPACK]
                    out["llama_no_repack"] = str(e)
                    wall, rss, _ = run(cmds[side], env)
                samples[side].append((wall, rss))
                print(f"  {name} {mode} round {r + 1}/{rounds} {side}: {wall:.2f} s, {rss:.0f} MB", file=sys.stderr)
        row = {}
        for side in SIDES:
            walls = [w for w, _ in samples[side]]
            rss = [m for _, m in samples[side]]
            row[side] = {"wall_s": statistics.median(walls), "peak_rss_mb": statistics.median(rss),
                         "samples": samples[side]}
        per_round = [a[0] / b[0] for a, b in zip(samples["tsspec"], samples["llama.cpp"])]
        row["ratio_wall"] = row["tsspec"]["wall_s"] / row["llama.cpp"]["wall_s"]
        row["ratio_wall_range"] = [min(per_round), max(per_round)]
        row["rss_over_mb"] = row["tsspec"]["peak_rss_mb"] - row["llama.cpp"]["peak_rss_mb"]
        out[mode] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*", default=[m for m in KNOWN_MODELS])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cold", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--tokens", type=int, default=1, help="tokens each run generates (1: the first token; "
                    "32 for the peak memory of a short run)")
    ap.add_argument("--llama-bin", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    if a.rounds < 1:
        sys.exit("bench_startup: --rounds must be >= 1")
    llama = llama_tool("llama-completion", a.llama_bin)
    if a.tokens < 1:
        sys.exit("bench_startup: --tokens must be >= 1")
    results = [bench_model(m, a.rounds, a.threads, llama, a.cold, a.tokens) for m in a.models]
    print(f"{'model':22s} {'mode':5s} {'tsspec s':>9s} {'llama s':>8s} {'ratio':>6s} {'[min-max]':>13s} "
          f"{'tsspec MB':>10s} {'llama MB':>9s} {'over MB':>8s}")
    for r in results:
        for mode in ("warm", "cold"):
            if mode not in r:
                continue
            row = r[mode]
            lo, hi = row["ratio_wall_range"]
            print(f"{r['model']:22s} {mode:5s} {row['tsspec']['wall_s']:9.2f} {row['llama.cpp']['wall_s']:8.2f} "
                  f"{row['ratio_wall']:6.2f} [{lo:5.2f}-{hi:5.2f}] {row['tsspec']['peak_rss_mb']:10.0f} "
                  f"{row['llama.cpp']['peak_rss_mb']:9.0f} {row['rss_over_mb']:8.0f}")
    if a.json is not None:
        a.json.write_text(json.dumps({"results": results, "machine": provenance.machine_info(),
                                      "git": provenance.git_state(), "argv": sys.argv}, indent=2) + "\n")


if __name__ == "__main__":
    main()
