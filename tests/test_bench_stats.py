"""tsspec.bench.stats on synthetic timings: real effects are found, no-ops are called noise,
and the bootstrap interval covers the true ratio about as often as it claims to."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tsspec.bench import stats

PROMPT_SPEEDS = np.array([8.0, 14.0, 20.0, 31.0, 45.0])  # prompts differ far more than configs do
REPS = 5


def _experiment(rng: np.random.Generator, true_ratio: float, noise: float = 0.10):
    """Paired tok/s (x, A, A') for every prompt x rep with multiplicative per-run noise."""
    base = np.repeat(PROMPT_SPEEDS, REPS)
    # a slow drift over the run (shared machine): pairing must cancel it
    drift = 1.0 + 0.15 * np.sin(np.linspace(0, 3, base.size))
    n = base.size

    def run(scale: float) -> np.ndarray:
        return scale * base * drift * np.exp(rng.normal(0.0, noise, n))

    return run(true_ratio), run(1.0), run(1.0)


def test_real_gain_is_reported_as_faster():
    x, a, a2 = _experiment(np.random.default_rng(1), 1.2)
    c = stats.compare(x, a, a2)
    assert c.verdict == stats.FASTER, c.reason
    assert 1.1 < c.ratio.estimate < 1.3
    assert c.ratio.ci_low > 1.0
    assert c.ratio.ci_low <= 1.2 <= c.ratio.ci_high
    assert c.noise.relative < 0.2  # the floor is the summary's noise, not a single run's


def test_real_gain_is_found_reliably():
    rng = np.random.default_rng(2)
    verdicts = [stats.compare(*_experiment(rng, 1.2), n_resamples=500).verdict for _ in range(50)]
    assert verdicts.count(stats.FASTER) >= 48


def test_slowdown_is_reported_as_slower():
    x, a, a2 = _experiment(np.random.default_rng(3), 0.8)
    c = stats.compare(x, a, a2)
    assert c.verdict == stats.SLOWER, c.reason
    assert c.ratio.ci_high < 1.0


def test_identical_configurations_are_within_noise():
    x, a, a2 = _experiment(np.random.default_rng(4), 1.0)
    c = stats.compare(x, a, a2)
    assert c.verdict == stats.WITHIN_NOISE, c.reason


def test_identical_configurations_rarely_called_an_effect():
    rng = np.random.default_rng(5)
    verdicts = [stats.compare(*_experiment(rng, 1.0), n_resamples=500).verdict for _ in range(100)]
    assert verdicts.count(stats.WITHIN_NOISE) >= 95


def test_ci_covers_true_ratio_in_most_experiments():
    rng = np.random.default_rng(6)
    true = 1.15
    covered = 0
    for _ in range(200):
        x, a, _ = _experiment(rng, true)
        r = stats.paired_ratio(x, a, n_resamples=1000)
        covered += r.ci_low <= true <= r.ci_high
    assert covered >= 0.85 * 200, covered


def test_small_effect_inside_noise_floor_is_within_noise():
    # a tight CI that excludes 1 is still no effect when the self-pair moves as much
    ratio = stats.RatioSummary(estimate=1.02, ci_low=1.01, ci_high=1.03, n_pairs=25)
    floor = stats.NoiseFloor(self_ratio=None, log_floor=math.log(1.05))
    verdict, reason = stats.verdict(ratio, floor)
    assert verdict == stats.WITHIN_NOISE
    assert "noise floor" in reason
    assert stats.verdict(ratio, stats.NoiseFloor(None, 0.0))[0] == stats.FASTER


def test_ratio_is_pair_by_pair_not_ratio_of_medians():
    # the config is 2x on the slow prompt and 1x on the fast one: pairs say sqrt(2) overall
    x = np.array([20.0, 100.0, 20.0, 100.0, 20.0, 100.0])
    a = np.array([10.0, 100.0, 10.0, 100.0, 10.0, 100.0])
    r = stats.paired_ratio(x, a)
    assert r.estimate == pytest.approx(math.sqrt(2.0))


def test_geometric_mean_is_symmetric():
    rng = np.random.default_rng(7)
    x, a, _ = _experiment(rng, 1.3)
    assert stats.paired_ratio(x, a).estimate * stats.paired_ratio(a, x).estimate == pytest.approx(1.0)


def test_bootstrap_is_deterministic_for_a_seed():
    x, a, _ = _experiment(np.random.default_rng(8), 1.1)
    assert stats.paired_ratio(x, a, seed=3) == stats.paired_ratio(x, a, seed=3)


def test_summarize_median_and_iqr():
    s = stats.summarize([1.0, 2.0, 3.0, 4.0, 5.0])
    assert (s.median, s.q1, s.q3, s.iqr, s.n) == (3.0, 2.0, 4.0, 2.0, 5)


def test_noise_floor_from_self_pair():
    rng = np.random.default_rng(9)
    _, a, a2 = _experiment(rng, 1.0, noise=0.02)
    quiet = stats.noise_floor(a, a2)
    _, b, b2 = _experiment(rng, 1.0, noise=0.15)
    loud = stats.noise_floor(b, b2)
    assert 0 < quiet.relative < loud.relative
    lo, hi = loud.band
    assert lo < 1.0 < hi
    assert stats.noise_floor(a, None).log_floor == 0.0


def test_too_few_pairs_is_within_noise():
    c = stats.compare([20.0, 21.0], [10.0, 10.0], [10.0, 10.5])
    assert c.verdict == stats.WITHIN_NOISE
    assert "too few" in c.reason


@pytest.mark.parametrize("bad", [[0.0, 1.0, 2.0], [1.0, float("nan"), 2.0], [-1.0, 1.0, 1.0], []])
def test_bad_throughputs_are_rejected(bad):
    with pytest.raises(ValueError):
        stats.summarize(bad)


def test_unequal_pair_lengths_are_rejected():
    with pytest.raises(ValueError):
        stats.paired_ratio([1.0, 2.0, 3.0], [1.0, 2.0])


# ----------------------------------------------------------------------------- grouped by prompt


def _prompt_experiment(rng, n_prompts=12, reps=3, spread=0.15, rep_noise=0.01, true_log=0.05):
    """Paired ratios where prompts differ (each has its own true log-ratio around ``true_log``) and
    greedy repetitions of a prompt are near copies (1% noise): what ``tsspec bench`` records."""
    prompt_logs = true_log + rng.normal(0.0, spread, n_prompts)
    logs = np.repeat(prompt_logs, reps) + rng.normal(0.0, rep_noise, n_prompts * reps)
    groups = np.repeat(np.arange(n_prompts), reps)
    return np.exp(logs), groups


def test_prompt_level_interval_covers_the_truth_at_about_its_nominal_rate():
    """Over prompts, a 95% interval should cover the population's ratio about 95% of the time; the
    pair-level interval, treating repetitions as independent, covers far less (it is too narrow
    by about sqrt(reps)): the bug this guards against."""
    rng = np.random.default_rng(42)
    truth = math.exp(0.05)
    grouped = pairwise = 0
    trials = 300
    for t in range(trials):
        ratios, groups = _prompt_experiment(rng)
        g = stats.ratio_summary(ratios, groups=groups, n_resamples=400, seed=t)
        p = stats.ratio_summary(ratios, n_resamples=400, seed=t)
        grouped += g.ci_low <= truth <= g.ci_high
        pairwise += p.ci_low <= truth <= p.ci_high
    assert 0.86 <= grouped / trials <= 0.99, grouped / trials
    assert pairwise / trials < 0.82, pairwise / trials


def test_grouped_estimate_weighs_each_prompt_once():
    # prompt a has 3 reps at 2.0, prompt b one at 0.5: prompts weigh equally -> 1.0
    r = stats.ratio_summary([2.0, 2.0, 2.0, 0.5], groups=["a", "a", "a", "b"])
    assert r.estimate == pytest.approx(1.0)
    assert (r.n_pairs, r.n_groups, r.n_units) == (4, 2, 2)
    assert (r.ci_low, r.ci_high) == (0.0, math.inf)  # two prompts: no honest interval


def test_too_few_prompts_is_within_noise_however_many_repetitions():
    x = [1.5] * 30
    base = [1.0] * 30
    c = stats.compare(x, base, groups=[i % 2 for i in range(30)])
    assert c.verdict == stats.WITHIN_NOISE and "prompts" in c.reason


def test_groups_must_label_every_pair():
    with pytest.raises(ValueError, match="labels"):
        stats.ratio_summary([1.0, 1.1, 1.2], groups=["a", "b"])
