"""``report.md``: a run's tables, section by section, around its figures."""

import re
from pathlib import Path

import numpy as np
import pandas as pd

from lorabench.analysis.compare import (
    APART_MARGIN_PCT,
    NO_SAMPLES,
    c_list,
    interval_of,
)
from lorabench.analysis.points import majority_gpu, ok_points, short_uuid, verdicts
from lorabench.analysis.recommend import PAYS, VLLM_NOTE, vllm_specialised
from lorabench.commands.report.labels import backends, in_order, strategies, unit
from lorabench.commands.tables import markdown_table, mib
from lorabench.config.backends import UNPADDED_SUFFIX, label_order
from lorabench.config.strategies import AUTO, BASELINE, STRATEGIES, report_order
from lorabench.stats import describe, geomean_ratio_pct, ratio_pct
from lorabench.storage.runs import run_status

BUCKET_GRID = [name for name, s in STRATEGIES.items() if s.bucket_grid]  # agnostic

VERDICT_WORD = {True: "ok", False: "WRONG", None: "not checked"}
HYPOTHESIS = ("Hypothesis: with `--specialize-active-lora` (kernels vllm, strategy pow2), a batch mixing base-model "
              "requests with adapters replays a graph whose grid is one slot short, so some adapter tokens get no LoRA update.")


def _fmt(v, spec: str):
    return None if pd.isna(v) else spec.format(v)


def _steps(df: pd.DataFrame, r) -> str:
    """``100``, or ``10–40 (--ci-target 0.3)`` when the CI target stopped points early."""
    steps = ok_points(df).get("timed_steps")
    if steps is None or steps.isna().all():
        return f"{int(r.iters)}"
    lo, hi = int(steps.min()), int(steps.max())
    target = r.get("ci_target")
    return (f"{lo}" if lo == hi else f"{lo}–{hi}") + (f" (--ci-target {target:g})" if pd.notna(target) else "")


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
    v = in_order(verdicts(df))
    out = ["## Correctness", "",
           "Each configuration's graphs replayed on all-adapter, all-base and mixed batches against the plain-torch "
           "reference before timing (`correct`, `check_detail`); a WRONG configuration is never recommended.", "",
           markdown_table(["kernels", "max_loras", "strategy", "verdict", "detail"],
                    [[r.kernels, int(r.max_loras), r.strategy, VERDICT_WORD[r.correct], r.check_detail] for r in v.itertuples()]),
           ""]
    if v.correct.isna().all():
        out += ["No configuration of this run has a verdict: it ran with `--no-check`, or before the check existed.", ""]
    pow2 = v[vllm_specialised(v)]
    if len(pow2):
        out += [f"{HYPOTHESIS} {hypothesis_verdict(pow2)}", ""]
    return out


def _point(v):
    return None if pd.isna(v) else int(v)


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
    if get("ranks"):
        slots = get("slot_ranks")
        held = f" (slots: {', '.join(str(int(x)) for x in slots)})" if slots is not None else ""
        out.append(f"- adapters' own ranks: {get('ranks')}{held}, zero-padded to rank {int(r['rank'])} as vLLM pads them; "
                   "`<backend>+unpadded` computes each at its own rank (What padding costs)")
    return out


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
                a, b = _point(r.point[ks[0]]), _point(r.point[k])
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
                        + [_fmt(r.step_ms_median[k] / r.step_ms_median[ks[0]], "{:.2f}x") for k in ks[1:]]
                        + (cells if samples is not None else [])
                        + [_fmt(r.overhead_pct[k], "{:+.1f} %") for k in ks])
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
            pa, pb = _point(a.point.iloc[0]), _point(b.point.iloc[0])
            cell = "-"
            if samples is not None and pa is not None and pb is not None:
                pairs.append((pa, pb))
                iv, why = ratio_interval(samples, pa, pb)
                cell = describe(iv, APART_MARGIN_PCT).replace("slower", "costs") if iv is not None else "-"
                if iv is None:
                    no_interval.add(why)
            ms_a, ms_b = a.step_ms_median.iloc[0], b.step_ms_median.iloc[0]
            rows.append([int(m), st, int(c), int(n), ms_a, ms_b, _fmt(100 * (ms_b / ms_a - 1), "{:+.1f} %"), cell])
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


AGNOSTIC_WITHIN = 0.03  # count-agnostic is as good as specialised when within 3 % of the best at every point


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
    for (k, m), g in sorted(ag.groupby(["kernels", "max_loras"]), key=lambda kv: (label_order(kv[0][0]), kv[0][1])):
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
        out += [f"**{k}, max_loras = {m}**\n", markdown_table(["c", "n", "agnostic [grid]", "best other", "agnostic vs best"], rows), ""]
        c_ag = cfg[(cfg.kernels == k) & (cfg.max_loras == m) & cfg.strategy.isin(BUCKET_GRID)].iloc[0]
        c_max = cfg[(cfg.kernels == k) & (cfg.max_loras == m) & (cfg.strategy == BASELINE)]
        cost = (f"{int(c_ag.num_graphs)} graphs / {mib(c_ag.graph_mem_bytes)} MiB / {c_ag.startup_s:.2f} s startup"
                + (f" (max: {int(c_max.num_graphs.iloc[0])} / {mib(c_max.graph_mem_bytes.iloc[0])} MiB / "
                   f"{c_max.startup_s.iloc[0]:.2f} s)" if len(c_max) else ""))
        verdict = "yes" if worst <= AGNOSTIC_WITHIN else "no"
        summary.append([k, int(m), f"{100 * worst:+.1f} %", verdict, cost])
    out += [markdown_table(["kernels", "max_loras", "worst agnostic vs best", f"within {100 * AGNOSTIC_WITHIN:.0f} % everywhere", "agnostic's graphs (max's)"],
                     summary), ""]
    return out


def roofline_md(fl: pd.DataFrame, plot: Path | None) -> list[str]:
    """Per (kernels, max_loras, c, n), the fastest strategy's LoRA overhead against its floor."""
    if fl.empty:
        return []
    gbs, us = fl.probe_copy_gbs.median(), fl.probe_kernel_us.median()
    launches = "/".join(str(int(k)) for k in sorted(fl.min_kernels.unique()))  # LoRA linears per step
    best = fl.loc[fl.groupby(["kernels", "max_loras", "concurrency", "n_active"]).overhead_ms.idxmin()]
    best = in_order(best, by=("kernels", "max_loras", "concurrency", "n_active"))
    out = ["## Roofline: LoRA overhead vs its floor", "",
           f"floor = n x LoRA bytes per slot / bandwidth + one kernel per LoRA linear ({launches} per step) "
           f"x the cost of one more kernel in a graph; measured by each worker: copy bandwidth {gbs:.0f} GB/s, "
           f"{us:.2f} us per extra kernel (medians). overhead = step - the same configuration's n = 0 step; "
           "the fastest strategy per point.", ""]
    if plot is not None:
        out += [f"![roofline]({plot.name})", ""]
    out += [markdown_table(["kernels", "max_loras", "c", "n", "strategy", "LoRA MB", "bytes us", "kernels us", "floor ms",
                      "overhead ms", "x floor"],
                     [[r.kernels, int(r.max_loras), int(r.concurrency), int(r.n_active), r.strategy, f"{r.lora_mb:.1f}",
                       f"{r.bytes_us:.1f}", f"{r.kernels_us:.1f}", r.floor_ms, r.overhead_ms, f"{r.x_floor:.2f}"]
                      for r in best.itertuples()]), ""]
    return out


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
        pt, pred_ms = _point(r.point), float(r.predicted_ms)
        iv, why = interval_of(samples, lambda m, pt=pt: 100 * (m[pt] / pred_ms - 1), [pt])
        rows.append([r.kernels, int(r.max_loras), "[" + ",".join(str(int(x)) for x in r.captured_counts) + "]", r.workload,
                     int(r.concurrency), r.predicted_ms, expected, r.step_ms_mean, r.step_ms_median,
                     _fmt(100 * (expected / r.predicted_ms - 1), "{:+.2f} %"), _fmt(100 * (r.step_ms_mean / r.predicted_ms - 1), "{:+.2f} %"),
                     describe(iv, APART_MARGIN_PCT) if iv is not None else
                     f"{100 * (r.step_ms_median / r.predicted_ms - 1):+.2f} % (no interval: {why})"])
    return [f"## Strategy auto: predicted vs measured ({u})", "",
            f"predicted = the cost model built from `{source}` for the chosen set; expected = sum over n of "
            "P(n | c) x this run's median(c, n) for that set; measured = its workload run's mean; median = its "
            "workload run's median, against the prediction with a 95 % interval drawn from the measured samples only "
            "(the prediction is taken as exact; faster = the run measured less than predicted).", "",
            markdown_table(["kernels", "max_loras", "set", "workload", "c", "predicted", "expected", "measured", "median",
                      "expected vs predicted", "measured vs predicted", "median vs predicted"], rows), ""]


def recommendation_md(rec: dict, incomplete: str | None = None) -> list[str]:
    out = ["## Recommendation", ""]
    if incomplete:
        out += ["This run is incomplete (see the top): each strategy is compared with max only over the concurrencies "
                "where both have every point the workload needs.", ""]
    out += [f"A strategy other than max is proposed only when the lower end of the 95 % interval of its gain over "
            f"max clears {100 * PAYS:g} % (each point's median resampled independently); otherwise max, the fewest "
            f"graphs, **inconclusive** when the interval reaches past {100 * PAYS:g} %. A run that kept no samples is "
            "decided on the medians alone. Strategies of one kernels and max_loras are timed in alternating turns on "
            "one GPU, so the verdicts' margin is 0; points measured on another GPU are not compared.", ""]
    for x in rec["recommendations"]:
        head = f"- **{x['kernels']}, max_loras {x['max_loras']}, workload {x['workload']}**: "
        if x["strategy"] is None:
            out.append(head + f"nothing proposed: {x['reason']}.")
        else:
            mark = " (**inconclusive**)" if x.get("inconclusive") else ""
            out.append(head + f"`{x['strategy']}` {x['captured_counts']}{mark}, {x['gain_over_max_pct']:+.1f} % vs max, "
                       f"{x['num_graphs']} graphs ({x['num_graphs_max']} for max). {x['reason']}. vLLM: `{x['vllm']['flags']}`")
        out += [f"  - rejected `{r['strategy']}`: {r['reason']}" for r in x.get("rejected", [])]
        out += versus_md(x)
        out += coverage_md(x.get("comparison"))
    notes = dict.fromkeys(x["vllm"]["note"] for x in rec["recommendations"] if x["strategy"] is not None)
    out += [f"\nvLLM: {n}" for n in notes if n != VLLM_NOTE]
    return out


def versus_md(x: dict) -> list[str]:
    """Sub-bullets: each strategy against max in words (with its interval, or why none), the GPU
    the comparison was made on, and what more measuring would take when inconclusive."""
    cmp = x.get("comparison") or {}
    out = []
    for name, s in cmp.get("strategies", {}).items():
        if s.get("versus_max") and s["status"] != "not comparable":
            out.append(f"  - `{name}` vs max over {c_list(s['compared_over'])}: {s['versus_max']}")
    if x.get("decided_on") and x["decided_on"].startswith("decided on medians alone"):
        out.append(f"  - {x['decided_on']}")
    if x.get("inconclusive"):
        out.append(f"  - inconclusive: {x.get('more_measuring') or 'more steps per point would narrow the interval'}")
    if cmp.get("gpu_uuid"):
        out.append(f"  - compared on one GPU: {cmp['gpu_uuid']}")
    return out


def coverage_md(cmp: dict | None) -> list[str]:
    """Sub-bullets of a recommendation whose comparison is not over every planned concurrency:
    each strategy's coverage, what it is compared over and its gain there; none when complete."""
    if not cmp or cmp["complete"]:
        return []
    out = []
    for name, s in cmp["strategies"].items():
        text = f"  - coverage `{name}`: {s['coverage'].partition(': ')[2]}"
        if s["status"] == "not comparable":
            text += " (not comparable)"
        elif name != BASELINE:
            text += f" ({s['gain_over_max_pct']:+.1f} % vs max there" + ("" if s["status"] == "complete" else "; partial: not proposed") + ")"
        out.append(text)
    return out


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


def render_markdown(df, run_info, cfg, exp, over, fl, rec, plots, incomplete: str | None = None,
                    samples=None, gpus: dict | None = None, extra: list[str] | None = None) -> str:
    """The whole report: configurations, expected steps, LoRA overhead, roofline floors (``fl``),
    the recommendation and the figures already written (``plots``: name -> path); ``incomplete``:
    the line saying how the run is incomplete (``lorabench.commands.report.incomplete_line``), if it
    is; ``extra``: a section of its own (the residency runs'), before the recommendation."""
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
        f"{int(ok_points(df).noisy.sum())} noisy (IQR/median >= 10 %, or a GPU slowdown or clock drop)",
        f"- timing: {u}; median of {_steps(df, r)} steps per point after {int(r.warmup)} warm-up steps",
        f"- intervals: {INTERVALS if samples is not None else 'none: ' + NO_SAMPLES + ' (decisions on medians alone)'}",
        *gpu_md(gpus or {}),
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
        out += [markdown_table(["c", "n"] + strats, rows), ""]
    if "backends" in plots:
        out += backends_md(over, cfg, u, plots["backends"], samples)
    out += padding_md(over, u, samples)
    out += agnostic_md(over, cfg, u)
    out += roofline_md(fl, plots.get("roofline"))
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
    host = ok.groupby(["kernels", "concurrency"]).agg(
        host=("host_us_median", "median"), copy=("copy_us_median", "median"), launch=("launch_us_median", "median"))
    out += ["## Host overhead per step (us, median over points)", "",
            "`host` = building the batch metadata + choosing the graph; `copy` = the call queueing the metadata's "
            "copy to the device; `launch` = the graph replay call (on the CPU: the eager step itself).", "",
            markdown_table(["kernels", "c", "host us", "copy us", "launch us"],
                     [[k, int(c), h["host"], h["copy"], h["launch"]] for (k, c), h in host.iterrows()]), ""]
    if "latency_vs_memory" in plots:
        out += [f"![latency vs memory]({plots['latency_vs_memory'].name})", ""]
    out += extra or []
    out += recommendation_md(rec, incomplete)
    bad = df[(df.status == "failed") | df.noisy.fillna(False).astype(bool)]
    if len(bad):
        out += ["", "## Failed and noisy points", "",
                markdown_table(["point", "kernels", "max_loras", "strategy", "c", "n", "mode", "status", "error / why noisy"],
                         [[int(b.point), b.kernels, b.max_loras, b.strategy, b.concurrency, b.n_active, b["mode"], b.status,
                           (b.error or "")[:120] if b.status == "failed" else
                           (b.get("noisy_why") if isinstance(b.get("noisy_why"), str) else f"IQR {b.step_ms_iqr:.3f} ms")]
                          for _, b in bad.iterrows()])]
    return "\n".join(out) + "\n"
