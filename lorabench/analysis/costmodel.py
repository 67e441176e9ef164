"""What a capture set would cost, from what a sweep measured: the one model of a step's cost that
strategy auto (``lorabench.analysis.optimise``), its search (``lorabench.analysis.search``) and
residency (``lorabench.analysis.residency``) price with.

Step time ``t(c, n, g)``: the median step at concurrency c with n active adapters on a graph
launched with g slots (taken as never decreasing in g: where noise says a larger grid was
faster, the larger grid gets the smaller grid's time). Configurations that failed their
correctness check are left out. Sweeps measure it at the launch counts their strategies dispatched to
(``graph_loras``: ``max`` gives g = max_loras, ``dense`` g = n, ``pow2`` the next power of
two). Where a launch count was not measured for (c, n) it is interpolated linearly in g between
the measured counts around it, or, outside them, extrapolated with the slope in g fitted over the
same concurrency's other active counts; every value says which (``source``).

Every price is a function of the fixed points' medians (``StepTimes``): at the observed medians it
is the model's prediction; at a ``lorabench.stats.Resampler``'s bootstrap medians (arrays of
draws) the same arithmetic gives that prediction's interval (``Pricing.gain``). A capture set's
price under a workload (``Pricing``): the expected step ``E(C) = mean_c sum_n P(n | c)
t(c, n, up_C(n))``, with ``up_C(n)`` the smallest count in C >= n (the no-LoRA graph at n = 0;
past the largest capture size a step runs eagerly with launch count n), the mean over the
concurrencies weighted as the workload's steps are.

Graph costs: graph memory and capture time of each measured capture set, as a function of its
LoRA graph count (``GraphCost``: exact at the measured sets, linear between and beyond them), so
any set's cost follows from its graph count.
"""

import bisect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from lorabench.analysis.intervals import Gain, interval_of, most_steps, points_read
from lorabench.analysis.points import not_found_wrong, ok_points
from lorabench.config.strategies import choose_launch
from lorabench.stats import Resampler

MEASURED, INTERPOLATED, EXTRAPOLATED = "measured", "interpolated", "extrapolated"


def lora_graphs(counts: list[int], capture_sizes: list[int], max_loras: int) -> int:
    """LoRA graphs the dispatcher captures for a set: per size b, the distinct launch counts
    that some n in 1..min(b, max_loras) rounds up to (only reachable keys are captured)."""
    return sum(len({choose_launch(n, counts) for n in range(1, min(b, max_loras) + 1)}) for b in capture_sizes)


class GraphCost:
    """A graph cost (memory or capture time) as a function of the LoRA graph count: the
    piecewise-linear curve through the measured sets, exact at each of them, continued with the
    nearest segment's slope outside them. More graphs never cost less, so a value that noise
    puts below a smaller set's is raised to it. One measured set gives a cost per graph only."""

    def __init__(self, graphs: list[int], values: list[float]):
        by_g: dict[int, list[float]] = {}
        for g, v in zip(graphs, values):
            by_g.setdefault(int(g), []).append(float(v))
        self.g = np.array(sorted(by_g), float)
        self.v = np.maximum.accumulate([float(np.mean(by_g[g])) for g in sorted(by_g)])

    def __call__(self, graphs: int) -> float:
        g, v = self.g, self.v
        if len(g) == 1:
            return float(v[0] * graphs / g[0]) if g[0] else float(v[0])
        i = int(np.clip(np.searchsorted(g, graphs), 1, len(g) - 1))  # the segment [g[i-1], g[i]]
        slope = (v[i] - v[i - 1]) / (g[i] - g[i - 1])
        return float(max(v[i - 1] + slope * (graphs - g[i - 1]), 0.0))

    def most_within(self, budget: float, most: int) -> int:
        """The most graphs (0..most) whose cost stays within the budget; -1 when not even none."""
        return max((k for k in range(most + 1) if self(k) <= budget + 1e-9), default=-1)


def _fit(graphs: list[int], values: list[float]) -> GraphCost | None:
    pts = [(g, v) for g, v in zip(graphs, values) if v is not None and not pd.isna(v)]
    return GraphCost(*zip(*pts)) if pts else None


class StepTimes:
    """``t(c, n, g)`` at one set of the fixed points' medians (point -> median): the observed ones
    (floats) or a resample's (arrays of bootstrap medians), with the same arithmetic on both."""

    def __init__(self, cells: dict[tuple[int, int], dict[int, tuple]], medians: Mapping):
        self._cells, self._m = cells, medians
        self._at: dict[tuple[int, int], dict] = {}
        self._slope: dict[int, object] = {}

    def at(self, c: int, n: int) -> dict:
        """{g: t} at (c, n): the median over the points measuring each g (strategies sharing a
        launch count), a larger grid never faster (noise that says so is flattened). Not so for
        the gemm backend across its cap (``gemm_lora.EPILOGUE_MAX_LAUNCH``): past it the pair runs,
        which can be faster than its epilogue at fewer slots; that speed-up is flattened too."""
        if (c, n) not in self._at:
            by_g, top = {}, -np.inf
            for g, keys in self._cells.get((c, n), {}).items():
                v = self._m[keys[0]] if len(keys) == 1 else np.median(np.stack([np.asarray(self._m[k], float) for k in keys]), axis=0)
                top = by_g[g] = np.maximum(v, top)
            self._at[(c, n)] = by_g
        return self._at[(c, n)]

    def slope(self, c: int):
        """ms per extra launched slot at concurrency c, fitted over the (c, n) with >= 2 counts; None without."""
        if c not in self._slope:
            xs, ys = [], []
            for (cc, n), cell in self._cells.items():
                if cc == c and n > 0 and len(cell) >= 2:
                    by_g = self.at(cc, n)
                    g = np.array(list(by_g), float)
                    v = np.stack([np.asarray(x, float) for x in by_g.values()])
                    xs.append(g - g.mean())
                    ys.append(v - v.mean(axis=0))
            if xs:
                x, y = np.concatenate(xs), np.concatenate(ys)
                self._slope[c] = np.maximum((x.reshape((-1,) + (1,) * (y.ndim - 1)) * y).sum(axis=0) / (x * x).sum(), 0.0)
            else:
                self._slope[c] = None
        return self._slope[c]

    def step(self, c: int, n: int, g: int) -> tuple:
        """(t, source) of a step at (c, n) on a graph launched with g slots; (None, why) when
        nothing measured can say."""
        by_g = self.at(c, n)
        if not by_g:
            return None, f"no point measured at c={c}, n={n}"
        if n == 0:
            return by_g.get(0, next(iter(by_g.values()))), MEASURED
        if g in by_g:
            return by_g[g], MEASURED
        gs = list(by_g)
        i = bisect.bisect_left(gs, g)
        if 0 < i < len(gs):
            lo, hi = gs[i - 1], gs[i]
            return by_g[lo] + (by_g[hi] - by_g[lo]) * (g - lo) / (hi - lo), INTERPOLATED
        slope = self.slope(c)
        if slope is None:
            return None, f"only launch count(s) {gs} measured at c={c}, n={n}, and no slope to extrapolate with"
        ref = gs[0] if i == 0 else gs[-1]
        base = self.at(c, 0).get(0, 0.0)  # a LoRA step is never faster than the base model's
        return np.maximum(by_g[ref] + slope * (g - ref), base), EXTRAPOLATED


class CostModel:
    """The measured step times and graph costs of one (kernels, max_loras) in a run."""

    def __init__(self, df: pd.DataFrame, kernels: str, max_loras: int):
        """df: the run's rows measured on the GPU compared on (``RunView.compared``); rows of
        configurations that failed their check are left out (one may look fast by skipping work)."""
        ok = not_found_wrong(ok_points(df))
        rows = ok[(ok.kernels == kernels) & (ok.max_loras == max_loras)]
        if rows.empty:
            raise ValueError(f"the run has no successful points for kernels {kernels}, max_loras {max_loras}")
        self.kernels, self.max_loras = kernels, max_loras
        fixed = rows[rows["mode"] == "fixed"]
        self.concurrency = sorted(int(c) for c in fixed.concurrency.unique())
        self.capture_sizes = sorted(int(b) for b in rows.capture_sizes.iloc[0])
        # each fixed point's median, keyed by its point (a row without one by its index), and
        # (c, n) -> {g: the points measuring it}, both in order
        points = fixed["point"] if "point" in fixed else pd.Series(np.nan, index=fixed.index)
        keys = [int(p) if pd.notna(p) else ("row", i) for i, p in zip(fixed.index, points)]
        self.medians: dict = {}
        cells: dict[tuple[int, int], dict[int, list]] = {}
        for key, c, n, g, ms in zip(keys, fixed.concurrency, fixed.n_active, fixed.graph_loras, fixed.step_ms_median):
            self.medians[key] = float(ms)
            cells.setdefault((int(c), int(n)), {}).setdefault(int(g), []).append(key)
        self.cells = {cn: {g: tuple(by_g[g]) for g in sorted(by_g)} for cn, by_g in sorted(cells.items())}
        self.observed = StepTimes(self.cells, self.medians)
        sets = rows.drop_duplicates("strategy")
        graphs = [lora_graphs([int(x) for x in cc], self.capture_sizes, max_loras) for cc in sets.captured_counts]
        self.memory = _fit(graphs, list(sets.graph_mem_bytes))
        self.capture = _fit(graphs, list(sets.capture_s))
        self.startup_rest = float((sets.startup_s - sets.capture_s).median())  # build + compile

    def times(self, medians: Mapping | None = None) -> StepTimes:
        """t at ``medians`` (point -> median or bootstrap medians); the observed ones by default."""
        return self.observed if medians is None else StepTimes(self.cells, medians)

    @property
    def t(self) -> dict[tuple[int, int], dict[int, float]]:
        """The observed table: (c, n) -> {g: ms}, flattened."""
        return {cn: {g: float(v) for g, v in self.observed.at(*cn).items()} for cn in self.cells}

    def step(self, c: int, n: int, g: int) -> tuple[float | None, str]:
        """(ms, source) of a step at (c, n) on a graph launched with g slots, at the observed
        medians; (None, why) when nothing measured can say."""
        ms, source = self.observed.step(c, n, g)
        return (None if ms is None else float(ms)), source

    def graph_memory(self, counts: list[int]) -> float | None:
        return self.memory(lora_graphs(counts, self.capture_sizes, self.max_loras)) if self.memory else None

    def startup(self, counts: list[int]) -> float | None:
        return self.startup_rest + self.capture(lora_graphs(counts, self.capture_sizes, self.max_loras)) if self.capture else None


@dataclass(frozen=True)
class Plan:
    """A capture set and what the cost model predicts for it."""

    counts: list[int]
    expected_ms: float  # mean over the priced concurrencies
    expected_ms_by_c: dict[int, float]
    graphs: int  # LoRA graphs (the no-LoRA graphs come on top, the same for every set)
    graph_mem_bytes: float | None
    startup_s: float | None
    sources: dict[str, int] = field(default_factory=dict)  # how many t values were measured / interpolated / ...


class Pricing:
    """Capture sets priced under one workload's steps by a CostModel: P(n | c) per concurrency,
    each concurrency weighted by its share of the steps."""

    def __init__(self, model: CostModel, pmf: dict[int, np.ndarray], weights: dict[int, float] | None = None):
        """pmf: P(n | c) for each swept concurrency c, n = 0..min(c, max_loras). weights: how much
        each concurrency counts in the mean (a residency run's share of steps at each batch size,
        ``lorabench.analysis.residency``); default: every concurrency alike."""
        self.m, self.pmf = model, pmf
        self.L = model.max_loras
        self.conc = [c for c in model.concurrency if c in pmf and (weights is None or weights.get(c, 0) > 0)]
        if not self.conc:
            raise ValueError("no concurrency has both measured points and a workload distribution")
        total = sum(weights[c] for c in self.conc) if weights else len(self.conc)
        self.weight = {c: (weights[c] if weights else 1.0) / total for c in self.conc}

    def mean(self, by_c: dict[int, object]):
        """The mean over the concurrencies, each by its weight."""
        return sum(self.weight[c] * v for c, v in by_c.items())

    def launch(self, c: int, n: int, k: int) -> int:
        """The launch count a step of (c, n) runs with when k is its count in the set: past the
        largest capture size the step runs eagerly with exactly n, whatever the set."""
        return n if c > self.m.capture_sizes[-1] else k

    def segment(self, prev: int, k: int, times: StepTimes | None = None) -> tuple[dict | None, object]:
        """Per concurrency, the expected ms contributed by n in (prev, k], served at count k, and
        how many values were measured / interpolated / extrapolated; (None, (c, n, why)) when the
        model cannot price a step the workload produces there."""
        times = times or self.m.observed
        out, sources = {}, {}
        for c in self.conc:
            p, e = self.pmf[c], 0.0
            for n in range(prev + 1, min(k, len(p) - 1) + 1):
                if p[n] > 0:
                    ms, src = times.step(c, n, self.launch(c, n, k))
                    if ms is None:
                        return None, (c, n, src)
                    e += p[n] * ms
                    sources[src] = sources.get(src, 0) + 1
            out[c] = e
        return out, sources

    def base_by_c(self, times: StepTimes | None = None) -> dict[int, object]:
        """Per concurrency, the expected ms of its steps with no adapter (the no-LoRA graph)."""
        times = times or self.m.observed
        out = {}
        for c in self.conc:
            ms, _ = times.step(c, 0, 0)
            if self.pmf[c][0] > 0 and ms is None:
                raise ValueError(f"the workload has steps with no adapter at c={c} but the run has no n = 0 point there")
            out[c] = self.pmf[c][0] * ms if self.pmf[c][0] > 0 else 0.0
        return out

    def expected(self, counts: list[int], times: StepTimes | None = None) -> tuple[dict, dict] | None:
        """(expected ms per concurrency, the sources) of a set; None when a step cannot be priced."""
        by_c, sources, prev = self.base_by_c(times), {}, 0
        for k in sorted(set(counts)):
            seg, src = self.segment(prev, k, times)
            if seg is None:
                return None
            for c, v in seg.items():
                by_c[c] += v
            for s_, v in src.items():
                sources[s_] = sources.get(s_, 0) + v
            prev = k
        return by_c, sources

    def expected_ms(self, counts: list[int], medians: Mapping | None = None):
        """A set's expected step at ``medians`` (the observed by default): a float, or an array of
        bootstrap draws."""
        by_c, _ = self.expected(counts, self.m.times(medians))
        return self.mean(by_c)

    def plan(self, counts: list[int]) -> Plan | None:
        """What the model predicts for a set; None when it cannot price a step (``unpriced``)."""
        counts = sorted(set(counts))
        priced = self.expected(counts)
        if priced is None:
            return None
        by_c, sources = priced
        return Plan(counts, float(self.mean(by_c)), {c: float(v) for c, v in by_c.items()},
                    lora_graphs(counts, self.m.capture_sizes, self.L), self.m.graph_memory(counts),
                    self.m.startup(counts), sources)

    def unpriced(self, counts: list[int]) -> str | None:
        """Why a set cannot be priced (the first step the model has no time for), or None."""
        prev = 0
        for k in sorted(set(counts)):
            seg, why = self.segment(prev, k)
            if seg is None:
                c, n, reason = why
                return f"the run cannot price a step at c={c}, n={n} for the set {sorted(set(counts))}: {reason}"
            prev = k
        return None

    def gain_statistic(self, counts: list[int]) -> Callable:
        """The set's gain over max (%) as a function of the medians, for ``lorabench.stats.Resampler``."""
        def gain(m):
            times = self.m.times(m)
            return 100 * (1 - self.mean(self.expected(counts, times)[0]) / self.mean(self.expected([self.L], times)[0]))
        return gain

    def gain(self, counts: list[int], rs: Resampler | None) -> Gain:
        """A set's predicted gain over max (%), with its interval from ``rs`` (none, and why, without)."""
        stat = self.gain_statistic(counts)
        points = points_read(stat, self.m.medians)
        iv, why = interval_of(rs, stat, points)
        return Gain(float(stat(self.m.medians)), iv, why, most_steps(rs, points) if iv is not None else 0)
