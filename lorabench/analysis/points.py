"""From measured points to what a user asks: the expected step time under a workload,
E[t | c] = sum_n P(n | c) · t(c, n) over the fixed-mode medians, next to what the workload run
measured, and each strategy's speed-up over ``max``. Shared by the report and the notebook."""

import numpy as np
import pandas as pd

from lorabench.config.strategies import BASELINE
from lorabench.config.workload import parse_workload
from lorabench.storage.results import COLUMNS

CONFIG = ["kernels", "max_loras", "strategy"]
VERDICT = ["correct", "check_detail"]


def with_columns(df: pd.DataFrame) -> pd.DataFrame:
    """Every column of the schema, null where rows made by hand (tests, notebooks) lack one."""
    missing = [c for c in COLUMNS if c not in df]
    return df.reindex(columns=[*df.columns, *missing]) if missing else df


def ok_points(df: pd.DataFrame) -> pd.DataFrame:
    return df[df.status == "ok"]


def verdicts(df: pd.DataFrame) -> pd.DataFrame:
    """Every configuration of the run, failed-only ones included, with its check verdict: the first
    non-null value over its rows, ok rows first. ``correct`` is True, False or None (not checked,
    inconclusive, or a run from before the check, whose rows lack the columns)."""
    rows = df.reindex(columns=CONFIG + VERDICT).assign(_failed=df.status != "ok")
    first = rows.sort_values("_failed", kind="stable").groupby(CONFIG)[VERDICT].first().reset_index()
    first["correct"] = first.correct.map(lambda v: None if pd.isna(v) else bool(v)).astype(object)
    first["check_detail"] = first.check_detail.astype(object).where(first.check_detail.notna(), None)
    return first


def configs(df: pd.DataFrame) -> pd.DataFrame:
    """One row per measured (kernels, max_loras, strategy): capture set, startup/memory costs and
    the check's verdict (``verdicts``)."""
    cols = CONFIG + ["captured_counts", "num_graphs", "graph_mem_bytes", "pool_bytes", "build_s", "compile_s",
                     "capture_s", "startup_s", "process_s", "triton_cache"]
    first = ok_points(df).drop_duplicates(CONFIG)[cols].copy()
    first["captured_counts"] = first["captured_counts"].map(lambda c: [int(x) for x in c])
    return first.merge(verdicts(df), on=CONFIG, how="left").reset_index(drop=True)


def expected_steps(df: pd.DataFrame, workloads: list[str] | None = None) -> pd.DataFrame:
    """Per (kernels, max_loras, strategy, concurrency, workload): expected step ms from the fixed
    points, the workload run's measured mean and median when there is one."""
    ok = ok_points(df)
    fixed = ok[ok["mode"] == "fixed"]
    runs = ok[ok["mode"] == "workload"]
    workloads = workloads or sorted(runs.workload.dropna().unique()) or ["uniform"]
    rows = []
    for (k, m, s, c), g in fixed.groupby(CONFIG + ["concurrency"]):
        t = dict(zip(g.n_active.astype(int), g.step_ms_median))
        for w in workloads:
            try:
                pmf = parse_workload(w).active_count_pmf(int(c), int(m))
            except ValueError:  # e.g. a trace file not readable from here: no expectation, still the run
                pmf = None
            needed = [] if pmf is None else [n for n, p in enumerate(pmf) if p > 0]
            expected = sum(pmf[n] * t[n] for n in needed) if pmf is not None and all(n in t for n in needed) else np.nan
            meas = runs[(runs.kernels == k) & (runs.max_loras == m) & (runs.strategy == s)
                        & (runs.concurrency == c) & (runs.workload == w)]
            rows.append({
                "kernels": k, "max_loras": int(m), "strategy": s, "concurrency": int(c), "workload": w,
                "expected_ms": expected,
                "measured_mean_ms": meas.step_ms_mean.iloc[0] if len(meas) else np.nan,
                "measured_median_ms": meas.step_ms_median.iloc[0] if len(meas) else np.nan,
                "base_ms": t.get(0, np.nan),
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
