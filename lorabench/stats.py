"""The statistics every comparison in lorabench uses: the interval of a point's median step time,
the interval of a relative difference between configurations, a rank test, and what more
measuring would take.

Step times are skewed and carry outliers (a preemption, a clock change), so every point is
summarised by its median and every interval is a percentile bootstrap of medians: it assumes no
distribution, and a statistic composed from several points' medians (a ratio, a workload's
weighted sum, a geometric mean) gets its interval the same way, by resampling every point
independently. Numpy only, and scipy for the rank test and quantile intervals alone (imported there: scipy.stats takes
about a second to import, which every process that imports this module would otherwise pay): the
sweep's workers (its stop rule), the sweep and the analysis all use it.
"""

import math
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from functools import lru_cache

import numpy as np

LEVEL = 0.95  # every interval lorabench reports
N_BOOT = 2000  # bootstrap resamples
MIN_SAMPLES = 10  # below this, no interval (None)

_CHUNK_ELEMENTS = 1 << 21  # resampled values held at once: bounds memory for long points


def _check_level(level: float) -> None:
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must lie strictly between 0 and 1, not {level}")


def _samples(x) -> np.ndarray:
    """A flat float array; non-finite step times are a bug upstream, not something to average."""
    a = np.asarray(x, dtype=float).ravel()
    if not np.all(np.isfinite(a)):
        raise ValueError("samples must be finite")
    return a


def _round(value: float, decimals: int) -> float:
    return round(float(value), decimals) if math.isfinite(value) else float(value)


@dataclass(frozen=True)
class Interval:
    """A statistic with its confidence interval; ``estimate`` is the statistic on the observed
    samples, so it need not sit at the interval's centre."""

    estimate: float
    low: float
    high: float
    level: float = LEVEL

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    def excludes(self, value: float) -> bool:
        """True when ``value`` lies outside ``[low, high]``: the data rule it out at ``level``."""
        return value < self.low or value > self.high

    def to_dict(self) -> dict:
        """For JSON: three significant digits of the half-width, since digits below it are noise."""
        hw = self.half_width
        decimals = max(0, 2 - math.floor(math.log10(hw))) if math.isfinite(hw) and hw > 0 else None

        def r(v: float) -> float:
            return float(f"{v:.6g}") if decimals is None else _round(v, decimals)

        return {"estimate": r(self.estimate), "low": r(self.low), "high": r(self.high),
                "level": round(self.level, 4)}


class _TooFew(Exception):
    """A statistic read a point with fewer than MIN_SAMPLES samples: its interval is None."""


class _Lazy(Mapping):
    """What a statistic sees: a point's value is fetched (and its samples checked) only when the
    statistic reads it, so a statistic over a few points never bootstraps the others."""

    def __init__(self, keys: Sequence[Hashable], fetch: Callable[[Hashable], np.ndarray | float]):
        self._keys = keys
        self._fetch = fetch

    def __getitem__(self, key):
        return self._fetch(key)  # KeyError for a key never measured, _TooFew for a short one

    def __iter__(self) -> Iterator:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def _boot_medians(x: np.ndarray, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """Medians of ``n_boot`` resamples of ``x`` with replacement, drawn in chunks to bound memory."""
    n = len(x)
    chunk = max(1, _CHUNK_ELEMENTS // n)
    out = np.empty(n_boot)
    for start in range(0, n_boot, chunk):
        stop = min(n_boot, start + chunk)
        idx = rng.integers(0, n, size=(stop - start, n), dtype=np.int32 if n < 2**31 else np.int64)
        out[start:stop] = np.median(x[idx], axis=1)
    return out


class Resampler:
    """Bootstrap distributions of the medians of many independent sample sets (one per measured
    point), so that any statistic composed from several points' medians (a ratio, a workload's
    weighted sum over active counts, a mean over concurrencies) gets a percentile interval:
    every point is resampled independently, the same B draws are reused for every statistic.

    A point's draws depend only on ``seed`` and the point's position in ``samples``, not on the
    order in which statistics read the points, so results are reproducible."""

    def __init__(self, samples: Mapping[Hashable, np.ndarray], n_boot: int = N_BOOT, seed: int = 0):
        if n_boot < 1:
            raise ValueError(f"n_boot must be positive, not {n_boot}")
        self._samples = {k: _samples(v) for k, v in samples.items()}
        self._index = {k: i for i, k in enumerate(self._samples)}
        self._keys = tuple(self._samples)
        self.n_boot = n_boot
        self.seed = seed
        self._medians: dict[Hashable, float] = {}
        self._boot: dict[Hashable, np.ndarray] = {}

    def n(self, key) -> int:
        """How many samples the point has."""
        return len(self._samples[key])

    def median(self, key) -> float:
        """The observed median (nan for a point without samples)."""
        if key not in self._medians:
            x = self._samples[key]
            self._medians[key] = float(np.median(x)) if len(x) else math.nan
        return self._medians[key]

    def boot(self, key) -> np.ndarray:
        """The point's ``n_boot`` bootstrap medians, computed on first use and cached."""
        if key not in self._boot:
            x = self._samples[key]
            if not len(x):
                raise ValueError(f"no samples for {key!r}: nothing to resample")
            rng = np.random.default_rng([self.seed, self._index[key]])
            b = _boot_medians(x, self.n_boot, rng)
            b.flags.writeable = False  # shared by every statistic: nobody may alter it
            self._boot[key] = b
        return self._boot[key]

    def _checked(self, key) -> None:
        if self.n(key) < MIN_SAMPLES:
            raise _TooFew(key)

    def _observed(self, key) -> float:
        self._checked(key)
        return self.median(key)

    def _resampled(self, key) -> np.ndarray:
        self._checked(key)
        return self.boot(key)

    def interval(self, statistic: Callable[[Mapping[Hashable, np.ndarray | float]], np.ndarray | float],
                 level: float = LEVEL) -> Interval | None:
        """``statistic`` maps point keys to medians: called once with the observed medians (floats)
        for the estimate, once with the bootstrap medians (arrays of ``n_boot``, so it must be
        written with numpy operations) for the percentile interval. None when a point it reads
        has fewer than MIN_SAMPLES samples."""
        _check_level(level)
        try:
            observed = np.asarray(statistic(_Lazy(self._keys, self._observed)), dtype=float)
            values = np.asarray(statistic(_Lazy(self._keys, self._resampled)), dtype=float)
        except _TooFew:
            return None
        if observed.shape != () or values.shape != (self.n_boot,):
            # a reduction (np.mean, sum over the array) would otherwise pass as a constant
            raise ValueError(f"statistic gave shapes {observed.shape} and {values.shape}, not () and "
                             f"({self.n_boot},): it must work element-wise on the medians")
        tail = (1 - level) / 2 * 100
        low, high = np.percentile(values, [tail, 100 - tail])
        return Interval(float(observed), float(low), float(high), level)

    def median_interval(self, key, level: float = LEVEL) -> Interval | None:
        """The interval of one point's median."""
        return self.interval(lambda m: m[key], level)


def median_interval(x: np.ndarray, level: float = LEVEL, n_boot: int = N_BOOT,
                    seed: int = 0) -> Interval | None:
    """The percentile-bootstrap interval of the median of one point's samples."""
    return Resampler({0: x}, n_boot, seed).median_interval(0, level)


@lru_cache(maxsize=4096)
def _order_ranks(n: int, level: float) -> tuple[int, int]:
    """0-based ranks (j, n-1-j) of the distribution-free interval of the median: the number of
    samples below the true median is Binomial(n, 1/2), so [x_(j), x_(n-1-j)] covers it with
    probability 1 - 2 P(B < j+1) >= level."""
    j = _binomial_half_ppf((1 - level) / 2, n)  # smallest j with P(B <= j) >= (1-level)/2
    j = min(max(j - 1, 0), (n - 1) // 2)  # 0-based: x_(j+1) in 1-based order
    return j, n - 1 - j


def _binomial_half_ppf(q: float, n: int) -> int:
    """The smallest j with P(B <= j) >= q for B ~ Binomial(n, 1/2), q < 1/2 (scipy's
    ``binom.ppf(q, n, 0.5)``, the same on every n and level tests/test_stats.py tries): the CDF
    summed in log space, C(n, i) as a running product, over the lower half."""
    i = np.arange(1, n // 2 + 1)
    log_comb = np.concatenate([[0.0], np.cumsum(np.log((n - i + 1) / i))])
    cdf = np.cumsum(np.exp(log_comb - n * math.log(2)))
    return int(np.searchsorted(cdf, q))


def half_width_pct(x: np.ndarray, level: float = LEVEL) -> float | None:
    """100 * half-width / median: the stop rule of ``--ci-target``. A sweep calls it after every
    round of ~10 steps, so it uses the distribution-free order-statistic (binomial) interval of the
    median (a partial sort) instead of the bootstrap. It never covers less than ``level``, so it is
    the wider of the two on few samples: 0.8 to 2.2 times ``median_interval``'s half-width at 10
    samples (where the bootstrap covers about 92 % for 95 %), 0.8 to 1.6 times from 20 samples,
    about 1.05 times from 200 (tests/test_stats.py). None below MIN_SAMPLES, inf for a median of 0."""
    _check_level(level)
    a = _samples(x)
    n = len(a)
    if n < MIN_SAMPLES:
        return None
    lo, hi = _order_ranks(n, level)
    mid = ((n - 1) // 2, n // 2)
    part = np.partition(a, sorted({lo, hi, *mid}))
    median = (part[mid[0]] + part[mid[1]]) / 2
    half = (part[hi] - part[lo]) / 2
    if median == 0:
        return math.inf
    return float(100 * half / abs(median))


def ratio_pct(a: Hashable, b: Hashable) -> Callable:
    """The statistic ``100 * (median(b) / median(a) - 1)`` of two keys of a Resampler, in
    percent: positive means b is slower (for step times)."""
    return lambda m: 100 * (m[b] / m[a] - 1)


def geomean_ratio_pct(pairs: Sequence[tuple[Hashable, Hashable]]) -> Callable:
    """The statistic ``100 * (geomean over pairs of median(b) / median(a) - 1)`` over (a, b) keys
    of a Resampler: the geometric mean weighs a 10 % gain on a fast point like one on a slow one."""
    pairs = list(pairs)
    return lambda m: 100 * (np.exp(sum(np.log(m[b]) - np.log(m[a]) for a, b in pairs) / len(pairs)) - 1)


def relative_difference(a: np.ndarray, b: np.ndarray, level: float = LEVEL, n_boot: int = N_BOOT,
                        seed: int = 0) -> Interval | None:
    """``ratio_pct`` of two sample sets, with its interval; ``a`` and ``b`` are resampled
    independently (not paired)."""
    return Resampler({"a": a, "b": b}, n_boot, seed).interval(ratio_pct("a", "b"), level)


def rank_test(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sided Mann-Whitney U p-value, for unpaired samples: does one tend to be larger?
    1.0 when every value in both is the same (nothing to tell apart)."""
    a, b = _samples(a), _samples(b)
    if not len(a) or not len(b):
        raise ValueError("rank_test needs samples on both sides")
    both = np.concatenate([a, b])
    if np.all(both == both[0]):
        return 1.0
    from scipy import stats as _sps  # here alone: see the module's docstring

    return float(_sps.mannwhitneyu(a, b, alternative="two-sided").pvalue)


def geometric_mean_ratio(pairs: Sequence[tuple[np.ndarray, np.ndarray]], level: float = LEVEL,
                         n_boot: int = N_BOOT, seed: int = 0) -> Interval | None:
    """The overall change over many matched points, ``100 * (geomean_i median(b_i)/median(a_i) - 1)``
    in percent (positive = b slower): the geometric mean weighs a 10 % gain on a fast point like
    one on a slow point. Every point's a and b are resampled independently. None with no pairs
    or when any side has fewer than MIN_SAMPLES."""
    if not pairs:
        return None
    samples = {}
    for i, (a, b) in enumerate(pairs):
        samples[(i, "a")] = a
        samples[(i, "b")] = b
    statistic = geomean_ratio_pct([((i, "a"), (i, "b")) for i in range(len(pairs))])
    return Resampler(samples, n_boot, seed).interval(statistic, level)


class Verdict(str, Enum):
    FASTER = "faster"
    SLOWER = "slower"
    SAME = "no difference detected"


def verdict(diff_pct: Interval | None, margin_pct: float) -> Verdict | None:
    """``diff_pct`` as ``relative_difference`` gives it (positive = slower). A change counts only
    when the whole interval lies beyond the margin, so noise and changes too small to matter both
    read as SAME. None when there is no interval."""
    if margin_pct < 0:
        raise ValueError(f"margin_pct must not be negative, not {margin_pct}")
    if diff_pct is None:
        return None
    if diff_pct.high < -margin_pct:
        return Verdict.FASTER
    if diff_pct.low > margin_pct:
        return Verdict.SLOWER
    return Verdict.SAME


def _decimals(half_width: float) -> int:
    """One decimal, more when the interval is narrower than that shows (at most three)."""
    if not math.isfinite(half_width) or half_width <= 0:
        return 1
    return min(3, max(1, -math.floor(math.log10(half_width))))


def _pct(value: float, decimals: int) -> str:
    text = f"{value:.{decimals}f}"
    return text[1:] if float(text) == 0 and text.startswith("-") else text  # no "-0.0"


def describe(diff_pct: Interval | None, margin_pct: float, words: tuple[str, str] = ("faster", "slower")) -> str:
    """The verdict in a user's words: "faster by 3.1 % (95 % CI 2.5…3.8)" (magnitudes: the step
    time fell), "slower by 0.8 % (95 % CI 0.6…1.0)", "no difference detected (-0.1 %, 95 % CI
    -0.3…0.2)" (signed), or "not enough samples". ``words``: what a fall and a rise are called
    (a throughput's: ("more tokens/s", "fewer tokens/s"), its ``diff_pct`` negated)."""
    v = verdict(diff_pct, margin_pct)
    if v is None:
        return "not enough samples"
    d = _decimals(diff_pct.half_width)
    ci = f"{diff_pct.level * 100:g} % CI"
    if v is Verdict.FASTER:
        return (f"{words[0]} by {_pct(-diff_pct.estimate, d)} % "
                f"({ci} {_pct(-diff_pct.high, d)}…{_pct(-diff_pct.low, d)})")
    if v is Verdict.SLOWER:
        return (f"{words[1]} by {_pct(diff_pct.estimate, d)} % "
                f"({ci} {_pct(diff_pct.low, d)}…{_pct(diff_pct.high, d)})")
    return (f"{v.value} ({_pct(diff_pct.estimate, d)} %, "
            f"{ci} {_pct(diff_pct.low, d)}…{_pct(diff_pct.high, d)})")


def samples_needed(n: int, half_width: float, target_half_width: float) -> int:
    """How many samples in all an interval of ``half_width`` from ``n`` samples would need to
    narrow to ``target_half_width``, since the half-width shrinks as 1/sqrt(n); never fewer than
    ``n``."""
    if n < 1:
        raise ValueError(f"n must be positive, not {n}")
    if target_half_width <= 0:
        raise ValueError(f"target_half_width must be positive, not {target_half_width}")
    if half_width <= target_half_width:
        return n
    needed = n * (half_width / target_half_width) ** 2
    return max(n, math.ceil(needed * (1 - 1e-12)))  # 400.00000000001 is 400, not 401


@lru_cache(maxsize=None)
def quantile_interval_samples(q: float, level: float = LEVEL) -> int:
    """The fewest samples for which ``quantile_interval`` gives the ``q`` quantile an interval
    (at 95 %: p90 36, p99 368)."""
    _check_level(level)
    if not 0 < q < 1:
        raise ValueError(f"quantile {q}: it must lie strictly between 0 and 1")
    n = MIN_SAMPLES
    while _order_statistics(n, q, level) is None:
        n += 1
    return n


def _order_statistics(n: int, q: float, level: float) -> tuple[int, int] | None:
    """The 0-based order statistics (lo, hi) of n samples that bound the ``q`` quantile at
    ``level`` (``quantile_interval``), or None where they would reach past the samples."""
    from scipy import stats as _sps  # here alone: see the module's docstring

    tail = (1 - level) / 2
    # B, the samples below the quantile, is Binomial(n, q); x_(i) is 0-based. x_(lo) lies above the
    # quantile only if B <= lo, x_(hi) below it only if B >= hi + 1: each has probability <= tail.
    lo = int(_sps.binom.ppf(tail, n, q)) - 1
    hi = int(_sps.binom.ppf(1 - tail, n, q))
    return None if lo < 0 or hi > n - 1 else (lo, hi)


def quantile_interval(x: np.ndarray, q: float, level: float = LEVEL) -> Interval | None:
    """The ``q`` quantile of samples (numpy's linear interpolation) with its distribution-free
    interval: the number of samples below the true quantile is Binomial(n, q), so the order
    statistics [x_(l), x_(u)] at that law's (1 - level)/2 and (1 + level)/2 points cover it with
    probability >= level. None when n is too small for it (the interval would reach past the
    smallest or largest sample: p90 needs 36 samples at 95 %, p99 368)."""
    _check_level(level)
    if not 0 < q < 1:
        raise ValueError(f"quantile {q}: it must lie strictly between 0 and 1")
    a = np.sort(_samples(x))
    n = len(a)
    bounds = None if n < MIN_SAMPLES else _order_statistics(n, q, level)
    if bounds is None:
        return None
    return Interval(float(np.quantile(a, q)), float(a[bounds[0]]), float(a[bounds[1]]), level)
