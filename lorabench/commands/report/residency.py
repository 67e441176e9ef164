"""The report's residency section, for runs with residency points (``sweep --adapters N``): what
loading an adapter costs, each residency run against its prediction, and the configuration
``lorabench recommend --adapters`` would choose for the run's own adapters and clients."""

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from lorabench.analysis.decision import ResidencyDecision
from lorabench.analysis.reasons import reason, versus_card
from lorabench.analysis.recommendation_json import priced_json
from lorabench.analysis.residency import residency_decisions
from lorabench.analysis.residency_price import validation
from lorabench.analysis.view import RunView
from lorabench.commands.tables import markdown_table, mib
from lorabench.config.residency import Adapters


@dataclass(frozen=True)
class ResidencyReport:
    loads: pd.DataFrame  # per (kernels, max_loras): the timed load's median, interval, ops, bytes
    validation: pd.DataFrame  # per residency row: measured against predicted (lorabench.analysis.residency_price.validation)
    decisions: list[ResidencyDecision]  # per (workload, kernels) of the run's residency points
    runs: pd.DataFrame  # the residency points
    paths: pd.DataFrame | None = None  # per (kernels, max_loras): the other load paths' medians (empty: not timed)


def build(view: RunView) -> ResidencyReport | None:
    """The section's figures for a run (its rows measured on the GPU compared on), or None
    without residency points."""
    ok = view.compared
    runs = ok[ok["mode"] == "residency"]
    if runs.empty:
        return None
    loads = (ok.dropna(subset=["load_ms_median"]).drop_duplicates(["kernels", "max_loras"])
             [["kernels", "max_loras", "load_ms_median", "load_ms_ci_low", "load_ms_ci_high", "load_alone_ms_median",
               "load_host_us_median", "load_ops", "lora_bytes_per_slot"]].sort_values(["kernels", "max_loras"]))
    decisions = []
    for (w, n, cpu, out, c), _ in runs.groupby(["workload", "adapters", "max_cpu_loras", "output_tokens", "concurrency"]):
        adapters = Adapters(int(n), int(cpu), out)
        try:
            decisions += residency_decisions(view, w, adapters, int(c))
        except ValueError as e:
            decisions.append(ResidencyDecision("-", w, adapters, int(c), unavailable=str(e)))
    paths = pd.DataFrame()
    if "load_one_copy_alone_ms_median" in ok:
        have = ok.dropna(subset=["load_one_copy_alone_ms_median"]).drop_duplicates(["kernels", "max_loras"])
        have = have.reindex(columns=[*have.columns, *(c for c in PATH_COLUMNS if c not in have)])  # older runs lack some
        paths = have[["kernels", "max_loras", *PATH_COLUMNS]].sort_values(["kernels", "max_loras"])
    return ResidencyReport(loads, validation(view), decisions, runs, paths)


PATH_COLUMNS = ["load_alone_ms_median", "load_one_copy_ms_median", "load_one_copy_alone_ms_median", "load_one_copy_ops",
                "load_pageable_alone_ms_median", "load_overlap_usable_ms_median", "load_overlap_lost_ms_median",
                "storage_read_cold_ms_median", "storage_read_warm_ms_median", "storage_fs", "host_link_gb_s_median",
                "lora_bytes_per_slot"]


def link_bound_ms(r) -> float | None:
    """An adapter's bytes over the host link's measured bandwidth, ms: what no load path beats."""
    link = getattr(r, "host_link_gb_s_median", None)
    return None if link is None or pd.isna(link) or not link else r.lora_bytes_per_slot / (link * 1e6)


def best_alone(r) -> float:
    """The fastest blocking load path's time alone (per-slice or one-copy from pinned memory)."""
    return min(x for x in (r.load_alone_ms_median, r.load_one_copy_alone_ms_median) if pd.notna(x))


def markdown(rep: ResidencyReport, plot: Path | None, u: str) -> list[str]:
    out = ["## Adapters: residency, loads and memory", "",
           "A residency run is a closed loop of clients (the run's largest concurrency), each keeping one request in "
           "flight; requests choose among the run's adapters by the workload; vLLM's scheduler rules admit them "
           "(a request waits while the batch holds max_loras other adapters) and its LRU keeps adapters in the slots. "
           "Each step's time includes the loads it makes (one adapter copied from pinned host memory into a slot, "
           "blocking, as vLLM activates one). Predicted = the fixed points' medians for each step's batch size and "
           "active count, plus the loads at the timed load's median: on the very steps the run made, and on a long "
           "simulation of the same loop (what `lorabench recommend --adapters` uses). Prefill is not modelled.", ""]
    if plot is not None:
        out += [f"![residency]({plot.name})", ""]
    out += [f"**Loading one adapter into a slot ({u}): what it adds to the step that waits for it, and by itself**", "",
            markdown_table(["kernels", "max_loras", "in a step ms", "95 % CI", "alone ms", "host us", "device ops", "MiB",
                            "GB/s alone"],
                           [[r.kernels, int(r.max_loras), r.load_ms_median, _ci(r.load_ms_ci_low, r.load_ms_ci_high),
                             r.load_alone_ms_median, r.load_host_us_median, _int(r.load_ops), r.lora_bytes_per_slot / 2**20,
                             r.lora_bytes_per_slot / (r.load_alone_ms_median * 1e-3) / 1e9] for r in rep.loads.itertuples()]), ""]
    if rep.paths is not None and len(rep.paths):
        out += [f"**The other load paths ({u}, medians, ms)**: vLLM's per-slice copies alone; one pinned buffer per "
                "adapter copied at once then scattered (in a step, alone, host calls); the same from pageable memory; "
                "on a side stream beside the steps (until usable, what a step beside it lost); the adapter's file read "
                "from storage with its pages dropped first and again at once (--adapters DIR only); the host link's "
                "bandwidth (a 256 MiB pinned copy) and the adapter's bytes over it, the bound: the fastest blocking "
                "path alone as a multiple of it", "",
                markdown_table(["kernels", "max_loras", "per-slice alone", "one-copy in a step", "one-copy alone",
                                "calls", "pageable alone", "overlapped until usable", "step beside it lost",
                                "storage cold", "storage warm", "filesystem", "link GB/s", "bytes/link ms", "best / bound"],
                               [[r.kernels, int(r.max_loras), r.load_alone_ms_median, r.load_one_copy_ms_median,
                                 r.load_one_copy_alone_ms_median, _int(r.load_one_copy_ops), r.load_pageable_alone_ms_median,
                                 r.load_overlap_usable_ms_median, r.load_overlap_lost_ms_median,
                                 r.storage_read_cold_ms_median, r.storage_read_warm_ms_median, r.storage_fs or "-",
                                 r.host_link_gb_s_median, link_bound_ms(r),
                                 None if link_bound_ms(r) is None else best_alone(r) / link_bound_ms(r)]
                                for r in rep.paths.itertuples()]), ""]
    v = rep.validation
    if len(v):
        rows = [[r.kernels, r.max_loras, r.strategy, r.workload, r.clients, r.tokens_per_step, 1000 * r.loads_per_step,
                 r.measured_ms, getattr(r, "predicted_ms", None), getattr(r, "error_pct", None),
                 r.measured_tokens_per_s, getattr(r, "long_run_tokens_per_s", None), getattr(r, "long_run_error_pct", None),
                 getattr(r, "window_sd_pct", None)]
                for r in v.sort_values(["kernels", "workload", "max_loras", "strategy"]).itertuples()]
        out += [f"**Residency runs: measured against predicted ({u}, mean step)**", "",
                markdown_table(["kernels", "max_loras", "strategy", "workload", "clients", "tokens/step", "loads/1k steps",
                                "measured ms", "predicted ms (same steps)", "error %", "measured tokens/s",
                                "predicted tokens/s (long run)", "error %", "runs this long: SD %"], rows),
                "", "The last column: how much simulated runs of as many steps differ in tokens/s (standard deviation): "
                "a long-run error within about twice it is the run's shortness, not the prediction's.", ""]
        why = v[v.get("why", pd.Series(dtype=object)).notna()] if "why" in v else v.iloc[:0]
        out += [f"- point {int(r.point)}: not predicted: {r.why}" for r in why.itertuples()]
    for d in rep.decisions:
        out += [f"**{d.adapters.count} adapters under {d.workload}, {d.clients} clients ({d.kernels})**", ""]
        if d.chosen is None:
            out += [f"- nothing to recommend: {reason(d)}", ""]
            continue
        configs = [priced_json(x) for x in d.configs]  # the figures recommendation.json holds
        if configs:
            out += [markdown_table(["max_loras", "set", "expected step ms", "tokens/s", "tokens/step", "waiting", "loads/1k steps",
                                    "graph MiB", "slot MiB", "KV tokens given up"],
                                   [[x["max_loras"], _set(x), x["expected_step_ms"], x["tokens_per_s"], x["tokens_per_step"],
                                     x["waiting_per_step"], 1000 * x["loads_per_step"], mib(x["graph_mem_bytes"]),
                                     mib(x["slot_bytes"]), x["kv_tokens_given_up"]] for x in configs]), ""]
        c = priced_json(d.chosen)
        out += [f"- recommended: max_loras {c['max_loras']}, {_set(c)}: {c['tokens_per_s']:.0f} tokens/s, "
                f"{c['expected_step_ms']:.3f} ms per step; {reason(d)}"]
        if d.card is not None:
            out.append(f"- against the card's max_loras {d.card.max_loras} (max): {versus_card(d)}")
        out += [f"- note: {x}" for x in d.notes]
        out += [f"- vLLM: `{d.vllm.flags}` ({d.vllm.note})", f"- validate: `{d.validate}`", ""]
    return out


def _set(x: dict) -> str:
    counts = "[" + ",".join(map(str, x["counts"])) + "]"
    return counts if x["strategy"] == "auto" else f"{x['strategy']} {counts}"


def _ci(lo, hi):
    return None if pd.isna(lo) or pd.isna(hi) else f"{lo:.3f}…{hi:.3f}"


def _int(v):
    return None if pd.isna(v) else int(v)

