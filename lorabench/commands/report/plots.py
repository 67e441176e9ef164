"""The report's figures (PNG), each titled with what was measured where."""

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from lorabench.analysis.points import ok_points
from lorabench.analysis.recommendation_json import priced_json
from lorabench.commands.report.labels import label, unit
from lorabench.config.backends import TUNED_SUFFIX, UNPADDED_SUFFIX, label_order
from lorabench.config.strategies import BASELINE
from lorabench.storage.figures import save_png


def _grid(nrows, ncols, w=4.2, h=3.2):
    """A figure of its own (not pyplot's: no backend, nothing to close) and its axes."""
    fig = Figure(figsize=(w * ncols, h * nrows))
    return fig, fig.subplots(nrows, ncols, squeeze=False)


def _save(fig, df, what, path: Path) -> Path:
    """Title the figure with what was measured where, write it."""
    r = ok_points(df).iloc[0]
    where = r.gpu_name if r.device == "cuda" else "CPU (not a GPU result)"
    fig.suptitle(f"{what}\n{r.model} ({int(r.layers)} layers), rank {int(r['rank'])}, {r['dtype']}, {where}", fontsize=10)
    fig.tight_layout()
    save_png(fig, path)
    return path


def _by_active(points: pd.DataFrame, ylabel: str, draw):
    """One panel per (max_loras row, concurrency column) with the active count on x; ``draw(ax,
    kernels, strategy, rows sorted by n)`` draws each (kernels, strategy). Returns (fig, axes)."""
    loras, conc = sorted(points.max_loras.unique()), sorted(points.concurrency.unique())
    fig, axes = _grid(len(loras), len(conc))
    for i, m in enumerate(loras):
        for j, c in enumerate(conc):
            ax = axes[i][j]
            for (k, s), g in points[(points.max_loras == m) & (points.concurrency == c)].groupby(["kernels", "strategy"]):
                draw(ax, k, s, g.sort_values("n_active"))
            ax.set_title(f"max_loras={m}, c={c}", fontsize=9)
            ax.set_xlabel("active adapters n")
            ax.set_ylabel(ylabel)
            ax.xaxis.get_major_locator().set_params(integer=True)
    return fig, axes


def latency_vs_active(df: pd.DataFrame, path: Path) -> Path:
    """Step time vs active count at each concurrency: the round-up steps of each capture set."""
    def draw(ax, k, s, g):
        err = [g.step_ms_median - g.step_ms_p10, g.step_ms_p90 - g.step_ms_median]
        ax.errorbar(g.n_active, g.step_ms_median, yerr=err, marker="o", ms=3, capsize=2, label=label(df, k, s))

    fig, axes = _by_active(ok_points(df)[lambda d: d["mode"] == "fixed"], f"step ({unit(df)}), p10-p90", draw)
    axes[0][0].legend(fontsize=8)
    return _save(fig, df, "Decode step vs active adapters", path)


def latency_vs_concurrency(df: pd.DataFrame, exp: pd.DataFrame, path: Path) -> Path:
    """Workload-weighted expected step time vs concurrency, measured workload runs as markers."""
    loras, wls = sorted(exp.max_loras.unique()), sorted(exp.workload.unique())
    fig, axes = _grid(len(loras), len(wls))
    for i, m in enumerate(loras):
        for j, w in enumerate(wls):
            ax = axes[i][j]
            sub = exp[(exp.max_loras == m) & (exp.workload == w)]
            for (k, s), g in sub.groupby(["kernels", "strategy"]):
                g = g.sort_values("concurrency")
                line = ax.plot(g.concurrency, g.expected_ms, marker="o", ms=3, label=f"{label(df, k, s)} expected")[0]
                ax.plot(g.concurrency, g.measured_mean_ms, ls="none", marker="x", color=line.get_color())
            base = sub.groupby("concurrency").base_ms.min()
            ax.plot(base.index, base.values, ls="--", color="grey", label="n = 0 (no LoRA)")
            ax.set_xscale("log", base=2)
            ax.set_title(f"max_loras={m}, workload {w}", fontsize=9)
            ax.set_xlabel("concurrency (tokens per step)")
            ax.set_ylabel(f"step ({unit(df)})")
    axes[0][0].legend(fontsize=7, title="x = measured workload run", title_fontsize=7)
    return _save(fig, df, "Expected decode step under the workload", path)


def speedup(df: pd.DataFrame, exp: pd.DataFrame, path: Path) -> Path:
    loras = sorted(exp.max_loras.unique())
    fig, axes = _grid(1, len(loras))
    for i, m in enumerate(loras):
        ax = axes[0][i]
        sub = exp[(exp.max_loras == m) & (exp.strategy != BASELINE) & exp.speedup_vs_max.notna()]
        for (k, s, w), g in sub.groupby(["kernels", "strategy", "workload"]):
            g = g.sort_values("concurrency")
            ax.plot(g.concurrency, g.speedup_vs_max, marker="o", ms=3, label=f"{label(df, k, s)}, {w}")
        ax.axhline(1.0, color="grey", ls="--")
        if sub.empty:
            ax.text(0.5, 0.6, "no measured max baseline\nor no other strategy", ha="center", transform=ax.transAxes)
        else:
            ax.set_xscale("log", base=2)
            ax.legend(fontsize=7)
        ax.set_title(f"max_loras={m}", fontsize=9)
        ax.set_xlabel("concurrency")
        ax.set_ylabel("expected speed-up over max (x)")
    return _save(fig, df, "Speed-up of specialised capture sets over max", path)


def memory_startup(df: pd.DataFrame, cfg: pd.DataFrame, path: Path) -> Path:
    fig, axes = _grid(1, 2, w=5.5)
    names = [f"{label(df, r.kernels, r.strategy)}\nL={r.max_loras}" for r in cfg.itertuples()]
    x = np.arange(len(cfg))
    mem = cfg.graph_mem_bytes.astype(float) / 2**20
    axes[0][0].bar(x, mem.fillna(0))
    axes[0][0].set_ylabel("graph memory (MiB, free-memory delta)")
    if mem.isna().all():
        axes[0][0].text(0.5, 0.5, "no graph memory on the CPU", ha="center", transform=axes[0][0].transAxes)
    bottom = np.zeros(len(cfg))
    for part in ("build_s", "compile_s", "capture_s"):
        v = cfg[part].astype(float).to_numpy()
        axes[0][1].bar(x, v, bottom=bottom, label=part.removesuffix("_s"))
        bottom += v
    axes[0][1].set_ylabel("startup (s)")
    axes[0][1].legend(fontsize=8)
    for ax in axes[0]:
        ax.set_xticks(x, names, fontsize=7)
    return _save(fig, df, "What each capture set costs", path)


def latency_vs_memory(df: pd.DataFrame, cmps: list, cfg: pd.DataFrame, path: Path) -> Path:
    """Each capture set's expected step against its graph memory, for one workload: the mean over
    one set of concurrencies for all (``Comparison.means``); sets measured at only part of it are left out."""
    fig, axes = _grid(1, 1, w=5.5, h=4)
    ax = axes[0][0]
    w = cmps[0].workload if cmps else "-"
    mean, partial = {}, []
    for cmp in cmps:
        means = cmp.means()
        mean.update({(cmp.kernels, cmp.max_loras, s): v for s, v in means.items()})
        partial += [s for s in cmp.covers if s not in means]
    for r in cfg.itertuples():
        if (r.kernels, r.max_loras, r.strategy) not in mean:
            continue
        x = (r.graph_mem_bytes or 0) / 2**20 if pd.notna(r.graph_mem_bytes) else 0
        y = mean[(r.kernels, r.max_loras, r.strategy)]
        ax.scatter(x, y)
        ax.annotate(f"{label(df, r.kernels, r.strategy)} L={r.max_loras}", (x, y), fontsize=7)
    ax.set_xlabel("graph memory (MiB)")
    ax.set_ylabel(f"expected step, mean over concurrency ({unit(df)})")
    title = f"workload {w}"
    if partial or any(cmp.has_max and cmp.grid != cmp.planned for cmp in cmps):
        over = "the concurrencies max covers" if any(cmp.has_max for cmp in cmps) else "every planned concurrency"
        title += f"; mean over {over}" + (f", without {', '.join(sorted(set(partial)))}" if partial else "")
    ax.set_title(title, fontsize=9)
    return _save(fig, df, "Latency vs graph memory", path)


def backends(df: pd.DataFrame, over: pd.DataFrame, path: Path) -> Path:
    """LoRA overhead over the n = 0 step vs active count, one line per backend and strategy."""
    def draw(ax, k, s, g):
        ax.plot(g.n_active, g.overhead_pct, ms=3, ls=["-", "--", ":", "-."][int(label_order(k)) % 4], marker="os^d"[(TUNED_SUFFIX in k) + 2 * (UNPADDED_SUFFIX in k)], label=f"{k}/{s}")

    fig, axes = _by_active(over, "LoRA overhead over n = 0 (%)", draw)
    for ax in axes.flat:
        ax.axhline(0, color="grey", ls="--")
    axes[0][0].legend(fontsize=7)
    return _save(fig, df, "LoRA overhead by backend", path)


def roofline(df: pd.DataFrame, fl: pd.DataFrame, path: Path) -> Path:
    """Measured LoRA overhead against its floor, every fixed point with n > 0, one colour per backend."""
    fig, axes = _grid(1, 1, w=5.5, h=4.2)
    ax = axes[0][0]
    for k, g in sorted(fl.groupby("kernels"), key=lambda kv: label_order(kv[0])):
        ax.scatter(g.floor_ms, g.overhead_ms, s=12, label=k)
    lo, hi = fl.floor_ms.min() * 0.8, max(fl.overhead_ms.max(), fl.floor_ms.max()) * 1.2
    for x, style in [(1, "-"), (2, "--"), (3, ":")]:
        ax.plot([lo, hi], [x * lo, x * hi], color="grey", ls=style, lw=0.8, label=f"{x}x floor")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("floor: LoRA bytes / bandwidth + one kernel per LoRA linear (ms)")
    ax.set_ylabel("measured LoRA overhead over n = 0 (ms)")
    ax.legend(fontsize=7)
    return _save(fig, df, "LoRA overhead vs its floor", path)


def residency(df: pd.DataFrame, decisions: list, measured: pd.DataFrame, path: Path) -> Path:
    """Per workload: tokens per second and expected step against max_loras, each (kernels,
    capture set) as the run prices it under residency (lines, the figures recommendation.json
    holds), the residency runs measured (crosses). ``decisions``: ``ResidencyDecision``s."""
    workloads = sorted({d.workload for d in decisions if d.configs})
    fig, axes = _grid(2, max(1, len(workloads)))
    for j, w in enumerate(workloads):
        top, bottom = axes[0][j], axes[1][j]
        slots: set[int] = set()
        for d in (d for d in decisions if d.workload == w and d.configs):
            priced = pd.DataFrame([priced_json(p) for p in d.configs])
            runs = measured[(measured.workload == w) & (measured.kernels == d.kernels)]
            slots |= set(int(m) for m in priced.max_loras)
            for s, g in priced.groupby("strategy"):
                g, name = g.sort_values("max_loras"), label(df, d.kernels, s)
                (line,) = top.plot(g.max_loras, g.tokens_per_s, marker="o", ms=3, label=f"{name} (predicted)")
                bottom.plot(g.max_loras, g.expected_step_ms, marker="o", ms=3, color=line.get_color())
                m = runs[runs.strategy == s]
                if len(m):
                    top.scatter(m.max_loras, m.tokens_per_s, marker="x", s=40, color=line.get_color(), label=f"{name} (measured)")
                    bottom.scatter(m.max_loras, m.step_ms_mean, marker="x", s=40, color=line.get_color())
            top.set_title(f"{d.adapters.count} adapters, {w}, {d.clients} clients", fontsize=9)
        for ax, what in ((top, "tokens/s"), (bottom, f"expected step ({unit(df)}), loads included")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted(slots), [str(m) for m in sorted(slots)])
            ax.minorticks_off()
            ax.set_xlabel("max_loras")
            ax.set_ylabel(what)
        top.legend(fontsize=7)
    return _save(fig, df, "Adapter residency: throughput and step vs slots", path)


def overhead_vs_tokens(df: pd.DataFrame, pre: pd.DataFrame, over: pd.DataFrame, path: Path) -> Path:
    """LoRA overhead over the same step without adapters (%) against the tokens a step holds: prefill
    points (lines, one per backend, strategy and active count) and decode points (crosses, at c
    tokens), one panel per max_loras."""
    loras = sorted(pre.max_loras.unique())
    fig, axes = _grid(1, len(loras), w=5.5, h=4.2)
    decode = over[over.n_active > 0] if len(over) else over
    for ax, m in zip(axes[0], loras):
        for (k, s, n), g in pre[(pre.max_loras == m) & (pre.n_active > 0)].groupby(["kernels", "strategy", "n_active"]):
            g = g.sort_values("prefill_tokens")
            (line,) = ax.plot(g.prefill_tokens, g.overhead_pct, marker="o", ms=3, label=f"{label(df, k, s)}, n={int(n)}")
            d = decode[(decode.max_loras == m) & (decode.kernels == k) & (decode.strategy == s) & (decode.n_active == n)]
            if len(d):
                ax.scatter(d.concurrency, d.overhead_pct, marker="x", s=30, color=line.get_color())
        ax.set_xscale("log", base=2)
        ax.axhline(0, color="grey", ls="--", lw=0.8)
        ax.set_title(f"max_loras={m} (lines: prefill, crosses: decode)", fontsize=9)
        ax.set_xlabel("tokens per step")
        ax.set_ylabel("LoRA overhead over n = 0 (%)")
        ax.legend(fontsize=7)
    return _save(fig, df, "LoRA overhead vs tokens per step", path)
