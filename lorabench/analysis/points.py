"""From measured points to what a user asks: the expected step time under a workload,
E[t | c] = sum_n P(n | c) · t(c, n) over the fixed-mode medians, next to what the workload run
measured, and each strategy's speed-up over ``max``. Shared by the report and the notebook.

Also what every comparison rests on: a run's samples (every timed step of every point, for the
intervals of ``lorabench.stats``) and the same-GPU rule (``same_gpu``): points are compared only
with points measured on the same GPU."""

from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd

from lorabench.config.strategies import BASELINE
from lorabench.config.workload import parse_workload
from lorabench.storage.results import COLUMNS
from lorabench.storage.samples import read_samples, step_times

CONFIG = ["kernels", "max_loras", "strategy"]
VERDICT = ["correct", "check_detail"]


def with_columns(df: pd.DataFrame) -> pd.DataFrame:
    """Every column of the schema, null where rows made by hand (tests, notebooks) lack one."""
    missing = [c for c in COLUMNS if c not in df]
    return df.reindex(columns=[*df.columns, *missing]) if missing else df


def ok_points(df: pd.DataFrame) -> pd.DataFrame:
    return df[df.status == "ok"]


def not_found_wrong(df: pd.DataFrame) -> pd.DataFrame:
    """The rows of configurations the check did not find wrong: one that skips work may look fast."""
    return df[~df.correct.eq(False)] if "correct" in df else df


def verdicts(df: pd.DataFrame) -> pd.DataFrame:
    """Every configuration of the run, failed-only ones included, with its check verdict: the first
    non-null value over its rows, ok rows first. ``correct`` is True, False or None (not checked,
    inconclusive, or a run from before the check, whose rows lack the columns)."""
    rows = df.reindex(columns=CONFIG + VERDICT).assign(_failed=df.status != "ok")
    first = rows.sort_values("_failed", kind="stable").groupby(CONFIG)[VERDICT].first().reset_index()
    first["correct"] = first.correct.map(lambda v: None if pd.isna(v) else bool(v)).astype(object)
    first["check_detail"] = first.check_detail.astype(object).where(first.check_detail.notna(), None)
    return first


def run_samples(run_dir: Path) -> dict[int, np.ndarray]:
    """point -> its timed steps (ms); empty for a run that kept no samples (runs made before
    lorabench kept them)."""
    return step_times(read_samples(run_dir))


def _uuid(v) -> str | None:
    """A row's GPU: its uuid, or None (CPU rows and runs from before the column), one GPU."""
    return v if isinstance(v, str) and v else None


def short_uuid(u: str | None) -> str:
    """``GPU-3f2a9c1e…`` for text (the full uuid is in the JSON); ``unknown`` for None."""
    return "unknown" if u is None else (u if len(u) <= 12 else u[:12] + "…")


def majority_gpu(rows: pd.DataFrame) -> str | None:
    """The uuid most of ``rows`` have (None counts as one GPU); ties go to the earliest point's."""
    if rows.empty or "gpu_uuid" not in rows:
        return None
    order = rows.sort_values("point", kind="stable") if "point" in rows else rows
    return Counter(_uuid(v) for v in order.gpu_uuid).most_common(1)[0][0]


def same_gpu(df: pd.DataFrame) -> tuple[pd.DataFrame, dict[tuple[str, int], dict]]:
    """The same-GPU rule. Per (kernels, max_loras) the GPU is max's (the uuid most of max's ok rows
    have; without max, most of the ok rows'); ok rows measured on another GPU are left out (so the
    comparisons treat them as missing). Returns the rows kept (failed rows all kept) and, per
    (kernels, max_loras), ``{"gpu_uuid": its GPU, "elsewhere": {strategy: [other uuids]}}``."""
    df = with_columns(df)
    ok = ok_points(df)
    gpus: dict[tuple[str, int], dict] = {}
    drop = pd.Series(False, index=df.index)
    for (k, m), g in ok.groupby(["kernels", "max_loras"]):
        base = g[g.strategy == BASELINE]
        gpu = majority_gpu(base if len(base) else g)
        other = g[[_uuid(v) != gpu for v in g.gpu_uuid]]  # not Series != None: pandas says True for None
        elsewhere: dict[str, list] = {}
        for s, gs in other.groupby("strategy", sort=False):
            elsewhere[s] = sorted({_uuid(v) for v in gs.gpu_uuid}, key=lambda u: (u is None, u or ""))
        gpus[(k, int(m))] = {"gpu_uuid": gpu, "elsewhere": elsewhere}
        drop[other.index] = True
    return (df[~drop] if drop.any() else df), gpus


def configs(df: pd.DataFrame) -> pd.DataFrame:
    """One row per measured (kernels, max_loras, strategy): capture set, startup/memory costs and
    the check's verdict (``verdicts``)."""
    cols = CONFIG + ["captured_counts", "num_graphs", "graph_mem_bytes", "pool_bytes", "build_s", "compile_s",
                     "capture_s", "startup_s", "process_s", "triton_cache", "num_mixed_graphs", "mixed_graph_mem_bytes",
                     "mixed_capture_s"]
    first = ok_points(with_columns(df)).drop_duplicates(CONFIG)[cols].copy()
    first["captured_counts"] = first["captured_counts"].map(lambda c: [int(x) for x in c])
    return first.merge(verdicts(df), on=CONFIG, how="left").reset_index(drop=True)


def expected_steps(df: pd.DataFrame, workloads: list[str] | None = None) -> pd.DataFrame:
    """Per (kernels, max_loras, strategy, concurrency, workload): expected step ms from the fixed
    points, the workload run's measured mean and median when there is one. ``terms``: the fixed
    points the expectation reads and their weights, ((point, P(n | c)), ...), so that its
    interval can be drawn from their samples (None where a point has no index)."""
    ok = ok_points(df)
    fixed = ok[ok["mode"] == "fixed"]
    runs = ok[ok["mode"] == "workload"]
    workloads = workloads or sorted(runs.workload.dropna().unique()) or ["uniform"]
    measured = {}  # (kernels, max_loras, strategy, concurrency, workload) -> the workload run's first row
    for r in runs.itertuples():
        measured.setdefault((r.kernels, r.max_loras, r.strategy, r.concurrency, r.workload), r)
    parsed, pmfs = {}, {}  # each workload parsed once, P(n | c) once per (workload, c, max_loras)
    rows = []
    for (k, m, s, c), g in fixed.groupby(CONFIG + ["concurrency"]):
        t = dict(zip(g.n_active.astype(int), g.step_ms_median))
        pt = dict(zip(g.n_active.astype(int), g["point"] if "point" in g else [None] * len(g)))
        for w in workloads:
            if (w, int(c), int(m)) not in pmfs:
                try:
                    wl = parsed[w] if w in parsed else parsed.setdefault(w, parse_workload(w))
                    pmfs[(w, int(c), int(m))] = wl.active_count_pmf(int(c), int(m))
                except ValueError:  # e.g. a trace file not readable from here: no expectation, still the run
                    pmfs[(w, int(c), int(m))] = None
            pmf = pmfs[(w, int(c), int(m))]
            needed = [] if pmf is None else [n for n, p in enumerate(pmf) if p > 0]
            expected = sum(pmf[n] * t[n] for n in needed) if pmf is not None and all(n in t for n in needed) else np.nan
            terms = (tuple((int(pt[n]), float(pmf[n])) for n in needed)
                     if not pd.isna(expected) and all(pd.notna(pt[n]) for n in needed) else None)
            meas = measured.get((k, m, s, c, w))
            rows.append({
                "kernels": k, "max_loras": int(m), "strategy": s, "concurrency": int(c), "workload": w,
                "expected_ms": expected,
                "measured_mean_ms": meas.step_ms_mean if meas is not None else np.nan,
                "measured_median_ms": meas.step_ms_median if meas is not None else np.nan,
                "base_ms": t.get(0, np.nan),
                "terms": terms,
                "measured_point": int(meas.point) if meas is not None and "point" in runs and pd.notna(meas.point) else None,
            })
    out = pd.DataFrame(rows)
    if out.empty:
        return out
    ref = out[out.strategy == BASELINE].set_index(["kernels", "max_loras", "concurrency", "workload"]).expected_ms
    key = pd.MultiIndex.from_frame(out[["kernels", "max_loras", "concurrency", "workload"]])
    out["speedup_vs_max"] = ref.reindex(key).to_numpy() / out.expected_ms.to_numpy()
    return out


def lora_overhead(df: pd.DataFrame) -> pd.DataFrame:
    """Fixed points with their step time relative to the same configuration's n = 0 step."""
    fixed = ok_points(df)[lambda d: d["mode"] == "fixed"].copy()
    base = fixed[fixed.n_active == 0].set_index(CONFIG + ["concurrency"]).step_ms_median
    key = pd.MultiIndex.from_frame(fixed[CONFIG + ["concurrency"]])
    fixed["base_ms"] = base.reindex(key).to_numpy()
    fixed["overhead_pct"] = 100 * (fixed.step_ms_median / fixed.base_ms - 1)
    return fixed
