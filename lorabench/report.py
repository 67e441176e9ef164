"""``lorabench report``: plots (PNG), ``report.md`` and ``recommendation.json`` in a run's folder."""

import json
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from lorabench.analysis import configs, expected_steps, lora_overhead, ok_points, verdicts  # noqa: E402
from lorabench.recommend import VLLM_NOTE, recommend  # noqa: E402
from lorabench.kernels import TUNED, backend_of  # noqa: E402
from lorabench.results import read_points  # noqa: E402
from lorabench.roofline import floors  # noqa: E402
from lorabench.spec import UserError  # noqa: E402
from lorabench.strategies import BUCKET_GRID  # noqa: E402

STRATEGY_ORDER = {"max": 0, "pow2": 1, "dense": 2, "agnostic": 3}
BACKEND_ORDER = {"triton": 0, "fused": 1, "torch": 2, "vllm": 3}
VERDICT_WORD = {True: "ok", False: "WRONG", None: "not checked"}
HYPOTHESIS = ("Hypothesis: with `--specialize-active-lora` (kernels vllm, strategy pow2), a batch mixing base-model "
              "requests with adapters replays a graph whose grid is one slot short, so some adapter tokens get no LoRA update.")


def find_newest_run(results: Path) -> Path:
    runs = sorted(p.parent for p in Path(results).glob("*/points.parquet"))
    if not runs:
        raise UserError(f"no runs with a points.parquet under {results}/ (run `lorabench sweep` first)")
    return max(runs, key=lambda p: (p / "points.parquet").stat().st_mtime)


def load_run(run_dir: Path) -> pd.DataFrame:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"{run_dir} is not a folder")
    if not (run_dir / "points.parquet").is_file():
        raise UserError(f"{run_dir} has no points.parquet (is it a sweep's output folder?)")
    try:
        df = read_points(run_dir)
    except Exception as e:  # noqa: BLE001 - a corrupt file is bad input, not a crash
        raise UserError(f"{run_dir}/points.parquet cannot be read: {e}") from None
    if not len(ok_points(df)):
        raise UserError(f"{run_dir}/points.parquet holds no successful points to report on")
    return df


def strategies(df: pd.DataFrame) -> list[str]:
    return sorted(df.strategy.unique(), key=lambda s: (STRATEGY_ORDER.get(s, 4), s))


def backend_rank(k: str) -> float:
    """Report order of a kernels label: its backend's place, a "+tuned" run right after it."""
    return BACKEND_ORDER.get(backend_of(k), 4) + 0.5 * k.endswith(TUNED)


def backends(df: pd.DataFrame) -> list[str]:
    return sorted(df.kernels.unique(), key=lambda k: (backend_rank(k), k))


def _order(cfg: pd.DataFrame, by=("kernels", "max_loras", "strategy")) -> pd.DataFrame:
    """Configurations in report order: backends and strategies in their usual order, not alphabetical."""
    rank = {"kernels": backend_rank, "strategy": lambda s: STRATEGY_ORDER.get(s, 4)}
    return cfg.sort_values(list(by), key=lambda col: col.map(lambda v: (rank[col.name](v), v))
                           if col.name in rank else col)


def unit(df: pd.DataFrame) -> str:
    return "GPU ms" if (df.device == "cuda").all() else "CPU wall ms"


def label(df: pd.DataFrame, kernels: str, strategy: str) -> str:
    return strategy if df.kernels.nunique() == 1 else f"{kernels}/{strategy}"


def _grid(nrows, ncols, w=4.2, h=3.2):
    fig, axes = plt.subplots(nrows, ncols, figsize=(w * ncols, h * nrows), squeeze=False)
    return fig, axes


def _save(fig, df, what, path: Path) -> Path:
    """Title the figure with what was measured where, write it, free it."""
    r = ok_points(df).iloc[0]
    where = r.gpu_name if r.device == "cuda" else "CPU (not a GPU result)"
    fig.suptitle(f"{what} - {r.model} ({int(r.layers)} layers), rank {int(r['rank'])}, {r['dtype']}, {where}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
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


def plot_latency_vs_active(df: pd.DataFrame, path: Path) -> Path:
    """Step time vs active count at each concurrency: the round-up steps of each capture set."""
    def draw(ax, k, s, g):
        err = [g.step_ms_median - g.step_ms_p10, g.step_ms_p90 - g.step_ms_median]
        ax.errorbar(g.n_active, g.step_ms_median, yerr=err, marker="o", ms=3, capsize=2, label=label(df, k, s))

    fig, axes = _by_active(ok_points(df)[lambda d: d["mode"] == "fixed"], f"step ({unit(df)}), p10-p90", draw)
    axes[0][0].legend(fontsize=8)
    return _save(fig, df, "Decode step vs active adapters", path)


def plot_latency_vs_concurrency(df: pd.DataFrame, exp: pd.DataFrame, path: Path) -> Path:
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


def plot_speedup(df: pd.DataFrame, exp: pd.DataFrame, path: Path) -> Path:
    loras = sorted(exp.max_loras.unique())
    fig, axes = _grid(1, len(loras))
    for i, m in enumerate(loras):
        ax = axes[0][i]
        sub = exp[(exp.max_loras == m) & (exp.strategy != "max") & exp.speedup_vs_max.notna()]
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


def plot_memory_startup(df: pd.DataFrame, cfg: pd.DataFrame, path: Path) -> Path:
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


def plot_latency_vs_memory(df: pd.DataFrame, exp: pd.DataFrame, cfg: pd.DataFrame, path: Path) -> Path:
    fig, axes = _grid(1, 1, w=5.5, h=4)
    ax = axes[0][0]
    w = sorted(exp.workload.unique())[0]
    mean = exp[exp.workload == w].groupby(["kernels", "max_loras", "strategy"]).expected_ms.mean()
    for r in cfg.itertuples():
        if (r.kernels, r.max_loras, r.strategy) not in mean:
            continue
        x = (r.graph_mem_bytes or 0) / 2**20 if pd.notna(r.graph_mem_bytes) else 0
        y = mean[(r.kernels, r.max_loras, r.strategy)]
        ax.scatter(x, y)
        ax.annotate(f"{label(df, r.kernels, r.strategy)} L={r.max_loras}", (x, y), fontsize=7)
    ax.set_xlabel("graph memory (MiB)")
    ax.set_ylabel(f"expected step, mean over concurrency ({unit(df)})")
    ax.set_title(f"workload {w}", fontsize=9)
    return _save(fig, df, "Latency vs graph memory", path)


def plot_backends(df: pd.DataFrame, over: pd.DataFrame, path: Path) -> Path:
    """LoRA overhead over the n = 0 step vs active count, one line per backend and strategy."""
    def draw(ax, k, s, g):
        ax.plot(g.n_active, g.overhead_pct, ms=3, ls=["-", "--", ":", "-."][int(backend_rank(k)) % 4], marker="os"[k.endswith(TUNED)], label=f"{k}/{s}")

    fig, axes = _by_active(over, "LoRA overhead over n = 0 (%)", draw)
    for ax in axes.flat:
        ax.axhline(0, color="grey", ls="--")
    axes[0][0].legend(fontsize=7)
    return _save(fig, df, "LoRA overhead by backend", path)


def plot_roofline(df: pd.DataFrame, fl: pd.DataFrame, path: Path) -> Path:
    """Measured LoRA overhead against its floor, every fixed point with n > 0, one colour per backend."""
    fig, axes = _grid(1, 1, w=5.5, h=4.2)
    ax = axes[0][0]
    for k, g in sorted(fl.groupby("kernels"), key=lambda kv: backend_rank(kv[0])):
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


def md_table(headers: list[str], rows: list[list]) -> str:
    def fmt(v):
        if v is None or (isinstance(v, float) and np.isnan(v)):
            return "-"
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def _fmt(v, spec: str):
    return None if pd.isna(v) else spec.format(v)


def _mib(v):
    return None if v is None or pd.isna(v) else f"{float(v) / 2**20:.0f}"


def hypothesis_verdict(pow2: pd.DataFrame) -> str:
    """What the vllm/pow2 verdicts say about HYPOTHESIS: a failure whose smallest batch mixes base
    requests with adapters confirms it; every configuration correct refutes it."""
    wrong = pow2[pow2.correct.map(lambda v: v is False)]
    if len(wrong):
        r = wrong.iloc[0]
        smallest = (r.check_detail or "").partition("smallest: ")[2] or r.check_detail or "no detail recorded"
        where = f"max_loras {', '.join(str(int(m)) for m in wrong.max_loras)}"
        if re.search(r"n=[1-9]\d*, [1-9]\d* base", smallest):
            return f"This run **confirms** it: vllm/pow2 is WRONG at {where}; smallest failing batch: {smallest}."
        return (f"vllm/pow2 is WRONG at {where}, but its smallest failing batch does not mix base requests with "
                f"adapters, so this run does not single out the hypothesised failure: {smallest}.")
    if pow2.correct.map(lambda v: v is True).all():
        return ("This run **refutes** it: every vllm/pow2 configuration (max_loras "
                f"{', '.join(str(int(m)) for m in pow2.max_loras)}) matched the reference, mixed batches included.")
    return "This run cannot tell: a vllm/pow2 configuration has no verdict (not checked, or the check was inconclusive)."


def correctness_md(df: pd.DataFrame) -> list[str]:
    v = _order(verdicts(df))
    out = ["## Correctness", "",
           "Each configuration's graphs replayed on all-adapter, all-base and mixed batches against the plain-torch "
           "reference before timing (`correct`, `check_detail`); a WRONG configuration is never recommended.", "",
           md_table(["kernels", "max_loras", "strategy", "verdict", "detail"],
                    [[r.kernels, int(r.max_loras), r.strategy, VERDICT_WORD[r.correct], r.check_detail] for r in v.itertuples()]),
           ""]
    if v.correct.isna().all():
        out += ["No configuration of this run has a verdict: it ran with `--no-check`, or before the check existed.", ""]
    pow2 = v[(v.kernels.map(backend_of) == "vllm") & (v.strategy == "pow2")]
    if len(pow2):
        out += [f"{HYPOTHESIS} {hypothesis_verdict(pow2)}", ""]
    return out


def backends_md(over: pd.DataFrame, cfg: pd.DataFrame, u: str, plot: Path) -> list[str]:
    """Per (max_loras, strategy) measured with several backends: step times, ratios to the first
    backend and each backend's LoRA overhead; then what each backend's graphs cost."""
    out = ["## Backends side by side", "", f"![backends]({plot.name})", ""]
    groups = sorted(over.groupby(["max_loras", "strategy"]), key=lambda kv: (kv[0][0], STRATEGY_ORDER.get(kv[0][1], 3), kv[0][1]))
    for (m, s), g in groups:
        ks = backends(g)
        if len(ks) < 2:
            continue
        t = g.pivot(index=["concurrency", "n_active"], columns="kernels", values=["step_ms_median", "overhead_pct"])
        rows = [[int(c), int(n)] + [r.step_ms_median[k] for k in ks]
                + [_fmt(r.step_ms_median[k] / r.step_ms_median[ks[0]], "{:.2f}x") for k in ks[1:]]
                + [_fmt(r.overhead_pct[k], "{:+.1f} %") for k in ks] for (c, n), r in t.iterrows()]
        out += [f"**max_loras = {m}, {s}**: median step ({u}), ratio to {ks[0]}, LoRA overhead over n = 0\n",
                md_table(["c", "n"] + [f"{k} ms" for k in ks] + [f"{k}/{ks[0]}" for k in ks[1:]] + [f"{k} overhead" for k in ks], rows),
                ""]
    cost = _order(cfg, by=("max_loras", "strategy", "kernels"))
    out += [md_table(["max_loras", "strategy", "kernels", "graph MiB", "graphs", "startup s"],
                     [[int(c.max_loras), c.strategy, c.kernels, _mib(c.graph_mem_bytes), int(c.num_graphs), c.startup_s]
                      for c in cost.itertuples()]), ""]
    return out


AGNOSTIC_WITHIN = 0.03  # issue 4's bar: count-agnostic within 3 % of the best specialised strategy


def agnostic_md(over: pd.DataFrame, cfg: pd.DataFrame, u: str) -> list[str]:
    """Does the count-agnostic grid make specialisation unnecessary? Per (kernels, max_loras, c,
    n): agnostic's step against the fastest other strategy that passed its check."""
    over = over[over.n_active > 0]  # n = 0 runs the same no-LoRA graph under every strategy
    ag = over[over.strategy.isin(BUCKET_GRID)]
    if ag.empty:
        return []
    wrong = {(c.kernels, c.max_loras, c.strategy) for c in cfg.itertuples() if c.correct is False}
    failed = sorted({(k, int(m)) for k, m, s in zip(ag.kernels, ag.max_loras, ag.strategy) if (k, m, s) in wrong})
    ag = ag[[(k, m, s) not in wrong for k, m, s in zip(ag.kernels, ag.max_loras, ag.strategy)]]  # wrong can look fast
    others = over[~over.strategy.isin(BUCKET_GRID)]
    others = others[[(k, m, s) not in wrong for k, m, s in zip(others.kernels, others.max_loras, others.strategy)]]
    out = ["## Count-agnostic vs specialised", "",
           "`agnostic` captures one LoRA graph per bucket with min(bucket, max_loras) programs on the adapter axis, "
           "whatever n; `best other` is the fastest other strategy of the same kernels that passed its check, "
           f"per point ({u}, median). Specialisation is unnecessary where agnostic is within "
           f"{100 * AGNOSTIC_WITHIN:.0f} % everywhere.", ""]
    out += [f"**{k}, max_loras = {m}**: agnostic failed its correctness check (see Correctness); not compared.\n"
            for k, m in failed]
    summary = []
    for (k, m), g in sorted(ag.groupby(["kernels", "max_loras"]), key=lambda kv: (backend_rank(kv[0][0]), kv[0][1])):
        rows, worst = [], -np.inf
        for r in g.sort_values(["concurrency", "n_active"]).itertuples():
            o = others[(others.kernels == k) & (others.max_loras == m) & (others.concurrency == r.concurrency)
                       & (others.n_active == r.n_active)]
            if o.empty:
                continue
            b = o.loc[o.step_ms_median.idxmin()]
            gap = r.step_ms_median / b.step_ms_median - 1
            worst = max(worst, gap)
            rows.append([int(r.concurrency), int(r.n_active), f"{r.step_ms_median:.3f} [{int(r.graph_loras)}]",
                         f"{b.step_ms_median:.3f} ({b.strategy} [{int(b.graph_loras)}])", f"{100 * gap:+.1f} %"])
        if not rows:
            continue
        out += [f"**{k}, max_loras = {m}**\n", md_table(["c", "n", "agnostic [grid]", "best other", "agnostic vs best"], rows), ""]
        c_ag = cfg[(cfg.kernels == k) & (cfg.max_loras == m) & cfg.strategy.isin(BUCKET_GRID)].iloc[0]
        c_max = cfg[(cfg.kernels == k) & (cfg.max_loras == m) & (cfg.strategy == "max")]
        cost = (f"{int(c_ag.num_graphs)} graphs / {_mib(c_ag.graph_mem_bytes)} MiB / {c_ag.startup_s:.2f} s startup"
                + (f" (max: {int(c_max.num_graphs.iloc[0])} / {_mib(c_max.graph_mem_bytes.iloc[0])} MiB / "
                   f"{c_max.startup_s.iloc[0]:.2f} s)" if len(c_max) else ""))
        verdict = "yes" if worst <= AGNOSTIC_WITHIN else "no"
        summary.append([k, int(m), f"{100 * worst:+.1f} %", verdict, cost])
    out += [md_table(["kernels", "max_loras", "worst agnostic vs best", f"within {100 * AGNOSTIC_WITHIN:.0f} % everywhere", "agnostic's graphs (max's)"],
                     summary), ""]
    return out


def roofline_md(fl: pd.DataFrame, plot: Path | None) -> list[str]:
    """Per (kernels, max_loras, c, n), the fastest strategy's LoRA overhead against its floor."""
    if fl.empty:
        return []
    gbs, us = fl.probe_copy_gbs.median(), fl.probe_kernel_us.median()
    kernels = "/".join(str(int(k)) for k in sorted(fl.min_kernels.unique()))
    best = fl.loc[fl.groupby(["kernels", "max_loras", "concurrency", "n_active"]).overhead_ms.idxmin()]
    best = _order(best, by=("kernels", "max_loras", "concurrency", "n_active"))
    out = ["## Roofline: LoRA overhead vs its floor", "",
           f"floor = n x LoRA bytes per slot / bandwidth + one kernel per LoRA linear ({kernels} per step) "
           f"x the cost of one more kernel in a graph; measured by each worker: copy bandwidth {gbs:.0f} GB/s, "
           f"{us:.2f} us per extra kernel (medians). overhead = step - the same configuration's n = 0 step; "
           "the fastest strategy per point.", ""]
    if plot is not None:
        out += [f"![roofline]({plot.name})", ""]
    out += [md_table(["kernels", "max_loras", "c", "n", "strategy", "LoRA MB", "bytes us", "kernels us", "floor ms",
                      "overhead ms", "x floor"],
                     [[r.kernels, int(r.max_loras), int(r.concurrency), int(r.n_active), r.strategy, f"{r.lora_mb:.1f}",
                       f"{r.bytes_us:.1f}", f"{r.kernels_us:.1f}", r.floor_ms, r.overhead_ms, f"{r.x_floor:.2f}"]
                      for r in best.itertuples()]), ""]
    return out


def auto_md(df: pd.DataFrame, exp: pd.DataFrame, run_info: dict, u: str) -> list[str]:
    """Strategy auto: what the cost model (from the --auto-from run) predicted for the chosen
    set, next to what this run measured for it."""
    runs = ok_points(df)
    pred = runs[(runs.strategy == "auto") & (runs["mode"] == "workload")] if "predicted_ms" in runs else runs.iloc[:0]
    pred = pred[pred.predicted_ms.notna()] if len(pred) else pred
    if pred.empty:
        return []
    source = (run_info.get("spec") or {}).get("auto_from", "the --auto-from run")
    e = exp[exp.strategy == "auto"].set_index(["kernels", "max_loras", "workload", "concurrency"])
    rows = []
    for r in pred.sort_values(["kernels", "max_loras", "concurrency"]).itertuples():
        key = (r.kernels, r.max_loras, r.workload, r.concurrency)
        expected = e.expected_ms.get(key, np.nan)
        rows.append([r.kernels, int(r.max_loras), "[" + ",".join(str(int(x)) for x in r.captured_counts) + "]", r.workload,
                     int(r.concurrency), r.predicted_ms, expected, r.step_ms_mean,
                     _fmt(100 * (expected / r.predicted_ms - 1), "{:+.2f} %"), _fmt(100 * (r.step_ms_mean / r.predicted_ms - 1), "{:+.2f} %")])
    return [f"## Strategy auto: predicted vs measured ({u})", "",
            f"predicted = the cost model built from `{source}` for the chosen set; expected = sum over n of "
            "P(n | c) x this run's median(c, n) for that set; measured = its workload run's mean.", "",
            md_table(["kernels", "max_loras", "set", "workload", "c", "predicted", "expected", "measured",
                      "expected vs predicted", "measured vs predicted"], rows), ""]


def recommendation_md(rec: dict) -> list[str]:
    out = ["## Recommendation", ""]
    for x in rec["recommendations"]:
        head = f"- **{x['kernels']}, max_loras {x['max_loras']}, workload {x['workload']}**: "
        if x["strategy"] is None:
            out.append(head + f"nothing proposed: {x['reason']}.")
        else:
            out.append(head + f"`{x['strategy']}` {x['captured_counts']}, {x['gain_over_max_pct']:+.1f} % vs max, "
                       f"{x['num_graphs']} graphs ({x['num_graphs_max']} for max). {x['reason']}. vLLM: `{x['vllm']['flags']}`")
        out += [f"  - rejected `{r['strategy']}`: {r['reason']}" for r in x.get("rejected", [])]
    notes = dict.fromkeys(x["vllm"]["note"] for x in rec["recommendations"] if x["strategy"] is not None)
    out += [f"\nvLLM: {n}" for n in notes if n != VLLM_NOTE]
    return out


def render_markdown(df, run_info, cfg, exp, over, rec, plots) -> str:
    r = ok_points(df).iloc[0]
    where = f"{r.gpu_name} (driver {r.driver}, CUDA {r.cuda})" if r.device == "cuda" else "CPU: figures are CPU wall times, not GPU results"
    u = unit(df)
    out = [
        f"# lorabench report: {r.run_id}",
        "",
        f"- machine: {where}",
        f"- model: {r.model}, {int(r.layers)} layers, hidden {int(r.hidden)}, rank {int(r['rank'])}, {r['dtype']}, "
        f"context {int(r.context_len) if pd.notna(r.context_len) else '-'}",
        f"- torch {r.torch}, triton {r.triton}, git {r.git_sha}",
        f"- command: `{run_info.get('argv', r.argv)}`",
        f"- sweep wall time: {run_info.get('wall_s', float('nan')):.1f} s; {len(df)} points, {int((df.status == 'failed').sum())} failed, "
        f"{int(ok_points(df).noisy.sum())} noisy (IQR/median >= 10 %)",
        f"- timing: {u}; median of {int(r.iters)} steps per point after {int(r.warmup)} warm-up steps",
        "",
        *correctness_md(df),
        "## Capture sets and their cost",
        "",
        md_table(
            ["kernels", "max_loras", "strategy", "launch counts", "graphs", "graph MiB", "pool MiB", "build s", "compile s", "capture s", "startup s"],
            [[c.kernels, int(c.max_loras), c.strategy, "[" + ",".join(map(str, c.captured_counts)) + "]", int(c.num_graphs), _mib(c.graph_mem_bytes),
              _mib(c.pool_bytes), c.build_s, c.compile_s, c.capture_s, c.startup_s] for c in cfg.itertuples()],
        ),
        "",
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
        rows = []
        for (c, n), gg in g.groupby(["concurrency", "n_active"]):
            cells = [int(c), int(n)]
            for s in strats:
                p = gg[gg.strategy == s]
                cells.append(f"{p.step_ms_median.iloc[0]:.3f} [{int(p.graph_loras.iloc[0])}] {p.overhead_pct.iloc[0]:+.1f} %"
                             if len(p) else "-")
            rows.append(cells)
        out += [md_table(["c", "n"] + strats, rows), ""]
    if "backends" in plots:
        out += backends_md(over, cfg, u, plots["backends"])
    out += agnostic_md(over, cfg, u)
    out += roofline_md(floors(df), plots.get("roofline"))
    if not exp.empty:
        out += [f"## Expected step under each workload ({u})", "",
                "expected = sum over n of P(n | c) x median(c, n); measured = the workload run's mean over its steps.", "",
                f"![latency vs concurrency]({plots['latency_vs_concurrency'].name})", "",
                f"![speed-up]({plots['speedup'].name})", ""]
        rows = [[e.kernels, e.max_loras, e.workload, e.concurrency, e.strategy, e.expected_ms, e.measured_mean_ms,
                 (e.measured_mean_ms / e.expected_ms - 1) * 100 if e.expected_ms else np.nan, e.speedup_vs_max]
                for e in exp.sort_values(["kernels", "max_loras", "workload", "concurrency"]).itertuples()]
        out += [md_table(["kernels", "max_loras", "workload", "c", "strategy", "expected", "measured", "meas/exp - 1 (%)", "speed-up vs max"], rows), ""]
        out += auto_md(df, exp, run_info, u)
    ok = ok_points(df)
    host = ok.groupby(["kernels", "concurrency"]).agg(
        host=("host_us_median", "median"), copy=("copy_us_median", "median"), launch=("launch_us_median", "median"))
    out += ["## Host overhead per step (us, median over points)", "",
            "`host` = building the batch metadata + choosing the graph; `copy` = the call queueing the metadata's "
            "copy to the device; `launch` = the graph replay call (on the CPU: the eager step itself).", "",
            md_table(["kernels", "c", "host us", "copy us", "launch us"],
                     [[k, int(c), h["host"], h["copy"], h["launch"]] for (k, c), h in host.iterrows()]), ""]
    if "latency_vs_memory" in plots:
        out += [f"![latency vs memory]({plots['latency_vs_memory'].name})", ""]
    out += recommendation_md(rec)
    bad = df[(df.status == "failed") | df.noisy.fillna(False).astype(bool)]
    if len(bad):
        out += ["", "## Failed and noisy points", "",
                md_table(["point", "kernels", "max_loras", "strategy", "c", "n", "mode", "status", "error / IQR"],
                         [[int(b.point), b.kernels, b.max_loras, b.strategy, b.concurrency, b.n_active, b["mode"], b.status,
                           (b.error or "")[:120] if b.status == "failed" else f"IQR {b.step_ms_iqr:.3f} ms"] for _, b in bad.iterrows()])]
    return "\n".join(out) + "\n"


def write_report(run_dir: Path) -> list[Path]:
    run_dir = Path(run_dir)
    df = load_run(run_dir)
    info_path = run_dir / "run.json"
    run_info = json.loads(info_path.read_text()) if info_path.exists() else {}
    cfg, exp, over = configs(df), expected_steps(df), lora_overhead(df)
    plots = {
        "latency_vs_active": plot_latency_vs_active(df, run_dir / "latency_vs_active.png"),
        "memory_startup": plot_memory_startup(df, cfg, run_dir / "memory_startup.png"),
    }
    if not exp.empty:
        plots["latency_vs_concurrency"] = plot_latency_vs_concurrency(df, exp, run_dir / "latency_vs_concurrency.png")
        plots["speedup"] = plot_speedup(df, exp, run_dir / "speedup_vs_max.png")
        plots["latency_vs_memory"] = plot_latency_vs_memory(df, exp, cfg, run_dir / "latency_vs_memory.png")
    if ok_points(df).kernels.nunique() > 1:
        plots["backends"] = plot_backends(df, over, run_dir / "backends.png")
    fl = floors(df)
    if not fl.empty:
        plots["roofline"] = plot_roofline(df, fl, run_dir / "roofline.png")
    rec = recommend(df)
    rec_path = run_dir / "recommendation.json"
    if rec_path.is_file():  # keep what `lorabench recommend` added (strategy auto per workload)
        try:
            auto = json.loads(rec_path.read_text()).get("auto")
        except (ValueError, AttributeError):
            auto = None
        if auto:
            rec["auto"] = auto
    rec_path.write_text(json.dumps(rec, indent=2) + "\n")
    md_path = run_dir / "report.md"
    md = render_markdown(df, run_info, cfg, exp, over, rec, plots)
    if (run_dir / "NOTE.md").is_file():  # a caveat kept next to a run's data
        head, _, rest = md.partition("\n")
        md = f"{head}\n\n> **Read [NOTE.md](NOTE.md) first:** a caveat on this run's data.\n{rest}"
    md_path.write_text(md)
    return list(plots.values()) + [md_path, rec_path]
