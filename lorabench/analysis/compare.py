"""Which strategies are compared with which, over which points: the one table that both
``lorabench report`` (its recommendation among the measured strategies) and ``lorabench recommend``
(strategy auto) build on, so that on the same run and workload they cannot tell different stories.

Per (kernels, max_loras, workload), a strategy *covers* a concurrency c when its expected step
``E[t | c] = sum_n P(n | c) t(c, n)`` is defined: every active count n the workload produces at c
has a successful fixed point (a failed or missing point leaves c uncovered). ``max``, the
baseline, covers some of the concurrencies the run planned: those are the comparison's *grid*.
Every other strategy is compared with max only over the concurrencies both cover, which are the
same (c, n) fixed points, since P(n | c) is the workload's:

- ``complete``: it covers the whole grid; its gain is over the grid, the same concurrencies for
  every complete strategy, so complete strategies can be ranked against each other;
- ``partial``: it covers part of the grid; its gain is over that part only, and it is never
  proposed over max (it could look faster only because it lacks the points it would lose on);
- ``not comparable``: it shares no concurrency with max, or max covers none.

Concurrencies a strategy covers and max does not are listed (``extra``), never compared.

Same GPU: per (kernels, max_loras) only rows measured on max's GPU are compared
(``lorabench.analysis.points.same_gpu``); a strategy's rows on another GPU count as missing, so it
is partial or not comparable, and says so.

Intervals: with the run's samples, every gain over max has a 95 % percentile-bootstrap interval
(``lorabench.stats.Resampler``: each fixed point's median resampled independently, the same
composition of medians as the gain). Within one (kernels, max_loras) the sweep times the
strategies in alternating turns on one GPU, so drift cancels and the verdict's margin is 0. A run
that kept no samples (runs from before) has no interval, and says so.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from lorabench.analysis.intervals import (
    APART_MARGIN_PCT,
    MARGIN_PCT,
    NO_SAMPLES,
    Gain,
    interval_of,
    most_steps,
    resampler,
    versus,
)
from lorabench.analysis.points import expected_steps, same_gpu, short_uuid
from lorabench.config.strategies import BASELINE, report_order
from lorabench.stats import Interval, Resampler

COMPLETE, PARTIAL, NOT_COMPARABLE = "complete", "partial", "not comparable"


def c_list(cs) -> str:
    """``c = 1, 2, 4`` (or ``no concurrency``)."""
    cs = list(cs)
    return "c = " + ", ".join(str(c) for c in cs) if cs else "no concurrency"


@dataclass(frozen=True)
class Cover:
    """One strategy against max: where it has an expected step, and what it gains where both do."""

    strategy: str
    by_c: dict[int, float]  # its expected step (ms) at every concurrency it covers
    grid: tuple[int, ...]  # the concurrencies max covers
    planned: tuple[int, ...]  # the concurrencies the run planned for these (kernels, max_loras)
    terms: dict[int, tuple | None] = field(default_factory=dict)  # c -> ((point, P(n | c)), ...) its E[t | c] reads
    elsewhere: tuple = ()  # the other GPUs (uuids, None for unknown) its rows left out were measured on

    @property
    def compared_over(self) -> tuple[int, ...]:
        return tuple(c for c in self.grid if c in self.by_c)

    @property
    def lacks(self) -> tuple[int, ...]:
        """Grid concurrencies it does not cover: not comparable there."""
        return tuple(c for c in self.grid if c not in self.by_c)

    @property
    def extra(self) -> tuple[int, ...]:
        """Concurrencies it covers and max does not: never compared."""
        return tuple(sorted(c for c in self.by_c if c not in self.grid))

    @property
    def status(self) -> str:
        if not self.compared_over:
            return NOT_COMPARABLE
        return COMPLETE if not self.lacks else PARTIAL

    @property
    def comparable(self) -> bool:
        return self.status != NOT_COMPARABLE

    def mean_ms(self) -> float | None:
        """Its expected step averaged over the concurrencies it is compared over."""
        over = self.compared_over
        return float(np.mean([self.by_c[c] for c in over])) if over else None

    def text(self) -> str:
        """``pow2: 3 of 4 concurrencies; compared over c = 1, 2, 4``."""
        have = len(set(self.by_c) & set(self.planned))
        out = f"{self.strategy}: {have} of {len(self.planned)} concurrencies"
        if self.comparable:
            out += f"; compared over {c_list(self.compared_over)}"
        if self.elsewhere:
            out += f"; {self.elsewhere_text()}"
        return out

    def elsewhere_text(self) -> str:
        """``measured on another GPU (GPU-3f2a9c1e…): not compared``."""
        return (f"measured on another GPU ({', '.join(short_uuid(u) for u in self.elsewhere)}): "
                f"{'not compared' if not self.by_c else 'those points not compared'}")


@dataclass(frozen=True)
class Comparison:
    """Every strategy of one (kernels, max_loras) under one workload, against max."""

    kernels: str
    max_loras: int
    workload: str
    planned: tuple[int, ...]  # the concurrencies planned (from the run's plan) or, without one, seen in its rows
    covers: dict[str, Cover] = field(default_factory=dict)  # every strategy of the run here, max included, report order
    gpu_uuid: str | None = None  # the GPU every point compared here was measured on (max's); None: unknown or CPU
    samples: Resampler | None = field(default=None, repr=False, compare=False)  # the run's, None when it kept none
    interleaved: bool = True  # every point timed with all the strategies in alternating turns (not: resumed points)
    _intervals: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # cache

    @property
    def has_max(self) -> bool:
        return BASELINE in self.covers

    @property
    def grid(self) -> tuple[int, ...]:
        """The concurrencies max covers: every gain is over (part of) these."""
        return tuple(sorted(self.covers[BASELINE].by_c)) if self.has_max else ()

    @property
    def complete(self) -> bool:
        """Every strategy covers every planned concurrency: nothing to qualify."""
        return all(set(self.planned) <= set(c.by_c) for c in self.covers.values())

    def max_ms(self, over) -> float | None:
        return float(np.mean([self.covers[BASELINE].by_c[c] for c in over])) if self.has_max and over else None

    def gain(self, strategy: str) -> float | None:
        """1 - its expected step / max's, both averaged over the concurrencies both cover; None
        when not comparable."""
        cv = self.covers.get(strategy)
        if cv is None or not cv.comparable:
            return None
        return 1 - cv.mean_ms() / self.max_ms(cv.compared_over)

    def _gain_statistic(self, strategy: str) -> tuple[Callable, list] | None:
        """The gain (%) as a function of the points' medians, and the points it reads; None when
        not comparable or a point has no index."""
        cv = self.covers.get(strategy)
        if cv is None or not cv.comparable or not self.has_max:
            return None
        over = cv.compared_over
        mine, base = [cv.terms.get(c) for c in over], [self.covers[BASELINE].terms.get(c) for c in over]
        if any(t is None for t in mine + base):
            return None

        def mean(m, terms):
            return sum(sum(p * m[pt] for pt, p in t) for t in terms) / len(terms)

        def statistic(m):
            return 100 * (1 - mean(m, mine) / mean(m, base))

        return statistic, list(dict.fromkeys(pt for t in mine + base for pt, _ in t))

    def gain_interval(self, strategy: str) -> Interval | None:
        """The 95 % interval of ``gain`` in percent (positive = faster than max), from the
        samples; None when not comparable or without samples (``interval_why`` says why)."""
        return self._interval(strategy)[0]

    def interval_why(self, strategy: str) -> str | None:
        """Why a comparable strategy's gain has no interval (NO_SAMPLES, TOO_FEW), or None."""
        return self._interval(strategy)[1]

    def _interval(self, strategy: str) -> tuple[Interval | None, str | None]:
        if strategy not in self._intervals:
            stat = self._gain_statistic(strategy)
            if stat is None:
                cv = self.covers.get(strategy)
                self._intervals[strategy] = (None, NO_SAMPLES if cv is not None and cv.comparable else NOT_COMPARABLE)
            else:
                self._intervals[strategy] = interval_of(self.samples, *stat)
        return self._intervals[strategy]

    def steps(self, strategy: str) -> int:
        """Timed steps per point of the points a gain reads (the most of them): what more
        measuring is counted from."""
        stat = self._gain_statistic(strategy)
        return most_steps(self.samples, stat[1]) if stat else 0

    def versus_max(self, strategy: str) -> str:
        """The gain in words: "faster by 3.1 % (95 % CI 2.5…3.8)", "no difference detected
        (...)", or, without samples, the medians' gain and "no interval: the run kept no samples"."""
        g = self.gain(strategy)
        if g is None:
            return NOT_COMPARABLE
        iv, why = self._interval(strategy)
        return versus(Gain(100 * g, iv, why), self.margin_pct)

    @property
    def margin_pct(self) -> float:
        """0 when the strategies were timed in alternating turns at every point; otherwise (a
        resumed point timed alone) the margin of comparisons across workers."""
        return MARGIN_PCT if self.interleaved else APART_MARGIN_PCT

    def status(self, strategy: str) -> str:
        cv = self.covers.get(strategy)
        return NOT_COMPARABLE if cv is None else cv.status

    def candidates(self) -> list[str]:
        """Strategies that may be ranked and proposed: those covering the whole grid (max included)."""
        return [s for s, cv in self.covers.items() if cv.status == COMPLETE]

    def why_not_comparable(self) -> str:
        """Why nothing here can be compared with max (when the grid is empty)."""
        if not self.has_max:
            return f"this run has no {BASELINE} (the baseline) for {self.kernels}, max_loras {self.max_loras}"
        return (f"{BASELINE} (the baseline) has no concurrency with every fixed point the workload needs "
                f"({self.covers[BASELINE].text()})")

    def to_dict(self) -> dict:
        """JSON: the grid and, per strategy, its coverage, what it is compared over and its gain."""
        out = {"complete": self.complete, "planned_concurrency": list(self.planned), "compared_over": list(self.grid),
               "gpu_uuid": self.gpu_uuid, "strategies": {}}
        for s, cv in self.covers.items():
            g = self.gain(s)
            iv = self.gain_interval(s) if s != BASELINE else None
            out["strategies"][s] = {
                "status": cv.status, "coverage": cv.text(), "compared_over": list(cv.compared_over),
                "lacks": list(cv.lacks), "extra": list(cv.extra), "gain_over_max_pct": None if g is None else round(100 * g, 2),
                "gain_over_max_ci_pct": None if iv is None else iv.to_dict(),
                "versus_max": None if s == BASELINE or g is None else self.versus_max(s),
                "measured_elsewhere": list(cv.elsewhere)}
        return out

    def means(self) -> dict[str, float]:
        """Each strategy's expected step averaged over one set of concurrencies, for plotting them
        side by side: max's grid and the strategies covering it; without max, the planned
        concurrencies and the strategies covering all of them."""
        if self.has_max:
            return {s: self.covers[s].mean_ms() for s in self.candidates()}
        return {s: float(np.mean([cv.by_c[c] for c in self.planned])) for s, cv in self.covers.items()
                if self.planned and set(self.planned) <= set(cv.by_c)}


def compare(df: pd.DataFrame, workloads: list[str] | None = None,
            planned: dict[tuple[str, int, str], tuple[int, ...]] | None = None,
            exp: pd.DataFrame | None = None,
            samples: "Mapping[int, np.ndarray] | Resampler | None" = None) -> list[Comparison]:
    """One Comparison per (kernels, max_loras, workload) of the run. ``workloads`` as in
    ``expected_steps``; ``planned``: (kernels, max_loras, strategy) -> the concurrencies the run
    planned for it (``lorabench.storage.runs.Coverage.planned``), so that a configuration or a
    concurrency with no row at all (a sweep stopped before it) still counts; without it, what the
    rows (ok or failed) show. ``exp``: ``expected_steps(same_gpu(df)[0], workloads)`` when the
    caller has it. ``samples``: the run's (``lorabench.analysis.points.run_samples``), or a
    Resampler over them, for the gains' intervals. (``lorabench.analysis.view.RunView.comparisons``
    is the same over a run read once.)"""
    kept, gpus = same_gpu(df)
    exp = expected_steps(kept, workloads) if exp is None else exp
    return comparisons(df, kept, gpus, exp, workloads, planned, resampler(samples))


def comparisons(rows: pd.DataFrame, kept: pd.DataFrame, gpus: dict, exp: pd.DataFrame, workloads: list[str] | None,
                planned: dict | None, rs: Resampler | None) -> list[Comparison]:
    """``compare`` from its parts: every row, the rows kept by ``same_gpu`` and its GPUs, the kept
    rows' expected steps."""
    names = list(workloads) if workloads else sorted(exp.workload.unique()) if len(exp) else []
    if not names:
        return []
    exp = exp[exp.expected_ms.notna()]
    conc: dict[tuple[str, int], set[int]] = {}
    strats: dict[tuple[str, int], set[str]] = {}
    decode = rows[rows["mode"] != "prefill"] if "mode" in rows else rows  # a prefill point's requests are no concurrency
    for (k, m, s), g in decode.dropna(subset=["concurrency"]).groupby(["kernels", "max_loras", "strategy"]):
        conc.setdefault((k, int(m)), set()).update(int(c) for c in g.concurrency)
        strats.setdefault((k, int(m)), set()).add(s)
    for (k, m, s), cs in (planned or {}).items():
        conc.setdefault((k, int(m)), set()).update(int(c) for c in cs)
        strats.setdefault((k, int(m)), set()).add(s)
    out = []
    for (k, m) in sorted(conc):
        plan = tuple(sorted(conc[(k, m)]))
        for w in names:
            sub = exp[(exp.kernels == k) & (exp.max_loras == m) & (exp.workload == w)]
            by_s = {s: {int(c): float(v) for c, v in zip(g.concurrency, g.expected_ms)} for s, g in sub.groupby("strategy")}
            terms = ({s: dict(zip(g.concurrency.astype(int), g.terms)) for s, g in sub.groupby("strategy")}
                     if "terms" in sub else {})
            grid = tuple(sorted(by_s.get(BASELINE, {})))
            gpu = gpus.get((k, m), {"gpu_uuid": None, "elsewhere": {}})
            covers = {s: Cover(s, by_s.get(s, {}), grid, plan, terms.get(s, {}), tuple(gpu["elsewhere"].get(s, ())))
                      for s in sorted(strats[(k, m)], key=report_order)}
            out.append(Comparison(k, m, w, plan, covers, gpu["gpu_uuid"], rs, interleaved(kept, k, m)))
    return out


def interleaved(df: pd.DataFrame, kernels: str, max_loras: int) -> bool:
    """Every ok row of (kernels, max_loras) was timed together with every strategy that has ok
    rows there (its ``arms``). Rows without ``arms`` (runs from before interleaving) kept no
    samples, so no interval is drawn from them."""
    rows = df[(df.status == "ok") & (df.kernels == kernels) & (df.max_loras == max_loras)]
    if "arms" not in rows or rows.arms.isna().all():
        return True
    everyone = set(rows.strategy)
    return all(isinstance(a, str) and everyone <= set(a.split(",")) for a in rows.arms)
