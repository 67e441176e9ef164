"""A serving run against its prediction: the same loop's steps priced from the run's own points.

The schedule a serving run timed is simulated again (``config.serving.simulate_prompts``, seeded
as the worker seeds it). Each step is priced from the same configuration's points: a decode step
of b tokens at the fixed point of its graph's bucket and its active count; a step with a prompt
chunk, of T tokens, by linear interpolation in T between the points measured at its active count
(the fixed points at their c tokens, the prefill points at theirs; past the largest, along the
last two); plus its loads at the run's timed load. The predicted steps then give the latencies the
same requests would see (``config.serving_latency``), set against the measured ones.
"""

from dataclasses import dataclass

import numpy as np
import pandas as pd

from lorabench.analysis.points import ok_points
from lorabench.config.lengths import parse_lengths
from lorabench.config.residency import Adapters
from lorabench.config.serving import simulate_prompts
from lorabench.config.serving_latency import latencies
from lorabench.config.strategies import choose_bucket
from lorabench.config.workload import parse_workload

FIGURES = ("output_tokens_per_s", "step_ms_mean", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99")


@dataclass(frozen=True)
class ServingPrediction:
    point: int
    measured: dict  # FIGURES -> the row's value
    predicted: dict  # FIGURES -> the prediction's (None: not predicted)
    why: str | None = None  # why not predicted
    ttft_requests: int = 0  # the requests the predicted TTFT percentiles count

    def error_pct(self, name: str) -> float | None:
        m, p = self.measured.get(name), self.predicted.get(name)
        if m is None or p is None or pd.isna(m) or not m or not np.isfinite(m) or not np.isfinite(p):
            return None
        return 100 * (p / m - 1)


def _anchors(points: pd.DataFrame, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, median step) of the configuration's fixed and prefill points at ``n``, by tokens;
    none without a prefill point there (decode points alone say nothing of a prompt's cost)."""
    at = points[points.n_active == n]
    if not (at["mode"] == "prefill").any():
        at = at.iloc[:0]
    tokens = np.where(at["mode"] == "prefill", at.prefill_tokens, at.concurrency).astype(float)
    order = np.argsort(tokens)
    return tokens[order], at.step_ms_median.to_numpy(dtype=float)[order]


def _interpolate(tokens: float, xs: np.ndarray, ys: np.ndarray) -> float | None:
    if len(xs) == 0 or (len(xs) == 1 and tokens != xs[0]):
        return None
    if tokens <= xs[-1]:
        return float(np.interp(tokens, xs, ys))
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])  # past the largest: along the last two points
    return float(ys[-1] + slope * (tokens - xs[-1]))


def predict(view_rows: pd.DataFrame, row) -> ServingPrediction:
    """One serving row against its prediction (see the module's docstring)."""
    measured = {f: (None if pd.isna(getattr(row, f)) else float(getattr(row, f))) for f in FIGURES}
    ok = ok_points(view_rows)
    mine = ok[(ok.kernels == row.kernels) & (ok.max_loras == row.max_loras) & (ok.strategy == row.strategy)]
    points = mine[mine["mode"].isin(["fixed", "prefill"])]
    fixed = points[points["mode"] == "fixed"].set_index(["concurrency", "n_active"]).step_ms_median.to_dict()
    try:
        steps = simulate_prompts(parse_workload(row.workload), Adapters(int(row.adapters), int(row.max_cpu_loras),
                                                                        row.output_tokens),
                                 int(row.concurrency), int(row.max_loras), int(row.timed_steps),
                                 parse_lengths(row.input_tokens, "input_tokens"), int(row.max_num_batched_tokens),
                                 int(row.seed))
    except (ValueError, TypeError) as e:
        return ServingPrediction(int(row.point), measured, {}, f"its loop cannot be simulated again: {e}")
    load_ms = 0.0 if pd.isna(row.load_ms_median) else float(row.load_ms_median)
    sizes = sorted(int(b) for b in row.capture_sizes)
    anchors: dict[int, tuple] = {}
    predicted_ms = np.empty(len(steps.pieces))
    for k, step in enumerate(steps.pieces):
        n, tokens = int(steps.n_active[k]), int(steps.tokens[k])
        if step.prefill_tokens == 0:
            bucket = choose_bucket(tokens, sizes)
            t = fixed.get((bucket, n)) if bucket is not None else None
        else:
            if n not in anchors:  # not setdefault: its default would be built for every step
                anchors[n] = _anchors(points, n)
            t = _interpolate(tokens, *anchors[n])
        if t is None or pd.isna(t):
            what = f"a decode step of {tokens} tokens" if step.prefill_tokens == 0 else f"a {tokens}-token step with a prompt"
            return ServingPrediction(int(row.point), measured, {},
                                     f"no point prices {what} at n = {n} (fixed or prefill points missing)")
        predicted_ms[k] = t + steps.n_loads[k] * load_ms
    lat = latencies(steps.served, predicted_ms)
    predicted = {"output_tokens_per_s": lat.tokens_per_s, "step_ms_mean": float(predicted_ms.mean())}
    for p in (50, 99):
        predicted[f"ttft_ms_p{p}"], predicted[f"itl_ms_p{p}"] = lat.ttft_value(p), lat.itl_value(p)
    return ServingPrediction(int(row.point), measured, predicted, ttft_requests=int(np.size(lat.ttft_ms)))


def predictions(rows: pd.DataFrame) -> list[ServingPrediction]:
    """Every ok serving row of lorabench's kernels and vLLM's alike against its prediction."""
    ok = ok_points(rows)
    return [predict(rows, r) for r in ok[ok["mode"] == "serving"].itertuples()]
