"""The serving choice: which measured configuration serves a loop with prompts best under a TTFT
target (``lorabench recommend RUN --ttft-p99-ms X``, and the report's serving section).

Every serving run (``mode`` ``serving``) is one configuration (kernels, max_loras, capture set,
PIECEWISE sizes) measured on the same loop. The choice is among the measured ones, per kernels and
workload: the most output tokens per second among those that meet the target; a configuration the
check found wrong is never chosen. A run *meets* it
when the 95 % interval of its TTFT p99 lies at or below it, *misses* it when the interval lies
above, and is *unclear* when the interval spans it or the run had too few requests for an interval
(its estimate is shown beside the verdict, never taken for one). Runs with requests still waiting for
their first token at the end are marked: their percentiles read low. A loop whose requests all
decode the same number of tokens says so (``lockstep_note``): its TTFT tail is its start's.
"""

import math
from dataclasses import dataclass

import pandas as pd

from lorabench.analysis.points import not_found_wrong
from lorabench.config.lengths import as_lengths
from lorabench.stats import quantile_interval_samples

MET, MISSED, UNCLEAR = "met", "missed", "unclear"


@dataclass(frozen=True)
class ServingRun:
    """One serving run's figures as the choice reads them."""

    kernels: str
    max_loras: int
    strategy: str
    max_cudagraph_capture_size: int
    point: int
    output_tokens_per_s: float
    ttft_p99_ms: float | None
    ttft_p99_low: float | None
    ttft_p99_high: float | None
    itl_p99_ms: float | None
    ttft_pending: int
    graph_mem_bytes: float | None  # FULL and PIECEWISE graphs together
    startup_s: float | None  # build, compile and both captures
    ttft_requests: int = 0  # the requests its TTFT percentiles count
    iters: int = 0  # the loop's timed steps
    ttft_p50_ms: float | None = None
    itl_p50_ms: float | None = None
    run_id: str | None = None  # the run it was measured in (choices may span runs: ``recommend --also``)

    @property
    def too_few_requests(self) -> bool:
        """Its TTFT p99 has no interval because the loop served too few requests for one."""
        return self.ttft_p99_ms is not None and self.ttft_p99_low is None

    def against(self, target_ms: float | None) -> str | None:
        """MET, MISSED or UNCLEAR against ``target_ms`` (None: no target)."""
        if target_ms is None:
            return None
        if self.ttft_p99_ms is None:
            return UNCLEAR
        if self.ttft_p99_high is not None and self.ttft_p99_low is not None:
            return MET if self.ttft_p99_high <= target_ms else MISSED if self.ttft_p99_low > target_ms else UNCLEAR
        return UNCLEAR


@dataclass(frozen=True)
class ServingChoice:
    workload: str
    kernels: str
    target_ms: float | None
    runs: tuple[ServingRun, ...]  # every configuration measured, most output tokens/s first
    chosen: ServingRun | None
    why: str
    note: str | None = None  # what the loop's TTFT tail is not (``lockstep_note``)


def _value(v) -> float | None:
    return None if v is None or pd.isna(v) else float(v)


def served_runs(rows: pd.DataFrame) -> pd.DataFrame:
    """The ok serving rows of configurations not found wrong by the check (one that skips work may
    look fast)."""
    runs = rows[(rows.status == "ok") & (rows["mode"] == "serving")]
    return not_found_wrong(runs)


def lockstep_note(runs: pd.DataFrame) -> str | None:
    """Where every request of these serving runs decodes the same number of tokens (no range; a
    trace's own lengths are not read here): the clients' cycles are equally long, so unless they wait
    for slots they keep the phases the loop's start gave them, and prompts that met there meet again
    or not at all. Measured
    on an H100 (16 clients, 1600/600 tokens): every TTFT p99 came from the first ~2000 of 3000 steps,
    and lengths drawn from ranges removed that. None where some run draws its lengths."""
    fixed = set()
    for r in runs.itertuples():
        if str(r.workload).startswith("trace:"):
            return None
        try:
            out = as_lengths(getattr(r, "output_tokens", None))
        except ValueError:
            return None
        if out.low != out.high:
            return None
        fixed.add(out.low)
    if not fixed:
        return None
    n = "/".join(str(x) for x in sorted(fixed))
    return (f"every request decodes {n} tokens: the clients' cycles are equally long, so unless they wait for slots "
            "they keep the phases the loop's start gave them, and the TTFT tail is that of its first steps, where "
            "prompts still met, rather than of requests arriving at random; draw output lengths (--output-tokens "
            "LO-HI) for a tail that is the loop's own")


def choices(rows: pd.DataFrame, target_ms: float | None = None) -> list[ServingChoice]:
    """Per (workload, kernels) of the run's serving rows: the choice (see the module's docstring)."""
    out = []
    for (w, k), g in served_runs(rows).groupby(["workload", "kernels"], sort=False):
        note = lockstep_note(g)
        runs = tuple(sorted((ServingRun(
            k, int(r.max_loras), r.strategy, int(r.max_cudagraph_capture_size), int(r.point), float(r.output_tokens_per_s),
            _value(r.ttft_ms_p99), _value(r.ttft_ms_p99_low), _value(r.ttft_ms_p99_high), _value(r.itl_ms_p99),
            int(r.ttft_pending), _sum(r.graph_mem_bytes, r.mixed_graph_mem_bytes),
            _sum(r.startup_s, r.mixed_capture_s), int(_value(r.ttft_requests) or 0), int(r.iters),
            _value(getattr(r, "ttft_ms_p50", None)), _value(getattr(r, "itl_ms_p50", None)), getattr(r, "run_id", None))
            for r in g.itertuples()), key=lambda s: -s.output_tokens_per_s))
        if target_ms is None:
            out.append(ServingChoice(w, k, None, runs, runs[0], "the most output tokens/s (no TTFT target)", note))
            continue
        met = [s for s in runs if s.against(target_ms) == MET]
        if met:
            chosen = met[0]
            faster = [s for s in runs if s.output_tokens_per_s > chosen.output_tokens_per_s]
            why = (f"the most output tokens/s whose TTFT p99 is within {target_ms:g} ms (its 95 % interval below it)"
                   + (f"; {len(faster)} faster configuration(s) miss it or are not shown to meet it" if faster else "")
                   + few_requests(faster))
            out.append(ServingChoice(w, k, target_ms, runs, chosen, why, note))
            continue
        unclear = [s for s in runs if s.against(target_ms) == UNCLEAR]
        why = (f"none is shown to meet TTFT p99 <= {target_ms:g} ms"
               + (f"; {len(unclear)} not shown either way (interval spans it, or too few requests for one)"
                  if unclear else "") + few_requests(unclear))
        out.append(ServingChoice(w, k, target_ms, runs, None, why, note))
    return out


def few_requests(runs) -> str:
    """What the runs among ``runs`` whose TTFT p99 lacks an interval for want of requests would
    need: the requests, and the steps a loop at their rate takes to serve them ('' if none)."""
    few = [s for s in runs if s.too_few_requests and s.ttft_requests > 0]
    if not few:
        return ""
    need = quantile_interval_samples(0.99)
    steps = max(math.ceil(s.iters * need / s.ttft_requests) for s in few)
    lo, hi = min(s.ttft_requests for s in few), max(s.ttft_requests for s in few)
    served = f"{lo}" if lo == hi else f"{lo}-{hi}"
    return (f"; {len(few)} of them served {served} requests, a p99 interval needs {need}: "
            f"--iters {math.ceil(steps / 1000) * 1000} or more would serve them")


def _sum(a, b) -> float | None:
    if a is None or pd.isna(a):
        return None
    return float(a) + (0.0 if b is None or pd.isna(b) else float(b))
