"""The console's summary of a sweep: one row per (kernels, max_loras, strategy)."""

import pandas as pd
from rich.table import Table

from lorabench.analysis.points import CONFIG, configs, ok_points


def points_table(df: pd.DataFrame, device: str) -> Table:
    """Per (kernels, max_loras, strategy): capture set, cost, and the first workload's median step."""
    ok = ok_points(df)
    workload = ok[ok["mode"] == "workload"]["workload"].dropna().unique()
    wl = workload[0] if len(workload) else None
    conc = sorted(df.concurrency.dropna().unique())
    unit = "ms GPU" if device == "cuda" else "ms CPU wall"
    table = Table(title=f"median step ({unit}), workload {wl}" if wl else "median step")
    for col in ["kernels", "L", "strategy", "graphs", "MiB", "start s"]:
        table.add_column(col, justify="right" if col not in ("kernels", "strategy") else "left", no_wrap=True)
    for c in conc:
        table.add_column(f"c={c}", justify="right", no_wrap=True)
    table.add_column("failed", justify="right")
    table.add_column("check", justify="left")
    cost = configs(df).set_index(CONFIG)
    for (k, m, s), g in df.groupby(CONFIG, sort=False):
        cells = [k, str(m), s, "-", "-", "-"]
        if (k, m, s) in cost.index:
            c_row = cost.loc[(k, m, s)]
            mem = c_row.graph_mem_bytes
            cells[3:] = [str(int(c_row.num_graphs)), f"{mem / 2**20:.0f}" if pd.notna(mem) else "-", f"{c_row.startup_s:.1f}"]
        good = ok_points(g)
        for c in conc:
            pt = good[(good.concurrency == c) & (good["mode"] == "workload") & (good.workload == wl)]
            cells.append(f"{pt.step_ms_median.iloc[0]:.3f}" if len(pt) else "-")
        cells.append(str(int((g.status == "failed").sum())))
        verdict = g["correct"].dropna().tolist() if "correct" in g else []
        cells.append("[red]WRONG[/]" if False in verdict else "ok" if verdict else "-")
        table.add_row(*cells)
    return table
