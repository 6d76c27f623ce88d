"""Paired-run statistics for ``tsspec bench``: is B faster than A, by how much, and is it noise?

Contract (pure functions, numpy only, no I/O, deterministic for a given ``seed``):

* Input is *paired* throughput: ``x[i]`` and ``base[i]`` are tokens/second of a configuration
  and of the baseline measured on the same prompt, in the same repetition, close in time.
  Pairing is the point: prompts differ in speed by far more than configurations do, and a
  shared machine drifts; a ratio taken *within* a pair cancels both.
* ``summarize`` gives the median and inter-quartile range of one configuration's tok/s.
* ``ratio_summary`` summarises the paired ratios ``x[i] / base[i]`` by their **geometric mean**
  (the mean of log-ratios, exponentiated), with a **percentile bootstrap** confidence interval
  over pairs (default 2000 resamples, 95 %, seeded RNG); given each pair's prompt (``groups``),
  over prompts instead: every prompt weighs the same and whole prompts are resampled, because
  greedy repetitions of a prompt are near copies, not independent samples (``tsspec bench``
  always passes them). Geometric mean rather than median
  because (a) it is symmetric: the ratio of A to B is exactly the inverse of B to A, (b) noise is
  multiplicative, so in log space it is additive and averages out, and (c) the bootstrap
  distribution of a mean is smooth, whereas a median over a handful of pairs jumps between
  a few observed values and gives lumpy, badly covering intervals.
* ``noise_floor`` runs the same statistic on the baseline against itself (A' / A: the baseline is
  run twice per repetition). The floor is the largest log-distance from 1 inside that self-pair
  confidence interval: the smallest effect this machine, this run length and this number of
  pairs can tell apart from running the very same thing twice.
* ``compare`` returns a ``Comparison`` with a verdict: ``"faster"`` / ``"slower"`` only when the
  CI excludes 1 **and** the estimated effect is larger than the noise floor; otherwise
  ``"within noise"``. Fewer than ``MIN_PAIRS`` pairs is always ``"within noise"``.
  On synthetic data (25 pairs, 3-10 % multiplicative noise) two identical configurations get
  "faster"/"slower" in about 1-2 % of experiments, and a real 20 % gain is found in ~all
  (``tests/test_bench_stats.py``).

All throughputs must be positive and finite (``ValueError`` otherwise: a zero tok/s means the
caller measured nothing and must not be averaged into a ratio).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Sequence

import numpy as np

FASTER = "faster"
SLOWER = "slower"
WITHIN_NOISE = "within noise"
VERDICTS = (FASTER, SLOWER, WITHIN_NOISE)

DEFAULT_RESAMPLES = 2000
DEFAULT_CONFIDENCE = 0.95
DEFAULT_SEED = 0
# below this a bootstrap interval is meaningless (with one pair every resample is identical)
MIN_PAIRS = 3


@dataclass(frozen=True)
class Spread:
    """Median and quartiles of one configuration's tok/s over all its recorded runs."""

    median: float
    q1: float
    q3: float
    n: int

    @property
    def iqr(self) -> float:
        return self.q3 - self.q1


@dataclass(frozen=True)
class RatioSummary:
    """Geometric mean of paired ratios with its percentile-bootstrap confidence interval."""

    estimate: float
    ci_low: float
    ci_high: float
    n_pairs: int
    confidence: float = DEFAULT_CONFIDENCE
    n_groups: int | None = None  # prompts, when the pairs were grouped by prompt

    @property
    def n_units(self) -> int:
        """The independent samples the interval rests on: prompts when grouped, else pairs."""
        return self.n_pairs if self.n_groups is None else self.n_groups

    def crosses_one(self) -> bool:
        return self.ci_low <= 1.0 <= self.ci_high


@dataclass(frozen=True)
class NoiseFloor:
    """How far from 1.0 the baseline-vs-itself ratio can land: the smallest believable effect.

    ``log_floor`` is in natural-log units; ``relative`` is the same as a fraction
    (0.03 means "effects within about +-3 % are indistinguishable from noise").
    """

    self_ratio: RatioSummary | None
    log_floor: float

    @property
    def relative(self) -> float:
        return math.expm1(self.log_floor)

    @property
    def band(self) -> tuple[float, float]:
        """The ratio interval [1/(1+f), 1+f] that counts as noise."""
        return (math.exp(-self.log_floor), math.exp(self.log_floor))


@dataclass(frozen=True)
class Comparison:
    """One configuration against the baseline: the answer ``tsspec bench`` prints."""

    config: Spread
    baseline: Spread
    ratio: RatioSummary
    noise: NoiseFloor
    verdict: str
    reason: str


def _as_positive(values: Sequence[float] | np.ndarray, what: str) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float64).reshape(-1)
    if arr.size == 0:
        raise ValueError(f"{what}: no measurements")
    if not np.all(np.isfinite(arr)) or np.any(arr <= 0):
        raise ValueError(f"{what}: throughputs must be positive and finite")
    return arr


def _paired(x: Sequence[float] | np.ndarray, base: Sequence[float] | np.ndarray) -> np.ndarray:
    xa = _as_positive(x, "config")
    ba = _as_positive(base, "baseline")
    if xa.shape != ba.shape:
        raise ValueError(f"paired measurements differ in length: {xa.size} vs {ba.size}")
    return xa / ba


def summarize(values: Sequence[float] | np.ndarray) -> Spread:
    """Median and quartiles (linear interpolation) of one configuration's tok/s."""
    arr = _as_positive(values, "values")
    q1, med, q3 = np.quantile(arr, [0.25, 0.5, 0.75])
    return Spread(median=float(med), q1=float(q1), q3=float(q3), n=int(arr.size))


def geometric_mean(ratios: Sequence[float] | np.ndarray) -> float:
    arr = _as_positive(ratios, "ratios")
    return float(np.exp(np.mean(np.log(arr))))


def _group_index(groups: Sequence[Hashable] | None, n: int) -> np.ndarray | None:
    """Each pair's group as 0..G-1 (in order of first appearance), or None for ungrouped pairs."""
    if groups is None:
        return None
    groups = list(groups)
    if len(groups) != n:
        raise ValueError(f"groups has {len(groups)} labels for {n} pairs")
    ids: dict[Hashable, int] = {}
    return np.array([ids.setdefault(g, len(ids)) for g in groups], dtype=np.int64)


def _group_means(logs: np.ndarray, gidx: np.ndarray) -> np.ndarray:
    """Mean log-ratio of each group: a prompt's repetitions count as one sample between them."""
    return np.bincount(gidx, weights=logs) / np.bincount(gidx)


def grouped_geometric_mean(ratios: Sequence[float] | np.ndarray, groups: Sequence[Hashable]) -> float:
    """Geometric mean over groups of each group's geometric mean: every prompt weighs the same,
    however many repetitions it has."""
    logs = np.log(_as_positive(ratios, "ratios"))
    return float(np.exp(_group_means(logs, _group_index(groups, logs.size)).mean()))


def bootstrap_ci(
    ratios: Sequence[float] | np.ndarray,
    *,
    groups: Sequence[Hashable] | None = None,
    n_resamples: int = DEFAULT_RESAMPLES,
    confidence: float = DEFAULT_CONFIDENCE,
    seed: int = DEFAULT_SEED,
) -> tuple[float, float]:
    """Percentile-bootstrap interval of the geometric mean.

    Ungrouped, whole pairs are resampled. With ``groups`` (the prompt of each pair) whole groups
    are resampled instead (a cluster bootstrap): greedy repetitions of one prompt emit the same
    tokens and differ by about 1%, while prompts differ several-fold, so the repetitions are
    not independent samples and resampling them as if they were gives intervals far too narrow.
    """
    logs = np.log(_as_positive(ratios, "ratios"))
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if n_resamples < 1:
        raise ValueError(f"n_resamples must be >= 1, got {n_resamples}")
    gidx = _group_index(groups, logs.size)
    units = logs if gidx is None else _group_means(logs, gidx)
    rng = np.random.default_rng(seed)
    n = units.size
    means = np.empty(n_resamples, dtype=np.float64)
    # chunk so memory stays bounded (n_resamples x n indices) however many units there are
    chunk = max(1, 2_000_000 // n)
    for start in range(0, n_resamples, chunk):
        stop = min(n_resamples, start + chunk)
        idx = rng.integers(0, n, size=(stop - start, n))
        means[start:stop] = units[idx].mean(axis=1)
    alpha = (1.0 - confidence) / 2.0
    lo, hi = np.quantile(means, [alpha, 1.0 - alpha])
    return float(np.exp(lo)), float(np.exp(hi))


def ratio_summary(
    ratios: Sequence[float] | np.ndarray,
    *,
    groups: Sequence[Hashable] | None = None,
    n_resamples: int = DEFAULT_RESAMPLES,
    confidence: float = DEFAULT_CONFIDENCE,
    seed: int = DEFAULT_SEED,
) -> RatioSummary:
    """Geometric mean of already-paired ratios and its bootstrap CI (over prompts with ``groups``)."""
    arr = _as_positive(ratios, "ratios")
    if groups is None:
        est, units, n_groups = geometric_mean(arr), arr.size, None
    else:
        est = grouped_geometric_mean(arr, groups)
        n_groups = units = int(_group_index(groups, arr.size).max()) + 1 if arr.size else 0
    if units < MIN_PAIRS:
        # no honest interval from one or two samples: say "anything is possible"
        lo, hi = 0.0, math.inf
    else:
        lo, hi = bootstrap_ci(arr, groups=groups, n_resamples=n_resamples, confidence=confidence, seed=seed)
    return RatioSummary(estimate=est, ci_low=lo, ci_high=hi, n_pairs=int(arr.size), confidence=confidence,
                        n_groups=n_groups)


def paired_ratio(
    x: Sequence[float] | np.ndarray,
    base: Sequence[float] | np.ndarray,
    *,
    groups: Sequence[Hashable] | None = None,
    n_resamples: int = DEFAULT_RESAMPLES,
    confidence: float = DEFAULT_CONFIDENCE,
    seed: int = DEFAULT_SEED,
) -> RatioSummary:
    """Ratio of ``x`` to ``base`` computed pair by pair (``x[i] / base[i]``), then summarised."""
    return ratio_summary(_paired(x, base), groups=groups, n_resamples=n_resamples, confidence=confidence,
                         seed=seed)


def noise_floor(
    base: Sequence[float] | np.ndarray,
    base_again: Sequence[float] | np.ndarray | None,
    *,
    groups: Sequence[Hashable] | None = None,
    n_resamples: int = DEFAULT_RESAMPLES,
    confidence: float = DEFAULT_CONFIDENCE,
    seed: int = DEFAULT_SEED,
) -> NoiseFloor:
    """The baseline against itself (A' / A, pair by pair): how big a no-op "effect" looks.

    Without a self-pair (``base_again`` None or empty) the floor is 0 and only the CI decides.
    With too few self-pairs to bound it, the floor is infinite: nothing can be called an effect.
    """
    if base_again is None or len(base_again) == 0:
        return NoiseFloor(self_ratio=None, log_floor=0.0)
    self_ratio = paired_ratio(base_again, base, groups=groups, n_resamples=n_resamples, confidence=confidence,
                              seed=seed)
    if self_ratio.n_units < MIN_PAIRS:
        return NoiseFloor(self_ratio=self_ratio, log_floor=math.inf)
    # the farthest point of the self-pair interval from 1, in log units: a systematic A'/A bias
    # (cache warmth, thermal drift) widens the floor just as random spread does
    floor = max(abs(math.log(self_ratio.ci_low)), abs(math.log(self_ratio.ci_high)))
    return NoiseFloor(self_ratio=self_ratio, log_floor=floor)


def verdict(ratio: RatioSummary, noise: NoiseFloor) -> tuple[str, str]:
    """(verdict, one-line reason) from a ratio and the noise floor."""
    if ratio.n_units < MIN_PAIRS:
        what = "pairs" if ratio.n_groups is None else "prompts"
        return WITHIN_NOISE, f"too few {what} ({ratio.n_units} < {MIN_PAIRS})"
    pct = ratio.confidence * 100
    if ratio.crosses_one():
        return WITHIN_NOISE, f"{pct:g}% CI [{ratio.ci_low:.3f}, {ratio.ci_high:.3f}] contains 1"
    effect = abs(math.log(ratio.estimate))
    if effect <= noise.log_floor:
        return (
            WITHIN_NOISE,
            f"effect {math.expm1(effect) * 100:.1f}% is within the noise floor +-{noise.relative * 100:.1f}%",
        )
    word = FASTER if ratio.estimate > 1.0 else SLOWER
    return word, f"{pct:g}% CI excludes 1 and the effect exceeds the noise floor"


def compare(
    x: Sequence[float] | np.ndarray,
    base: Sequence[float] | np.ndarray,
    base_again: Sequence[float] | np.ndarray | None = None,
    *,
    noise: NoiseFloor | None = None,
    groups: Sequence[Hashable] | None = None,
    n_resamples: int = DEFAULT_RESAMPLES,
    confidence: float = DEFAULT_CONFIDENCE,
    seed: int = DEFAULT_SEED,
) -> Comparison:
    """Everything about configuration ``x`` against the baseline ``base`` (paired arrays).

    ``base_again`` is the baseline's second run per pair (for the noise floor); pass a
    precomputed ``noise`` instead to share one floor between several configurations. ``groups``
    names each pair's prompt: the estimate then weighs prompts equally and the interval
    resamples prompts (see ``bootstrap_ci``).
    """
    if noise is None:
        noise = noise_floor(base, base_again, groups=groups, n_resamples=n_resamples, confidence=confidence,
                            seed=seed)
    ratio = paired_ratio(x, base, groups=groups, n_resamples=n_resamples, confidence=confidence, seed=seed)
    word, reason = verdict(ratio, noise)
    return Comparison(
        config=summarize(x),
        baseline=summarize(base),
        ratio=ratio,
        noise=noise,
        verdict=word,
        reason=reason,
    )
