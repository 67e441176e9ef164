"""Strategy ``auto``: the capture set that minimises the expected step time under a workload,
within a graph-memory and a startup budget.

Expected step time of a set C (sorted launch counts, ending at max_loras), averaged over the
concurrencies where max has every point the workload needs (``lorabench.analysis.compare``'s
grid, what the report compares over): ``E(C) = mean_c sum_n P(n | c) t(c, n, up_C(n))`` with ``up_C(n)`` the
smallest count in C >= n (and the no-LoRA graph at n = 0), t from ``lorabench.analysis.costmodel``.

Exact search: step time never drops when a grid grows, and a count's graphs are one per capture
size larger than the previous count, so an optimal set's counts are active counts the workload
can produce, capture sizes, or max_loras: any other count can move down to the nearest of those
without serving fewer batches, costing more time, or adding graphs (or, serving nothing, go).
Over those candidates, a set is a path of segments (previous count, count]:
each segment's expected time depends on its two ends only, and so does its graph count (a count
is captured for every size larger than the previous count). Dynamic programming over (last
count, graphs so far) finds the cheapest path for every graph count within the budget the
memory and startup budgets allow; of those, ``auto`` takes the fewest graphs within ``NOISE`` of
the optimum. Every set the budgets allow, max, pow2 and dense included, is in that search, so
``auto`` is never predicted slower than the best of them that fits by more than ``NOISE``.
``auto_recommendations`` then holds that set to the report's rules (at least ``PAYS`` faster than
max; what the run measured beats what the model predicts), so that ``lorabench report`` and
``lorabench recommend`` never contradict each other on a run. With the run's samples, "at least
PAYS faster" is the report's rule too: the lower end of the 95 % interval of the predicted gain
clears PAYS (``PricedGain``: the same pricing as the cost model, as a function of the fixed
points' medians, each resampled independently); a run that kept no samples is decided on the
medians alone. Only points measured on max's GPU price anything (``same_gpu``).
"""

import bisect
from dataclasses import dataclass, field

import numpy as np

from lorabench.analysis.compare import (
    COMPLETE,
    describe_gain,
    interval_of,
    points_read,
    resampler,
    steps_hint,
)
from lorabench.analysis.costmodel import CostModel, lora_graphs
from lorabench.analysis.points import (
    configs,
    ok_points,
    same_gpu,
    verdicts,
    with_columns,
)
from lorabench.analysis.recommend import (
    MEDIANS_ONLY,
    PAYS,
    SPECIALISED,
    UNVERIFIED_POW2,
    VLLM_NOTE,
    fully_sharded_of,
    recommend,
    tp_of,
    verified_pow2,
    vllm_flags,
)
from lorabench.config.backends import backend_of
from lorabench.config.strategies import BASELINE, STRATEGIES, Vllm, strategy
from lorabench.config.workload import parse_workload

PLAIN = "the cost model's best set within the budgets"  # auto's reason when no rule of the report's had to step in
NOISE = 0.005  # predicted gains under 0.5 % are not worth a graph (H200 reruns differ by up to 0.57 %)


@dataclass
class Plan:
    """A capture set and what the cost model predicts for it."""

    counts: list[int]
    expected_ms: float  # mean over the swept concurrencies
    expected_ms_by_c: dict[int, float]
    graphs: int  # LoRA graphs (the no-LoRA graphs come on top, the same for every set)
    graph_mem_bytes: float | None
    startup_s: float | None
    sources: dict[str, int] = field(default_factory=dict)  # how many t values were measured / interpolated / ...


class Optimiser:
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

    def mean(self, by_c: dict[int, float]):
        """The mean over the concurrencies, each by its weight."""
        return sum(self.weight[c] * v for c, v in by_c.items())

    def _launch(self, c: int, n: int, k: int) -> int:
        """The launch count a step of (c, n) runs with when k is its count in the set: past the
        largest capture size the step runs eagerly with exactly n, whatever the set."""
        return n if c > self.m.capture_sizes[-1] else k

    def _by_c(self, prev: int, k: int) -> tuple[dict[int, float], dict[str, int]] | tuple[None, tuple]:
        """Per concurrency, the expected ms contributed by n in (prev, k], served at count k;
        (None, (c, n, why)) when the model cannot price a step the workload produces there."""
        out, sources = {}, {}
        for c in self.conc:
            p, e = self.pmf[c], 0.0
            for n in range(prev + 1, min(k, len(p) - 1) + 1):
                if p[n] > 0:
                    ms, src = self.m.step(c, n, self._launch(c, n, k))
                    if ms is None:
                        return None, (c, n, src)
                    e += p[n] * ms
                    sources[src] = sources.get(src, 0) + 1
            out[c] = e
        return out, sources

    def _seg(self, prev: int, k: int) -> tuple[float, dict[str, int]] | None:
        by_c, sources = self._by_c(prev, k)
        return None if by_c is None else (self.mean(by_c), sources)

    def _base_by_c(self) -> dict[int, float]:
        out = {}
        for c in self.conc:
            ms, _ = self.m.step(c, 0, 0)
            if self.pmf[c][0] > 0 and ms is None:
                raise ValueError(f"the workload has steps with no adapter at c={c} but the run has no n = 0 point there")
            out[c] = self.pmf[c][0] * ms if self.pmf[c][0] > 0 else 0.0
        return out

    def _base(self) -> float:
        return self.mean(self._base_by_c())

    def evaluate(self, counts: list[int]) -> Plan | None:
        """What the model predicts for a set; None when it cannot price a step (``unpriced``)."""
        counts = sorted(set(counts))
        by_c, sources, prev = self._base_by_c(), {}, 0
        for k in counts:
            seg, src = self._by_c(prev, k)
            if seg is None:
                return None
            for c, v in seg.items():
                by_c[c] += v
            for s_, v in src.items():
                sources[s_] = sources.get(s_, 0) + v
            prev = k
        return Plan(counts, self.mean(by_c), by_c, lora_graphs(counts, self.m.capture_sizes, self.L),
                    self.m.graph_memory(counts), self.m.startup(counts), sources)

    def unpriced(self, counts: list[int]) -> str | None:
        """Why a set cannot be priced (the first step the model has no time for), or None."""
        prev = 0
        for k in sorted(set(counts)):
            seg, why = self._by_c(prev, k)
            if seg is None:
                c, n, reason = why
                return f"the run cannot price a step at c={c}, n={n} for the set {sorted(set(counts))}: {reason}"
            prev = k
        return None

    def graph_budget(self, memory_bytes: float | None, startup_s: float | None) -> int:
        """The most LoRA graphs the budgets allow (per the graph-cost curves); -1 when none fits."""
        most = lora_graphs(list(range(1, self.L + 1)), self.m.capture_sizes, self.L)
        limit = most
        if memory_bytes is not None:
            if self.m.memory is None:
                raise ValueError("the run has no graph memory (a CPU run): a memory budget cannot be checked")
            limit = min(limit, self.m.memory.most_within(memory_bytes, most))
        if startup_s is not None and self.m.capture is not None:
            limit = min(limit, self.m.capture.most_within(startup_s - self.m.startup_rest, most))
        return limit

    def best(self, memory_bytes: float | None = None, startup_s: float | None = None) -> Plan | None:
        """The optimal set within the budgets, or None when not even ``max`` fits. Raises
        ValueError when the run cannot price even ``max`` (a point missing or failed)."""
        why = self.unpriced([self.L])
        if why:
            raise ValueError(why)
        budget = self.graph_budget(memory_bytes, startup_s)
        if budget < 0:
            return None
        active = {n for c in self.conc for n, p in enumerate(self.pmf[c]) if p > 0 and 0 < n < self.L}
        cands = sorted(active | {min(b, self.L) for b in self.m.capture_sizes} | {self.L})

        def graphs_after(prev: int) -> int:
            """Graphs a count adds after ``prev``: one per capture size that can hold more than prev."""
            return sum(1 for b in self.m.capture_sizes if min(b, self.L) > prev)

        # dp[k][g] = (cost of serving every n <= k with k the last count, using g graphs, previous count)
        dp: dict[int, dict[int, tuple[float, int | None]]] = {}
        for i, k in enumerate(cands):
            dp[k] = {}
            for prev in [0] + cands[:i]:
                seg = self._seg(prev, k)
                if seg is None:
                    continue
                graphs_k = graphs_after(prev)
                starts = {0: (0.0, None)} if prev == 0 else dp[prev]
                for g0, (cost0, _) in starts.items():
                    g = g0 + graphs_k
                    if g > budget:
                        continue
                    cost = cost0 + seg[0]
                    if g not in dp[k] or cost < dp[k][g][0] - 1e-12:
                        dp[k][g] = (cost, prev)
        if not dp.get(self.L):
            return None
        # The fewest graphs whose expected time is within NOISE of the optimum: a smaller
        # predicted gain is below what a rerun can tell apart, and graphs cost memory and startup.
        cost = {gg: c for gg, (c, _) in dp[self.L].items()}
        base = self._base()
        best = min(cost.values())
        bound = best + NOISE * abs(base + best)
        g = min(gg for gg, c in cost.items() if c <= bound + 1e-12)  # the optimum itself always qualifies
        counts, k = [], self.L
        while k:
            counts.append(k)
            _, prev = dp[k][g]
            g -= graphs_after(prev or 0)
            k = prev
        return self.evaluate(sorted(counts))

    def baselines(self) -> dict[str, Plan | None]:
        """The registered fixed sets (max, pow2, dense), as the model prices them."""
        return {name: self.evaluate(s.counts(self.L)) for name, s in STRATEGIES.items() if s.fixed}


def fits(plan: Plan, memory_bytes: float | None, startup_s: float | None) -> bool:
    ok = memory_bytes is None or (plan.graph_mem_bytes is not None and plan.graph_mem_bytes <= memory_bytes + 1)
    return ok and (startup_s is None or plan.startup_s is None or plan.startup_s <= startup_s + 1e-9)



class PricedGain:
    """The gain (%) of a capture set over max as the cost model prices it (``Optimiser.evaluate``,
    ``CostModel.step``), written as a function of the fixed points' medians, so that
    ``lorabench.stats.Resampler`` can give it an interval: the same median over strategies
    sharing a (c, n, g), the same flattening (a larger grid is never faster), interpolation,
    extrapolation with the fitted slope and the base step as a floor, on floats or on arrays of
    bootstrap medians alike."""

    def __init__(self, df, opt: Optimiser, samples=None):
        ok = ok_points(df)
        if "correct" in ok:
            ok = ok[~ok.correct.eq(False)]
        rows = ok[(ok.kernels == opt.m.kernels) & (ok.max_loras == opt.L) & (ok["mode"] == "fixed")]
        self.opt, self.samples = opt, resampler(samples)
        self.cells: dict[tuple[int, int], dict[int, list]] = {}
        self.medians: dict = {}
        for i, r in zip(rows.index, rows.itertuples()):
            key = int(r.point) if "point" in rows and not np.isnan(r.point) else ("row", i)
            self.medians[key] = float(r.step_ms_median)
            self.cells.setdefault((int(r.concurrency), int(r.n_active)), {}).setdefault(int(r.graph_loras), []).append(key)
        for c_n in self.cells:
            self.cells[c_n] = dict(sorted(self.cells[c_n].items()))

    def _t(self, m, memo: dict, c: int, n: int) -> dict:
        if (c, n) not in memo:
            by_g, top = {}, -np.inf
            for g, keys in self.cells.get((c, n), {}).items():
                v = m[keys[0]] if len(keys) == 1 else np.median(np.stack([np.asarray(m[x], float) for x in keys]), axis=0)
                top = by_g[g] = np.maximum(v, top)
            memo[(c, n)] = by_g
        return memo[(c, n)]

    def _slope(self, m, memo: dict, c: int):
        xs, ys = [], []
        for cc, n in self.cells:
            if cc == c and n > 0 and len(self.cells[(cc, n)]) >= 2:
                by_g = self._t(m, memo, cc, n)
                g = np.array(list(by_g), float)
                v = list(by_g.values())
                mean = sum(v) / len(v)
                xs += list(g - g.mean())
                ys += [x - mean for x in v]
        if not xs:
            return None
        return np.maximum(sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs), 0.0)

    def _step(self, m, memo: dict, c: int, n: int, g: int):
        by_g = self._t(m, memo, c, n)
        if n == 0:
            return by_g.get(0, next(iter(by_g.values())))
        if g in by_g:
            return by_g[g]
        gs = list(by_g)
        i = bisect.bisect_left(gs, g)
        if 0 < i < len(gs):
            lo, hi = gs[i - 1], gs[i]
            return by_g[lo] + (by_g[hi] - by_g[lo]) * (g - lo) / (hi - lo)
        slope = self._slope(m, memo, c)
        ref = gs[0] if i == 0 else gs[-1]
        base = self._t(m, memo, c, 0).get(0, 0.0)
        return np.maximum(by_g[ref] + slope * (g - ref), base)

    def expected(self, m, memo: dict, counts: list[int]):
        """``Optimiser.evaluate(counts).expected_ms`` from the medians ``m``."""
        o, total = self.opt, 0.0
        for c in o.conc:
            p = o.pmf[c]
            e = p[0] * self._step(m, memo, c, 0, 0) if p[0] > 0 else 0.0
            prev = 0
            for k in sorted(set(counts)):
                for n in range(prev + 1, min(k, len(p) - 1) + 1):
                    if p[n] > 0:
                        e = e + p[n] * self._step(m, memo, c, n, o._launch(c, n, k))
                prev = k
            total = total + o.weight[c] * e
        return total

    def statistic(self, counts: list[int]):
        def gain(m):
            memo: dict = {}
            return 100 * (1 - self.expected(m, memo, counts) / self.expected(m, memo, [self.opt.L]))
        return gain

    def interval(self, counts: list[int]):
        """(the interval of the set's predicted gain over max in %, None or why there is none)."""
        stat = self.statistic(counts)
        return interval_of(self.samples, stat, points_read(stat, self.medians))

    def steps(self, counts: list[int]) -> int:
        if self.samples is None:
            return 0
        return max(self.samples.n(p) for p in points_read(self.statistic(counts), self.medians))


def auto_recommendations(df, workload: str, memory_bytes: float | None = None, startup_s: float | None = None,
                         kernels: list[str] | None = None, max_loras: list[int] | None = None,
                         planned: dict[tuple[str, int, str], tuple[int, ...]] | None = None,
                         samples=None) -> list[dict]:
    """Per (kernels, max_loras) of a run: the ``auto`` set under the workload and budgets, next
    to ``max``, ``pow2`` and ``dense`` as the same cost model prices them, and next to what the
    report says of the measured strategies (``measured``: ``lorabench.analysis.recommend.measured_choice``
    on the same ``Comparison``).

    The report and this never contradict each other:
    - sets are priced over the concurrencies where max has every needed point (the comparison's
      grid), the concurrencies the report compares over; with none, nothing is comparable;
    - a set other than max is proposed only when it is at least ``PAYS`` faster than max (the
      report's rule: the lower end of the predicted gain's interval, with samples); within that,
      the fewest graphs within ``NOISE`` of the optimum;
    - only points measured on max's GPU are used (``lorabench.analysis.points.same_gpu``);
    - measured beats modelled: the model's best set is taken only if the run did not measure it
      or the report proposes it; where the model keeps max but the report proposes a measured set
      (one that fits the budgets), auto takes that set;
    - the vLLM flags are the report's (they follow what was measured).
    ``planned``: the run's plan, as ``lorabench.analysis.compare.compare`` takes it; ``samples``:
    the run's samples (``lorabench.analysis.points.run_samples``) or a Resampler over them."""
    wl = parse_workload(workload)
    df = with_columns(df)
    rs = resampler(samples)
    measured = {(r["kernels"], r["max_loras"]): r for r in recommend(df, [wl.name], planned, rs)["recommendations"]}
    df, _ = same_gpu(df)  # the model prices from max's GPU's points only, as the report compares
    ok = ok_points(df)
    sets = _measured_sets(df)
    out = []
    for (k, m), _ in ok.groupby(["kernels", "max_loras"]):
        if (kernels and k not in kernels) or (max_loras and int(m) not in max_loras):
            continue
        if backend_of(k) == "vllm":
            continue  # vLLM captures max or pow2 only; its own rules are not lorabench's dispatch
        meas = measured[(k, int(m))]
        grid = meas["comparison"]["compared_over"]
        entry = {"kernels": k, "max_loras": int(m), "workload": wl.name, "capture_sizes": meas["capture_sizes"],
                 "concurrency": grid, "budgets": {"graph_memory_bytes": memory_bytes, "startup_s": startup_s},
                 "measured": _measured_dict(meas)}
        if not grid:
            out.append({**entry, "auto": None, "reason": meas["reason"]})
            continue
        model = CostModel(df, k, int(m))
        opt = Optimiser(model, {c: wl.active_count_pmf(c, int(m)) for c in grid})
        entry["concurrency"] = opt.conc
        entry["capture_sizes"] = model.capture_sizes
        best = opt.best(memory_bytes, startup_s)
        base = opt.baselines()
        if best is None:
            need = base.get(BASELINE)
            out.append({**entry, "auto": None, "reason": "no capture set fits the budgets (not even max" + (
                "" if need is None else f": {_cost(need)}") + ")"})
            continue
        priced = PricedGain(df, opt, rs)
        best, reason, decision = _settle(opt, best, base[BASELINE], meas, sets.get((k, int(m)), {}), memory_bytes,
                                         startup_s, priced)
        entry["auto"] = _plan_dict(best)
        entry["reason"] = reason
        entry.update(decision)
        entry["baselines"] = {}
        cmp = meas["comparison"]["strategies"]
        for name, plan in base.items():
            if plan is not None:
                entry["baselines"][name] = {**_plan_dict(plan), "fits_budgets": fits(plan, memory_bytes, startup_s),
                                            "auto_gain_pct": round(100 * (1 - best.expected_ms / plan.expected_ms), 2)}
                if name in cmp:
                    entry["baselines"][name]["measured"] = {x: cmp[name][x] for x in ("status", "compared_over", "gain_over_max_pct")}
        realisable = [s.counts(int(m)) for s in STRATEGIES.values() if s.vllm in (Vllm.DEFAULT, Vllm.SPECIALISE)]
        exact = best.counts in realisable
        note = ("vLLM captures max_loras+1 or, with --specialize-active-lora, powers of two: "
                + ("the auto set is one of those" if exact else "the auto set is lorabench's own"))
        flags = meas["vllm"]["flags"]
        if flags is None:  # the report realises nothing here (every measured strategy wrong): the model's rule
            specialise = best.counts != strategy(BASELINE).counts(int(m)) and _pow2_pays(base)
            flags = vllm_flags(int(m), int(ok["rank"].iloc[0]), specialise, tp_of(ok.iloc[0]), fully_sharded_of(ok.iloc[0]))
            note += "; the flags give the better of vLLM's two as the model prices them"
            if specialise and not verified_pow2(verdicts(df)):
                note += "; " + UNVERIFIED_POW2
        else:
            note += "; the flags are the report's (from what was measured)"
            if meas["vllm"]["note"] != VLLM_NOTE:
                note += f": {meas['vllm']['note']}"
            if SPECIALISED not in cmp or cmp[SPECIALISED]["status"] != COMPLETE:
                p, mx = base.get(SPECIALISED), base.get(BASELINE)
                if p is not None and mx is not None and _pow2_pays(base):
                    note += (f"; pow2 is not measured at every concurrency max is: the model predicts it "
                             f"{100 * (1 - p.expected_ms / mx.expected_ms):.1f} % faster than max, so measure it "
                             f"before enabling --specialize-active-lora")
        entry["vllm"] = {"flags": flags, "note": note}
        entry["validate"] = (f"lorabench sweep --max-loras {int(m)} --strategy '[{','.join(map(str, best.counts))}]' "
                             f"--concurrency {','.join(map(str, model.concurrency))} "
                             f"--capture-sizes {','.join(map(str, model.capture_sizes))} --kernels {k} --workload {wl.name}")
        out.append(entry)
    return out


def _settle(opt: Optimiser, best: Plan, max_plan: Plan, meas: dict, sets: dict[str, tuple[int, ...]],
            memory_bytes: float | None, startup_s: float | None,
            priced: PricedGain | None = None) -> tuple[Plan, str, dict]:
    """The model's best set, held to the report's rules: at least PAYS faster than max (the lower
    end of the predicted gain's interval, when ``priced`` has samples for it; else the medians),
    and never against what the run measured (see ``auto_recommendations``). ``sets``: each
    measured strategy's capture set. Returns the set, why, and the decision's fields
    (``gain_interval_pct``, ``inconclusive``, ``more_measuring``, ``decided_on``)."""
    L = opt.L
    chosen = meas["strategy"]
    gain = 1 - best.expected_ms / max_plan.expected_ms
    reason = PLAIN
    decision = {"gain_interval_pct": None, "inconclusive": False, "more_measuring": None, "decided_on": None}
    if best.counts != [L]:
        iv, why = priced.interval(best.counts) if priced is not None else (None, None)
        if iv is not None:
            decision.update(gain_interval_pct=iv.to_dict(), decided_on="the 95 % interval of the predicted gain")
            if iv.low < 100 * PAYS:
                more = steps_hint(iv, priced.steps(best.counts), 100 * PAYS)
                open_ = iv.high >= 100 * PAYS
                reason = (f"the cost model's best set {best.counts} vs max: {describe_gain(iv)}; "
                          + (f"inconclusive: the interval's low end does not clear {100 * PAYS:g} %" if open_ else
                             f"the whole interval is below the {100 * PAYS:g} % that pays for extra graphs")
                          + ", so max, the fewest graphs" + (f"; {more}" if more else ""))
                decision.update(inconclusive=open_, more_measuring=more if open_ else None)
                best = max_plan
        else:
            decision["decided_on"] = MEDIANS_ONLY.format(why=why or "no samples given")
            if gain < PAYS:
                reason = (f"the cost model's best set {best.counts} is only {100 * gain:.2f} % faster than max "
                          f"(< 2 %: extra graphs do not pay), so max")
                best = max_plan
            if why:
                reason += f"; {decision['decided_on']}"
    same = [s for s, counts in sets.items() if list(counts) == best.counts and s != BASELINE]
    if same and chosen not in same:
        why = "; ".join(meas["comparison"]["strategies"].get(s, {}).get("coverage", s) for s in same)
        reason = (f"the cost model's best set {best.counts} is {' and '.join(same)}'s, which this run measured ({why}) "
                  f"and the report does not propose; measured beats modelled")
        best = max_plan
        if chosen in sets and list(sets[chosen]) != [L]:
            plan = opt.evaluate(list(sets[chosen]))
            if plan is not None and fits(plan, memory_bytes, startup_s):
                best, reason = plan, reason + f", so {chosen}'s set, which the report proposes"
        if best is max_plan:
            reason += ", so max"
            if meas.get("inconclusive"):
                reason += f" (the report: inconclusive; {meas['more_measuring'] or 'more steps per point would settle it'})"
                decision.update(inconclusive=True, more_measuring=meas["more_measuring"])
    elif best.counts == [L] and chosen not in (None, BASELINE):
        plan = opt.evaluate(list(sets[chosen])) if chosen in sets else None
        g = meas["gain_over_max_pct"]
        if plan is not None and fits(plan, memory_bytes, startup_s):
            reason = (f"the cost model prices no set {100 * PAYS:.0f} % faster than max, but this run measured {chosen} "
                      f"{g:.1f} % faster: measured beats modelled, so {chosen}'s set")
            best = plan
        elif chosen in sets:
            reason += f"; the report proposes {chosen} (measured {g:.1f} % faster than max), which does not fit the budgets"
        else:
            reason += f"; the report proposes {chosen} (measured {g:.1f} % faster than max), a set auto does not price"
    if best.counts != [L] and decision["decided_on"] is None:
        decision["decided_on"] = "the report's (a measured set)"
    return best, reason, decision


def _measured_sets(df) -> dict[tuple[str, int], dict[str, tuple[int, ...]]]:
    """Per (kernels, max_loras): each measured strategy with count-sized grids -> its capture set."""
    out: dict[tuple[str, int], dict[str, tuple[int, ...]]] = {}
    for r in configs(df).itertuples():
        if r.strategy in STRATEGIES and STRATEGIES[r.strategy].bucket_grid:
            continue  # the same counts as max, with another grid
        out.setdefault((r.kernels, int(r.max_loras)), {})[r.strategy] = tuple(int(x) for x in r.captured_counts)
    return out


def _cost(plan: Plan) -> str:
    parts = [f"{plan.graphs} LoRA graphs"]
    if plan.graph_mem_bytes is not None:
        parts.append(f"{plan.graph_mem_bytes / 2**20:.0f} MiB")
    if plan.startup_s is not None:
        parts.append(f"{plan.startup_s:.2f} s startup")
    return "max needs " + ", ".join(parts)


def _measured_dict(meas: dict) -> dict:
    """What the report recommends for the same (kernels, max_loras, workload)."""
    return {x: meas[x] for x in ("strategy", "captured_counts", "gain_over_max_pct", "reason")} | {
        "vllm_flags": meas["vllm"]["flags"], "comparison": meas["comparison"]}


def _pow2_pays(base: dict) -> bool:
    """vLLM's flag follows the rule ``lorabench report`` uses: pow2 at least PAYS faster than max."""
    p, m = base.get(SPECIALISED), base.get(BASELINE)
    return p is not None and m is not None and p.expected_ms <= m.expected_ms * (1 - PAYS)


def _plan_dict(plan: Plan) -> dict:
    return {"counts": plan.counts, "expected_ms": round(plan.expected_ms, 4),
            "expected_ms_by_c": {str(c): round(v, 4) for c, v in plan.expected_ms_by_c.items()},
            "lora_graphs": plan.graphs, "graph_mem_bytes": None if plan.graph_mem_bytes is None else int(plan.graph_mem_bytes),
            "startup_s": None if plan.startup_s is None else round(plan.startup_s, 3),
            "model_values": plan.sources}
