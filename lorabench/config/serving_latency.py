"""A served schedule's latencies as its clients see them: time to first token (TTFT), inter-token
latency (ITL) and output tokens per second, from each step's time.

Steps run back to back; step i starts when step i-1 ends. A request waits from the start of its
arrival step (in the closed loop, the end of its predecessor's last step); its first token is out
at the end of the step that processed its last prompt token, each later one at the end of the
step that decoded it. TTFT = first token's end - arrival; ITL = the gaps between a request's
consecutive tokens. Only what the first ``from_step`` steps did not start counts: requests that
arrived from that step on, gaps whose first token came from it on, tokens out from it on (the
loop's start, every client arriving at once, is not the steady state). Requests still waiting
for their first token when the steps end are counted (``ttft_pending``), not timed: under load
they are the slowest, so percentiles over ``ttft_ms`` alone read low when many are pending.
"""

from dataclasses import dataclass

import numpy as np

from lorabench.config.chunked import Served
from lorabench.stats import Interval, quantile_interval



@dataclass(frozen=True)
class Latencies:
    ttft_ms: np.ndarray  # one per request that arrived from ``from_step`` on and got its first token
    ttft_pending: int  # requests that arrived from ``from_step`` on and had no token when the steps ended
    itl_ms: np.ndarray  # one per gap between consecutive tokens of a request
    output_tokens: int  # tokens out in the counted steps
    wall_ms: float  # the counted steps' time

    @property
    def tokens_per_s(self) -> float:
        return 1000 * self.output_tokens / self.wall_ms if self.wall_ms > 0 else float("nan")

    def ttft(self, p: int) -> Interval | None:
        """TTFT's p-th percentile with its interval (None: too few requests for one)."""
        return quantile_interval(self.ttft_ms, p / 100)

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
    ttft, itl, tokens, pending = [], [], 0, 0
    for r in served.requests:
        steps = r.emitted_at
        if from_step <= r.arrival < len(ms):
            if steps:
                ttft.append(end[steps[0]] - start[r.arrival])
            else:
                pending += 1
        itl.extend(end[b] - end[a] for a, b in zip(steps, steps[1:]) if a >= from_step)
        tokens += sum(1 for s in steps if s >= from_step)
    return Latencies(np.array(ttft), pending, np.array(itl), tokens, float(ms[from_step:].sum()))
