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
    base = ordered[0]
    by_name = {c.name: c for c in ordered}
    self_slot = base.name + SELF_PAIR_SUFFIX
    if self_slot in by_name:
        raise BadInput(f"config name {self_slot!r} is reserved for the baseline's second run")
    slots = [c.name for c in ordered] + [self_slot]

    def config_of(slot: str) -> BenchConfig:
        return base if slot == self_slot else by_name[slot]

    started = _now()
    t0 = time.perf_counter()
    total = warmup * len(ordered) + sum(reps * len(w.prompts) * len(slots) for w in workloads)
    done = 0
    schedule: list[ScheduleEntry] = []
    measurements: list[Measurement] = []

    def tick(desc: str) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total, desc)

    # 1. warm-up: not recorded, not checked
    first = workloads[0]
    for i in range(warmup):
        prompt = first.prompts[i % len(first.prompts)]
        for c in ordered:
            run_one(c, prompt)
            schedule.append(ScheduleEntry(first.name, prompt.id, c.name, -1, True))
            tick(f"warm-up {c.name}")

    workload_results: list[WorkloadResult] = []
    for w in workloads:
        # reference token ids per prompt, and every recorded run's ids to check against them
        tokens: dict[tuple[str, str, int], list[int]] = {}  # (prompt_id, slot, rep) -> ids
        counters: dict[str, list[Mapping[str, Any]]] = {c.name: [] for c in ordered}
        for rep in range(reps):
            order = rotation(slots, rep)
            for prompt in w.prompts:
                for pos, slot in enumerate(order):
                    c = config_of(slot)
                    rec = run_one(c, prompt)
                    _check_record(rec, c, prompt, w)
                    schedule.append(ScheduleEntry(w.name, prompt.id, slot, rep, False))
                    measurements.append(
                        Measurement(
                            workload=w.name,
                            prompt_id=prompt.id,
                            config=c.name,
                            slot=slot,
                            rep=rep,
                            position=pos,
                            n_tokens=int(rec.n_tokens),
                            decode_s=float(rec.decode_s),
                            tok_s=float(rec.tok_s),
                            prefill_s=None if rec.prefill_s is None else float(rec.prefill_s),
                        )
                    )
                    tokens[(prompt.id, slot, rep)] = list(rec.token_ids)
                    if slot != self_slot:
                        # the self-pair is a timing device only; its counters would double-count
                        counters[c.name].append(rec.counters or {})
                    tick(f"{w.name} rep {rep + 1}/{reps} {prompt.id} {slot}")
        workload_results.append(
            _summarise_workload(
                w,
                ordered,
                self_slot,
                reps,
                measurements,
                tokens,
                counters,
                check_identical=check_identical,
                n_resamples=n_resamples,
                confidence=confidence,
                seed=seed,
            )
        )

    metadata: dict[str, Any] = {
        "machine": provenance.machine_info(),
        "git": provenance.git_state(),
        "env": provenance.spec_env(),
        "kernels": provenance.kernels_info(),
        "command": list(sys.argv if argv is None else argv),
        "started_at": started,
        "finished_at": _now(),
        "wall_s": round(time.perf_counter() - t0, 3),
        "model": None,
        "check_identical": check_identical,
        "n_resamples": n_resamples,
        "confidence": confidence,
        "seed": seed,
    }
    if model_path is not None:
        mp = Path(model_path)
        sha = model_sha256
        if sha is None and mp.is_file():
            sha = file_sha256(mp)
        metadata["model"] = {"path": str(mp), "sha256": sha}
    if extra_metadata:
        metadata.update(dict(extra_metadata))
    return BenchResult(
        baseline=base.name,
        reps=reps,
        warmup=warmup,
        workloads=workload_results,
        measurements=measurements,
        schedule=schedule,
        metadata=metadata,
    )


def _check_record(rec: RunRecord, c: BenchConfig, prompt: Prompt, w: Workload) -> None:
    # a zero or broken throughput cannot enter a ratio; say which run produced it
    if not isinstance(rec, RunRecord):
        raise TsspecError(f"bench: run_one returned {type(rec).__name__}, not RunRecord")
    if not (np.isfinite(rec.tok_s) and rec.tok_s > 0):
        raise TsspecError(
            f"bench: {c.name} on {w.name}/{prompt.id} measured {rec.tok_s} tok/s "
            f"({rec.n_tokens} tokens); nothing to compare (did it stop at once?)"
        )


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
    # tok/s keyed by (slot, rep, prompt) so pairs line up whatever order runs happened in
    tps = {(m.slot, m.rep, m.prompt_id): m.tok_s for m in measurements if m.workload == w.name}
    keys = [(rep, p.id) for rep in range(reps) for p in w.prompts]

    runs = {(m.slot, m.rep, m.prompt_id): m for m in measurements if m.workload == w.name}

    def series(slot: str) -> np.ndarray:
        return np.array([tps[(slot, rep, pid)] for rep, pid in keys])

    def metric(slot: str, attr: str) -> np.ndarray | None:
        vals = [getattr(runs[(slot, rep, pid)], attr) for rep, pid in keys]
        return None if any(v is None for v in vals) else np.array(vals, dtype=np.float64)

    def per_prompt_of(x: np.ndarray, base_x: np.ndarray) -> dict[str, float]:
        return {p.id: stats.geometric_mean([x[i] / base_x[i] for i, (_, pid) in enumerate(keys) if pid == p.id])
                for p in w.prompts}

    base_tps = series(base.name)
    again_tps = series(self_slot)
    # pairs grouped by prompt: the intervals resample prompts, not near-identical repetitions
    kw = dict(groups=[pid for _, pid in keys], n_resamples=n_resamples, confidence=confidence, seed=seed)
    noise = stats.noise_floor(base_tps, again_tps, **kw)
    extra_noise = {}
    for attr in ("e2e_tok_s", "first_token_per_s"):
        b, a = metric(base.name, attr), metric(self_slot, attr)
        extra_noise[attr] = None if b is None or a is None else (b, a, stats.noise_floor(b, a, **kw))

    e2e_floor = extra_noise["e2e_tok_s"]
    extra_noise_floor = noise if e2e_floor is None else e2e_floor[2]
    # each engine's own plain configuration: a peer's speculative text and speed are judged by it
    own_plain = {base.engine: base}
    for c in ordered:
        if c.engine != base.engine and c.algo == "plain":
            own_plain.setdefault(c.engine, c)

    def against_reference(c: BenchConfig, ref: BenchConfig | None, comp: stats.Comparison,
                           e2e: stats.Comparison | None) -> dict[str, Any]:
        if ref is None or ref.name == c.name:
            return {}  # a reference is not judged against itself
        if c.engine == base.engine:  # ref is the baseline: the ratios are the ones above
            dec, head = comp, e2e or comp
        else:  # a peer against its own plain runs, pair by pair in the same rounds
            dec = stats.compare(series(c.name), series(ref.name), noise=noise, **kw)
            xe, be = metric(c.name, "e2e_tok_s"), metric(ref.name, "e2e_tok_s")
            head = dec if xe is None or be is None else stats.compare(xe, be, noise=extra_noise_floor, **kw)
        same = None
        if check_identical:
            same = (sum(all(tokens[(p.id, c.name, rep)] == tokens[(p.id, ref.name, 0)] for rep in range(reps))
                        for p in w.prompts), len(w.prompts))
        return {"reference": ref.name, "vs_reference": head, "vs_reference_decode": dec, "same_text": same}

    results: list[ConfigResult] = []
    for c in ordered:
        is_base = c.name == base.name
        x = again_tps if is_base else series(c.name)
        comp = stats.compare(x, base_tps, noise=noise, **kw)
        per_prompt = per_prompt_of(x, base_tps)
        extra: dict[str, stats.Comparison | None] = {}
        per_prompt_e2e: dict[str, float] = {}
        for attr, got in extra_noise.items():
            xs = metric(self_slot if is_base else c.name, attr)
            if got is None or xs is None:
                extra[attr] = None
                continue
            b, _, fl = got
            extra[attr] = stats.compare(xs, b, noise=fl, **kw)
            if attr == "e2e_tok_s":
                per_prompt_e2e = per_prompt_of(xs, b)
        mismatches: list[Mismatch] = []
        if check_identical and c.engine == base.engine:  # a peer promises no exactness: counted below
            slots = [c.name, self_slot] if is_base else [c.name]
            for rep, pid in keys:
                want = tokens[(pid, base.name, 0)]
                for slot in slots:
                    if is_base and slot == base.name and rep == 0:
                        continue  # the reference itself
                    got = tokens[(pid, slot, rep)]
                    d = first_difference(want, got)
                    if d is not None:
                        mismatches.append(
                            Mismatch(
                                workload=w.name,
                                prompt_id=pid,
                                config=slot,
                                rep=rep,
                                first_diff=d,
                                baseline_len=len(want),
                                config_len=len(got),
                                baseline_excerpt=list(want[d : d + 8]),
                                config_excerpt=list(got[d : d + 8]),
                            )
                        )
        results.append(
            ConfigResult(
                config=c,
                is_baseline=is_base,
                spread=stats.summarize(series(c.name)),
                comparison=comp,
                counters=aggregate_counters(counters[c.name]),
                checked=check_identical and c.engine == base.engine,
                mismatches=mismatches,
                per_prompt=per_prompt,
                end_to_end=extra["e2e_tok_s"],
                first_token=extra["first_token_per_s"],
                per_prompt_e2e=per_prompt_e2e,
                **against_reference(c, own_plain.get(c.engine), comp, extra["e2e_tok_s"]),
            )
        )
    e2e = extra_noise["e2e_tok_s"]
    return WorkloadResult(name=w.name, prompt_ids=[p.id for p in w.prompts], noise=noise, configs=results,
                          noise_e2e=None if e2e is None else e2e[2])
