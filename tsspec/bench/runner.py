"""The benchmark method, independent of any engine: interleaved, rotated, paired runs.

``run_bench(configs, workloads, run_one=..., reps=5, warmup=1)`` calls the caller's
``run_one(config, prompt) -> RunRecord`` and returns a ``BenchResult``. The method:

1. **Warm-up**: ``warmup`` runs per configuration before anything is recorded (first prompts of
   the first workload), so page-in of weights, allocator growth and kernel compilation are not
   charged to whichever configuration happens to run first.
2. **Slots**: the configurations (baseline first) plus one more slot, the baseline again (A').
   A' against A is a self-pair: the same work twice, which measures the noise floor.
3. **Interleaving with rotation**: for each repetition ``r`` and each prompt, every slot runs
   once, in the slot order rotated left by ``r`` (A B C A', B C A' A, C A' A B, ...). Runs
   compared with each other are seconds apart, and no configuration is always first (cold) or
   always last (hot) in a round.
4. **Pairs**: for each (repetition, prompt), config X's tok/s pairs with the baseline's tok/s
   from the same round; ``tsspec.bench.stats`` turns the pairs into ratio, CI and verdict.
5. **Exactness**: with ``check_identical`` (greedy decoding) every run's token ids must equal the
   baseline's for the same prompt (the first recorded baseline run is the reference). Any
   difference is a ``Mismatch``: a correctness bug, reported loudly, never a speed result.

``counters`` from each ``RunRecord`` are aggregated per workload x config over recorded runs:
integer counters (e.g. ``governor_parks``, ``drafted``, ``accepted``) are summed and float ones
(``acceptance_rate``, ``tokens_per_verify``, ``phase_ms.*``) averaged; nested dicts recurse.
Reports read ``acceptance_rate``, ``tokens_per_verify`` and ``governor_parks`` by name.
"""

from __future__ import annotations

import hashlib
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from tsspec.bench import provenance, stats
from tsspec.bench.configs import BenchConfig, resolve_configs
from tsspec.bench.workloads import Prompt, Workload
from tsspec.errors import BadInput, TsspecError

SELF_PAIR_SUFFIX = "'"  # the baseline's second slot is shown as e.g. "plain'"


@dataclass
class RunRecord:
    """What one generation reports back; produced by the caller's ``run_one``."""

    text: str
    token_ids: list[int]
    n_tokens: int
    decode_s: float
    tok_s: float
    counters: dict[str, Any] = field(default_factory=dict)
    # prompt to first token: the trunk's prefill plus any drafter's own prefill or catch-up (None:
    # not measured, and the end-to-end and first-token ratios are then left out)
    prefill_s: float | None = None


@dataclass(frozen=True)
class Measurement:
    """One recorded run (text and token ids are not kept: only what the statistics need)."""

    workload: str
    prompt_id: str
    config: str  # the config's name (the self-pair run carries the baseline's name)
    slot: str  # config name, or baseline name + "'" for the self-pair run
    rep: int
    position: int  # index within the round (0 = ran first for this prompt)
    n_tokens: int
    decode_s: float
    tok_s: float
    prefill_s: float | None = None

    @property
    def e2e_tok_s(self) -> float | None:
        """Tokens over the whole call, prefill (first token) included."""
        if self.prefill_s is None:
            return None
        return self.n_tokens / (self.prefill_s + self.decode_s)

    @property
    def first_token_per_s(self) -> float | None:
        """1 / time to first token: a speed, so its ratio reads like the others (> 1 is faster)."""
        return None if not self.prefill_s else 1.0 / self.prefill_s


@dataclass(frozen=True)
class ScheduleEntry:
    """One call of ``run_one``, in the order it happened (warm-ups included)."""

    workload: str
    prompt_id: str
    slot: str
    rep: int  # -1 for warm-up runs
    warmup: bool


@dataclass(frozen=True)
class Mismatch:
    """A run whose tokens differ from the baseline's: a correctness bug."""

    workload: str
    prompt_id: str
    config: str
    rep: int
    first_diff: int  # first token index that differs (== shorter length if one is a prefix)
    baseline_len: int
    config_len: int
    baseline_excerpt: list[int]  # a few token ids from first_diff on
    config_excerpt: list[int]


@dataclass
class ConfigResult:
    """One configuration on one workload."""

    config: BenchConfig
    is_baseline: bool
    spread: stats.Spread
    # vs the baseline, pair by pair; for the baseline itself this is A' vs A (the self-pair)
    comparison: stats.Comparison
    counters: dict[str, Any]
    checked: bool  # whether token ids were compared with the baseline's (never for a peer engine's)
    mismatches: list[Mismatch]
    # geometric mean over repetitions of the ratio to the baseline, per prompt id (the samples
    # the interval resamples); for the baseline itself, its self-pair A'/A
    per_prompt: dict[str, float] = field(default_factory=dict)
    # ``comparison`` is decode-only; these take the whole call (prefill, any drafter's own prefill
    # and the decode) and the time to the first token; None when the runs did not time prefill
    end_to_end: stats.Comparison | None = None
    first_token: stats.Comparison | None = None
    per_prompt_e2e: dict[str, float] = field(default_factory=dict)
    # what this config's text and own-engine speed are judged against: the baseline for configs of
    # the baseline's engine, that engine's plain config for a peer's (None for those references)
    reference: str | None = None
    vs_reference: stats.Comparison | None = None  # end-to-end where timed, else decode-only
    vs_reference_decode: stats.Comparison | None = None
    # greedy runs only: (prompts whose every run's tokens equal the reference's first run, prompts)
    same_text: tuple[int, int] | None = None

    @property
    def headline(self) -> stats.Comparison:
        """What the verdict is on: end-to-end where measured, else decode-only."""
        return self.end_to_end if self.end_to_end is not None else self.comparison

    @property
    def identical(self) -> bool | None:
        return (not self.mismatches) if self.checked else None

    @property
    def verdict(self) -> str:
        return "baseline" if self.is_baseline else self.headline.verdict


@dataclass
class WorkloadResult:
    name: str
    prompt_ids: list[str]
    noise: stats.NoiseFloor  # decode-only
    configs: list[ConfigResult]
    noise_e2e: stats.NoiseFloor | None = None  # end-to-end, where prefill was timed

    @property
    def headline_noise(self) -> stats.NoiseFloor:
        return self.noise_e2e if self.noise_e2e is not None else self.noise


@dataclass
class BenchResult:
    baseline: str
    reps: int
    warmup: int
    workloads: list[WorkloadResult]
    measurements: list[Measurement]
    schedule: list[ScheduleEntry]
    metadata: dict[str, Any]

    @property
    def mismatches(self) -> list[Mismatch]:
        return [m for w in self.workloads for c in w.configs for m in c.mismatches]

    @property
    def ok(self) -> bool:
        """False when any run's output differed from the baseline's (a correctness failure)."""
        return not self.mismatches


ProgressFn = Callable[[int, int, str], None]
RunOne = Callable[[BenchConfig, Prompt], RunRecord]


# ----------------------------------------------------------------------------- pure helpers


def rotation(slots: Sequence[str], rep: int) -> list[str]:
    """The slot order for repetition ``rep``: rotated left by ``rep`` (A B C, B C A, C A B, ...)."""
    k = len(slots)
    if k == 0:
        return []
    s = rep % k
    return list(slots[s:]) + list(slots[:s])


def aggregate_counters(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Combine per-run counters: ints summed (counts), floats averaged (rates, times), dicts recurse.

    A key is averaged as soon as any run reports it as a float. Averages are over the runs that
    report the key. Non-numeric values are dropped (they have no sensible aggregate).
    """
    keys: list[str] = []
    for rec in records:
        for k in rec:
            if k not in keys:
                keys.append(k)
    out: dict[str, Any] = {}
    for k in keys:
        vals = [rec[k] for rec in records if k in rec]
        if all(isinstance(v, Mapping) for v in vals):
            out[k] = aggregate_counters(vals)
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            if all(isinstance(v, int) for v in vals):
                out[k] = int(sum(vals))
            else:
                out[k] = float(np.mean([float(v) for v in vals]))
        elif all(isinstance(v, bool) for v in vals):
            out[k] = int(sum(vals))  # e.g. "parked": how many runs it happened in
    return out


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token, or None when identical."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return None if len(a) == len(b) else n


def file_sha256(path: str | Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# ----------------------------------------------------------------------------- the method


def run_bench(
    configs: Sequence[BenchConfig],
    workloads: Sequence[Workload],
    *,
    run_one: RunOne,
    reps: int = 5,
    warmup: int = 1,
    progress: ProgressFn | None = None,
    baseline: str | BenchConfig | None = None,
    check_identical: bool = True,
    model_path: str | Path | None = None,
    model_sha256: str | None = None,
    argv: Sequence[str] | None = None,
    extra_metadata: Mapping[str, Any] | None = None,
    n_resamples: int = stats.DEFAULT_RESAMPLES,
    confidence: float = stats.DEFAULT_CONFIDENCE,
    seed: int = stats.DEFAULT_SEED,
) -> BenchResult:
    """Run every configuration on every workload with the method above; see the module docstring.

    ``baseline``: a config, a config name or a spec; default the config named "plain", else
    ``plain`` is added. ``check_identical``: compare token ids with the baseline (set False for
    sampled decoding, where outputs legitimately differ). ``model_path``: recorded with its
    sha256 (computed unless ``model_sha256`` is given). ``argv`` defaults to ``sys.argv``.
    """
    ordered, self_slot = _check_inputs(configs, workloads, reps, warmup, baseline)
    started, t0 = _now(), time.perf_counter()
    total = warmup * len(ordered) + sum(reps * len(w.prompts) * (len(ordered) + 1) for w in workloads)
    done = 0
    schedule: list[ScheduleEntry] = []
    measurements: list[Measurement] = []

    def tick(desc: str) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total, desc)

    first = workloads[0]  # the warm-up: not recorded, not checked
    for i in range(warmup):
        prompt = first.prompts[i % len(first.prompts)]
        for c in ordered:
            run_one(c, prompt)
            schedule.append(ScheduleEntry(first.name, prompt.id, c.name, -1, True))
            tick(f"warm-up {c.name}")
    workload_results: list[WorkloadResult] = []
    for w in workloads:
        tokens, counters = _run_workload(w, ordered, self_slot, reps, run_one, schedule, measurements, tick)
        workload_results.append(_summarise_workload(
            w, ordered, self_slot, reps, measurements, tokens, counters, check_identical=check_identical,
            n_resamples=n_resamples, confidence=confidence, seed=seed))
    metadata: dict[str, Any] = {
        "machine": provenance.machine_info(),
        "git": provenance.git_state(),
        "env": provenance.spec_env(),
        "kernels": provenance.kernels_info(),
        "command": list(sys.argv if argv is None else argv),
        "started_at": started,
        "finished_at": _now(),
        "wall_s": round(time.perf_counter() - t0, 3),
        "model": None if model_path is None else _model_record(Path(model_path), model_sha256),
        "check_identical": check_identical,
        "n_resamples": n_resamples,
        "confidence": confidence,
        "seed": seed,
    }
    if extra_metadata:
        metadata.update(dict(extra_metadata))
    return BenchResult(baseline=ordered[0].name, reps=reps, warmup=warmup, workloads=workload_results,
                       measurements=measurements, schedule=schedule, metadata=metadata)


def _check_inputs(configs, workloads, reps: int, warmup: int, baseline) -> tuple[list[BenchConfig], str]:
    """-> (the configurations, baseline first; the baseline's second slot), or ``BadInput``."""
    if reps < 1:
        raise BadInput(f"--reps must be >= 1, got {reps}")
    if warmup < 0:
        raise BadInput(f"--warmup must be >= 0, got {warmup}")
    if not workloads:
        raise BadInput("bench: no workloads")
    names = [w.name for w in workloads]
    if len(set(names)) != len(names):
        raise BadInput("bench: a workload is given twice")
    ordered = resolve_configs(configs, baseline)
    self_slot = ordered[0].name + SELF_PAIR_SUFFIX
    if self_slot in {c.name for c in ordered}:
        raise BadInput(f"config name {self_slot!r} is reserved for the baseline's second run")
    return ordered, self_slot


def _run_workload(w: Workload, ordered: Sequence[BenchConfig], self_slot: str, reps: int, run_one: RunOne,
                  schedule: list[ScheduleEntry], measurements: list[Measurement], tick: Callable[[str], None]
                  ) -> tuple[dict[tuple[str, str, int], list[int]], dict[str, list[Mapping[str, Any]]]]:
    """Every repetition of one workload, the slots' order rotating; each run's timing appended to
    ``measurements``. -> (token ids by (prompt id, slot, rep), each configuration's counters)."""
    base = ordered[0]
    by_name = {c.name: c for c in ordered}
    slots = [c.name for c in ordered] + [self_slot]
    tokens: dict[tuple[str, str, int], list[int]] = {}
    counters: dict[str, list[Mapping[str, Any]]] = {c.name: [] for c in ordered}
    for rep in range(reps):
        for prompt in w.prompts:
            for pos, slot in enumerate(rotation(slots, rep)):
                c = base if slot == self_slot else by_name[slot]
                rec = run_one(c, prompt)
                _check_record(rec, c, prompt, w)
                schedule.append(ScheduleEntry(w.name, prompt.id, slot, rep, False))
                measurements.append(Measurement(
                    workload=w.name, prompt_id=prompt.id, config=c.name, slot=slot, rep=rep, position=pos,
                    n_tokens=int(rec.n_tokens), decode_s=float(rec.decode_s), tok_s=float(rec.tok_s),
                    prefill_s=None if rec.prefill_s is None else float(rec.prefill_s)))
                tokens[(prompt.id, slot, rep)] = list(rec.token_ids)
                if slot != self_slot:  # the self-pair is a timing device only; its counters would double-count
                    counters[c.name].append(rec.counters or {})
                tick(f"{w.name} rep {rep + 1}/{reps} {prompt.id} {slot}")
    return tokens, counters


def _model_record(mp: Path, sha: str | None) -> dict[str, Any]:
    if sha is None and mp.is_file():
        sha = file_sha256(mp)
    return {"path": str(mp), "sha256": sha}


def _check_record(rec: RunRecord, c: BenchConfig, prompt: Prompt, w: Workload) -> None:
    # a zero or broken throughput cannot enter a ratio; say which run produced it
    if not isinstance(rec, RunRecord):
        raise TsspecError(f"bench: run_one returned {type(rec).__name__}, not RunRecord")
    if not (np.isfinite(rec.tok_s) and rec.tok_s > 0):
        raise TsspecError(
            f"bench: {c.name} on {w.name}/{prompt.id} measured {rec.tok_s} tok/s "
            f"({rec.n_tokens} tokens); nothing to compare (did it stop at once?)"
        )


def _mismatches(w: Workload, name: str, base: str, again: str | None, keys: Sequence[tuple[int, str]],
                tokens: Mapping[tuple[str, str, int], list[int]]) -> list[Mismatch]:
    """Where configuration ``name``'s runs part from the baseline's first (``again``: the
    baseline's second slot, when ``name`` is the baseline)."""
    out: list[Mismatch] = []
    slots = [name] if again is None else [name, again]
    for rep, pid in keys:
        want = tokens[(pid, base, 0)]
        for slot in slots:
            if slot == base and rep == 0:
                continue  # the reference itself
            got = tokens[(pid, slot, rep)]
            d = first_difference(want, got)
            if d is not None:
                out.append(Mismatch(workload=w.name, prompt_id=pid, config=slot, rep=rep, first_diff=d,
                                    baseline_len=len(want), config_len=len(got),
                                    baseline_excerpt=list(want[d : d + 8]), config_excerpt=list(got[d : d + 8])))
    return out


class _Pairs:
    """One workload's measurements, lined up pair by pair: a slot's series over (rep, prompt), in
    the same order for every slot whatever order the runs happened in, and the comparisons between
    them, whose intervals resample prompts, not near-identical repetitions."""

    def __init__(self, w: Workload, reps: int, measurements: Sequence[Measurement], **kw):
        self.w = w
        self.keys = [(rep, p.id) for rep in range(reps) for p in w.prompts]
        self.runs = {(m.slot, m.rep, m.prompt_id): m for m in measurements if m.workload == w.name}
        self.kw = dict(groups=[pid for _, pid in self.keys], **kw)

    def series(self, slot: str, attr: str = "tok_s") -> np.ndarray | None:
        """The slot's ``attr`` over the keys (None where a run lacks it: a peer's end-to-end time)."""
        vals = [getattr(self.runs[(slot, rep, pid)], attr) for rep, pid in self.keys]
        return None if any(v is None for v in vals) else np.array(vals, dtype=np.float64)

    def noise(self, base: np.ndarray | None, again: np.ndarray | None) -> stats.Comparison | None:
        return None if base is None or again is None else stats.noise_floor(base, again, **self.kw)

    def compare(self, x: np.ndarray, ref: np.ndarray, noise) -> stats.Comparison:
        return stats.compare(x, ref, noise=noise, **self.kw)

    def per_prompt(self, x: np.ndarray, ref: np.ndarray) -> dict[str, float]:
        return {p.id: stats.geometric_mean([x[i] / ref[i] for i, (_, pid) in enumerate(self.keys) if pid == p.id])
                for p in self.w.prompts}


def _summarise_workload(
    w: Workload,
    ordered: Sequence[BenchConfig],
    self_slot: str,
    reps: int,
    measurements: Sequence[Measurement],
    tokens: Mapping[tuple[str, str, int], list[int]],
    counters: Mapping[str, list[Mapping[str, Any]]],
    *,
    check_identical: bool,
    n_resamples: int,
    confidence: float,
    seed: int,
) -> WorkloadResult:
    base = ordered[0]
    pairs = _Pairs(w, reps, measurements, n_resamples=n_resamples, confidence=confidence, seed=seed)
    base_tps, again_tps = pairs.series(base.name), pairs.series(self_slot)
    noise = pairs.noise(base_tps, again_tps)
    # the end-to-end and first-token figures, each with its own noise floor (None where a run lacks it)
    floors = {attr: pairs.noise(pairs.series(base.name, attr), pairs.series(self_slot, attr))
              for attr in ("e2e_tok_s", "first_token_per_s")}
    e2e_noise = noise if floors["e2e_tok_s"] is None else floors["e2e_tok_s"]
    # each engine's own plain configuration: a peer's speculative text and speed are judged by it
    own_plain = {base.engine: base}
    for c in ordered:
        if c.engine != base.engine and c.algo == "plain":
            own_plain.setdefault(c.engine, c)
    results: list[ConfigResult] = []
    for c in ordered:
        is_base = c.name == base.name
        x = again_tps if is_base else pairs.series(c.name)
        comp = pairs.compare(x, base_tps, noise)
        extra: dict[str, stats.Comparison | None] = {}
        per_prompt_e2e: dict[str, float] = {}
        for attr, floor in floors.items():
            xs, b = pairs.series(self_slot if is_base else c.name, attr), pairs.series(base.name, attr)
            extra[attr] = None if floor is None or xs is None else pairs.compare(xs, b, floor)
            if attr == "e2e_tok_s" and extra[attr] is not None:
                per_prompt_e2e = pairs.per_prompt(xs, b)
        checked = check_identical and c.engine == base.engine  # a peer promises no exactness: counted below
        results.append(ConfigResult(
            config=c,
            is_baseline=is_base,
            spread=stats.summarize(pairs.series(c.name)),
            comparison=comp,
            counters=aggregate_counters(counters[c.name]),
            checked=checked,
            mismatches=_mismatches(w, c.name, base.name, self_slot if is_base else None, pairs.keys, tokens)
            if checked else [],
            per_prompt=pairs.per_prompt(x, base_tps),
            end_to_end=extra["e2e_tok_s"],
            first_token=extra["first_token_per_s"],
            per_prompt_e2e=per_prompt_e2e,
            **_against_reference(pairs, c, own_plain.get(c.engine), base, comp, extra["e2e_tok_s"], noise,
                                 e2e_noise, tokens if check_identical else None, reps),
        ))
    return WorkloadResult(name=w.name, prompt_ids=[p.id for p in w.prompts], noise=noise, configs=results,
                          noise_e2e=floors["e2e_tok_s"])


def _against_reference(pairs: _Pairs, c: BenchConfig, ref: BenchConfig | None, base: BenchConfig,
                       comp: stats.Comparison, e2e: stats.Comparison | None, noise, e2e_noise,
                       tokens: Mapping[tuple[str, str, int], list[int]] | None, reps: int) -> dict[str, Any]:
    """A configuration judged against its own engine's plain runs: tsspec's against the baseline
    (the ratios already taken), a peer's pair by pair against its own plain in the same rounds;
    ``tokens`` (None: not checked) counts the prompts whose text equals the reference's."""
    if ref is None or ref.name == c.name:
        return {}  # a reference is not judged against itself
    if c.engine == base.engine:
        dec, head = comp, e2e or comp
    else:
        dec = pairs.compare(pairs.series(c.name), pairs.series(ref.name), noise)
        xe, be = pairs.series(c.name, "e2e_tok_s"), pairs.series(ref.name, "e2e_tok_s")
        head = dec if xe is None or be is None else pairs.compare(xe, be, e2e_noise)
    same = None
    if tokens is not None:
        w = pairs.w
        same = (sum(all(tokens[(p.id, c.name, rep)] == tokens[(p.id, ref.name, 0)] for rep in range(reps))
                    for p in w.prompts), len(w.prompts))
    return {"reference": ref.name, "vs_reference": head, "vs_reference_decode": dec, "same_text": same}
