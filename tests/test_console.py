"""What a newcomer reads on the console after a CPU sweep: noisy points marked as the report counts
them, a CPU run too noisy to compare strategies said so in one line, and an interrupted sweep that
finished no point not naming a points.parquet it never wrote."""

import io
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
from conftest import H200_CARD
from rich.console import Console

from lorabench.commands.summary import NOISY, points_table
from lorabench.commands.sweep import interrupted_line

CARD = pd.read_parquet(H200_CARD / "points.parquet")


def shown(df: pd.DataFrame, device: str) -> str:
    console = Console(width=80, file=io.StringIO())
    console.print(points_table(df, device))
    return console.file.getvalue()


def workload_cell(out: str, c: int) -> list[str]:
    [line] = [ln for ln in out.splitlines() if ln.startswith("│") and ln.strip("│ ").split("│")[0].strip() == str(c)]
    return [cell.strip() for cell in line.strip("│").split("│")][1:]


def test_noisy_points_are_marked_and_counted():
    df = CARD.assign(noisy=False)
    wl = (df["mode"] == "workload") & (df.concurrency == 2) & (df.strategy == "pow2")
    df.loc[wl, "noisy"] = True
    out = shown(df, "cuda")
    cells = workload_cell(out, 2)
    assert cells[1].endswith("*") and not cells[0].endswith("*") and not cells[2].endswith("*")  # max, pow2, dense
    assert f"* {NOISY}: 1 of {len(df)} points" in " ".join(out.split())
    assert "too noisy" not in out  # a GPU run, and one point


def test_a_cpu_run_too_noisy_to_compare_strategies_says_so_in_one_line():
    df = CARD.assign(noisy=[i % 10 != 0 for i in range(len(CARD))], device="cpu")
    out = " ".join(shown(df, "cpu").split())
    n = int(df.noisy.sum())
    assert f"this CPU run is too noisy to compare strategies ({n} of {len(df)} points noisy)" in out
    quiet = shown(CARD.assign(noisy=False, device="cpu"), "cpu")
    assert "noisy" not in quiet and "*" not in quiet


def test_rows_without_the_column_are_not_noisy():
    out = shown(CARD.drop(columns=["noisy"]), "cpu")
    assert "noisy" not in out


def test_an_interrupted_sweep_with_no_row_names_no_points_parquet(tmp_path):
    run = SimpleNamespace(run_dir=tmp_path / "run", writer=SimpleNamespace(rows=[], path=tmp_path / "run" / "points.parquet"))
    line = interrupted_line(run, 2)
    assert "points.parquet" not in line.replace("no points.parquet", "") and "before any point finished" in line
    assert line.startswith("interrupted (SIGINT)") and f"lorabench sweep --resume {run.run_dir}" in line
    run.writer.rows = [object()] * 3
    assert f"3 finished rows kept in {Path(run.writer.path)}" in interrupted_line(run, 15)
