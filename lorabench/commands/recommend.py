"""``lorabench recommend RUN``: the capture set (strategy auto) that minimises the expected step
under a workload within the budgets, from what a run measured, next to max, pow2 and dense and
next to what ``lorabench report`` recommends among the measured strategies (the same comparison:
``lorabench.analysis.compare``); added to the run's ``recommendation.json`` under ``"auto"``, with
the run's ``"coverage"``.

Exit status 0 when at least one (kernels, max_loras) gets a set; each that gets none (no set fits
the budgets, not even max; or nothing is comparable with max) is named in a line. Exit status 2,
one line on stderr and nothing written, when none gets a set.
"""

import json
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from lorabench.analysis.optimise import PLAIN, auto_recommendations
from lorabench.analysis.points import run_samples
from lorabench.analysis.residency import CARD, residency_recommendations, set_name
from lorabench.commands.tables import mib
from lorabench.config.flags import to_int, to_positive
from lorabench.config.residency import OUTPUT_TOKENS, Adapters, check_residency
from lorabench.config.spec import coerce
from lorabench.config.strategies import STRATEGIES
from lorabench.config.workload import parse_workload
from lorabench.errors import UserError
from lorabench.storage.results import load_run
from lorabench.storage.runs import Coverage, coverage
from lorabench.storage.samples import read_loads


def auto_table(recs: list[dict]) -> Table:
    """One row per (kernels, max_loras): the auto set, its predicted step and costs, and its gain
    over the baselines as the model prices them (how each value was priced is on the lines below)."""
    baselines = [name for name, s in STRATEGIES.items() if s.fixed]
    table = Table(title=f"strategy auto under {recs[0]['workload']}: expected step (model), mean over c",
                  box=box.SIMPLE_HEAD, padding=(0, 0), pad_edge=False)
    for col in ["kernels", "L", "set", "ms", "graphs", "MiB", "start s", *(f"vs {b}" for b in baselines)]:
        table.add_column(col, justify="left" if col in ("kernels", "set") else "right", overflow="fold", no_wrap=col != "kernels")
    for r in recs:
        a = r["auto"]
        if a is None:
            table.add_row(r["kernels"], str(r["max_loras"]), "none", *["-"] * (4 + len(baselines)))
            continue
        gains = []
        for name in baselines:
            b = r["baselines"].get(name)
            gains.append("-" if b is None else f"{b['auto_gain_pct']:+.2f}%" + ("" if b["fits_budgets"] else " (over budget)"))
        mem = "-" if a["graph_mem_bytes"] is None else f"{a['graph_mem_bytes'] / 2**20:.0f}"
        table.add_row(r["kernels"], str(r["max_loras"]), "[" + ",".join(map(str, a["counts"])) + "]", f"{a['expected_ms']:.3f}", str(a["lora_graphs"]), mem,
                      "-" if a["startup_s"] is None else f"{a['startup_s']:.2f}", *gains)
    return table


def write_auto(run_dir: Path, recs: list[dict], cov: Coverage | None = None) -> Path:
    """Into the run's recommendation.json, under "auto" keyed by workload, and the run's coverage
    (the rest is the report's and stays as it is)."""
    path = Path(run_dir) / "recommendation.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    data["coverage"] = cov.to_dict() if cov else None
    data.setdefault("auto", {})[recs[0]["workload"]] = recs
    path.write_text(json.dumps(data, indent=2, default=float) + "\n")
    return path


def recommend(run_dir: Path, workload: str, graph_memory_budget: str | None, startup_budget: str | None,
              kernels: str | None, max_loras: str | None, console: Console) -> int:
    df = load_run(run_dir)
    cov = coverage(run_dir, df)
    incomplete = cov.incomplete() if cov is not None else None
    memory = coerce("graph_memory_budget", graph_memory_budget) * 2**20 if graph_memory_budget is not None else None
    startup = coerce("startup_budget", startup_budget) if startup_budget is not None else None
    try:
        recs = auto_recommendations(df, workload, memory, startup,
                                    kernels=coerce("kernels", kernels) if kernels else None,
                                    max_loras=coerce("max_loras", max_loras) if max_loras else None,
                                    planned=cov.planned_concurrency if cov else None,
                                    samples=run_samples(run_dir))
    except ValueError as e:
        raise UserError(str(e)) from None
    if not recs:
        raise UserError(f"{run_dir}: nothing to optimise (no lorabench-kernel points matching --kernels/--max-loras)")
    none = [r for r in recs if r["auto"] is None]
    if len(none) == len(recs):
        raise UserError(f"{run_dir}: nothing to recommend" + (f" (incomplete run, {incomplete})" if incomplete else "") + ": "
                        + "; ".join(f"{r['kernels']} max_loras {r['max_loras']}: {r['reason']}" for r in none))
    if incomplete:
        console.print(f"incomplete run, {incomplete}; every comparison is over the concurrencies where max has every point")
    console.print(auto_table(recs))
    for r in recs:
        where = f"{r['kernels']} max_loras={r['max_loras']}"
        if r["auto"] is None:
            console.print(f"{where}: no set: {r['reason']}")
            continue
        if r["reason"] != PLAIN:
            console.print(f"{where}: auto is {r['auto']['counts']}: {r['reason']}")
        if r.get("inconclusive"):
            console.print(f"{where}: inconclusive: {r.get('more_measuring') or 'more steps per point would settle it'}")
        m = r["measured"]
        chosen = "nothing proposed" if m["strategy"] is None else f"{m['strategy']} {m['captured_counts']}"
        console.print(f"{where}: measured, as lorabench report says: {chosen}: {m['reason']}")
        console.print(f"  model values: {', '.join(f'{v} {k}' for k, v in r['auto']['model_values'].items())}")
        console.print(f"  validate with  {r['validate']}")
        console.print(f"  vLLM: {r['vllm']['flags']}  ({r['vllm']['note']})")
    console.print(f"-> {write_auto(run_dir, recs, cov)}")
    return 0


def _mib(b) -> str:
    return mib(b) or "-"


def residency_table(entry: dict) -> Table:
    """One row per (max_loras, capture set) priced under the residency workload: expected step
    (ms), tokens/s, tokens per step, requests waiting, loads per 1000 steps, graph and slot memory,
    and the KV-cache tokens they take."""
    table = Table(title=(f"{entry['kernels']}: {entry['adapters']} adapters under {entry['workload']}, {entry['clients']} clients, "
                         f"{entry['output_tokens']} tokens per request (expected, from the run's points)"),
                  box=box.SIMPLE_HEAD, padding=(0, 0), pad_edge=False)
    for col in ["L", "set", "ms", "tok/s", "tok/step", "wait", "loads/1k", "graph MiB", "slot MiB", "KV tok"]:
        table.add_column(col, justify="left" if col == "set" else "right", no_wrap=col != "set",
                         overflow="fold" if col == "set" else "ellipsis", min_width=len(col) if col != "set" else 4)
    chosen = entry["chosen"] or {}
    for c in entry["configs"]:
        mark = " *" if (c["max_loras"], c["counts"]) == (chosen.get("max_loras"), chosen.get("counts")) else ""
        name = set_name(c)
        kv = "-" if c["kv_tokens_given_up"] is None else f"{c['kv_tokens_given_up']:,}"
        table.add_row(str(c["max_loras"]), name + mark, f"{c['expected_step_ms']:.3f}", f"{c['tokens_per_s']:,.0f}",
                      f"{c['tokens_per_step']:.1f}", f"{c['waiting_per_step']:.1f}", f"{1000 * c['loads_per_step']:.1f}",
                      _mib(c["graph_mem_bytes"]), _mib(c["slot_bytes"]), kv)
    return table


def write_residency(run_dir: Path, entries: list[dict]) -> Path:
    """Into the run's recommendation.json, under "residency" keyed by workload and adapters."""
    path = Path(run_dir) / "recommendation.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    key = f"{entries[0]['workload']} over {entries[0]['adapters']} adapters"
    data.setdefault("residency", {})[key] = entries
    path.write_text(json.dumps(data, indent=2, default=float) + "\n")
    return path


def recommend_residency(run_dir: Path, workload: str, adapters: str, clients: str | None, output_tokens: str | None,
                        max_cpu_loras: str | None, gpu_memory_budget: str | None, kernels: str | None,
                        max_loras: str | None, console: Console) -> int:
    """``lorabench recommend RUN --adapters N``: max_loras, capture set and CPU cache for N
    adapters under a workload (``lorabench.analysis.residency``)."""
    df = load_run(run_dir)
    n = coerce("adapters", adapters)  # the sweep's bounds
    out = coerce("output_tokens", output_tokens) if output_tokens is not None else OUTPUT_TOKENS
    cpu = coerce("max_cpu_loras", max_cpu_loras) if max_cpu_loras is not None else None
    c = to_int("concurrency", clients, 1) if clients is not None else None
    budget = to_positive("gpu_memory_budget", gpu_memory_budget) * 2**30 if gpu_memory_budget is not None else None
    slots = coerce("max_loras", max_loras) if max_loras else None
    try:
        wl = parse_workload(workload)
        check_residency(wl, n, None, [1])  # a max_loras above the CPU cache is left out, and says so
        recs = residency_recommendations(df, workload, Adapters(n, cpu, out), c, budget,
                                         kernels=coerce("kernels", kernels) if kernels else None, max_loras=slots,
                                         samples=run_samples(run_dir), loads=read_loads(run_dir))
    except ValueError as e:
        raise UserError(str(e)) from None
    if not recs:
        raise UserError(f"{run_dir}: nothing to price (no fixed points of lorabench's kernels matching --kernels/--max-loras)")
    if all(r["chosen"] is None for r in recs):
        raise UserError(f"{run_dir}: nothing to recommend: " + "; ".join(f"{r['kernels']}: {r['reason']}" for r in recs))
    for r in recs:
        console.print(residency_table(r))
        where = f"{r['kernels']}"
        c = r["chosen"]
        if c is None:
            console.print(f"{where}: nothing to recommend: {r['reason']}")
            continue
        name = set_name(c)
        console.print(f"{where}: max_loras {c['max_loras']}, {name} {c['counts']}: {c['expected_step_ms']:.3f} ms per step, "
                      f"{c['tokens_per_s']:,.0f} tokens/s, {1000 * c['loads_per_step']:.1f} loads per 1000 steps; {r['reason']}")
        if r["versus_card"]:
            v = r["versus_card"]
            console.print(f"  against the card's max_loras {CARD} (max): {v['tokens_per_s']:,.0f} tokens/s; "
                          f"the choice: {v['verdict']}")
        gpu = c["graph_mem_bytes"]
        console.print(f"  memory: graphs {_mib(gpu)} MiB + {c['max_loras']} adapter slots {_mib(c['slot_bytes'])} MiB"
                      + (f" = {c['kv_tokens_given_up']:,} KV-cache tokens given up" if c["kv_tokens_given_up"] is not None else "")
                      + f"; CPU cache {r['max_cpu_loras']} adapters = {r['max_cpu_loras'] * c['slot_bytes'] / c['max_loras'] / 2**30:.1f} GiB of host memory")
        for note in r["notes"]:
            console.print(f"  note: {note}")
        console.print(f"  vLLM: {r['vllm']['flags']}  ({r['vllm']['note']})")
        console.print(f"  validate with  {r['validate']}")
    console.print(f"-> {write_residency(run_dir, recs)}")
    return 0
