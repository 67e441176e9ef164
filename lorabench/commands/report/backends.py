"""The report's comparisons between kernels: backends side by side (ratios with their intervals,
LoRA overhead, graph costs) and what padding adapters to the rank costs (``+unpadded``). Backends
run in separate workers, so these comparisons carry ``APART_MARGIN_PCT``; points are compared
only when measured on one GPU."""

from pathlib import Path

import pandas as pd

from lorabench.analysis.intervals import APART_MARGIN_PCT, NO_SAMPLES, interval_of
from lorabench.analysis.points import majority_gpu, short_uuid
from lorabench.commands.report.labels import backends, in_order
from lorabench.commands.tables import cell, index, markdown_table, mib
from lorabench.config.backends import UNPADDED_SUFFIX, label_order
from lorabench.config.strategies import report_order
from lorabench.stats import describe, geomean_ratio_pct, ratio_pct

def _uuid(v):
    return v if isinstance(v, str) and v else None


def ratio_interval(samples, a, b):
    """``100 * (median(b) / median(a) - 1)`` (positive: b slower) with its interval, from the two
    points' samples, or (None, why)."""
    return interval_of(samples, ratio_pct(a, b), [a, b])


def geomean_interval(samples, pairs):
    """The geometric mean over ``pairs`` of (point a, point b) of median(b) / median(a), as
    ``100 * (ratio - 1)``, with its interval (every point resampled independently), or (None, why)."""
    return interval_of(samples, geomean_ratio_pct(pairs), [x for pair in pairs for x in pair])


def backends_md(over: pd.DataFrame, cfg: pd.DataFrame, u: str, plot: Path, samples=None) -> list[str]:
    """Per (max_loras, strategy) measured with several backends: step times, ratios to the first
    backend with their intervals (from the samples; only between points measured on one GPU: the
    first backend's) and each backend's LoRA overhead; then what each backend's graphs cost."""
    out = ["## Backends side by side", "", f"![backends]({plot.name})", "",
           "Backends run in separate workers, one after the other, so drift between them is not cancelled as it is "
           "between a backend's strategies: a difference is reported only when its whole 95 % interval lies beyond "
           f"±{APART_MARGIN_PCT:g} % (at n = 0, where both run the base model alone, they differ by drift alone). "
           "Points are compared only when measured on the same GPU.", ""]
    groups = sorted(over.groupby(["max_loras", "strategy"]), key=lambda kv: (kv[0][0], report_order(kv[0][1])))
    no_interval = set()
    for (m, s), g in groups:
        ks = backends(g)
        if len(ks) < 2:
            continue
        gpu = majority_gpu(g[g.kernels == ks[0]])
        away = g[[_uuid(v) != gpu for v in g.gpu_uuid]] if "gpu_uuid" in g else g.iloc[:0]
        notes = [f"{k} measured on another GPU ({', '.join(sorted({short_uuid(_uuid(v)) for v in a.gpu_uuid}))} "
                 f"vs {ks[0]}'s {short_uuid(gpu)}): not compared" for k, a in away.groupby("kernels")]
        g = g.drop(away.index)
        ks = backends(g)
        if len(ks) < 2:
            out += [f"**max_loras = {m}, {s}**: " + "; ".join(notes), ""]
            continue
        t = g.pivot(index=["concurrency", "n_active"], columns="kernels", values=["step_ms_median", "overhead_pct", "point"])
        rows, pairs = [], {k: [] for k in ks[1:]}
        for (c, n), r in t.iterrows():
            cells = []
            for k in ks[1:]:
                a, b = index(r.point[ks[0]]), index(r.point[k])
                if a is None or b is None:
                    cells.append("-")
                    continue
                pairs[k].append((a, b))
                iv, why = ratio_interval(samples, a, b)
                if iv is None:
                    no_interval.add(why)
                    cells.append("-")
                else:
                    cells.append(describe(iv, APART_MARGIN_PCT))
            rows.append([int(c), int(n)] + [r.step_ms_median[k] for k in ks]
                        + [cell(r.step_ms_median[k] / r.step_ms_median[ks[0]], "{:.2f}x") for k in ks[1:]]
                        + (cells if samples is not None else [])
                        + [cell(r.overhead_pct[k], "{:+.1f} %") for k in ks])
        head = (["c", "n"] + [f"{k} ms" for k in ks] + [f"{k}/{ks[0]}" for k in ks[1:]]
                + ([f"{k} vs {ks[0]}" for k in ks[1:]] if samples is not None else []) + [f"{k} overhead" for k in ks])
        out += [f"**max_loras = {m}, {s}**: median step ({u}), ratio to {ks[0]}"
                + (" and its 95 % interval" if samples is not None else "") + ", LoRA overhead over n = 0"
                + (f"; on GPU {short_uuid(gpu)}" if gpu else "") + "\n",
                markdown_table(head, rows), ""]
        for k in ks[1:]:
            if pairs[k]:
                iv, why = geomean_interval(samples, pairs[k])
                text = describe(iv, APART_MARGIN_PCT) if iv is not None else f"no interval: {why}"
                out.append(f"- {k} vs {ks[0]} over the {len(pairs[k])} points both have (geometric mean of the ratios): {text}")
        out += [f"- {x}" for x in notes] + [""]
    if samples is None or no_interval:
        out += [f"no interval: {', '.join(sorted(no_interval)) or NO_SAMPLES}", ""]
    cost = in_order(cfg, by=("max_loras", "strategy", "kernels"))
    out += [markdown_table(["max_loras", "strategy", "kernels", "graph MiB", "graphs", "startup s"],
                     [[int(c.max_loras), c.strategy, c.kernels, mib(c.graph_mem_bytes), int(c.num_graphs), c.startup_s]
                      for c in cost.itertuples()]), ""]
    return out


def padding_md(over: pd.DataFrame, u: str, samples=None) -> list[str]:
    """What padding costs: each ``<backend>+unpadded`` (every adapter at its own rank) against the
    same backend padding every adapter to ``rank`` (vLLM's way), per (max_loras, strategy, c, n),
    on one GPU; positive = the padding's cost. Empty when the run has no ``+unpadded`` kernels."""
    labels = sorted(set(over.kernels), key=label_order)
    twins = [(k, k.replace(UNPADDED_SUFFIX, "")) for k in labels if UNPADDED_SUFFIX in k]
    twins = [(k, p) for k, p in twins if p in labels]
    if not twins:
        return []
    r = over.iloc[0]
    mix = r["ranks"] if "ranks" in over and isinstance(r["ranks"], str) else "mixed"
    out = ["## What padding costs", "",
           f"Adapters of ranks {mix} zero-padded to rank {int(r['rank'])} as vLLM pads them (the padded kernels compute "
           "every rank), against the same adapters each at its own rank (`+unpadded` skips the padding). Separate "
           f"workers: a difference counts only when its whole 95 % interval lies beyond ±{APART_MARGIN_PCT:g} %. "
           "Against a run of the same adapters at their own rank (`--rank` set to it): "
           "`lorabench compare THAT_RUN THIS_RUN`.", ""]
    for unpadded, padded in twins:
        both = over[over.kernels.isin([unpadded, padded])]
        gpu = majority_gpu(both[both.kernels == padded])
        if "gpu_uuid" in both:
            both = both[[_uuid(v) == gpu for v in both.gpu_uuid]]
        rows, pairs, no_interval = [], [], set()
        for (m, st, c, n), g in sorted(both.groupby(["max_loras", "strategy", "concurrency", "n_active"]),
                                       key=lambda kv: (kv[0][0], report_order(kv[0][1]), kv[0][2], kv[0][3])):
            a, b = (g[g.kernels == k] for k in (unpadded, padded))
            if not len(a) or not len(b) or n == 0:
                continue
            pa, pb = index(a.point.iloc[0]), index(b.point.iloc[0])
            verdict = "-"
            if samples is not None and pa is not None and pb is not None:
                pairs.append((pa, pb))
                iv, why = ratio_interval(samples, pa, pb)
                verdict = describe(iv, APART_MARGIN_PCT).replace("slower", "costs") if iv is not None else "-"
                if iv is None:
                    no_interval.add(why)
            ms_a, ms_b = a.step_ms_median.iloc[0], b.step_ms_median.iloc[0]
            rows.append([int(m), st, int(c), int(n), ms_a, ms_b, cell(100 * (ms_b / ms_a - 1), "{:+.1f} %"), verdict])
        out += [f"**{padded} (padded) vs {unpadded}** ({u}" + (f"; on GPU {short_uuid(gpu)}" if gpu else "") + ")", "",
                markdown_table(["max_loras", "strategy", "c", "n", f"{unpadded} ms", f"{padded} ms", "padding costs",
                                "padded vs unpadded, 95 % CI"], rows), ""]
        if pairs:
            iv, why = geomean_interval(samples, pairs)
            text = describe(iv, APART_MARGIN_PCT).replace("slower", "costs") if iv is not None else f"no interval: {why}"
            out += [f"- over the {len(pairs)} points with adapters (geometric mean): padding {text}", ""]
        if no_interval:
            out += [f"no interval: {', '.join(sorted(no_interval))}", ""]
    return out

