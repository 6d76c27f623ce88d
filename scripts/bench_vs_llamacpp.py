#!/usr/bin/env python3
"""tsspec plain decode and prefill beside llama.cpp's llama-bench on the same GGUF file, plus tsspec's verify-cost curve.

    python scripts/bench_vs_llamacpp.py [MODEL ...] [--rounds 3] [--reps 3] [--tokens 64]
        [--threads 2] [--llama-bin DIR] [--isa avx2] [--json OUT] [--curve/--no-curve] [--prefill/--no-prefill]

MODEL is a name from ``tsspec.hub.KNOWN_MODELS`` (default: all of them).

* Decode: llama-bench ``-p 0 -n TOKENS`` times TOKENS single-token decodes from an empty context.
  tsspec mirrors it: prefill a short prompt (``--prompt-tokens``, default 1), then time TOKENS greedy
  decode steps (``tsspec.spec.loop.decode``, ``SpecStats.decode_tok_s``). Each round runs tsspec
  (median of ``--reps`` runs) and llama-bench (``-r REPS``, median of its samples) back to back, in
  alternating order (AB, BA, AB, ...) so drift on a shared machine hits both sides alike. Reported:
  the median over rounds of each side, the ratio of the medians (tsspec / llama.cpp) and the
  min / max of the per-round ratios.
* Decode at depth (``--depth N``, off by default): the same decode after an N-token context,
  where attention over the cache weighs in: llama-bench ``-p 0 -n TOKENS -d N`` (it prefills N
  tokens untimed first), tsspec the same after an N-token prompt.
* Prefill (``--prefill``, on by default): tsspec's prefill of a ``--prefill-tokens`` (512) prompt vs
  llama-bench ``-p 512 -n 0``, the same rounds and ratios.
* Verify curve (``--curve``, tsspec only): ms per forward of r rows (r = 1..``--curve-rows``, all
  logits, as a verify does) on top of a ``--curve-context`` (128) token cache, rewinding after each
  forward; the median over ``--curve-reps`` passes (each pass walks all r, so drift spreads evenly)
  and the ratio to r = 1. r = 5 and r = 9 are the verify of a k = 4 and a k = 8 draft.

Both sides use the same thread count (``torch.set_num_threads`` and llama-bench ``-t``). With other
work on the cores either side's numbers can collapse (llama-bench spin-waits its threads, ``--poll
50``), and not alike: run this on an otherwise idle machine; the JSON keeps the 1-minute load average
of every round. ``--json OUT`` writes every sample with
provenance (git commit and dirty files, torch version, TSSPEC_WEIGHTS, CPU, the llama.cpp build, the
model files' sha256 and the command line).

llama.cpp: ``bash ../shared/tools/build_llamacpp.sh`` builds it and prints its bin directory
(default ``$LLAMA_CPP_DIR/build/bin`` or ``~/.cache/tsspec-peer/llama.cpp/build/bin``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from tsspec.bench import provenance as provenance_
from tsspec.bench.llama_server import llama_tool
from tsspec.bench.stats import geometric_mean
from tsspec.hub import recorded_sha256

REPO = Path(__file__).resolve().parents[1]
HIGHLIGHT_ROWS = {5: "k=4", 9: "k=8"}
TSSPEC, LLAMA = "tsspec", "llama.cpp"

TEXT = (
    "The history of computing is a story of abstraction layered on abstraction. Early machines were "
    "programmed by rewiring panels; stored programs made software possible; compilers let people "
    "write in something closer to mathematics; operating systems hid the hardware; networks joined "
    "machines into systems that no single person understands. "
)


class ScriptError(Exception):
    """Printed as one ``error: ...`` line; the script exits non-zero."""


# ============================================================================ pure helpers


@dataclass(frozen=True)
class LlamaBenchResult:
    """One test record of ``llama-bench -o json`` (the fields this script reads)."""

    n_prompt: int
    n_gen: int
    n_threads: int
    avg_ts: float
    samples_ts: tuple[float, ...]
    build_commit: str
    build_number: int
    model_type: str
    model_filename: str
    cpu_info: str


def parse_llama_bench_json(text: str) -> list[LlamaBenchResult]:
    """Parse ``llama-bench -o json`` stdout (a JSON array of test records) into results.

    Raises ``ValueError`` on anything that is not such an array."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"llama-bench output is not JSON: {e}") from None
    if not isinstance(data, list):
        raise ValueError("llama-bench JSON: expected an array of test records")
    out = []
    for rec in data:
        try:
            samples = tuple(float(s) for s in rec.get("samples_ts") or ())
            out.append(
                LlamaBenchResult(
                    n_prompt=int(rec["n_prompt"]),
                    n_gen=int(rec["n_gen"]),
                    n_threads=int(rec["n_threads"]),
                    avg_ts=float(rec["avg_ts"]),
                    samples_ts=samples,
                    build_commit=str(rec.get("build_commit", "")),
                    build_number=int(rec.get("build_number", -1)),
                    model_type=str(rec.get("model_type", "")),
                    model_filename=str(rec.get("model_filename", "")),
                    cpu_info=str(rec.get("cpu_info", "")),
                )
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"llama-bench JSON: bad test record ({e!r})") from None
    return out


def llama_bench_argv(binary: str | Path, model: str | Path, threads: int, n_prompt: int, n_gen: int,
                     reps: int, extra: Sequence[str] = (), depth: int = 0) -> list[str]:
    """The llama-bench command line for one test (``-p N -n M``, ``-d D`` at a depth), JSON on stdout."""
    return [str(binary), "-m", str(model), "-t", str(threads), "-p", str(n_prompt), "-n", str(n_gen),
            *(["-d", str(depth)] if depth else []), "-r", str(reps), "-o", "json", *extra]


def round_orders(rounds: int) -> list[tuple[str, str]]:
    """Which side runs first in each round: AB, BA, AB, ... (A = tsspec)."""
    return [(TSSPEC, LLAMA) if i % 2 == 0 else (LLAMA, TSSPEC) for i in range(rounds)]


def summarize(values: Sequence[float]) -> dict[str, float]:
    """Median, min, max and count of a non-empty sample."""
    if not values:
        raise ValueError("summarize needs at least one value")
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def compare(tsspec: Sequence[float], llama: Sequence[float]) -> dict[str, Any]:
    """Paired per-round throughputs (tok/s) -> medians, ratio of medians and per-round ratios.

    ``ratio`` is median(tsspec) / median(llama); ``round_ratios`` are tsspec[i] / llama[i]."""
    if len(tsspec) != len(llama) or not tsspec:
        raise ValueError("compare needs two equally long, non-empty samples")
    per_round = [a / b for a, b in zip(tsspec, llama)]
    ts, ll = summarize(tsspec), summarize(llama)
    return {
        "tsspec": ts,
        "llama": ll,
        "ratio": ts["median"] / ll["median"],
        "round_ratios": per_round,
        "round_ratio_min": min(per_round),
        "round_ratio_max": max(per_round),
        "round_ratio_geomean": geometric_mean(per_round),
    }


def curve_table(ms_by_rows: dict[int, Sequence[float]]) -> list[dict[str, Any]]:
    """{rows: [ms samples]} -> rows sorted by r with median ms, ms per row and the ratio to r = 1
    (ratio is None when r = 1 was not measured)."""
    med = {r: statistics.median(v) for r, v in ms_by_rows.items()}
    base = med.get(1)
    return [
        {"rows": r, "ms": med[r], "ms_min": min(ms_by_rows[r]), "ms_max": max(ms_by_rows[r]),
         "ms_per_row": med[r] / r, "ratio_to_1": (med[r] / base) if base else None,
         "note": HIGHLIGHT_ROWS.get(r, "")}
        for r in sorted(med)
    ]


def fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


# ============================================================================ environment


def provenance(args: argparse.Namespace, llama_bench: Path) -> dict[str, Any]:
    import torch

    from tsspec.settings import resolve_run

    version = subprocess.run([str(llama_bench), "--version"], capture_output=True, text=True)
    return {
        "command": shlex.join([sys.executable, *sys.argv]),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "git": provenance_.git_state(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "env": provenance_.spec_env(),
        "tsspec_weights_format": resolve_run().weights,
        "kernels": provenance_.kernels_info(),
        "threads": args.threads,
        "torch_threads": torch.get_num_threads(),
        "cpu": provenance_.cpu(),
        "nproc": os.cpu_count(),
        "llama_bench": str(llama_bench),
        "tsspec_isa": os.environ.get("TSSPEC_ISA", "auto"),
        "llama_bench_version": (version.stdout + version.stderr).strip(),
    }


# ============================================================================ measurements


class LlamaBenchKilled(ScriptError):
    """llama-bench died by a signal (SIGILL: on a virtual machine that advertises AMX but does not
    let a process use its tiles, llama.cpp's default repacked CPU buffers crash in prefill)."""


# what the prefill falls back to when llama-bench is killed: the plain CPU buffers
LLAMA_NO_REPACK = ("--repack", "0")


def run_llama_bench(exe: Path, model: Path, threads: int, n_prompt: int, n_gen: int, reps: int,
                    extra: Sequence[str], depth: int = 0) -> LlamaBenchResult:
    argv = llama_bench_argv(exe, model, threads, n_prompt, n_gen, reps, extra, depth)
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["(no stderr)"])[-1]
        cls = LlamaBenchKilled if r.returncode < 0 else ScriptError
        raise cls(f"llama-bench exited {r.returncode} ({shlex.join(argv)}): {tail}")
    try:
        results = parse_llama_bench_json(r.stdout)
    except ValueError as e:
        raise ScriptError(str(e)) from None
    if len(results) != 1:
        raise ScriptError(f"llama-bench: expected one test record, got {len(results)}")
    return results[0]


@dataclass
class TsspecBench:
    """A loaded tsspec target and its prompts; the measurements of one model."""

    name: str
    path: Path
    target: Any
    prompt: list[int]
    weight_mb: float = 0.0

    @classmethod
    def load(cls, name: str, path: Path, need_tokens: int) -> TsspecBench:
        """Load the model and tokenize at least ``need_tokens`` tokens of benchmark text."""
        from tsspec.models import load_model
        from tsspec.settings import resolve_run
        from tsspec.tokenizer import Tokenizer

        target = load_model(path, fmt=resolve_run().weights)  # TSSPEC_WEIGHTS, read by tsspec.settings
        tok = Tokenizer.from_gguf(path)
        ids = tok.encode(TEXT)
        if len(ids) < need_tokens:
            ids = tok.encode(TEXT * (need_tokens // max(len(ids) - 1, 1) + 2))
        if len(ids) < need_tokens:
            raise ScriptError(f"{name}: the benchmark text gives {len(ids)} < {need_tokens} tokens")
        return cls(name, path, target, ids[:need_tokens], target.weight_bytes() / 1e6)

    def _decode(self, prompt: list[int], max_tokens: int):
        from tsspec.sampling import Sampler
        from tsspec.spec.loop import decode
        from tsspec.spec.stats import SpecStats

        st = SpecStats()
        decode(self.target, Sampler(), prompt, max_tokens, stats=st)
        return st

    def decode_tok_s(self, prompt_tokens: int, tokens: int) -> float:
        """Greedy decode of ``tokens`` steps after a ``prompt_tokens`` prefill (the prefill
        forward yields the first token, so ``tokens + 1`` are generated)."""
        st = self._decode(self.prompt[:prompt_tokens], tokens + 1)
        if st.generated != tokens + 1:
            raise ScriptError(f"{self.name}: decode stopped after {st.generated} of {tokens + 1} tokens")
        return st.decode_tok_s

    def prefill_tok_s(self, prompt_tokens: int) -> float:
        return self._decode(self.prompt[:prompt_tokens], 1).prefill_tok_s

    def verify_curve(self, context: int, max_rows: int, reps: int) -> dict[int, list[float]]:
        """ms per ``forward(r rows, all_logits=True)`` after ``context`` cached tokens, r = 1..max_rows."""
        return time_forwards(self.target, self.prompt, context, list(range(1, max_rows + 1)), reps)


def time_forwards(target, ids: Sequence[int], context: int, rows: Sequence[int], passes: int) -> dict[int, list[float]]:
    """ms of each ``forward(ids[context:context + r], all_logits=True)`` (a verify of r rows) on a
    ``context``-token cache, rewound after each, ``passes`` times over ``rows`` (each pass walks all
    r, so drift spreads evenly); one untimed forward of each shape first. Also used by
    scripts/ab_revisions.py."""
    c = target.make_cache()
    c.reserve(context + max(rows) + 1)
    for i in range(0, context, 256):
        target.forward(ids[i:min(i + 256, context)], c)
    draft = ids[context : context + max(rows)]
    for r in rows:  # warm-up: one of each shape
        target.forward(draft[:r], c, all_logits=True)
        c.trim(c.length - context)
    ms: dict[int, list[float]] = {r: [] for r in rows}
    for _ in range(passes):
        for r in rows:
            t0 = time.perf_counter()
            target.forward(draft[:r], c, all_logits=True)
            ms[r].append((time.perf_counter() - t0) * 1000.0)
            c.trim(c.length - context)
    return ms


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def paired_rounds(rounds: int, run_tsspec: Callable[[], list[float]], run_llama: Callable[[], list[float]],
                  log: Callable[[str], None], label: str) -> dict[str, Any]:
    """Run both sides once per round in alternating order; each returns its tok/s samples of the
    round, whose median is the round's value. -> per-round samples and the comparison."""
    ts, ll, orders, samples, load = [], [], [], [], []
    for i, order in enumerate(round_orders(rounds)):
        got: dict[str, list[float]] = {}
        load.append(_loadavg())
        for side in order:
            got[side] = run_tsspec() if side == TSSPEC else run_llama()
        ts.append(statistics.median(got[TSSPEC]))
        ll.append(statistics.median(got[LLAMA]))
        samples.append(got)
        orders.append("AB" if order[0] == TSSPEC else "BA")
        log(f"  {label} round {i + 1}/{rounds} ({orders[-1]}): tsspec {ts[-1]:.1f} tok/s, "
            f"llama.cpp {ll[-1]:.1f} tok/s, ratio {ts[-1] / ll[-1]:.2f}")
    return {"tsspec_tok_s": ts, "llama_tok_s": ll, "orders": orders, "round_samples": samples,
            "loadavg_1m": load, **compare(ts, ll)}


def bench_model(name: str, args: argparse.Namespace, exe: Path, log: Callable[[str], None]) -> dict[str, Any]:
    from tsspec.hub import ensure_model

    path = Path(ensure_model(name))
    log(f"{name}: loading {path}")
    need = max(args.prompt_tokens, args.depth, args.prefill_tokens if args.prefill else 0,
               args.curve_context + args.curve_rows if args.curve else 0)
    tb = TsspecBench.load(name, path, need)
    out: dict[str, Any] = {"path": str(path), "sha256": recorded_sha256(path), "tsspec_weight_mb": tb.weight_mb,
                           "tsspec_weight_formats": provenance_.weight_formats(tb.target)}
    builds: list[LlamaBenchResult] = []

    def llama(n_prompt: int, n_gen: int, depth: int = 0) -> list[float]:
        kind = "depth" if depth else "decode" if n_prompt == 0 else "prefill"
        fell_back = kind in out.get("llama_fallback", {})  # a test kind killed once runs LLAMA_NO_REPACK
        extra = [*args.llama_arg, *LLAMA_NO_REPACK] if fell_back else args.llama_arg
        try:
            res = run_llama_bench(exe, path, args.threads, n_prompt, n_gen, args.reps, extra, depth)
        except LlamaBenchKilled as e:
            if fell_back:
                raise
            log(f"  {e}; {kind} runs with {' '.join(LLAMA_NO_REPACK)} from here")
            out.setdefault("llama_fallback", {})[kind] = {"args": list(LLAMA_NO_REPACK), "why": str(e)}
            return llama(n_prompt, n_gen, depth)
        builds.append(res)
        return list(res.samples_ts) or [res.avg_ts]

    tb.decode_tok_s(args.prompt_tokens, min(8, args.tokens))  # warm-up (llama-bench warms up itself)
    out["decode"] = paired_rounds(
        args.rounds,
        lambda: [tb.decode_tok_s(args.prompt_tokens, args.tokens) for _ in range(args.reps)],
        lambda: llama(0, args.tokens), log, "decode")
    if args.depth:
        out["depth"] = paired_rounds(
            args.rounds,
            lambda: [tb.decode_tok_s(args.depth, args.tokens) for _ in range(args.reps)],
            lambda: llama(0, args.tokens, args.depth), log, "depth")
    if args.prefill:
        tb.prefill_tok_s(args.prefill_tokens)  # warm-up
        out["prefill"] = paired_rounds(
            args.rounds,
            lambda: [tb.prefill_tok_s(args.prefill_tokens) for _ in range(args.reps)],
            lambda: llama(args.prefill_tokens, 0), log, "prefill")
    if args.curve:
        log(f"  verify curve: r = 1..{args.curve_rows} at context {args.curve_context}, {args.curve_reps} passes")
        samples = tb.verify_curve(args.curve_context, args.curve_rows, args.curve_reps)
        out["curve"] = {"context": args.curve_context, "samples_ms": {str(r): v for r, v in samples.items()},
                        "table": curve_table(samples)}
    if builds:
        b = builds[0]
        out["llama"] = {"build_commit": b.build_commit, "build_number": b.build_number,
                        "model_type": b.model_type, "cpu_info": b.cpu_info, "n_threads": b.n_threads}
    return out


# ============================================================================ report


def print_report(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    from tsspec import kernels

    con = Console()
    con.print(f"tsspec products: {kernels.products_line()}; peer: {getattr(args, 'peer', '?')}")
    for m, r in results.items():
        if "llama" in r:
            b = r["llama"]
            con.print(f"{m}: llama.cpp build {b['build_number']} (commit {b['build_commit']}), "
                      f"{b['model_type']}; tsspec weights {r['tsspec_weight_mb']:.0f} MB")
    for kind, title in (("decode", f"decode, {args.tokens} tokens (llama-bench -p 0 -n {args.tokens})"),
                        ("depth", f"decode at depth {args.depth}, {args.tokens} tokens "
                                  f"(llama-bench -p 0 -n {args.tokens} -d {args.depth})"),
                        ("prefill", f"prefill, {args.prefill_tokens} tokens (llama-bench -p {args.prefill_tokens} -n 0)")):
        rows = [(m, r[kind]) for m, r in results.items() if kind in r]
        if not rows:
            continue
        tab = Table(title=f"{title}; {args.threads} threads, {args.rounds} rounds, median tok/s")
        for col in ("model", "tsspec", "llama.cpp", "tsspec/llama", "round min", "round max"):
            tab.add_column(col, justify="left" if col == "model" else "right")
        for m, c in rows:
            fb = "*" if kind in results[m].get("llama_fallback", {}) else ""
            tab.add_row(m, f"{c['tsspec']['median']:.1f}", f"{c['llama']['median']:.1f}{fb}", fmt_ratio(c["ratio"]),
                        fmt_ratio(c["round_ratio_min"]), fmt_ratio(c["round_ratio_max"]))
        con.print(tab)
        for m, _ in rows:
            if kind in results[m].get("llama_fallback", {}):
                con.print(f"* {m}: llama-bench's default {kind} was killed by a signal (the JSON has its "
                          f"error); measured with {' '.join(LLAMA_NO_REPACK)}")
    for m, r in results.items():
        if "curve" not in r:
            continue
        tab = Table(title=f"{m}: tsspec verify cost, r rows at context {r['curve']['context']} (median ms)")
        for col in ("rows", "ms", "ms/row", "vs r=1", ""):
            tab.add_column(col, justify="right")
        for row in r["curve"]["table"]:
            hl = row["rows"] in HIGHLIGHT_ROWS
            style = "bold yellow" if hl else None
            tab.add_row(str(row["rows"]), f"{row['ms']:.2f}", f"{row['ms_per_row']:.2f}",
                        fmt_ratio(row["ratio_to_1"]), row["note"], style=style)
        con.print(tab)


# ============================================================================ main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join((__doc__ or "").splitlines()[1:]))
    ap.add_argument("models", nargs="*", help="known model names (default: all)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating paired rounds (default 3)")
    ap.add_argument("--reps", type=int, default=3, help="runs per side inside a round; llama-bench -r (default 3)")
    ap.add_argument("--tokens", type=int, default=64, help="decode tokens, llama-bench -n (default 64)")
    ap.add_argument("--prompt-tokens", type=int, default=1, help="tsspec prompt before the timed decode (default 1)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads and llama-bench -t (default 2)")
    ap.add_argument("--llama-bin", metavar="DIR", help="llama.cpp bin dir holding llama-bench")
    ap.add_argument("--isa", choices=("auto", "avx512", "avx2", "neon", "scalar"), default=None,
                    help="tsspec's kernel level (sets TSSPEC_ISA); with avx2 the peer defaults to the "
                         "LLAMA_ISA=avx2 build (DIR-avx2 of the usual llama.cpp directory)")
    ap.add_argument("--llama-arg", action="append", default=[], metavar="ARG",
                    help="extra llama-bench argument (repeatable), e.g. --llama-arg=-fa --llama-arg=on")
    ap.add_argument("--json", metavar="OUT", help="write all samples and provenance here")
    ap.add_argument("--depth", type=int, default=0, metavar="N",
                    help="also time decode after an N-token context (llama-bench -d N); 0: off (default)")
    ap.add_argument("--prefill", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--curve", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--curve-rows", type=int, default=16)
    ap.add_argument("--curve-context", type=int, default=128)
    ap.add_argument("--curve-reps", type=int, default=7)
    args = ap.parse_args(argv)
    for flag in ("rounds", "reps", "tokens", "prompt_tokens", "threads", "prefill_tokens", "curve_rows", "curve_reps"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.curve_context < 1:
        ap.error("--curve-context must be >= 1")
    if args.depth < 0:
        ap.error("--depth must be >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from tsspec.errors import TsspecError
    from tsspec.hub import KNOWN_MODELS

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        models = args.models or list(KNOWN_MODELS)
        unknown = [m for m in models if m not in KNOWN_MODELS]
        if unknown:
            raise ScriptError(f"unknown model {', '.join(map(repr, unknown))} (known: {', '.join(KNOWN_MODELS)})")
        if args.isa:
            os.environ["TSSPEC_ISA"] = args.isa  # read when the kernels first load, below
        bin_dir = args.llama_bin
        if bin_dir is None and args.isa == "avx2":
            from tsspec.bench.llama_server import llama_cpp_dir

            bin_dir = str(Path(str(llama_cpp_dir()) + "-avx2") / "build" / "bin")
        exe = llama_tool("llama-bench", bin_dir)
        args.peer = str(exe)
        import torch

        torch.set_num_threads(args.threads)
        prov = provenance(args, exe)
        results = {m: bench_model(m, args, exe, log) for m in models}
        prov["llama_build"] = next((r["llama"] for r in results.values() if "llama" in r), None)
    except (ScriptError, TsspecError) as e:
        print(f"error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 2)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    print_report(results, args)
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k not in ("json", "models")}
        doc = {"provenance": prov, "settings": settings, "models": results}
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
