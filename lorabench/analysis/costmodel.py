"""What a capture set would cost, from what a sweep measured.

Step time ``t(c, n, g)``: the median step at concurrency c with n active adapters on a graph
launched with g slots (taken as never decreasing in g: where noise says a larger grid was
faster, the larger grid gets the smaller grid's time). Configurations that failed their
correctness check are left out. Sweeps measure it at the launch counts their strategies dispatched to
(``graph_loras``: ``max`` gives g = max_loras, ``dense`` g = n, ``pow2`` the next power of
two). Where a launch count was not measured for (c, n) it is interpolated linearly in g between
the measured counts around it, or, outside them, extrapolated with the slope in g fitted over the
same concurrency's other active counts; every value says which (``source``).

Graph costs: graph memory and capture time of each measured capture set, as a function of its
LoRA graph count (``GraphCost``: exact at the measured sets, linear between and beyond them), so
any set's cost follows from its graph count.
"""

import bisect

import numpy as np
import pandas as pd

from lorabench.analysis.points import ok_points
from lorabench.config.strategies import choose_launch

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


class CostModel:
    """The measured step times and graph costs of one (kernels, max_loras) in a run."""

    def __init__(self, df: pd.DataFrame, kernels: str, max_loras: int):
        ok = ok_points(df)
        if "correct" in ok:  # a configuration that failed its check may look fast by skipping work
            ok = ok[~ok.correct.eq(False)]
        rows = ok[(ok.kernels == kernels) & (ok.max_loras == max_loras)]
        if rows.empty:
            raise ValueError(f"the run has no successful points for kernels {kernels}, max_loras {max_loras}")
        self.kernels, self.max_loras = kernels, max_loras
        fixed = rows[rows["mode"] == "fixed"]
        self.concurrency = sorted(int(c) for c in fixed.concurrency.unique())
        self.capture_sizes = sorted(int(b) for b in rows.capture_sizes.iloc[0])
        # (c, n) -> {g: median ms}; repeated (c, n, g) across strategies -> their median
        self.t: dict[tuple[int, int], dict[int, float]] = {}
        for (c, n, g), grp in fixed.groupby(["concurrency", "n_active", "graph_loras"]):
            self.t.setdefault((int(c), int(n)), {})[int(g)] = float(grp.step_ms_median.median())
        for by_g in self.t.values():  # a larger grid is never faster: noise that says so is flattened
            top = -np.inf
            for g in sorted(by_g):
                top = by_g[g] = max(by_g[g], top)
        sets = rows.drop_duplicates("strategy")
        graphs = [lora_graphs([int(x) for x in cc], self.capture_sizes, max_loras) for cc in sets.captured_counts]
        self.memory = _fit(graphs, list(sets.graph_mem_bytes))
        self.capture = _fit(graphs, list(sets.capture_s))
        self.startup_rest = float((sets.startup_s - sets.capture_s).median())  # build + compile
        self._slope: dict[int, float | None] = {}

    def slope(self, c: int) -> float | None:
        """ms per extra launched slot at concurrency c, fitted over the (c, n) with >= 2 counts."""
        if c not in self._slope:
            xs, ys = [], []
            for (cc, n), by_g in self.t.items():
                if cc == c and n > 0 and len(by_g) >= 2:
                    g = np.array(sorted(by_g), float)
                    v = np.array([by_g[k] for k in sorted(by_g)])
                    xs.append(g - g.mean())
                    ys.append(v - v.mean())
            if xs:
                x, y = np.concatenate(xs), np.concatenate(ys)
                self._slope[c] = float(max((x * y).sum() / (x * x).sum(), 0.0))
            else:
                self._slope[c] = None
        return self._slope[c]

    def step(self, c: int, n: int, g: int) -> tuple[float | None, str]:
        """(ms, source) of a step at (c, n) on a graph launched with g slots; (None, why) when
        nothing measured can say."""
        by_g = self.t.get((c, n))
        if not by_g:
            return None, f"no point measured at c={c}, n={n}"
        if n == 0:
            return by_g.get(0, next(iter(by_g.values()))), MEASURED
        if g in by_g:
            return by_g[g], MEASURED
        gs = sorted(by_g)
        i = bisect.bisect_left(gs, g)
        if 0 < i < len(gs):
            lo, hi = gs[i - 1], gs[i]
            return by_g[lo] + (by_g[hi] - by_g[lo]) * (g - lo) / (hi - lo), INTERPOLATED
        slope = self.slope(c)
        if slope is None:
            return None, f"only launch count(s) {gs} measured at c={c}, n={n}, and no slope to extrapolate with"
        ref = gs[0] if i == 0 else gs[-1]
        base = self.t.get((c, 0), {}).get(0, 0.0)  # a LoRA step is never faster than the base model's
        return max(by_g[ref] + slope * (g - ref), base), EXTRAPOLATED

    def graph_memory(self, counts: list[int]) -> float | None:
        return self.memory(lora_graphs(counts, self.capture_sizes, self.max_loras)) if self.memory else None

    def startup(self, counts: list[int]) -> float | None:
        return self.startup_rest + self.capture(lora_graphs(counts, self.capture_sizes, self.max_loras)) if self.capture else None
