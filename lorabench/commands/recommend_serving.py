"""``lorabench recommend RUN --ttft-p99-ms X``: among a run's serving runs (requests with prompts),
per workload and kernels, the configuration with the most output tokens/s whose TTFT p99 is shown
within X ms (``lorabench.analysis.serving``); written to the run's ``recommendation.json`` under
``"serving"``. ``--also RUN2 ...`` adds other runs' serving runs to choose among (a sweep has one
``--max-cudagraph-capture-size``: each size is its own run), on the same GPU model only. Exit
status 0 when one (workload, kernels) gets a choice; 2 and one line otherwise."""

from dataclasses import asdict
from pathlib import Path

import pandas as pd

from rich import box
from rich.console import Console
from rich.table import Table

from lorabench.analysis.serving import ServingChoice, choices
from lorabench.analysis.view import RunView
from lorabench.analysis.vllm import run_flags
from lorabench.commands import recommendation_file
from lorabench.commands.tables import mib
from lorabench.config.flags import to_positive
from lorabench.config.spec import coerce
from lorabench.errors import UserError


def _ms(v) -> str:
    return "-" if v is None else "beyond the run" if v == float("inf") else f"{v:.1f}"


def serving_table(c: ServingChoice) -> Table:
    table = Table(title=f"{c.kernels} under {c.workload}: serving runs, most output tokens/s first", box=box.SIMPLE_HEAD,
                  padding=(0, 1), pad_edge=False)
    runs = len({s.run_id for s in c.runs}) > 1
    for col in ["run"] * runs + ["L", "set", "PIECEWISE to", "out tok/s", "TTFT p50 ms", "TTFT p99 ms", "95 % CI", "target", "ITL p50 ms",
                "ITL p99 ms", "pending", "graph MiB", "startup s"]:
        table.add_column(col, justify="left" if col == "set" else "right", no_wrap=True)
    for s in c.runs:
        mark = " *" if s == c.chosen else ""
        ci = "-" if s.ttft_p99_low is None else f"{_ms(s.ttft_p99_low)}…{_ms(s.ttft_p99_high)}"
        table.add_row(*[str(s.run_id)] * runs, str(s.max_loras), s.strategy + mark, str(s.max_cudagraph_capture_size), f"{s.output_tokens_per_s:,.0f}",
                      _ms(s.ttft_p50_ms), _ms(s.ttft_p99_ms), ci, s.against(c.target_ms) or "-", _ms(s.itl_p50_ms),
                      _ms(s.itl_p99_ms), str(s.ttft_pending),
                      mib(s.graph_mem_bytes) or "-", "-" if s.startup_s is None else f"{s.startup_s:.1f}")
    return table


def choice_json(c: ServingChoice, first) -> dict:
    chosen = c.chosen
    return {"workload": c.workload, "kernels": c.kernels, "ttft_p99_ms_target": c.target_ms, "why": c.why, "note": c.note,
            "chosen": None if chosen is None else {
                **asdict(chosen),
                "vllm_flags": f"{run_flags(first, chosen.max_loras, chosen.strategy == 'pow2')} "
                              f"--max-cudagraph-capture-size {chosen.max_cudagraph_capture_size}"},
            "runs": [{**asdict(s), "against_target": s.against(c.target_ms)} for s in c.runs]}


def serving_rows(views: list[tuple[Path, RunView]]) -> pd.DataFrame:
    """The serving rows of every run, one GPU model's only: one line and exit 2 when they differ (a
    throughput measured on another model of GPU is not one to choose by)."""
    models = {}  # GPU model -> the first run measured on it
    for path, view in views:
        names = view.compared.loc[view.compared["mode"] == "serving", "gpu_name"].dropna()
        models.setdefault(names.iloc[0] if len(names) else "no GPU", path)
    if len(models) > 1:
        (a, pa), (b, pb) = list(models.items())[:2]
        raise UserError(f"--also: {pa} measured on {a}, {pb} on {b}: choose among runs of one GPU model")
    return pd.concat([view.compared for _, view in views], ignore_index=True)


def recommend_serving(run_dir: Path, ttft_p99_ms: str, kernels: str | None, console: Console,
                      also: list[Path] | None = None) -> int:
    target = to_positive("ttft_p99_ms", ttft_p99_ms)
    view = RunView.read(run_dir)
    rows = serving_rows([(run_dir, view)] + [(p, RunView.read(p)) for p in also or []])
    if kernels:
        rows = rows[rows.kernels.isin(coerce("kernels", kernels))]
    found = choices(rows, target)
    if not found:
        raise UserError(f"{run_dir}: no serving runs to choose from (sweep with --adapters N --input-tokens ...)")
    if all(c.chosen is None for c in found):
        raise UserError(f"{run_dir}: nothing to recommend: " + "; ".join(f"{c.kernels} under {c.workload}: {c.why}"
                                                                        for c in found))
    for c in found:
        console.print(serving_table(c))
        if c.note:
            console.print(f"note: {c.kernels} under {c.workload}: {c.note}")
        if c.chosen is None:
            console.print(f"{c.kernels} under {c.workload}: nothing to recommend: {c.why}")
            continue
        j = choice_json(c, view.first)
        console.print(f"{c.kernels} under {c.workload}: max_loras {c.chosen.max_loras}, {c.chosen.strategy}: "
                      f"{c.chosen.output_tokens_per_s:,.0f} output tokens/s; {c.why}")
        console.print(f"  vLLM: {j['chosen']['vllm_flags']}")
    path = recommendation_file.write_section(run_dir, "serving", f"ttft_p99_ms={target:g}",
                                             [choice_json(c, view.first) for c in found])
    console.print(f"-> {path}")
    return 0
