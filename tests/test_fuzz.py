"""Hostile model files: a seeded corpus of damaged copies of every architecture's tiny file, each run
through ``tsspec generate`` (load, validate, tokenize, one forward) in process.

Asserted for every case: no traceback (only ``TsspecError``'s one ``error:`` line and its exit
code), no hang (a per-case time limit), and no exit 0 for a file that must be refused. The default
run takes a seeded subset; ``-m fuzz`` runs the full corpus (over 1,000 cases). The counts are
printed (``-s`` or the summary of a failure shows them).
"""

from __future__ import annotations

import os
import signal
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import pytest
from clirun import run
from fuzz import Case, corpus, describe, materialize
from tiny import write_tiny_model
from tiny_dflash import write_tiny_dflash

SEED = int(os.environ.get("TSSPEC_FUZZ_SEED", "13"))
FAST_CASES = 200
FULL_CASES = 1200
CASE_SECONDS = 20  # a tiny model loads and runs in well under a second; this is a hang


class Hang(BaseException):
    """Raised by the alarm inside a case that ran past its time (a BaseException, so no
    ``except Exception`` on the way can mistake it for an ordinary error)."""


@contextmanager
def time_limit(seconds: int):
    def on_alarm(signum, frame):
        raise Hang()

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    from tiny_hybrid import write_hybrid, write_nextn_only

    d = tmp_path_factory.mktemp("fuzz_bases")
    files = {arch: write_tiny_model(d / f"{arch}.gguf", arch, n_layers=2 if arch != "gemma3" else None)
             for arch in ("llama", "qwen2", "qwen3", "gemma3")}
    files["llama_q8"] = write_tiny_model(d / "llama_q8.gguf", "llama", quant="Q8_0", tied=False)
    files["qwen35"], q35 = write_hybrid(d / "qwen35.gguf", "qwen35")
    files["qwen3next"] = write_hybrid(d / "qwen3next.gguf", "qwen3next")[0]
    # a hybrid with its NextN/MTP block: without the block's eh_proj the head is simply not loaded
    files["qwen35_mtp"] = write_hybrid(d / "qwen35_mtp.gguf", "qwen35", mtp=True)[0]
    optional = {"output.weight"} | {f"blk.{i}.attn_{x}.bias" for i in range(8) for x in "qkv"}
    optional |= {f"blk.4.{n}" for n in describe_names(files["qwen35_mtp"]) if n.startswith("blk.4.")}
    # drafters, damaged and attached to an intact trunk with --draft-model
    trunk = write_tiny_model(d / "trunk.gguf", "qwen3", n_layers=4)
    files["dflash"] = write_tiny_dflash(d / "dflash.gguf", trunk)
    files["dflash2"] = write_tiny_dflash(d / "dflash2.gguf", trunk, dflash2=True)
    files["draft_llama"] = write_tiny_model(d / "draft_llama.gguf", "qwen3", n_layers=1, seed=5)
    files["nextn_head"] = write_nextn_only(d / "nextn_head.gguf", q35)  # a separate MTP head file
    trunks = {"dflash": trunk, "dflash2": trunk, "draft_llama": trunk, "nextn_head": files["qwen35"]}
    return {name: (p, describe(name, p, optional, drafter=name in trunks, meta_read=name != "nextn_head"),
                   trunks.get(name)) for name, p in files.items()}


def describe_names(path: Path) -> list[str]:
    import gguf

    return [t.name for t in gguf.GGUFReader(str(path)).tensors]


def run_case(case: Case, path: Path, trunk: Path | None = None) -> str:
    """-> "refused" | "loaded" | "traceback: ..." | "hang". A drafter (``trunk`` given) is attached
    to that trunk with --draft-model; a model file is the -m model."""
    if trunk is None:
        args = ["generate", "-m", str(path), "-p", "hello there", "-n", "2", "--quiet", "--no-spec"]
        if case.target == "tokenizer.chat_template":
            args.append("--chat")
    else:
        args = ["generate", "-m", str(trunk), "--draft-model", str(path), "-p", "hello there hello there",
                "-n", "4", "--quiet"]
    try:
        with time_limit(CASE_SECONDS):
            r = run(*args)
    except Hang:
        return "hang"
    if r.exit_code == 0 and r.exception is None:
        return "loaded"
    if isinstance(r.exception, SystemExit) and r.exit_code in (2, 3):
        lines = [x for x in r.stderr.strip().splitlines() if x.strip()]
        if len(lines) == 1 and lines[0].startswith("error:"):
            return "refused"
        return f"traceback: not one error line: {r.stderr[-300:]!r}"
    exc = r.exception
    return f"traceback: exit {r.exit_code} {type(exc).__name__}: {str(exc)[:200]}"


def run_corpus(bases, n: int, tmp_path) -> Counter:
    infos = [info for _, info, _ in bases.values()]
    cases = corpus(infos, n, SEED)
    counts: Counter = Counter()
    bad: list[str] = []
    for i, case in enumerate(cases):
        dst = tmp_path / f"case{i % 4}.gguf"
        path, _, trunk = bases[case.base]
        materialize(case, path, dst)
        outcome = run_case(case, dst, trunk)
        counts["cases"] += 1
        counts[outcome.split(":")[0]] += 1
        if outcome.startswith("traceback") or outcome == "hang":
            bad.append(f"{case.id}: {outcome}")
        elif outcome == "loaded" and case.invalid:
            counts["silent success"] += 1
            bad.append(f"{case.id}: loaded and generated, but the file is invalid")
        dst.unlink()
    line = (f"fuzz seed {SEED}: {counts['cases']} cases, {counts['refused']} refused, {counts['loaded']} loaded, "
            f"{counts['traceback']} tracebacks, {counts['hang']} hangs, {counts['silent success']} silent successes")
    print("\n" + line)
    assert not bad, line + "\n" + "\n".join(bad[:40])
    return counts


def test_corpus_is_seeded_and_mixed(bases):
    infos = [info for _, info, _ in bases.values()]
    a, b = corpus(infos, 300, SEED), corpus(infos, 300, SEED)
    assert [c.id for c in a] == [c.id for c in b] and len(a) == 300  # ids: NaN != NaN
    assert [c.id for c in corpus(infos, 300, SEED + 1)] != [c.id for c in a]
    kinds = Counter(c.kind for c in a)
    assert {"meta", "tensor", "header", "truncate", "flip", "drop_key", "drop_tensor"} <= set(kinds)
    assert {c.base for c in a} == set(bases)
    # most cases are files that must be refused (the rest need only fail cleanly)
    assert sum(c.invalid is True for c in a) > 0.7 * len(a)


def test_undamaged_bases_load(bases, tmp_path):
    for name, (path, _, trunk) in bases.items():
        assert run_case(Case(name, "none", "", None, False), path, trunk) == "loaded", name


def test_fuzz_fast(bases, tmp_path):
    counts = run_corpus(bases, FAST_CASES, tmp_path)
    assert counts["cases"] == FAST_CASES and counts["refused"] > 0.6 * FAST_CASES


@pytest.mark.fuzz
def test_fuzz_full(bases, tmp_path):
    counts = run_corpus(bases, FULL_CASES, tmp_path)
    assert counts["cases"] >= 1000


def test_a_few_cases_in_a_real_process(bases, tmp_path):
    """The installed entry point in its own process: exit code, one error line, nothing else on
    stderr (no traceback, no numpy warning)."""
    import subprocess
    import sys

    infos = [info for _, info, trunk in bases.values() if trunk is None]
    cases = [c for c in corpus(infos, 400, SEED) if c.invalid and c.target != "tokenizer.chat_template"][::97][:4]
    assert len(cases) == 4
    for i, case in enumerate(cases):
        path = materialize(case, bases[case.base][0], tmp_path / f"p{i}.gguf")
        r = subprocess.run([sys.executable, "-m", "tsspec.cli", "info", str(path)], capture_output=True,
                           text=True, timeout=120, env={**os.environ, "PYTHONWARNINGS": "default"})
        lines = [x for x in r.stderr.splitlines() if x.strip()]
        assert r.returncode in (2, 3), (case.id, r.returncode, r.stderr[-2000:])
        assert len(lines) == 1 and lines[0].startswith("error:"), (case.id, r.stderr[-2000:])
