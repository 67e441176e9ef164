"""The ``lorabench`` command line: ``sweep`` measures, ``check`` verifies every captured graph
against the reference, ``report`` turns a run into plots, tables and a recommendation,
``recommend`` chooses a capture set (strategy auto) for a workload within budgets, ``tune`` searches
kernel configs, ``compare`` A/Bs two runs (a regression gate). Bad input ends in one line on stderr
and exit status 2.

Each command's module is imported when the command runs, not before: ``report`` and ``recommend``
then never load torch or Triton, and ``--help`` stays fast."""

import importlib
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from lorabench.config.models import PRESETS
from lorabench.config.strategies import STRATEGIES
from lorabench.errors import UserError
from lorabench.kernels import BACKENDS, RANKS

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
Strategy = Annotated[str, typer.Option("--strategy", help=f"Capture sets: {', '.join(STRATEGIES)}, a list like [1,2,4], or auto (with --auto-from), {LIST} [default: max,pow2,dense].")]
Model = Annotated[str, typer.Option("--model", help=f"A preset ({', '.join(PRESETS)}), a config.json or a folder holding one, or a Hugging Face model id (its config only; weights are random) [default: llama-2-7b on a GPU, tiny on the CPU].")]
Layers = Annotated[str, typer.Option("--layers", help="Shorten the model to this many layers [default: the model's].")]
Tp = Annotated[str, typer.Option("--tp", help="Tensor-parallel ranks: build and time one rank's shapes, LoRA sharded as vLLM shards it; the rank's all-reduces are left out [default: 1].")]
Rank = Annotated[str, typer.Option("--rank", "--max-lora-rank", help=f"LoRA rank, vLLM's --max-lora-rank (every adapter is padded to it): {', '.join(map(str, RANKS))} [default: 16].")]
FullySharded = Annotated[bool, typer.Option("--fully-sharded-loras", help="With --tp: cut LoRA as vLLM's --fully-sharded-loras does (A's rank on qkv and gate_up, B's outputs on o and down); its collectives are left out too.")]
Ranks = Annotated[str, typer.Option("--ranks", help="The adapters' own ranks and their shares of the slots, e.g. 8:0.5,64:0.5, padded to --rank; lorabench's kernels also run as <backend>+unpadded, skipping the padding [default: all at --rank].")]
Dtype = Annotated[str, typer.Option("--dtype", help="float16, bfloat16, float32 [default: float16 on a GPU, float32 on the CPU].")]
Kernels = Annotated[str, typer.Option("--kernels", help=f"LoRA kernel backends, {LIST}: {'; '.join(f'{b.name} ({b.doc})' for b in BACKENDS.values())} [default: triton on a GPU, torch on the CPU].")]
Device = Annotated[str, typer.Option("--device", help="auto, cuda, cpu [default: auto].")]
Seed = Annotated[str, typer.Option("--seed", help="Seed for weights and batches [default: 0].")]
Executor = Annotated[str, typer.Option("--executor", help="Where the worker groups (every strategy of one kernels and max_loras, compared with each other) run: local (this host's GPUs, one group per GPU at a time) or dask (a Dask cluster's workers with a GPU resource: pip install 'lorabench[dask]') [default: local].")]
Gpus = Annotated[str, typer.Option("--gpus", help="This host's GPUs to use, as indices (0,1) or all; each worker is pinned to its GPU by UUID [default: all].")]
AdaptersN = Annotated[str, typer.Option("--adapters", help="Adapters the requests choose from, held in the max_loras GPU slots by LRU: the workload runs become residency runs of the largest concurrency's clients, loading adapters into slots as the steps need them (timed) [default: one adapter per slot, none loaded].")]
MaxCpuLoras = Annotated[str, typer.Option("--max-cpu-loras", help="With --adapters: vLLM's CPU cache of adapters (at least max_loras); a load of an adapter not in it is counted as a read from storage, which lorabench does not time [default: every adapter].")]
OutputTokens = Annotated[str, typer.Option("--output-tokens", help="With --adapters: tokens each request decodes (a trace's output_tokens column overrides it) [default: 128].")]
Scheduler = Annotated[str, typer.Option("--scheduler", help="With --executor dask: the address of a running Dask scheduler (tcp://HOST:8786) whose workers hold --resources GPU=1 [default: a LocalCluster over this host's GPUs].")]


@app.command()
def sweep(
    max_loras: MaxLoras = None,
    concurrency: str = typer.Option(None, "--concurrency", help=f"Requests per decode step, {LIST} [default: 1,2,4,8]."),
    strategy: Strategy = None,
    model: Model = None,
    layers: Layers = None,
    tp: Tp = None,
    fully_sharded_loras: FullySharded = False,
    rank: Rank = None,
    ranks: Ranks = None,
    context_len: str = typer.Option(None, "--context-len", help="KV-cache positions each request attends over [default: 1024]."),
    dtype: Dtype = None,
    kernels: Kernels = None,
    device: Device = None,
    workload: str = typer.Option(None, "--workload", help=f"Adapter mixes for workload runs, {LIST}: uniform, zipf:S, single, base:P, joined by +; or trace:PATH (CSV/JSONL) [default: uniform]."),
    iters: str = typer.Option(None, "--iters", help="Timed steps per point [default: 100]."),
    warmup: str = typer.Option(None, "--warmup", help="Untimed steps before each point [default: 10]."),
    ci_target: str = typer.Option(None, "--ci-target", help="Stop timing a point once the 95 % interval of its median is within +- this percent (at least 20 steps, and two turns per strategy where several share a point; at most --iters) [default: always --iters]."),
    seed: Seed = None,
    out: str = typer.Option(None, "--out", help="Output root; the run goes to OUT/<run_id> [default: results]."),
    capture_sizes: str = typer.Option(None, "--capture-sizes", help=f"Batch buckets that get graphs, {LIST} [default: the concurrency values]."),
    spec: Path = typer.Option(None, "--spec", help="A TOML spec (e.g. sweeps/card.toml); flags override it."),
    no_check: bool = typer.Option(False, "--no-check", help="Skip the correctness check of each configuration (the `correct` column)."),
    auto_from: str = typer.Option(None, "--auto-from", help="Strategy auto: the run whose points price the capture sets (see `lorabench recommend`)."),
    graph_memory_budget: str = typer.Option(None, "--graph-memory-budget", help="Strategy auto: most graph memory the set may take, MiB."),
    startup_budget: str = typer.Option(None, "--startup-budget", help="Strategy auto: most startup the set may take, s."),
    tuned: str = typer.Option(None, "--tuned", help="A `lorabench tune` output folder: each swept backend it has configs for (triton, fused, vllm) also runs as <backend>+tuned."),
    adapters: AdaptersN = None,
    max_cpu_loras: MaxCpuLoras = None,
    output_tokens: OutputTokens = None,
    resume: Path = typer.Option(None, "--resume", help="A run folder whose sweep ended early (killed, interrupted, or with failed points): measure its missing and failed points into it, under its own spec."),
    force: bool = typer.Option(False, "--force", help="With --resume: resume even when this lorabench plans the run differently, runs other code, or finds another GPU (the run.json records it)."),
    executor: Executor = None,
    gpus: Gpus = None,
    scheduler: Scheduler = None,
):
    """Measure decode steps over max_loras x strategy x concurrency x active count; write Parquet."""
    from lorabench.commands.sweep import Placement
    from lorabench.commands.sweep import sweep as run

    placement = Placement.parse(executor, gpus, scheduler)
    flags = dict(max_loras=max_loras, concurrency=concurrency, strategy=strategy, model=model, layers=layers, tp=tp,
                 fully_sharded_loras=fully_sharded_loras or None, rank=rank, ranks=ranks, context_len=context_len, dtype=dtype, kernels=kernels, device=device, workload=workload,
                 iters=iters, warmup=warmup, seed=seed, out=out, capture_sizes=capture_sizes,
                 check=False if no_check else None, auto_from=auto_from, graph_memory_budget=graph_memory_budget,
                 startup_budget=startup_budget, tuned=tuned, ci_target=ci_target, adapters=adapters,
                 max_cpu_loras=max_cpu_loras, output_tokens=output_tokens)
    return run(flags, spec, console, resume=resume, force=force, placement=placement)


@app.command()
def check(
    max_loras: MaxLoras = None,
    strategy: Strategy = None,
    kernels: Kernels = None,
    capture_sizes: str = typer.Option(None, "--capture-sizes", help=f"Batch buckets that get graphs, {LIST} [default: 1,2,4,8]."),
    model: Model = None,
    layers: Layers = None,
    tp: Tp = None,
    fully_sharded_loras: FullySharded = False,
    rank: Rank = None,
    ranks: Ranks = None,
    dtype: Dtype = None,
    device: Device = None,
    seed: Seed = None,
    out: str = typer.Option(None, "--out", help="Output root; checks.json goes to OUT/<run_id> [default: results]."),
    spec: Path = typer.Option(None, "--spec", help="A TOML spec; its configurations are checked, nothing is timed."),
    executor: Executor = None,
    gpus: Gpus = None,
    scheduler: Scheduler = None,
):
    """Replay every captured graph of each configuration on all-adapter, all-base and mixed
    batches at every active count, against the plain-torch reference. Exit 1 if any is wrong."""
    from lorabench.commands.check import check as run
    from lorabench.commands.sweep import Placement

    placement = Placement.parse(executor, gpus, scheduler)
    flags = dict(max_loras=max_loras, strategy=strategy, kernels=kernels, capture_sizes=capture_sizes, model=model,
                 layers=layers, tp=tp, fully_sharded_loras=fully_sharded_loras or None, rank=rank, ranks=ranks, dtype=dtype, device=device, seed=seed, out=out)
    return run(flags, spec, console, placement)


@app.command()
def recommend(
    run_dir: Path = typer.Argument(..., help="A sweep's run folder (its points.parquet is the cost model)."),
    workload: str = typer.Option("uniform", "--workload", help="The workload to optimise for: uniform, zipf:S, single, base:P, joined by +; or trace:PATH."),
    graph_memory_budget: str = typer.Option(None, "--graph-memory-budget", help="Most graph memory the set may take, MiB (free-memory delta, as sweeps measure it)."),
    startup_budget: str = typer.Option(None, "--startup-budget", help="Most startup (build + compile + capture) the set may take, s."),
    kernels: str = typer.Option(None, "--kernels", help=f"Only these backends, {LIST} [default: every lorabench backend in the run]."),
    max_loras: str = typer.Option(None, "--max-loras", help=f"Only these max_loras, {LIST} [default: every one in the run]."),
    adapters: str = typer.Option(None, "--adapters", help="Recommend the whole LoRA configuration for this many adapters: max_loras from adapter residency (LRU slots, loads timed by the run), the capture set, --max-cpu-loras, and what it all costs in KV cache."),
    concurrency: str = typer.Option(None, "--concurrency", help="With --adapters: clients keeping one request each in flight (vllm bench's --max-concurrency) [default: the run's largest concurrency]."),
    output_tokens: OutputTokens = None,
    max_cpu_loras: MaxCpuLoras = None,
    gpu_memory_budget: str = typer.Option(None, "--gpu-memory-budget", help="With --adapters: most GPU memory the LoRA configuration may take (its graphs and adapter slots, which come out of the KV cache), GiB [default: no limit]."),
):
    """Choose the capture set (strategy auto) that minimises the expected step time under a
    workload within the budgets, from what a run measured; compare it with max, pow2 and dense.
    With --adapters N: choose max_loras, the capture set and the CPU cache for N adapters, by
    tokens per second with adapter loads, and what they cost in memory and KV cache.
    Exit status 2 when no (kernels, max_loras) gets a set; those that get none are named."""
    from lorabench.commands.recommend import recommend as run
    from lorabench.commands.recommend import recommend_residency

    if adapters is not None:
        given = [f for f, v in (("--graph-memory-budget", graph_memory_budget), ("--startup-budget", startup_budget)) if v is not None]
        if given:
            raise UserError(f"{given[0]} prices strategy auto alone; with --adapters use --gpu-memory-budget")
        return recommend_residency(run_dir, workload, adapters, concurrency, output_tokens, max_cpu_loras,
                                   gpu_memory_budget, kernels, max_loras, console)
    given = [f for f, v in (("--concurrency", concurrency), ("--output-tokens", output_tokens), ("--max-cpu-loras", max_cpu_loras),
                            ("--gpu-memory-budget", gpu_memory_budget)) if v is not None]
    if given:
        raise UserError(f"{given[0]}: goes with --adapters N")
    return run(run_dir, workload, graph_memory_budget, startup_budget, kernels, max_loras, console)


@app.command()
def report(
    runs: list[Path] = typer.Argument(None, help="Run folders [default: the newest run under --results]."),
    results: Path = typer.Option(Path("results"), "--results", help="Where to look for the newest run."),
):
    """Plots, report.md and recommendation.json, written into each run's folder."""
    from lorabench.commands.report import write_report
    from lorabench.storage.results import find_newest_run

    for run_dir in runs or [find_newest_run(results)]:
        paths = write_report(run_dir, console)
        console.print(f"{run_dir}: " + ", ".join(p.name for p in paths))


@app.command()
def compare(
    run_a: Path = typer.Argument(..., help="The baseline run folder (A)."),
    run_b: Path = typer.Argument(..., help="The run compared with it (B); the JSON and plot go into it."),
    fail_if_slower: str = typer.Option(None, "--fail-if-slower", help="Exit 1 when B is slower than A by more than this percent with confidence (the low end of the overall 95 % interval above it and above --margin) [default: never]."),
    margin: str = typer.Option(None, "--margin", help="Differences whose whole 95 % interval lies within +- this percent read as no difference detected. A rerun on the same GPU a minute later differs by up to 0.5 % at a point, two GPUs of one host by up to 1.7 % [default: 1]."),
    plot: Path = typer.Option(None, "--plot", help="Where to write the plot [default: RUN_B/compare-<RUN_A's name>.png]."),
):
    """A/B of two runs for a regression gate: B's median step against A's per point both measured
    on the same GPU (95 % bootstrap interval, rank-test p, verdict with --margin, 1 % by default
    because reruns on one GPU differ by up to 0.5 % at a point and two GPUs of one host by up to 1.7 %), and
    the geometric mean over the points. Writes RUN_B/compare-<A>.json and a plot. Exit 0; 1 with
    --fail-if-slower when B is slower beyond it; 2 for bad input."""
    from lorabench.commands.compare import compare as run

    return run(run_a, run_b, fail_if_slower, margin, plot, console)


@app.command()
def tune(
    kernels: str = typer.Option(None, "--kernels", help=f"Kernels to tune, {LIST}: triton (lorabench's shrink and expand), fused (lorabench's), vllm (vLLM's shrink and expand) [default: triton,fused, plus vllm on a GPU when vLLM is installed]."),
    model: Model = None,
    tp: Tp = None,
    rank: Rank = None,
    dtype: str = typer.Option(None, "--dtype", help="float16, bfloat16, float32 (lorabench's kernels only) [default: the sweep's: float16 on a GPU, float32 on the CPU; float16 when tuning vllm]."),
    max_loras: MaxLoras = None,
    tokens: str = typer.Option(None, "--tokens", help=f"Token buckets (tokens per decode step) to tune, {LIST} [default: 1,8,32]."),
    budget_s: str = typer.Option(None, "--budget-s", help="Seconds of search, shared equally by the shapes (each still gets its default and one candidate) [default: 300]."),
    out: str = typer.Option(None, "--out", help="Output folder: cache.jsonl, lorabench_tuned.json, vllm/, tune.md [default: tuned]."),
    resume: bool = typer.Option(True, "--resume/--fresh", help="Reuse OUT/cache.jsonl (skip what it has measured), or start over."),
    device: Device = None,
    seed: Seed = None,
    executor: str = typer.Option(None, "--executor", help="Where the shapes are tuned: local (this process; with --gpus, one worker per chosen GPU of this host) or dask (the GPU workers of a Dask cluster: pip install 'lorabench[dask]') [default: local, this process]."),
    gpus: Gpus = None,
    scheduler: Scheduler = None,
):
    """Search kernel configs per shape within a time budget; write lorabench's tuned table and
    vLLM's VLLM_TUNED_CONFIG_FOLDER files. Rerun the same command to resume. With several GPUs
    (--gpus 0,1, or --executor dask), the shapes are dealt out to one worker per GPU and their
    measurements merged into the one folder."""
    from lorabench.commands.tune import tune as run

    flags = dict(kernels=kernels, model=model, tp=tp, rank=rank, dtype=dtype, max_loras=max_loras, tokens=tokens,
                 budget_s=budget_s, out=out, device=device, seed=seed, executor=executor, gpus=gpus, scheduler=scheduler)
    return run(flags, resume, console)


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
    except BrokenPipeError:  # e.g. `lorabench report | head`: the reader left, nothing to say
        return 141
    return rv if isinstance(rv, int) else 0


if __name__ == "__main__":
    sys.exit(main())
