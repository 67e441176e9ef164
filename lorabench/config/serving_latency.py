"""A served schedule's latencies as its clients see them: time to first token (TTFT), inter-token
latency (ITL) and output tokens per second, from each step's time.

Steps run back to back; step i starts when step i-1 ends. A request waits from the start of its
arrival step (in the closed loop, the end of its predecessor's last step); its first token is out
at the end of the step that processed its last prompt token, each later one at the end of the
step that decoded it. TTFT = first token's end - arrival; ITL = the gaps between a request's
consecutive tokens. Only what the first ``from_step`` steps did not start counts: requests that
arrived from that step on, gaps whose first token came from it on, tokens out from it on (the
loop's start, every client arriving at once, is not the steady state).

Requests still waiting for their first token when the steps end are right-censored: their TTFT is
not known, only that it exceeds the time they had waited. Dropping them would make the
percentiles read low (under load they are the slowest). So TTFT counts only the requests that
arrived at least the longest observed TTFT before the end: each of them either got its token, or
waited longer than any request that did, and those count above every timed one (``ttft_censored``).
A percentile (or an interval's bound) that falls among them is not known: +inf. Requests arriving
later are left out of TTFT (``ttft_pending`` counts every one still waiting).
"""

from dataclasses import dataclass

import numpy as np

from lorabench.config.chunked import Served
from lorabench.stats import Interval, quantile_interval


def _with_censored(x: np.ndarray, censored: int) -> tuple[np.ndarray, float]:
    """``x`` and ``censored`` stand-ins above every one of it, and the largest known value: a
    statistic of them that lands above it lands among the censored."""
    x = np.asarray(x, dtype=float)
    top = float(x.max()) if x.size else 0.0
    return np.concatenate([x, np.full(censored, 2 * top + 1)]), top


def censored_quantile(x: np.ndarray, censored: int, q: float) -> Interval | None:
    """``quantile_interval`` of ``x`` and ``censored`` more values above every one of it: where the
    estimate or a bound falls among those, it is +inf (None: too few values for an interval)."""
    values, top = _with_censored(x, censored)
    iv = quantile_interval(values, q)
    if iv is None or not censored:
        return iv

    def known(v):
        return v if v <= top else float("inf")

    return Interval(known(iv.estimate), known(iv.low), known(iv.high), iv.level)


def censored_percentile(x: np.ndarray, censored: int, p: float) -> float | None:
    """The p-th percentile of ``x`` and ``censored`` values above them all (+inf where it falls
    among those; None without any value)."""
    values, top = _with_censored(x, censored)
    if not values.size:
        return None
    v = float(np.percentile(values, p))
    return v if not censored or v <= top else float("inf")


@dataclass(frozen=True)
class Latencies:
    ttft_ms: np.ndarray  # the counted requests that got their first token (see the module's docstring)
    ttft_censored: int  # the counted requests still waiting at the end: longer than every one of ttft_ms
    ttft_pending: int  # every request that arrived from ``from_step`` on and had no token when the steps ended
    itl_ms: np.ndarray  # one per gap between consecutive tokens of a request
    output_tokens: int  # tokens out in the counted steps
    wall_ms: float  # the counted steps' time

    @property
    def tokens_per_s(self) -> float:
        return 1000 * self.output_tokens / self.wall_ms if self.wall_ms > 0 else float("nan")

    def ttft_value(self, p: float) -> float | None:
        """TTFT's p-th percentile (+inf: among the censored; None: no request counted)."""
        return censored_percentile(self.ttft_ms, self.ttft_censored, p)

    def ttft(self, p: int) -> Interval | None:
        """TTFT's p-th percentile with its interval (None: too few requests for one)."""
        return censored_quantile(self.ttft_ms, self.ttft_censored, p / 100)

    def itl_value(self, p: float) -> float | None:
        """ITL's p-th percentile (None: no gap)."""
        return float(np.percentile(self.itl_ms, p)) if self.itl_ms.size else None

    def itl(self, p: int) -> Interval | None:
        return quantile_interval(self.itl_ms, p / 100)


def latencies(served: Served, step_ms, from_step: int = 0) -> Latencies:
    """The latencies of ``served`` whose step i took ``step_ms[i]`` ms (one per step)."""
    ms = np.asarray(step_ms, dtype=np.float64)
    if ms.shape != (len(served.steps),):
        raise ValueError(f"{ms.size} step times for {len(served.steps)} steps")
    if not 0 <= from_step <= len(ms):
        raise ValueError(f"from_step {from_step} is outside the {len(ms)} steps")
    end = np.cumsum(ms)
    start = end - ms
    timed, waiting, itl, tokens = [], [], [], 0  # (arrival time, TTFT); arrival times of those still waiting
    for r in served.requests:
        steps = r.emitted_at
        if from_step <= r.arrival < len(ms):
            if steps:
                timed.append((start[r.arrival], end[steps[0]] - start[r.arrival]))
            else:
                waiting.append(start[r.arrival])
        itl.extend(end[b] - end[a] for a, b in zip(steps, steps[1:]) if a >= from_step)
        tokens += sum(1 for s in steps if s >= from_step)
    last = float(end[-1]) if len(ms) else 0.0
    longest = max((t for _, t in timed), default=0.0)
    ttft = [t for a, t in timed if a <= last - longest]  # arrived early enough for any TTFT seen to be seen
    censored = sum(1 for a in waiting if a <= last - longest)
    return Latencies(np.array(ttft), censored, len(waiting), np.array(itl), tokens, float(ms[from_step:].sum()))
