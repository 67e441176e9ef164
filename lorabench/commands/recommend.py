"""``lorabench recommend RUN``: the capture set (strategy auto) that minimises the expected step
under a workload within the budgets, from what a run measured, next to max, pow2 and dense;
added to the run's ``recommendation.json`` under ``"auto"``."""

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from lorabench.analysis.optimise import auto_recommendations
from lorabench.config.spec import coerce
from lorabench.config.strategies import STRATEGIES
from lorabench.errors import UserError
from lorabench.storage.results import load_run


def auto_table(recs: list[dict]) -> Table:
    baselines = [name for name, s in STRATEGIES.items() if s.fixed]
    table = Table(title=f"strategy auto under {recs[0]['workload']}: expected step (model), mean over concurrency")
    for col in ["kernels", "L", "set", "ms", "graphs", "MiB", "startup s", *(f"vs {b}" for b in baselines), "model values"]:
        table.add_column(col, justify="left" if col in ("kernels", "set", "model values") else "right", overflow="fold")
    for r in recs:
        a = r["auto"]
        if a is None:
            table.add_row(r["kernels"], str(r["max_loras"]), *["-"] * (5 + len(baselines)), r["reason"])
            continue
        gains = []
        for name in baselines:
            b = r["baselines"].get(name)
            gains.append("-" if b is None else f"{b['auto_gain_pct']:+.2f} %" + ("" if b["fits_budgets"] else " (over budget)"))
        mem = "-" if a["graph_mem_bytes"] is None else f"{a['graph_mem_bytes'] / 2**20:.0f}"
        table.add_row(r["kernels"], str(r["max_loras"]), str(a["counts"]), f"{a['expected_ms']:.3f}", str(a["lora_graphs"]), mem,
                      "-" if a["startup_s"] is None else f"{a['startup_s']:.2f}", *gains,
                      ", ".join(f"{v} {k}" for k, v in a["model_values"].items()))
    return table


def write_auto(run_dir: Path, recs: list[dict]) -> Path:
    """Into the run's recommendation.json, under "auto" keyed by workload (the rest is the
    report's and stays as it is)."""
    path = Path(run_dir) / "recommendation.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    data.setdefault("auto", {})[recs[0]["workload"]] = recs
    path.write_text(json.dumps(data, indent=2, default=float) + "\n")
    return path


def recommend(run_dir: Path, workload: str, graph_memory_budget: str | None, startup_budget: str | None,
              kernels: str | None, max_loras: str | None, console: Console) -> int:
    df = load_run(run_dir)
    memory = coerce("graph_memory_budget", graph_memory_budget) * 2**20 if graph_memory_budget is not None else None
    startup = coerce("startup_budget", startup_budget) if startup_budget is not None else None
    try:
        recs = auto_recommendations(df, workload, memory, startup,
                                    kernels=coerce("kernels", kernels) if kernels else None,
                                    max_loras=coerce("max_loras", max_loras) if max_loras else None)
    except ValueError as e:
        raise UserError(str(e)) from None
    if not recs:
        raise UserError(f"{run_dir}: nothing to optimise (no lorabench-kernel points matching --kernels/--max-loras)")
    console.print(auto_table(recs))
    for r in recs:
        if r["auto"] is not None:
            console.print(f"{r['kernels']} max_loras={r['max_loras']}: validate with  {r['validate']}")
            console.print(f"  vLLM: {r['vllm']['flags']}  ({r['vllm']['note']})")
    console.print(f"-> {write_auto(run_dir, recs)}")
    return 0
