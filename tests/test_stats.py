"""lorabench.stats on synthetic samples whose truth is known: the intervals cover what
they claim, the comparisons see real shifts and not noise, the words match the verdicts."""

import math
import time

import numpy as np
import pytest

from lorabench.stats import (
    LEVEL,
    MIN_SAMPLES,
    N_BOOT,
    Interval,
    Resampler,
    Verdict,
    describe,
    geometric_mean_ratio,
    half_width_pct,
    median_interval,
    rank_test,
    relative_difference,
    samples_needed,
    verdict,
)

# name: (draw(rng, n), true median): step-time-like shapes, symmetric and right-skewed
DISTRIBUTIONS = {
    "normal": (lambda r, n: r.normal(10.0, 1.0, n), 10.0),
    "shifted-lognormal": (lambda r, n: 5.0 + r.lognormal(0.0, 0.8, n), 6.0),
    "shifted-exponential": (lambda r, n: 5.0 + r.exponential(1.0, n), 5.0 + math.log(2)),
}


def draw(dist: str, n: int, seed: int) -> np.ndarray:
    return DISTRIBUTIONS[dist][0](np.random.default_rng(seed), n)


def noisy(n: int, scale: float, seed: int, noise: float = 0.01) -> np.ndarray:
    """Step times around ``scale`` with ``noise`` relative spread."""
    return scale * (1 + noise * np.random.default_rng(seed).standard_normal(n))


# ---------------------------------------------------------------- per-point interval of the median


@pytest.mark.parametrize("dist", sorted(DISTRIBUTIONS))
@pytest.mark.parametrize("n", [20, 40])
def test_median_interval_covers_the_true_median_about_95_percent(dist, n):
    truth = DISTRIBUTIONS[dist][1]
    seeds = range(200)
    covered = 0
    for seed in seeds:
        iv = median_interval(draw(dist, n, seed), seed=seed)
        assert iv.low <= iv.estimate <= iv.high
        assert iv.level == LEVEL
        covered += not iv.excludes(truth)
    assert 0.90 <= covered / len(seeds) <= 0.99


def test_median_interval_estimate_is_the_sample_median_and_narrows_as_one_over_sqrt_n():
    x = draw("shifted-lognormal", 400, seed=3)
    small = median_interval(x[:100])
    large = median_interval(x)
    assert small.estimate == pytest.approx(np.median(x[:100]))
    assert large.estimate == pytest.approx(np.median(x))
    # four times the samples: half the width (1/sqrt(4)), within the noise of one draw
    assert 0.35 <= large.half_width / small.half_width <= 0.7


def test_median_interval_is_reproducible_per_seed_and_level_orders_widths():
    x = draw("normal", 50, seed=1)
    assert median_interval(x, seed=7) == median_interval(x, seed=7)
    assert median_interval(x, seed=7) != median_interval(x, seed=8)
    narrow = median_interval(x, level=0.5)
    assert narrow.level == 0.5
    assert narrow.half_width < median_interval(x).half_width
    with pytest.raises(ValueError):
        median_interval(x, level=1.0)


# ---------------------------------------------------------------- too few samples


def test_no_interval_below_min_samples():
    x = draw("normal", MIN_SAMPLES, seed=0)
    assert median_interval(x) is not None
    assert median_interval(x[:-1]) is None
    assert median_interval(np.array([])) is None
    assert half_width_pct(x) is not None
    assert half_width_pct(x[:-1]) is None
    assert relative_difference(x, x[:-1]) is None
    assert relative_difference(x[:-1], x) is None
    assert geometric_mean_ratio([(x, x), (x, x[:-1])]) is None
    assert geometric_mean_ratio([]) is None


def test_a_statistic_is_none_only_when_it_reads_a_short_point():
    r = Resampler({"ok": draw("normal", 30, 0), "short": draw("normal", 5, 1), "empty": []})
    assert r.interval(lambda m: m["ok"] * 2) is not None  # the short points are never read
    assert r.interval(lambda m: m["ok"] + m["short"]) is None
    assert r.interval(lambda m: m["empty"]) is None
    assert r.median_interval("short") is None
    assert r.median("short") == pytest.approx(np.median(draw("normal", 5, 1)))
    assert math.isnan(r.median("empty"))
    with pytest.raises(KeyError):
        r.interval(lambda m: m["never measured"])


def test_non_finite_samples_are_refused():
    x = draw("normal", 20, 0)
    with pytest.raises(ValueError):
        median_interval(np.append(x, np.nan))
    with pytest.raises(ValueError):
        rank_test(x, np.append(x, np.inf))


# ---------------------------------------------------------------- Resampler: composed statistics


def weighted_points(seed: int = 0) -> dict[int, np.ndarray]:
    """Four fixed points (active counts 1, 2, 4, 8) whose step time grows with the count."""
    return {k: noisy(40 + 5 * k, 1.0 + 0.1 * k, seed + k, noise=0.05) for k in (1, 2, 4, 8)}


WEIGHTS = {1: 0.1, 2: 0.2, 4: 0.3, 8: 0.4}


def weighted_sum(m):
    return sum(w * m[k] for k, w in WEIGHTS.items())


def test_resampler_weighted_sum_matches_the_direct_computation():
    samples = weighted_points()
    r = Resampler(samples, seed=5)
    iv = r.interval(weighted_sum)
    assert iv.estimate == pytest.approx(sum(w * np.median(samples[k]) for k, w in WEIGHTS.items()))
    boot = sum(w * r.boot(k) for k, w in WEIGHTS.items())
    assert r.boot(1).shape == (N_BOOT,)
    assert (iv.low, iv.high) == pytest.approx(tuple(np.percentile(boot, [2.5, 97.5])))
    # the bootstrap medians are those of the point's own samples
    assert samples[8].min() <= r.boot(8).min() and r.boot(8).max() <= samples[8].max()
    assert abs(np.median(r.boot(8)) - np.median(samples[8])) < 0.02


def test_resampler_is_reproducible_whatever_the_order_points_are_read_in():
    samples = weighted_points()
    first = Resampler(samples, seed=5)
    a = first.interval(weighted_sum)
    second = Resampler(samples, seed=5)
    second.median_interval(8)  # point 8 drawn first this time
    second.interval(lambda m: m[4] / m[2])
    assert second.interval(weighted_sum) == a
    assert np.array_equal(first.boot(2), second.boot(2))
    other = Resampler(samples, seed=6).interval(weighted_sum)
    assert other != a
    assert other.estimate == a.estimate
    assert abs(other.low - a.low) < 0.5 * a.half_width


def test_resampler_points_are_resampled_independently():
    same = noisy(50, 1.0, seed=0, noise=0.05)
    r = Resampler({"a": same, "b": same})
    # identical samples under two keys: independent draws, not the same ones
    assert not np.array_equal(r.boot("a"), r.boot("b"))
    assert abs(np.corrcoef(r.boot("a"), r.boot("b"))[0, 1]) < 0.1
    # so the ratio of a point with itself under two keys has a real interval around 1
    iv = r.interval(lambda m: m["b"] / m["a"])
    assert iv.estimate == 1.0 and iv.low < 1.0 < iv.high


def test_resampler_statistics_may_iterate_the_points_and_must_be_vectorised():
    samples = weighted_points()
    r = Resampler(samples)
    mean = r.interval(lambda m: sum(m[k] for k in m) / len(m))
    assert mean.estimate == pytest.approx(np.mean([np.median(v) for v in samples.values()]))
    with pytest.raises(ValueError, match="element-wise"):
        r.interval(lambda m: np.mean(m[1]))  # reduces the bootstrap axis away
    with pytest.raises(ValueError, match="element-wise"):
        r.interval(lambda m: np.atleast_1d(m[1])[:1])
    boot = r.boot(1)
    with pytest.raises(ValueError):
        boot[0] = 0.0  # shared by every statistic: read-only


# ---------------------------------------------------------------- relative difference, verdict


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_relative_difference_detects_a_five_percent_shift(seed):
    a = noisy(100, 10.0, seed)
    b = noisy(100, 10.5, seed + 100)
    slower = relative_difference(a, b)
    assert 4.5 <= slower.estimate <= 5.5
    assert slower.excludes(0.0) and not slower.excludes(5.0)
    assert verdict(slower, margin_pct=1.0) is Verdict.SLOWER
    faster = relative_difference(b, a)  # 100 * (10 / 10.5 - 1) = -4.76
    assert -5.3 <= faster.estimate <= -4.3
    assert verdict(faster, margin_pct=1.0) is Verdict.FASTER
    assert describe(faster, 1.0).startswith("faster by 4.")
    # a 5 % change is not a 10 % one
    assert verdict(slower, margin_pct=10.0) is Verdict.SAME


def test_relative_difference_does_not_flag_an_a_a_comparison():
    seeds = range(20)
    diffs = [relative_difference(noisy(100, 10.0, s), noisy(100, 10.0, s + 1000), seed=s) for s in seeds]
    assert all(verdict(d, margin_pct=1.0) is Verdict.SAME for d in diffs)
    assert all(abs(d.estimate) < 0.5 and d.half_width < 1.0 for d in diffs)
    # with no margin, about 5 % of A/A intervals exclude 0 by construction; not many more
    assert sum(d.excludes(0.0) for d in diffs) <= 3


INTERVALS = [  # (diff, margin, verdict, words)
    (Interval(-3.1, -3.8, -2.5), 1.0, Verdict.FASTER, "faster by 3.1 % (95 % CI 2.5…3.8)"),
    (Interval(0.8, 0.6, 1.0), 0.5, Verdict.SLOWER, "slower by 0.8 % (95 % CI 0.6…1.0)"),
    (Interval(-0.1, -0.3, 0.2), 1.0, Verdict.SAME, "no difference detected (-0.1 %, 95 % CI -0.3…0.2)"),
    # wholly above 0 but within the margin: not worth calling slower
    (Interval(0.8, 0.6, 1.0), 1.0, Verdict.SAME, "no difference detected (0.8 %, 95 % CI 0.6…1.0)"),
    # narrow intervals get the decimals they need; the level is the interval's
    (Interval(0.05, 0.04, 0.06, 0.9), 0.0, Verdict.SLOWER, "slower by 0.05 % (90 % CI 0.04…0.06)"),
    (Interval(-0.01, -0.04, 0.02), 0.0, Verdict.SAME, "no difference detected (-0.01 %, 95 % CI -0.04…0.02)"),
    (None, 1.0, None, "not enough samples"),
]


@pytest.mark.parametrize("diff,margin,expected,words", INTERVALS)
def test_verdict_and_describe(diff, margin, expected, words):
    assert verdict(diff, margin) is expected
    assert describe(diff, margin) == words


def test_describe_writes_no_negative_zero_and_verdict_refuses_a_negative_margin():
    assert describe(Interval(-0.04, -0.9, 0.9), 1.0) == "no difference detected (0.0 %, 95 % CI -0.9…0.9)"
    with pytest.raises(ValueError):
        verdict(Interval(0.0, -1.0, 1.0), -1.0)


# ---------------------------------------------------------------- geometric mean over points


def test_geometric_mean_ratio_over_points_of_different_scales():
    pairs = [(noisy(60, s, seed=i), noisy(60, 1.03 * s, seed=i + 50)) for i, s in enumerate([0.1, 1, 10, 100])]
    iv = geometric_mean_ratio(pairs)
    ratios = [np.median(b) / np.median(a) for a, b in pairs]
    assert iv.estimate == pytest.approx(100 * (math.exp(np.mean(np.log(ratios))) - 1))
    assert 2.5 <= iv.estimate <= 3.5
    assert iv.excludes(0.0) and not iv.excludes(3.0)
    assert iv == geometric_mean_ratio(pairs)  # same seed, same interval


def test_geometric_mean_ratio_is_not_the_arithmetic_mean_of_ratios():
    # twice as slow on one point, twice as fast on the other: no overall change (arithmetic: +25 %)
    pairs = [(noisy(50, 1.0, 0, 0.001), noisy(50, 2.0, 1, 0.001)), (noisy(50, 2.0, 2, 0.001), noisy(50, 1.0, 3, 0.001))]
    iv = geometric_mean_ratio(pairs)
    assert abs(iv.estimate) < 0.1 and not iv.excludes(0.0)


# ---------------------------------------------------------------- the stop rule and its cost


def test_half_width_pct_is_the_binomial_order_statistic_interval():
    # n = 20: P(Bin(20, 1/2) <= 5) = 0.0207 <= 0.025 < P(<= 6), so the interval is [x_(6), x_(15)]
    x = np.random.default_rng(0).permutation(np.arange(1.0, 21.0))
    assert half_width_pct(x) == pytest.approx(100 * (15 - 6) / 2 / 10.5)
    assert half_width_pct(np.arange(1.0, 21.0)) == half_width_pct(x)  # order does not matter
    # n = 10: [x_(2), x_(9)] (coverage 97.9 %; [x_(3), x_(8)] would be 89 %)
    assert half_width_pct(np.arange(1.0, 11.0)) == pytest.approx(100 * (9 - 2) / 2 / 5.5)
    assert half_width_pct(np.r_[np.zeros(9), 1.0, -1.0]) == math.inf  # median 0: never narrow enough
    assert half_width_pct(np.full(12, 3.0)) == 0.0


@pytest.mark.parametrize("level", [0.5, 0.8, 0.9, 0.95, 0.99])
def test_the_order_statistic_ranks_are_scipys_binomial_quantile(level):
    """stats computes the binomial quantile itself (no scipy on import): the same j as scipy's."""
    from scipy import stats as sps

    from lorabench.stats import _binomial_half_ppf

    for n in [*range(1, 400), *range(400, 60_000, 611)]:
        assert _binomial_half_ppf((1 - level) / 2, n) == int(sps.binom.ppf((1 - level) / 2, n, 0.5)), n


def test_importing_stats_does_not_import_scipy():
    import subprocess
    import sys

    code = "import sys, lorabench.stats as s; s.half_width_pct([1.0] * 20); print('scipy' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


# the factor stated in half_width_pct's docstring: wider at few samples, where it stays >= 95 %
@pytest.mark.parametrize("n,upper", [(10, 2.2), (20, 1.6), (50, 1.6), (200, 1.3)])
@pytest.mark.parametrize("dist", ["normal", "shifted-lognormal"])
def test_half_width_pct_agrees_with_the_bootstrap(dist, n, upper):
    factors = []
    for seed in range(30):
        x = draw(dist, n, seed)
        boot = median_interval(x, seed=seed)
        factors.append(half_width_pct(x) / (100 * boot.half_width / boot.estimate))
    assert 0.8 <= min(factors) and max(factors) <= upper
    assert 0.95 <= np.median(factors) <= 1.45


def test_half_width_pct_is_cheap():
    x = draw("shifted-lognormal", 300, seed=0)
    start = time.perf_counter()
    for _ in range(20):
        median_interval(x)
    boot = (time.perf_counter() - start) / 20
    start = time.perf_counter()
    for _ in range(200):
        half_width_pct(x)
    cheap = (time.perf_counter() - start) / 200
    assert cheap * 5 < boot


@pytest.mark.parametrize(
    "n,half_width,target,needed",
    [(100, 2.0, 1.0, 400), (100, 1.5, 1.0, 225), (10, 3.0, 1.0, 90), (100, 1.1, 1.0, 121),
     (7, 1.3, 1.0, 12), (50, 0.5, 1.0, 50), (50, 1.0, 1.0, 50)],
)
def test_samples_needed(n, half_width, target, needed):
    assert samples_needed(n, half_width, target) == needed


def test_samples_needed_refuses_nonsense_and_predicts_a_real_interval():
    with pytest.raises(ValueError):
        samples_needed(10, 1.0, 0.0)
    with pytest.raises(ValueError):
        samples_needed(0, 1.0, 0.5)
    x = draw("normal", 2000, seed=11)
    first = median_interval(x[:50])
    n = samples_needed(50, first.half_width, first.half_width / 2)
    assert n == 200
    assert 0.3 <= median_interval(x[:n]).half_width / first.half_width <= 0.75


# ---------------------------------------------------------------- rank test, Interval


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rank_test(seed):
    a = draw("shifted-lognormal", 50, seed)
    assert rank_test(a, a + 0.5) < 0.01
    assert rank_test(a, a + 0.5) == pytest.approx(rank_test(a + 0.5, a))
    assert rank_test(a, draw("shifted-lognormal", 50, seed + 100)) > 0.01


def test_rank_test_false_alarms_are_rare_and_constants_are_the_same():
    p = [rank_test(draw("normal", 40, s), draw("normal", 40, s + 500)) for s in range(40)]
    assert sum(v < 0.05 for v in p) <= 6
    assert rank_test(np.ones(20), np.ones(20)) == 1.0
    with pytest.raises(ValueError):
        rank_test(np.ones(20), np.array([]))


def test_interval_properties_and_to_dict():
    iv = Interval(12.345678, 12.2, 12.5)
    assert iv.half_width == pytest.approx(0.15)
    assert iv.excludes(12.1) and iv.excludes(12.51)
    assert not iv.excludes(12.2) and not iv.excludes(12.5)
    # three significant digits of the half-width (0.150)
    assert iv.to_dict() == {"estimate": 12.346, "low": 12.2, "high": 12.5, "level": 0.95}
    assert Interval(1234.5678, 1000.0, 1500.0).to_dict()["estimate"] == 1235.0
    assert Interval(1 / 3, 1 / 3, 1 / 3, 0.9).to_dict() == {"estimate": 0.333333, "low": 0.333333,
                                                           "high": 0.333333, "level": 0.9}
