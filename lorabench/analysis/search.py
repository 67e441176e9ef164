"""Strategy auto's search: the capture set with the least expected step under a workload
(``lorabench.analysis.costmodel.Pricing``), within a graph-memory and a startup budget.

Exact search: step time never drops when a grid grows, and a count's graphs are one per capture
size larger than the previous count, so an optimal set's counts are active counts the workload
can produce, capture sizes, or max_loras: any other count can move down to the nearest of those
without serving fewer batches, costing more time, or adding graphs (or, serving nothing, go).
Over those candidates, a set is a path of segments (previous count, count]:
each segment's expected time depends on its two ends only, and so does its graph count (a count
is captured for every size larger than the previous count). Dynamic programming over (last
count, graphs so far) finds the cheapest path for every graph count within the budget the
memory and startup budgets allow; of those, ``best`` takes the fewest graphs within ``NOISE`` of
the optimum. Every set the budgets allow, max, pow2 and dense included, is in that search, so
``best`` is never predicted slower than the best of them that fits by more than ``NOISE``.
"""

from lorabench.analysis.costmodel import Plan, Pricing, lora_graphs
from lorabench.config.strategies import STRATEGIES

NOISE = 0.005  # predicted gains under 0.5 % are not worth a graph (H200 reruns differ by up to 0.57 %)


def graph_budget(pricing: Pricing, memory_bytes: float | None, startup_s: float | None) -> int:
    """The most LoRA graphs the budgets allow (per the graph-cost curves); -1 when none fits."""
    model, L = pricing.m, pricing.L
    most = lora_graphs(list(range(1, L + 1)), model.capture_sizes, L)
    limit = most
    if memory_bytes is not None:
        if model.memory is None:
            raise ValueError("the run has no graph memory (a CPU run): a memory budget cannot be checked")
        limit = min(limit, model.memory.most_within(memory_bytes, most))
    if startup_s is not None and model.capture is not None:
        limit = min(limit, model.capture.most_within(startup_s - model.startup_rest, most))
    return limit


def best(pricing: Pricing, memory_bytes: float | None = None, startup_s: float | None = None) -> Plan | None:
    """The optimal set within the budgets, or None when not even ``max`` fits. Raises
    ValueError when the run cannot price even ``max`` (a point missing or failed)."""
    L, sizes = pricing.L, pricing.m.capture_sizes
    why = pricing.unpriced([L])
    if why:
        raise ValueError(why)
    budget = graph_budget(pricing, memory_bytes, startup_s)
    if budget < 0:
        return None
    active = {n for c in pricing.conc for n, p in enumerate(pricing.pmf[c]) if p > 0 and 0 < n < L}
    cands = sorted(active | {min(b, L) for b in sizes} | {L})

    def graphs_after(prev: int) -> int:
        """Graphs a count adds after ``prev``: one per capture size that can hold more than prev."""
        return sum(1 for b in sizes if min(b, L) > prev)

    # dp[k][g] = (cost of serving every n <= k with k the last count, using g graphs, previous count)
    dp: dict[int, dict[int, tuple[float, int | None]]] = {}
    for i, k in enumerate(cands):
        dp[k] = {}
        for prev in [0] + cands[:i]:
            seg, _ = pricing.segment(prev, k)
            if seg is None:
                continue
            seg_ms = pricing.mean(seg)
            graphs_k = graphs_after(prev)
            starts = {0: (0.0, None)} if prev == 0 else dp[prev]
            for g0, (cost0, _) in starts.items():
                g = g0 + graphs_k
                if g > budget:
                    continue
                cost = cost0 + seg_ms
                if g not in dp[k] or cost < dp[k][g][0] - 1e-12:
                    dp[k][g] = (cost, prev)
    if not dp.get(L):
        return None
    # The fewest graphs whose expected time is within NOISE of the optimum: a smaller
    # predicted gain is below what a rerun can tell apart, and graphs cost memory and startup.
    cost = {gg: c for gg, (c, _) in dp[L].items()}
    base = pricing.mean(pricing.base_by_c())
    least = min(cost.values())
    bound = least + NOISE * abs(base + least)
    g = min(gg for gg, c in cost.items() if c <= bound + 1e-12)  # the optimum itself always qualifies
    counts, k = [], L
    while k:
        counts.append(k)
        _, prev = dp[k][g]
        g -= graphs_after(prev or 0)
        k = prev
    return pricing.plan(sorted(counts))


def baselines(pricing: Pricing) -> dict[str, Plan | None]:
    """The registered fixed sets (max, pow2, dense), as the model prices them."""
    return {name: pricing.plan(s.counts(pricing.L)) for name, s in STRATEGIES.items() if s.fixed}


def fits(plan: Plan, memory_bytes: float | None, startup_s: float | None) -> bool:
    ok = memory_bytes is None or (plan.graph_mem_bytes is not None and plan.graph_mem_bytes <= memory_bytes + 1)
    return ok and (startup_s is None or plan.startup_s is None or plan.startup_s <= startup_s + 1e-9)
