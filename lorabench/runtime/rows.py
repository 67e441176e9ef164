"""A timed point's columns, from its samples: the statistics, the host's parts, what was served,
and the steps themselves (``Steps``, which the sweep writes into the run's samples)."""

import numpy as np

from lorabench.config.chunked import Served
from lorabench.config.plan import FIXED, LOOPS, PREFILL, SERVING, WORKLOAD, Point
from lorabench.config.serving_latency import latencies
from lorabench.runtime.dispatch import Dispatcher
from lorabench.runtime.timing import summarize
from lorabench.runtime.turns import Timed
from lorabench.storage.steps import Steps


PERCENTILES = (50, 90, 99)  # of a serving run's TTFT and inter-token latency


def latency_columns(served: Served, step_ms: np.ndarray) -> dict:
    """A serving run's latencies as its clients see them (``config.serving_latency``; the steps run
    back to back, each as long as it was timed): TTFT and ITL percentiles with their 95 %
    intervals (None where too few requests or gaps), how many requests were timed and pending,
    output tokens per second, and the steps' mix."""
    lat = latencies(served, step_ms)
    row = {"ttft_requests": int(lat.ttft_ms.size) + lat.ttft_censored, "ttft_pending": lat.ttft_pending,
           "ttft_censored": lat.ttft_censored,
           "output_tokens_per_s": lat.tokens_per_s,
           "prefill_token_share": sum(s.prefill_tokens for s in served.steps) / max(1, sum(s.tokens for s in served.steps)),
           "mixed_step_share": sum(s.prefill_tokens > 0 for s in served.steps) / max(1, len(served.steps))}
    for name, value, interval in (("ttft", lat.ttft_value, lat.ttft), ("itl", lat.itl_value, lat.itl)):
        for p in PERCENTILES:
            iv = interval(p)
            row[f"{name}_ms_p{p}"] = value(p)
            row[f"{name}_ms_p{p}_low"] = None if iv is None else iv.low
            row[f"{name}_ms_p{p}_high"] = None if iv is None else iv.high
    return row


HOST_BOUND = 0.9  # a step whose launches took this share of its GPU time or more ran at the host's pace
HOST_BOUND_TIME = 0.1  # a point is flagged when such steps hold this share of its time or more


def host_bound(launch_us: np.ndarray, step_ms: np.ndarray) -> str | None:
    """Why a GPU point's time is partly the host's, not its kernels': steps whose launches (the
    host's time in the step's ``run``) took nearly all of their events' span hold a tenth of its
    time or more; None otherwise. A replayed graph launches in microseconds; steps that run kernels
    between graphs or eagerly can be host-bound (a loop's mixed steps among its decode steps too)."""
    bound = launch_us >= HOST_BOUND * step_ms * 1e3
    total = float(step_ms.sum())
    share = float(step_ms[bound].sum()) / total if total > 0 else 0.0
    if share >= HOST_BOUND_TIME:
        return f"host-bound: {100 * share:.0f} % of the time in steps whose launches took >= {100 * HOST_BOUND:.0f} % of them"
    return None


STALL = 5  # a loop's step this many times its reference or more: a compile or a stall, not its work
PEERS = 5  # steps of about its size a step's reference needs; with fewer, the steps at least half its size


def stalls(step_ms: np.ndarray, tokens: np.ndarray) -> str | None:
    """Why a loop's latencies read high: steps that took ``STALL`` times the median of the other
    steps of about their size (half to twice their tokens) or more, or, with fewer than ``PEERS``
    of those, of the other steps of at least half their size; e.g. a step that compiled kernels
    (on an H100: 0.4-1.2 s among 50-60 ms steps). One such step sets a TTFT p99 of few requests.
    None when there are none."""
    slow = np.zeros(len(step_ms), dtype=bool)
    for t in np.unique(tokens):
        near = np.flatnonzero((tokens * 2 >= t) & (tokens <= 2 * t))
        larger = np.flatnonzero(tokens * 2 >= t)
        for i in np.flatnonzero(tokens == t):
            others = step_ms[near[near != i]]
            if others.size < PEERS:
                others = step_ms[larger[larger != i]]
            slow[i] = others.size > 0 and step_ms[i] > 0 and step_ms[i] >= STALL * np.median(others)
    if not slow.any():
        return None
    worst = int(np.argmax(np.where(slow, step_ms, -np.inf)))
    return (f"{int(slow.sum())} step(s) took >= {STALL}x the median of steps of their size, the longest "
            f"{step_ms[worst]:.0f} ms at {int(tokens[worst])} tokens (a compile or a stall: latency tails read high)")


def timed_columns(d: Dispatcher, point: Point, t: Timed, predicted: dict, served: Served | None = None) -> tuple[dict, Steps]:
    """The columns an ok row adds to the point's, and its steps. ``noisy_iqr``, ``noisy_host`` and
    ``noisy_stall`` (not columns): why the step times are too spread (``lorabench.runtime.timing.summarize``),
    why they are the host's (``host_bound``), why a loop's tails read high (``stalls``), or None.
    ``served``: a serving point's requests over its timed steps (``Schedule.served``)."""
    c, s = point.concurrency, t.samples()
    stats = summarize(s.step_ms)
    row = {**stats, "status": "ok", "timed_steps": len(s.step_ms),
           "graph_tokens": d.route(c, 0).tokens,
           "host_us_median": float(np.median(s.host_us)),
           "host_us_p90": float(np.percentile(s.host_us, 90)),
           "copy_us_median": float(np.median(s.copy_us)),
           "launch_us_median": float(np.median(s.launch_us)),
           "tokens_per_s": c / (stats["step_ms_median"] / 1e3),
           "n_active_mean": float(s.n_active.mean()), "graph_loras_mean": float(s.launch_counts.mean())}
    row["noisy_host"] = host_bound(s.launch_us, s.step_ms) if d.use_graphs else None
    if point.mode in LOOPS:  # among the steps that loaded or read no adapter: those spend their time on it
        quiet = (s.loads == 0) & (s.reads == 0)
        row["noisy_stall"] = stalls(s.step_ms[quiet], s.tokens[quiet])
    else:
        row["noisy_stall"] = None
    if predicted and point.mode == WORKLOAD:
        row["predicted_ms"] = predicted.get((point.workload, c))
    if point.mode == FIXED:
        row["base_tokens"] = c if point.n_active == 0 else 0
        row["graph_loras"] = int(s.launch_counts[0])
    if point.mode == PREFILL:  # one step of prefill_tokens tokens from c requests
        route = d.route_mixed(point.prefill_tokens, point.n_active)
        row.update(graph_tokens=route.tokens, graph_loras=int(s.launch_counts[0]), mixed_route="piecewise" if route.graphed
                   else "eager", base_tokens=point.prefill_tokens if point.n_active == 0 else 0,
                   tokens_per_s=point.prefill_tokens / (stats["step_ms_median"] / 1e3), tokens_per_step=float(s.tokens.mean()))
    if d.model.cfg.moe is not None:  # the path of each count the steps launched (a workload's may differ; joined)
        paths = dict.fromkeys(d.moe_path(row["graph_tokens"], n) for n in sorted(set(s.launch_counts.tolist())) if n > 0)
        row["moe_lora_path"] = ", ".join(paths) or None  # None: no step launched an adapter column
    if point.mode in LOOPS:  # tokens per second over the whole run: a step of few tokens counts as few
        row.update(tokens_per_s=float(s.tokens.sum() / (s.step_ms.sum() / 1e3)), tokens_per_step=float(s.tokens.mean()),
                   loads_per_step=float(s.loads.mean()), storage_reads_per_step=float(s.reads.mean()),
                   storage_read_bytes_per_step=float(s.read_bytes.mean()))
    if point.mode == SERVING:
        row.update(latency_columns(served, s.step_ms))
    steps = Steps(turn=t.turns(), step_ms=s.step_ms.tolist(), host_us=s.host_us.tolist(), copy_us=s.copy_us.tolist(),
                  launch_us=s.launch_us.tolist(), n_active=s.n_active.tolist(), launches=s.launch_counts.tolist(),
                  tokens=s.tokens.tolist(), loads=s.loads.tolist(), reads=s.reads.tolist(),
                  read_bytes=s.read_bytes.tolist())
    return row, steps
