"""The report's serving section: serving runs (requests with prompts, chunked prefill), their
throughput and the latencies their clients see, per configuration."""

import pandas as pd

from lorabench.analysis.serving import lockstep_note
from lorabench.analysis.serving_price import FIGURES
from lorabench.commands.report.labels import in_order
from lorabench.commands.tables import markdown_table
from lorabench.stats import quantile_interval_samples


def _with_interval(r, name: str) -> str | None:
    """``p [low, high]`` in ms, the interval left out where too few requests or gaps gave none."""
    value = getattr(r, name)
    if value is None or pd.isna(value):
        return None
    low, high = getattr(r, f"{name}_low"), getattr(r, f"{name}_high")
    return _ms(value) + ("" if pd.isna(low) or pd.isna(high) else f" [{_ms(low)}, {_ms(high)}]")


def _ms(v: float) -> str:
    """A latency; +inf (among requests still waiting at the run's end) as beyond the run."""
    return f"{v:.2f}" if v != float("inf") else "beyond the run"


def serving_md(runs: pd.DataFrame, u: str, predicted: list | None = None) -> list[str]:
    """Per workload, every serving run: tokens/s, TTFT and ITL percentiles with their intervals,
    the steps' mix and loads; then each run against its prediction (``analysis.serving_price``)."""
    if runs.empty:
        return []
    r0 = runs.iloc[0]
    out = ["## Serving with prompts: throughput, time to first token, inter-token latency", "",
           f"Each serving run is a closed loop of {int(r0.concurrency)} clients over {int(r0.adapters)} adapters, each "
           f"request a prompt of {r0.input_tokens} tokens and {r0.output_tokens} output tokens, scheduled as vLLM "
           f"schedules chunked prefill (at most {int(r0.max_num_batched_tokens)} tokens per step, decode first, prompts "
           "chunked; a request waits while the running ones hold max_loras other adapters); adapters are loaded into "
           "slots least recently used, inside the step that needs them. A step with a prompt chunk replays PIECEWISE "
           "graphs (eager past the largest size), a decode step its FULL graph. The latencies take the steps as run "
           "back to back, each as long as it was timed: TTFT from the start of the step a request arrived in to the "
           "end of the step that made its first token, ITL between its tokens; TTFT counts the requests that arrived "
           "in the timed steps at least the longest TTFT seen before their end, those still waiting among them above "
           "every timed one (a percentile that falls among them is beyond the run); `pending`: every request still "
           f"waiting at the end. Percentiles in {u}, with distribution-free 95 % intervals where there are enough requests "
           f"(p90: {quantile_interval_samples(0.9)}, p99: {quantile_interval_samples(0.99)}).", ""]
    for w, g in runs.groupby("workload", sort=False):
        g = in_order(g, by=("kernels", "max_loras", "strategy"))
        rows = [[r.kernels, int(r.max_loras), r.strategy, r.output_tokens_per_s, r.tokens_per_s,
                 _with_interval(r, "ttft_ms_p50"), _with_interval(r, "ttft_ms_p90"), _with_interval(r, "ttft_ms_p99"),
                 _with_interval(r, "itl_ms_p50"), _with_interval(r, "itl_ms_p90"), _with_interval(r, "itl_ms_p99"),
                 r.step_ms_mean,
                 f"{100 * r.prefill_token_share:.0f} %", f"{100 * r.mixed_step_share:.0f} %", 1000 * r.loads_per_step,
                 f"{int(r.ttft_requests)} ({int(r.ttft_censored)}) / {int(r.ttft_pending)}"] for r in g.itertuples()]
        out += [f"**{w}**\n",
                markdown_table(["kernels", "max_loras", "strategy", "output tokens/s", "tokens/s", "TTFT p50", "TTFT p90",
                                "TTFT p99", "ITL p50", "ITL p90", "ITL p99", "mean step", "prompt tokens", "steps with prompts",
                                "loads/1k steps", "TTFT requests (still waiting) / pending"], rows), ""]
        note = lockstep_note(g)
        if note:
            out += [f"Note: {note}.", ""]
    return out + _predicted_md(runs, predicted or [])


def _predicted_md(runs: pd.DataFrame, predicted: list) -> list[str]:
    if not predicted:
        return []
    by_point = runs.set_index("point")
    rows, why = [], []
    for p in predicted:
        r = by_point.loc[p.point]
        if p.why:
            why.append(f"- {r.kernels} max_loras {int(r.max_loras)} {r.strategy} under {r.workload}: not predicted: {p.why}")
            continue
        cells = []
        for name in FIGURES:
            m, e = p.measured.get(name), p.error_pct(name)
            cells.append(None if m is None else f"{m:.1f} / {p.predicted[name]:.1f} ({e:+.1f} %)" if e is not None else f"{m:.1f}")
        rows.append([r.kernels, int(r.max_loras), r.strategy, r.workload, *cells])
    out = ["**Measured against predicted** (measured / predicted (error)): the same loop's steps priced from the run's "
           "fixed points (decode steps, at their graph's bucket), its prefill points (steps with a prompt, interpolated "
           "in tokens at their active count) and its timed load, the latencies taken from those steps", ""]
    if rows:
        out += [markdown_table(["kernels", "max_loras", "strategy", "workload", "output tokens/s", "mean step ms",
                                "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms"], rows), ""]
    return out + why + ([""] if why else [])
