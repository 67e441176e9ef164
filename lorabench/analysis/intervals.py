"""Intervals of statistics over a run's points: which points a statistic reads, why a statistic
has no interval, a gain in words, and what more measuring would settle.

A statistic is a function of the points' medians (``lorabench.stats.Resampler``): run once on the
observed medians it says which points it reads, so that its interval is drawn only when every one
of them kept enough samples, and otherwise says why not. Shared by the report's comparisons, the
cost model's predicted gains and residency's throughput gains.
"""

import math
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from lorabench.stats import MIN_SAMPLES, Interval, Resampler, describe, samples_needed

MARGIN_PCT = 0.0  # strategies of one (kernels, max_loras) are timed in alternating turns: drift cancels
# Backends, and auto's measurement against a prediction from another run, were timed in different
# workers: drift between them is not cancelled. At n = 0 both backends run the same base model and
# differ by up to 0.6 % on an H200 (results/confidence/backends); `lorabench compare`'s margin.
APART_MARGIN_PCT = 1.0
NO_SAMPLES = "the run kept no samples"
TOO_FEW = f"fewer than {MIN_SAMPLES} timed steps at a point"
MORE = ("more tokens/s", "fewer tokens/s")  # a throughput's words for a rise and a fall


def resampler(samples: "Mapping[int, np.ndarray] | Resampler | None") -> Resampler | None:
    """One Resampler for a run's samples (point -> step times), shared so that every point is
    bootstrapped once; None for a run that kept none."""
    if samples is None or isinstance(samples, Resampler):
        return samples
    return Resampler(samples) if len(samples) else None


class _Recorder(Mapping):
    """What a statistic reads, with the rows' medians as values: to learn which points it needs."""

    def __init__(self, medians: Mapping[Hashable, float]):
        self._m, self.read = medians, []

    def __getitem__(self, key):
        self.read.append(key)
        return self._m[key]

    def __iter__(self) -> Iterator:
        return iter(self._m)

    def __len__(self) -> int:
        return len(self._m)


def points_read(statistic: Callable, medians: Mapping[Hashable, float]) -> list:
    """The keys ``statistic`` reads, running it once on ``medians`` (KeyError: a point without one)."""
    rec = _Recorder(medians)
    statistic(rec)
    return list(dict.fromkeys(rec.read))


def interval_of(rs: Resampler | None, statistic: Callable, points) -> tuple[Interval | None, str | None]:
    """``rs.interval(statistic)`` when every point in ``points`` (those the statistic reads) has
    samples, with why not otherwise: NO_SAMPLES (points with none) or TOO_FEW."""
    points = list(points)
    if rs is None or not points:
        return None, NO_SAMPLES
    have = [p for p in points if _has(rs, p)]
    if len(have) < len(points):
        return None, NO_SAMPLES if not have else f"{len(points) - len(have)} of {len(points)} points kept no samples"
    if any(rs.n(p) < MIN_SAMPLES for p in points):
        return None, TOO_FEW
    return rs.interval(statistic), None


def _has(rs: Resampler, point) -> bool:
    try:
        rs.n(point)
    except KeyError:
        return False
    return True


def most_steps(rs: Resampler | None, points) -> int:
    """The most timed steps any of ``points`` has: what more measuring is counted from (0 without samples)."""
    return max(rs.n(p) for p in points) if rs is not None and points else 0


def as_slower(gain: Interval) -> Interval:
    """A gain (positive = faster) as ``lorabench.stats``' relative difference (positive = slower)."""
    return Interval(-gain.estimate, -gain.high, -gain.low, gain.level)


def describe_gain(gain: Interval | None, why: str | None = None, margin_pct: float = MARGIN_PCT) -> str:
    """"faster by 3.1 % (95 % CI 2.5…3.8)", "no difference detected (...)", or "no interval: why"."""
    return describe(as_slower(gain), margin_pct) if gain is not None else f"no interval: {why or NO_SAMPLES}"


def versus(gain: "Gain", margin_pct: float = MARGIN_PCT) -> str:
    """A step time's gain in words: its interval's verdict ("faster by 3.1 % (95 % CI 2.5…3.8)",
    "no difference detected (...)"), or its medians' gain and why there is no interval."""
    if gain.interval is not None:
        return describe_gain(gain.interval, margin_pct=margin_pct)
    return f"{gain.pct:+.1f} % by the medians (no interval: {gain.why})"


def describe_more(gain: Interval | None, why: str | None = None, margin_pct: float = 0.0) -> str:
    """A throughput gain (%, positive: more tokens/s) in words: "more tokens/s by 6.6 % (95 % CI
    3.7…10.1)", "no difference detected (...)", or "no interval: why"."""
    return describe(as_slower(gain), margin_pct, MORE) if gain is not None else f"no interval: {why or NO_SAMPLES}"


def _nice(n: int) -> int:
    """Up to two significant digits, rounded up: 437 -> 440, 1234 -> 1300."""
    if n < 100:
        return int(n)
    step = 10 ** (len(str(int(n))) - 2)
    return int(math.ceil(n / step) * step)


def steps_hint(gain: Interval, n: int, pays_pct: float) -> str | None:
    """What more measuring would settle whether ``gain`` (%, positive = faster) clears
    ``pays_pct``: the steps per point at which its interval would lie on one side of it (the
    half-width shrinks as 1/sqrt(steps)); None when it already does."""
    if gain.low >= pays_pct or gain.high < pays_pct:
        return None
    if gain.estimate >= pays_pct:  # the estimate clears it, the low end does not
        half, target = gain.estimate - gain.low, gain.estimate - pays_pct
    else:  # the estimate does not, the high end does
        half, target = gain.high - gain.estimate, pays_pct - gain.estimate
    if target <= 0:
        return f"the estimate sits on the {pays_pct:g} % line: no number of steps per point would settle it"
    need = _nice(samples_needed(n, half, target))
    return f"about {need} steps per point would settle it: --iters {need}"


@dataclass(frozen=True)
class Gain:
    """One option against another, in % (positive: the option is the better): by the medians, and
    the 95 % interval when the samples give one (else ``why`` there is none), with the timed steps
    per point behind it (what more measuring is counted from)."""

    pct: float
    interval: Interval | None = None
    why: str | None = None
    steps: int = 0

    def clears(self, pays_pct: float) -> bool:
        """At least ``pays_pct``: the interval's low end, or the medians' gain without an interval."""
        return (self.interval.low if self.interval is not None else self.pct) >= pays_pct

    def open(self, pays_pct: float) -> bool:
        """The interval reaches past ``pays_pct`` without clearing it: more measuring could settle it."""
        return self.interval is not None and self.interval.low < pays_pct <= self.interval.high

    def settle(self, pays_pct: float) -> str | None:
        """The steps per point that would settle whether it clears ``pays_pct`` (None: it is settled)."""
        return steps_hint(self.interval, self.steps, pays_pct) if self.interval is not None else None
