"""vLLM's CPU cache (``--max-cpu-loras``) for a residency configuration, chosen by tokens per
second against host memory (``lorabench recommend RUN --adapters DIR`` without ``--max-cpu-loras``).

A smaller cache holds fewer adapters in host memory, and a load of one it lacks first reads the
adapter's file from storage (a *miss*, priced at the run's cold read of an adapter's file). For
the chosen (max_loras, capture set), each candidate size is simulated (``STEPS`` steps of the
same closed loop) and priced; the choice is the smallest cache whose tokens per second fall at
most ``PAYS_PCT`` short of the best that fits ``--host-memory-budget`` (point estimates: the miss
price is one figure, a median of the run's reads, so there is no interval to test). Without a
timed storage read (random adapters: no files) misses cannot be priced, and the cache holds
every adapter, as vLLM's default does when ``--max-cpu-loras`` is unset.
"""

from dataclasses import dataclass

from lorabench.analysis.decision import PAYS_PCT, CacheChoice, CacheSize
from lorabench.analysis.occupancy import STEPS, simulated
from lorabench.analysis.residency_price import Priced, Pricer
from lorabench.analysis.view import RunView
from lorabench.config.residency import Adapters


@dataclass(frozen=True)
class CachePolicy:
    """How to choose the cache: one adapter's host bytes (None: a slot's, the run's adapters at
    its rank) and the most the cache may take (None: no limit)."""

    adapter_bytes: float | None = None
    host_budget_bytes: float | None = None


def candidates(max_loras: int, count: int) -> list[int]:
    """max_loras, doubling up to the adapters' count, the count's quarters, and the count."""
    out, s = {count}, max_loras
    while s < count:
        out.add(s)
        s *= 2
    out |= {q for q in (count // 4, count // 2, 3 * count // 4) if q >= max_loras}
    return sorted(out)


def choose_cpu_cache(view: RunView, chosen: Priced, adapters: Adapters, workload: str, clients: int,
                     policy: CachePolicy, steps: int = STEPS) -> CacheChoice:
    """The CPU cache for ``chosen`` (see the module's docstring)."""
    adapter_bytes = policy.adapter_bytes if policy.adapter_bytes is not None else chosen.slot_bytes / chosen.max_loras
    host_budget_bytes = policy.host_budget_bytes
    if chosen.miss is None:
        return CacheChoice(why="the run timed no read of an adapter's file (sweep with --adapters DIR), so a miss "
                               "cannot be priced: every adapter stays in the CPU cache")
    rows = view.compared
    mine = rows[(rows.kernels == chosen.kernels) & (rows.max_loras == chosen.max_loras)]
    sizes = [int(b) for b in mine.capture_sizes.iloc[0]]
    priced = []
    for size in candidates(chosen.max_loras, adapters.count):
        occ = simulated(workload, Adapters(adapters.count, size, adapters.output_tokens, adapters.file_bytes), clients,
                        chosen.max_loras, sizes, steps)
        p = Pricer(view, chosen.kernels, chosen.max_loras, occ).price(chosen.strategy, chosen.counts)
        if p is not None:
            priced.append(CacheSize(size, size * adapter_bytes, occ.cpu_misses, p.step_ms, p.tokens_per_s))
    if not priced:
        return CacheChoice(why="no cache size could be priced for the chosen configuration")
    fits = [c for c in priced if host_budget_bytes is None or c.host_bytes <= host_budget_bytes]
    if not fits:
        return CacheChoice(tuple(priced), why="no cache of at least max_loras adapters fits --host-memory-budget",
                           host_budget_bytes=host_budget_bytes)
    best = max(fits, key=lambda c: c.tokens_per_s)
    pick = next(c for c in fits if c.tokens_per_s >= best.tokens_per_s * (1 - PAYS_PCT / 100))
    why = ("the fastest" if pick is best else
           f"the smallest within {PAYS_PCT:g} % of the fastest that fits ({best.size}: {best.tokens_per_s:,.0f} tokens/s)")
    return CacheChoice(tuple(priced), pick, why, host_budget_bytes)
