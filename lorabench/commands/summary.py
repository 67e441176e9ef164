"""The console's summary of a sweep: one small table per (kernels, max_loras), a line for failed
points, a line for noisy ones (marked ``*`` in the tables, by the ``noisy`` column the report
counts: a wide IQR, a GPU slowdown or a clock drop) and, on a CPU run too noisy to compare
strategies, a line saying so; for an incomplete run, a line saying what it lacks. It fits an
80-column terminal (and a pipe, which Rich renders 80 wide): concurrencies are rows and strategies
columns, so a wider sweep grows downwards, not off the edge."""

import pandas as pd
from rich.columns import Columns
from rich.console import Group
from rich.table import Table
from rich.text import Text

from lorabench.analysis.points import CONFIG, configs, ok_points
from lorabench.config.backends import label_order
from lorabench.config.strategies import report_order
from lorabench.storage.runs import Coverage

ERROR_CHARS = 300  # of the first failure's error, on its line
NOISY = "noisy (IQR/median >= 10 %, host-bound steps, or a GPU slowdown or clock drop)"  # the report's words for the `noisy` column
TOO_NOISY = 0.5  # a CPU run with at least this share of its points noisy is too noisy to compare strategies


def noisy(rows: pd.DataFrame) -> pd.Series:
    """Each row's ``noisy`` flag, False where unknown (rows from before the column)."""
    if "noisy" not in rows:
        return pd.Series(False, index=rows.index)
    return rows.noisy.map(lambda v: pd.api.types.is_bool(v) and bool(v)).astype(bool)


def noise_lines(df: pd.DataFrame, device: str) -> list[Text]:
    """How many of the run's measured points are noisy (``*`` in the tables) and, on the CPU, when
    so many are that a difference between strategies says nothing, one line saying so."""
    ok = ok_points(df)
    n = int(noisy(ok).sum())
    if not n:
        return []
    lines = [Text(f"* {NOISY}: {n} of {len(ok)} points", style="yellow")]
    if device != "cuda" and n >= TOO_NOISY * len(ok):
        lines.append(Text(f"this CPU run is too noisy to compare strategies ({n} of {len(ok)} points noisy): their "
                          "differences are the machine's, not the capture sets'", style="yellow"))
    return lines


def points_table(df: pd.DataFrame, device: str, coverage: Coverage | None = None) -> Group:
    """Per (kernels, max_loras): each strategy's median step under the run's first workload at
    every concurrency, its capture set's cost (LoRA graphs + no-LoRA graphs, graph MiB, startup s),
    its failed points and its check's verdict. Under the tables: the failed points and the first
    one's error; with ``coverage`` (``lorabench.storage.runs.coverage``) of an incomplete run, its
    status, planned vs finished points and which configurations lack how many."""
    ok = ok_points(df)
    # --adapters: residency runs instead of workload runs; with --input-tokens, serving runs
    mode = next((m for m in ("workload", "residency", "serving") if (ok["mode"] == m).any()), "workload")
    workload = ok[ok["mode"] == mode]["workload"].dropna().unique()
    wl = workload[0] if len(workload) else None
    unit = "ms GPU" if device == "cuda" else "ms CPU wall"
    cost = configs(df).set_index(CONFIG) if len(ok) else None
    what = f"median step ({unit})"
    if wl and mode != "workload":
        what = f"mean step ({unit}), adapter loads included, of {mode} runs under {wl}"
    elif wl:
        what = f"median step ({unit}) under workload {wl}"
    tables = []
    for k, m in sorted(set(zip(df.kernels, df.max_loras)), key=lambda km: (label_order(km[0]), km[0], km[1])):
        g = df[(df.kernels == k) & (df.max_loras == m)]
        tables.append(_table(g, k, m, sorted(g.strategy.unique(), key=report_order), wl, cost, mode))
    parts: list = [Text(f"{what}, by concurrency c", style="bold"), Columns(tables, padding=(0, 2))]
    failed = df[df.status == "failed"]
    if len(failed):
        first = failed.sort_values("point").iloc[0] if "point" in failed else failed.iloc[0]
        where = f"{first.kernels} max_loras {first.max_loras} {first.strategy} c={_int(first.concurrency)}"
        where += f" n={_int(first.n_active)}" if pd.notna(first.get("n_active")) else f" workload {first.get('workload')}"
        error = str(first.get("error") or "no error recorded")
        error = error if len(error) <= ERROR_CHARS else error[: ERROR_CHARS - 3] + "..."
        parts.append(Text(f"{len(failed)} failed point{'s' * (len(failed) != 1)}; first: {where}: {error}", style="red"))
    parts += noise_lines(df, device)
    lacks = coverage.incomplete() if coverage is not None else None
    if lacks:
        parts.append(Text(f"incomplete run, {lacks}", style="yellow"))
    return Group(*parts)


def _table(g: pd.DataFrame, k: str, m, strats: list[str], wl: str | None, cost, mode: str = "workload") -> Table:
    table = Table(title=f"{k}, max_loras {m}", title_justify="left")
    table.add_column("c", justify="right", no_wrap=True)
    for s in strats:
        table.add_column(s, justify="right", overflow="fold")
    good = ok_points(g)
    conc = sorted(int(c) for c in g[g["mode"] != "prefill"].concurrency.dropna().unique())  # prefill: requests, not c
    for i, c in enumerate(conc):
        cells = []
        for s in strats:
            pt = good[(good.strategy == s) & (good.concurrency == c) & (good["mode"] == mode) & (good.workload == wl)]
            value = pt.step_ms_mean if mode != "workload" else pt.step_ms_median
            cells.append(f"{value.iloc[0]:.3f}" + ("*" if noisy(pt).iloc[0] else "") if len(pt) else "-")
        table.add_row(f"{c}", *cells, end_section=i == len(conc) - 1)
    rows = {"graphs": [], "MiB": [], "start s": [], "failed": [], "check": []}
    for s in strats:
        rs = g[g.strategy == s]
        c_row = cost.loc[(k, m, s)] if cost is not None and (k, m, s) in cost.index else None
        mem = None if c_row is None else c_row.graph_mem_bytes
        rows["graphs"].append("-" if c_row is None else str(int(c_row.num_graphs)))
        rows["MiB"].append(f"{mem / 2**20:.0f}" if mem is not None and pd.notna(mem) else "-")
        rows["start s"].append("-" if c_row is None else f"{c_row.startup_s:.1f}")
        n_failed = int((rs.status == "failed").sum())
        rows["failed"].append(f"[red]{n_failed}[/]" if n_failed else "0")
        verdict = rs["correct"].dropna().tolist() if "correct" in rs else []
        rows["check"].append("[red]WRONG[/]" if False in verdict else "ok" if verdict else "-")
    for name, cells in rows.items():
        table.add_row(name, *cells)
    return table


def _int(v) -> str:
    return "-" if v is None or pd.isna(v) else str(int(v))
