"""``report.md``: a run's tables, section by section, around its figures."""

import numpy as np
import pandas as pd

from lorabench.analysis.decision import MeasuredDecision
from lorabench.analysis.intervals import APART_MARGIN_PCT, NO_SAMPLES, interval_of
from lorabench.analysis.points import ok_points, short_uuid
from lorabench.analysis.view import RunView
from lorabench.commands.report.agnostic import agnostic_md
from lorabench.commands.report.backends import backends_md, padding_md
from lorabench.commands.report.correctness import correctness_md, hypothesis_verdict  # noqa: F401  (tests read it here)
from lorabench.commands.report.labels import strategies, unit
from lorabench.commands.report.moe import moe_md
from lorabench.commands.report.prefill import prefill_md
from lorabench.commands.report.recommendation import recommendation_md
from lorabench.commands.report.roofline import roofline_md
from lorabench.commands.tables import cell, index, markdown_table, mib
from lorabench.config.backends import label_order
from lorabench.config.strategies import AUTO
from lorabench.stats import describe
from lorabench.storage.runs import run_status


def _steps(df: pd.DataFrame, r) -> str:
    """``100``, or ``10–40 (--ci-target 0.3)`` when the CI target stopped points early."""
    steps = ok_points(df).get("timed_steps")
    if steps is None or steps.isna().all():
        return f"{int(r.iters)}"
    lo, hi = int(steps.min()), int(steps.max())
    target = r.get("ci_target")
    return (f"{lo}" if lo == hi else f"{lo}–{hi}") + (f" (--ci-target {target:g})" if pd.notna(target) else "")


def model_md(r) -> list[str]:
    """What the header says beyond the model's name: where its shapes came from, one TP rank, mixed ranks."""
    get = lambda c: r[c] if c in r.index and not (isinstance(r[c], float) and pd.isna(r[c])) else None  # noqa: E731
    out = []
    if get("architecture") and get("model_source") not in (None, "preset"):
        out.append(f"- shapes: {get('architecture')} from `{get('model_source')}` (weights random)")
    tp = get("tp")
    if tp is not None and int(tp) > 1:
        lora = ("fully sharded (--fully-sharded-loras: A's rank cut on qkv and gate_up, B's outputs on o and down)"
                if get("fully_sharded_loras") else "sharded as vLLM shards it by default")
        out.append(f"- tensor parallel: one of {int(tp)} ranks, timed alone: a 1/{int(tp)} share of the heads, "
                   f"intermediate features and vocabulary, of the KV heads where there are {int(tp)} or more (else one, "
                   f"replicated), LoRA {lora}; **the rank's collectives (an all-reduce after o and after down in every "
                   "layer, the embedding's all-reduce, the logits' all-gather, and fully sharded LoRA's own) are left "
                   "out of every figure**")
    if get("shared_expert_weights"):
        out.append("- **one set of routed-expert weights read by every MoE layer** (--share-expert-weights: the routers, "
                   "expert LoRA, attention and KV cache are each layer's own)")
    if get("ranks"):
        slots = get("slot_ranks")
        held = f" (slots: {', '.join(str(int(x)) for x in slots)})" if slots is not None else ""
        out.append(f"- adapters' own ranks: {get('ranks')}{held}, zero-padded to rank {int(r['rank'])} as vLLM pads them; "
                   "`<backend>+unpadded` computes each at its own rank (What padding costs)")
    if get("adapter_dir"):
        slots = get("slot_ranks")
        held = f", slots at ranks {', '.join(str(int(x)) for x in slots)}" if slots is not None else ""
        out.append(f"- the user's PEFT adapters: {get('adapter_dir')} ({int(r['adapters'])} adapters{held}, zero-padded to "
                   f"rank {int(r['rank'])} as vLLM pads them; slot i holds adapter i, by folder name)")
    return out


def active_counts_md(run_info: dict) -> list[str]:
    """The header's line for a run that measured some active counts only (``--active-counts``)."""
    counts = (run_info.get("spec") or {}).get("active_counts")
    if counts is None:
        return []
    return [f"- active counts measured: n = {', '.join(map(str, counts))} only (--active-counts); a workload whose mix "
            "reaches another count has no expected step ('-' below), and a decision covers only the concurrencies "
            "where every count its workload reaches was measured"]


def auto_md(df: pd.DataFrame, exp: pd.DataFrame, run_info: dict, u: str, samples=None) -> list[str]:
    """Strategy auto: what the cost model (from the --auto-from run) predicted for the chosen
    set, next to what this run measured for it; the measured median against the prediction with
    an interval drawn from the measured samples only (the prediction is taken as exact)."""
    runs = ok_points(df)
    pred = runs[(runs.strategy == AUTO) & (runs["mode"] == "workload")] if "predicted_ms" in runs else runs.iloc[:0]
    pred = pred[pred.predicted_ms.notna()] if len(pred) else pred
    if pred.empty:
        return []
    source = (run_info.get("spec") or {}).get("auto_from", "the --auto-from run")
    e = exp[exp.strategy == AUTO].set_index(["kernels", "max_loras", "workload", "concurrency"])
    rows = []
    for r in pred.sort_values(["kernels", "max_loras", "concurrency"]).itertuples():
        key = (r.kernels, r.max_loras, r.workload, r.concurrency)
        expected = e.expected_ms.get(key, np.nan)
        pt, pred_ms = index(r.point), float(r.predicted_ms)
        iv, why = interval_of(samples, lambda m, pt=pt: 100 * (m[pt] / pred_ms - 1), [pt])
        rows.append([r.kernels, int(r.max_loras), "[" + ",".join(str(int(x)) for x in r.captured_counts) + "]", r.workload,
                     int(r.concurrency), r.predicted_ms, expected, r.step_ms_mean, r.step_ms_median,
                     cell(100 * (expected / r.predicted_ms - 1), "{:+.2f} %"), cell(100 * (r.step_ms_mean / r.predicted_ms - 1), "{:+.2f} %"),
                     describe(iv, APART_MARGIN_PCT) if iv is not None else
                     f"{100 * (r.step_ms_median / r.predicted_ms - 1):+.2f} % (no interval: {why})"])
    return [f"## Strategy auto: predicted vs measured ({u})", "",
            f"predicted = the cost model built from `{source}` for the chosen set; expected = sum over n of "
            "P(n | c) x this run's median(c, n) for that set; measured = its workload run's mean; median = its "
            "workload run's median, against the prediction with a 95 % interval drawn from the measured samples only "
            "(the prediction is taken as exact; faster = the run measured less than predicted).", "",
            markdown_table(["kernels", "max_loras", "set", "workload", "c", "predicted", "expected", "measured", "median",
                      "expected vs predicted", "measured vs predicted", "median vs predicted"], rows), ""]


INTERVALS = "95 % percentile bootstrap from every timed step kept (samples/), each point's median resampled independently"


def gpu_md(gpus: dict) -> list[str]:
    """Header lines: the GPU each (kernels, max_loras) was compared on, and the rows left out
    because they were measured on another GPU."""
    out = []
    used = sorted({g["gpu_uuid"] for g in gpus.values() if g["gpu_uuid"]})
    if used:
        out.append(f"- GPU{'s' if len(used) > 1 else ''} compared on: {', '.join(used)}")
    for (k, m), g in sorted(gpus.items(), key=lambda kv: (label_order(kv[0][0]), kv[0][1])):
        for s_, uuids in g["elsewhere"].items():
            out.append(f"- {k}/{m}/{s_}: measured on another GPU ({', '.join(short_uuid(x) for x in uuids)}) than "
                       f"max's ({short_uuid(g['gpu_uuid'])}): not compared")
    return out


def piecewise_md(cfg: pd.DataFrame) -> list[str]:
    """What each configuration's PIECEWISE graphs (mixed steps) cost besides its FULL graphs."""
    have = cfg[cfg.num_mixed_graphs.notna()] if "num_mixed_graphs" in cfg else cfg.iloc[:0]
    if have.empty:
        return []
    return ["PIECEWISE graphs (mixed steps: the model's pieces between attentions, per token bucket and key), captured "
            "after the FULL ones and not counted in their columns:", "",
            markdown_table(["kernels", "max_loras", "strategy", "PIECEWISE graphs", "their MiB", "their capture s"],
                           [[c.kernels, int(c.max_loras), c.strategy, int(c.num_mixed_graphs), mib(c.mixed_graph_mem_bytes),
                             c.mixed_capture_s] for c in have.itertuples()]), ""]


def render_markdown(view: RunView, run_info: dict, over: pd.DataFrame, fl: pd.DataFrame,
                    decisions: list[MeasuredDecision], plots: dict, incomplete: str | None = None,
                    extra: list[str] | None = None, prefill: pd.DataFrame | None = None) -> str:
    """The whole report of a run (``view``): configurations, expected steps, LoRA overhead (``over``),
    roofline floors (``fl``), the recommendation (``decisions``) and the figures already written
    (``plots``: name -> path); ``incomplete``: the line saying how the run is incomplete
    (``lorabench.commands.report.incomplete_line``), if it is; ``extra``: a section of its own (the
    residency runs'), before the recommendation."""
    df, cfg, exp, samples = view.rows, view.configs, view.expected(), view.samples
    r = ok_points(df).iloc[0]
    where = f"{r.gpu_name} (driver {r.driver}, CUDA {r.cuda})" if r.device == "cuda" else "CPU: figures are CPU wall times, not GPU results"
    u = unit(df)
    wall = run_info.get("wall_s")
    wall = (f"{wall:.1f} s" if wall is not None
            else f"not recorded (run {run_status(run_info)})" if run_info else "not recorded (no run.json)")
    out = [
        f"# lorabench report: {r.run_id}",
        "",
        *([f"> **Incomplete run**: {incomplete}. Comparisons are over the points "
           "both strategies have (see Recommendation).", ""] if incomplete else []),
        f"- machine: {where}",
        f"- model: {r.model}, {int(r.layers)} layers, hidden {int(r.hidden)}, rank {int(r['rank'])}, {r['dtype']}, "
        f"context {int(r.context_len) if pd.notna(r.context_len) else '-'}",
        *model_md(r),
        f"- torch {r.torch}, triton {r.triton}, git {r.git_sha}",
        f"- command: `{run_info.get('argv', r.argv)}`",
        f"- sweep wall time: {wall}; {len(df)} points, {int((df.status == 'failed').sum())} failed, "
        f"{int(ok_points(df).noisy.sum())} noisy (IQR/median >= 10 %, host-bound steps, or a GPU slowdown or clock drop)",
        f"- timing: {u}; median of {_steps(df, r)} steps per point after {int(r.warmup)} warm-up steps",
        *active_counts_md(run_info),
        f"- intervals: {INTERVALS if samples is not None else 'none: ' + NO_SAMPLES + ' (decisions on medians alone)'}",
        *gpu_md(view.gpus),
        "",
        *correctness_md(df),
        "## Capture sets and their cost",
        "",
        markdown_table(
            ["kernels", "max_loras", "strategy", "launch counts", "graphs", "graph MiB", "pool MiB", "build s", "compile s", "capture s", "startup s"],
            [[c.kernels, int(c.max_loras), c.strategy, "[" + ",".join(map(str, c.captured_counts)) + "]", int(c.num_graphs), mib(c.graph_mem_bytes),
              mib(c.pool_bytes), c.build_s, c.compile_s, c.capture_s, c.startup_s] for c in cfg.itertuples()],
        ),
        "",
        *piecewise_md(cfg),
        f"![memory and startup]({plots['memory_startup'].name})",
        "",
        f"## Step time by active count ({u}, median [launch count], overhead over n = 0)",
        "",
        f"![latency vs active]({plots['latency_vs_active'].name})",
        "",
    ]
    strats = strategies(df)
    for (k, m), g in over.groupby(["kernels", "max_loras"]):
        out.append(f"**{k}, max_loras = {m}**\n")
        first = g.drop_duplicates(["concurrency", "n_active", "strategy"])
        at = {(c, n, s): f"{ms:.3f} [{int(gl)}] {pct:+.1f} %" for c, n, s, ms, gl, pct in
              zip(first.concurrency, first.n_active, first.strategy, first.step_ms_median, first.graph_loras, first.overhead_pct)}
        rows = [[int(c), int(n)] + [at.get((c, n, s), "-") for s in strats]
                for c, n in sorted(set(zip(g.concurrency, g.n_active)))]
        out += [markdown_table(["c", "n"] + strats, rows), ""]
    if "backends" in plots:
        out += backends_md(over, cfg, u, plots["backends"], samples)
    out += padding_md(over, u, samples)
    out += agnostic_md(over, cfg, u)
    out += moe_md(over, u)
    out += roofline_md(fl, plots.get("roofline"))
    if prefill is not None:
        out += prefill_md(prefill, u, plots.get("overhead_vs_tokens"), samples)
    if not exp.empty:
        out += [f"## Expected step under each workload ({u})", "",
                "expected = sum over n of P(n | c) x median(c, n); measured = the workload run's mean over its steps.", "",
                f"![latency vs concurrency]({plots['latency_vs_concurrency'].name})", "",
                f"![speed-up]({plots['speedup'].name})", ""]
        rows = [[e.kernels, e.max_loras, e.workload, e.concurrency, e.strategy, e.expected_ms, e.measured_mean_ms,
                 (e.measured_mean_ms / e.expected_ms - 1) * 100 if e.expected_ms else np.nan, e.speedup_vs_max]
                for e in exp.sort_values(["kernels", "max_loras", "workload", "concurrency"]).itertuples()]
        out += [markdown_table(["kernels", "max_loras", "workload", "c", "strategy", "expected", "measured", "meas/exp - 1 (%)", "speed-up vs max"], rows), ""]
        out += auto_md(df, exp, run_info, u, samples)
    ok = ok_points(df)
    ok = ok[ok["mode"].isin(["fixed", "workload"])]  # decode steps of c tokens (prefill and loop steps vary)
    host = ok.groupby(["kernels", "concurrency"]).agg(
        host=("host_us_median", "median"), copy=("copy_us_median", "median"), launch=("launch_us_median", "median"))
    out += ["## Host overhead per decode step (us, median over the fixed and workload points)", "",
            "`host` = building the batch metadata + choosing the graph; `copy` = the call queueing the metadata's "
            "copy to the device; `launch` = the graph replay call (on the CPU: the eager step itself).", "",
            markdown_table(["kernels", "c", "host us", "copy us", "launch us"],
                     [[k, int(c), h["host"], h["copy"], h["launch"]] for (k, c), h in host.iterrows()]), ""]
    if "latency_vs_memory" in plots:
        out += [f"![latency vs memory]({plots['latency_vs_memory'].name})", ""]
    out += extra or []
    out += recommendation_md(decisions, incomplete)
    bad = df[(df.status == "failed") | df.noisy.fillna(False).astype(bool)]
    if len(bad):
        out += ["", "## Failed and noisy points", "",
                markdown_table(["point", "kernels", "max_loras", "strategy", "c", "n", "mode", "status", "error / why noisy"],
                         [[int(b.point), b.kernels, b.max_loras, b.strategy, b.concurrency, b.n_active, b["mode"], b.status,
                           (b.error or "")[:120] if b.status == "failed" else
                           (b.get("noisy_why") if isinstance(b.get("noisy_why"), str) else f"IQR {b.step_ms_iqr:.3f} ms")]
                          for _, b in bad.iterrows()])]
    return "\n".join(out) + "\n"

