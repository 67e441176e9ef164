"""The ``lorabench`` command line: ``sweep`` measures, ``check`` verifies every captured graph
against the reference, ``report`` turns a run into plots, tables and a recommendation,
``recommend`` chooses a capture set (strategy auto) for a workload within budgets. Bad input ends
in one line on stderr and exit status 2."""

import importlib
import shlex
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from lorabench.spec import UserError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # help texts show "[default: ...]" literally
    help="Benchmark and tune multi-LoRA CUDA-graph specialisation: which capture sets pay, at what memory and startup cost.",
)
console = Console()

LIST = "comma-separated"

# Options that sweep and check share, declared once.
MaxLoras = Annotated[str, typer.Option("--max-loras", help=f"Resident adapter slots, {LIST} [default: 4].")]
Strategy = Annotated[str, typer.Option("--strategy", help=f"Capture sets: max, pow2, dense, agnostic (one graph set, grid sized by the bucket), a list like [1,2,4], or auto (with --auto-from), {LIST} [default: max,pow2,dense].")]
Model = Annotated[str, typer.Option("--model", help="Preset: llama-2-7b, llama-3-8b, tiny [default: llama-2-7b on a GPU, tiny on the CPU].")]
Layers = Annotated[str, typer.Option("--layers", help="Shorten the model to this many layers [default: the preset's].")]
Rank = Annotated[str, typer.Option("--rank", help="LoRA rank: 8, 16, 32, 64 [default: 16].")]
Dtype = Annotated[str, typer.Option("--dtype", help="float16, bfloat16, float32 [default: float16 on a GPU, float32 on the CPU].")]
Kernels = Annotated[str, typer.Option("--kernels", help=f"LoRA kernel backends, {LIST}: triton (shrink + expand), fused (one launch per LoRA linear), torch, vllm [default: triton on a GPU, torch on the CPU].")]
Device = Annotated[str, typer.Option("--device", help="auto, cuda, cpu [default: auto].")]
Seed = Annotated[str, typer.Option("--seed", help="Seed for weights and batches [default: 0].")]


@app.command()
def sweep(
    max_loras: MaxLoras = None,
    concurrency: str = typer.Option(None, "--concurrency", help=f"Requests per decode step, {LIST} [default: 1,2,4,8]."),
    strategy: Strategy = None,
    model: Model = None,
    layers: Layers = None,
    rank: Rank = None,
    context_len: str = typer.Option(None, "--context-len", help="KV-cache positions each request attends over [default: 1024]."),
    dtype: Dtype = None,
    kernels: Kernels = None,
    device: Device = None,
    workload: str = typer.Option(None, "--workload", help=f"Adapter mixes for workload runs, {LIST}: uniform, zipf:S, single, base:P, joined by +; or trace:PATH (CSV/JSONL) [default: uniform]."),
    iters: str = typer.Option(None, "--iters", help="Timed steps per point [default: 100]."),
    warmup: str = typer.Option(None, "--warmup", help="Untimed steps before each point [default: 10]."),
    seed: Seed = None,
    out: str = typer.Option(None, "--out", help="Output root; the run goes to OUT/<run_id> [default: results]."),
    capture_sizes: str = typer.Option(None, "--capture-sizes", help=f"Batch buckets that get graphs, {LIST} [default: the concurrency values]."),
    spec: Path = typer.Option(None, "--spec", help="A TOML spec (e.g. sweeps/card.toml); flags override it."),
    no_check: bool = typer.Option(False, "--no-check", help="Skip the correctness check of each configuration (the `correct` column)."),
    auto_from: str = typer.Option(None, "--auto-from", help="Strategy auto: the run whose points price the capture sets (see `lorabench recommend`)."),
    graph_memory_budget: str = typer.Option(None, "--graph-memory-budget", help="Strategy auto: most graph memory the set may take, MiB."),
    startup_budget: str = typer.Option(None, "--startup-budget", help="Strategy auto: most startup the set may take, s."),
    tuned: str = typer.Option(None, "--tuned", help="A `lorabench tune` output folder: each swept backend it has configs for (triton, fused, vllm) also runs as <backend>+tuned."),
):
    """Measure decode steps over max_loras x strategy x concurrency x active count; write Parquet."""
    import torch

    from lorabench.results import read_points
    from lorabench.spec import build_spec
    from lorabench.sweep import Sweep, summary_table

    flags = dict(max_loras=max_loras, concurrency=concurrency, strategy=strategy, model=model, layers=layers,
                 rank=rank, context_len=context_len, dtype=dtype, kernels=kernels, device=device, workload=workload,
                 iters=iters, warmup=warmup, seed=seed, out=out, capture_sizes=capture_sizes,
                 check=False if no_check else None, auto_from=auto_from, graph_memory_budget=graph_memory_budget,
                 startup_budget=startup_budget, tuned=tuned)
    the_spec, notice = build_spec(flags, spec, torch.cuda.is_available())
    if notice:
        console.print(notice)
    run = Sweep(the_spec, shlex.join(["lorabench"] + sys.argv[1:]), console)
    console.print(f"run {run.run_id}: {sum(len(j['points']) for j in run.jobs)} points in {len(run.jobs)} workers -> {run.run_dir}")
    try:
        run_dir = run.run()
    except KeyboardInterrupt:
        rows = len(run.writer.rows)
        print(f"interrupted: {rows} finished rows kept in {run.writer.path}", file=sys.stderr)
        raise typer.Exit(130)
    df = read_points(run_dir)
    console.print(summary_table(df, the_spec.device))
    failed = int((df.status == "failed").sum())
    console.print(f"{len(df)} points ({failed} failed) in {run.info['wall_s']:.1f} s -> {run_dir / 'points.parquet'}")
    console.print(f"next: lorabench report {run_dir}")
    if failed == len(df):
        raise typer.Exit(1)  # nothing was measured


@app.command()
def check(
    max_loras: MaxLoras = None,
    strategy: Strategy = None,
    kernels: Kernels = None,
    capture_sizes: str = typer.Option(None, "--capture-sizes", help=f"Batch buckets that get graphs, {LIST} [default: 1,2,4,8]."),
    model: Model = None,
    layers: Layers = None,
    rank: Rank = None,
    dtype: Dtype = None,
    device: Device = None,
    seed: Seed = None,
    out: str = typer.Option(None, "--out", help="Output root; checks.json goes to OUT/<run_id> [default: results]."),
    spec: Path = typer.Option(None, "--spec", help="A TOML spec; its configurations are checked, nothing is timed."),
):
    """Replay every captured graph of each configuration on all-adapter, all-base and mixed
    batches at every active count, against the plain-torch reference. Exit 1 if any is wrong."""
    import torch

    from lorabench.spec import build_spec, split_list
    from lorabench.sweep import Sweep, check_table

    if strategy and "auto" in split_list(strategy):
        raise UserError("lorabench check takes fixed capture sets: check an auto set by its list, e.g. --strategy '[8,128]'")
    flags = dict(max_loras=max_loras, strategy=strategy, kernels=kernels, capture_sizes=capture_sizes, model=model,
                 layers=layers, rank=rank, dtype=dtype, device=device, seed=seed, out=out, check=True)
    the_spec, notice = build_spec(flags, spec, torch.cuda.is_available())
    if notice:
        console.print(notice)
    run = Sweep(the_spec, shlex.join(["lorabench"] + sys.argv[1:]), console, check_only=True)
    console.print(f"check {run.run_id}: {len(run.jobs)} configurations -> {run.run_dir / 'checks.json'}")
    try:
        run.run()
    except KeyboardInterrupt:
        print(f"interrupted: {len(run.checks)} verdicts kept in {run.run_dir / 'checks.json'}", file=sys.stderr)
        raise typer.Exit(130)
    console.print(check_table(run.checks))
    wrong = sum(c.get("correct") is False for c in run.checks)
    unknown = sum(c.get("correct") is None for c in run.checks)
    console.print(f"{len(run.checks)} configurations: {len(run.checks) - wrong - unknown} correct, {wrong} wrong, {unknown} without a verdict")
    if wrong or unknown:
        raise typer.Exit(1)


@app.command()
def recommend(
    run_dir: Path = typer.Argument(..., help="A sweep's run folder (its points.parquet is the cost model)."),
    workload: str = typer.Option("uniform", "--workload", help="The workload to optimise for: uniform, zipf:S, single, base:P, joined by +; or trace:PATH."),
    graph_memory_budget: str = typer.Option(None, "--graph-memory-budget", help="Most graph memory the set may take, MiB (free-memory delta, as sweeps measure it)."),
    startup_budget: str = typer.Option(None, "--startup-budget", help="Most startup (build + compile + capture) the set may take, s."),
    kernels: str = typer.Option(None, "--kernels", help=f"Only these backends, {LIST} [default: every lorabench backend in the run]."),
    max_loras: str = typer.Option(None, "--max-loras", help=f"Only these max_loras, {LIST} [default: every one in the run]."),
):
    """Choose the capture set (strategy auto) that minimises the expected step time under a
    workload within the budgets, from what a run measured; compare it with max, pow2 and dense."""
    from lorabench.optimise import auto_recommendations, write_auto
    from lorabench.report import load_run
    from lorabench.spec import _coerce

    df = load_run(run_dir)
    budgets = {}
    for name, value, scale in (("graph_memory_budget", graph_memory_budget, 2**20), ("startup_budget", startup_budget, 1.0)):
        if value is not None:
            budgets[name] = _coerce(name, value) * scale
    try:
        recs = auto_recommendations(
            df, workload, budgets.get("graph_memory_budget"), budgets.get("startup_budget"),
            kernels=_coerce("kernels", kernels) if kernels else None,
            max_loras=_coerce("max_loras", max_loras) if max_loras else None)
    except ValueError as e:
        raise UserError(str(e)) from None
    if not recs:
        raise UserError(f"{run_dir}: nothing to optimise (no lorabench-kernel points matching --kernels/--max-loras)")
    console.print(auto_table(recs))
    for r in recs:
        if r["auto"] is not None:
            console.print(f"{r['kernels']} max_loras={r['max_loras']}: validate with  {r['validate']}")
            console.print(f"  vLLM: {r['vllm']['flags']}  ({r['vllm']['note']})")
    path = write_auto(run_dir, recs)
    console.print(f"-> {path}")


def auto_table(recs: list[dict]):
    from rich.table import Table

    table = Table(title=f"strategy auto under {recs[0]['workload']}: expected step (model), mean over concurrency")
    for col in ["kernels", "L", "set", "ms", "graphs", "MiB", "startup s", "vs max", "vs pow2", "vs dense", "model values"]:
        table.add_column(col, justify="left" if col in ("kernels", "set", "model values") else "right", overflow="fold")
    for r in recs:
        a = r["auto"]
        if a is None:
            table.add_row(r["kernels"], str(r["max_loras"]), "-", "-", "-", "-", "-", "-", "-", "-", r["reason"])
            continue
        gains = []
        for name in ("max", "pow2", "dense"):
            b = r["baselines"].get(name)
            gains.append("-" if b is None else f"{b['auto_gain_pct']:+.2f} %" + ("" if b["fits_budgets"] else " (over budget)"))
        mem = "-" if a["graph_mem_bytes"] is None else f"{a['graph_mem_bytes'] / 2**20:.0f}"
        table.add_row(r["kernels"], str(r["max_loras"]), str(a["counts"]), f"{a['expected_ms']:.3f}", str(a["lora_graphs"]), mem,
                      "-" if a["startup_s"] is None else f"{a['startup_s']:.2f}", *gains,
                      ", ".join(f"{v} {k}" for k, v in a["model_values"].items()))
    return table


@app.command()
def report(
    runs: list[Path] = typer.Argument(None, help="Run folders [default: the newest run under --results]."),
    results: Path = typer.Option(Path("results"), "--results", help="Where to look for the newest run."),
):
    """Plots, report.md and recommendation.json, written into each run's folder."""
    from lorabench.report import find_newest_run, write_report

    for run_dir in runs or [find_newest_run(results)]:
        paths = write_report(run_dir)
        console.print(f"{run_dir}: " + ", ".join(p.name for p in paths))


@app.command()
def tune(
    kernels: str = typer.Option(None, "--kernels", help=f"Kernels to tune, {LIST}: triton (lorabench's shrink and expand), fused (lorabench's), vllm (vLLM's shrink and expand) [default: triton,fused, plus vllm on a GPU when vLLM is installed]."),
    model: Model = None,
    rank: Rank = None,
    dtype: str = typer.Option(None, "--dtype", help="float16, bfloat16, float32 (lorabench's kernels only) [default: float16]."),
    max_loras: MaxLoras = None,
    tokens: str = typer.Option(None, "--tokens", help=f"Token buckets (tokens per decode step) to tune, {LIST} [default: 1,8,32]."),
    budget_s: str = typer.Option(None, "--budget-s", help="Seconds of search, shared equally by the shapes (each still gets its default and one candidate) [default: 300]."),
    out: str = typer.Option(None, "--out", help="Output folder: cache.jsonl, lorabench_tuned.json, vllm/, tune.md [default: tuned]."),
    resume: bool = typer.Option(True, "--resume/--fresh", help="Reuse OUT/cache.jsonl (skip what it has measured), or start over."),
    device: Device = None,
    seed: Seed = None,
):
    """Search kernel configs per shape within a time budget; write lorabench's tuned table and
    vLLM's VLLM_TUNED_CONFIG_FOLDER files. Rerun the same command to resume."""
    import torch

    from lorabench.tune import Tuner, build_tune_spec, interpreter_child
    from lorabench.tune_files import summary_table

    flags = dict(kernels=kernels, model=model, rank=rank, dtype=dtype, max_loras=max_loras, tokens=tokens,
                 budget_s=budget_s, out=out, device=device, seed=seed)
    child = interpreter_child(flags, resume, torch.cuda.is_available())
    if child is not None:  # on the CPU the whole tune runs in a child with Triton's interpreter on
        raise typer.Exit(child)
    the_spec, notice = build_tune_spec(flags, torch.cuda.is_available())
    if notice:
        console.print(notice)
    tuner = Tuner(the_spec, shlex.join(["lorabench"] + sys.argv[1:]), console, fresh=not resume)
    console.print(f"tune: {len(tuner.shapes)} shapes, {the_spec.budget_s:g} s -> {tuner.out}")
    try:
        results = tuner.run()
    except KeyboardInterrupt:
        tuner.write()
        print(f"interrupted: measurements kept in {tuner.cache.path}; rerun the same command to resume", file=sys.stderr)
        raise typer.Exit(130)
    console.print(summary_table(results, tuner.meta))
    console.print(f"-> {tuner.out / 'lorabench_tuned.json'}, {tuner.out / 'tune.md'}"
                  + (f", {tuner.out / 'vllm'} (VLLM_TUNED_CONFIG_FOLDER)" if "vllm" in the_spec.kernels else ""))


def _usage_errors() -> tuple[type, ...]:
    """Click's usage-error class: from click itself, or from the copy newer Typers vendor."""
    found = []
    for module in ("click.exceptions", "typer._click.exceptions"):
        try:
            found.append(importlib.import_module(module).ClickException)
        except (ImportError, AttributeError):
            pass
    return tuple(found)


def main(argv: list[str] | None = None) -> int:
    """Entry point: one line and status 2 for bad input, never a traceback."""
    try:
        rv = app(args=argv, standalone_mode=False, prog_name="lorabench")
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except _usage_errors() as e:
        print(f"error: {e.format_message()}", file=sys.stderr)
        return 2
    except typer.Abort:
        print("aborted", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return rv if isinstance(rv, int) else 0


if __name__ == "__main__":
    sys.exit(main())
