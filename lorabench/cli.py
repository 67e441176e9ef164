"""The ``lorabench`` command line: ``sweep`` measures, ``check`` verifies every captured graph
against the reference, ``report`` turns a run into plots, tables and a recommendation,
``recommend`` chooses a capture set (strategy auto) for a workload within budgets, ``tune`` searches
kernel configs, ``compare`` A/Bs two runs (a regression gate). Bad input ends in one line on stderr
and exit status 2.

Each command's module is imported when the command runs, not before: ``report`` and ``recommend``
then never load torch or Triton, and ``--help`` stays fast."""

import importlib
import inspect
import sys
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from lorabench.config.options import Kind, Option
from lorabench.config.sweep_spec import LIST, OPTIONS
from lorabench.config.tune_spec import TUNE_OPTIONS
from lorabench.errors import UserError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # help texts show "[default: ...]" literally
    help="Benchmark and tune multi-LoRA CUDA-graph specialisation: which capture sets pay, at what memory and startup cost.",
)
console = Console()

# Options of the command line alone (not of a spec), shared by commands.
Executor = Option("executor", Kind.TEXT, "Where the worker groups (every strategy of one kernels and max_loras, compared "
                  "with each other) run: local (this host's GPUs, one group per GPU at a time) or dask (a Dask cluster's "
                  "workers with a GPU resource: pip install 'lorabench[dask]')", default="local")
Gpus = Option("gpus", Kind.TEXT, "This host's GPUs to use, as indices (0,1) or all; each worker is pinned to its GPU by UUID",
              default="all")
Scheduler = Option("scheduler", Kind.TEXT, "With --executor dask: the address of a running Dask scheduler "
                   "(tcp://HOST:8786) whose workers hold --resources GPU=1",
                   shown="a LocalCluster over this host's GPUs")
OutputTokens = Annotated[str, typer.Option("--output-tokens", help=OPTIONS["output_tokens"].describe())]
MaxCpuLoras = Annotated[str, typer.Option("--max-cpu-loras", help=OPTIONS["max_cpu_loras"].describe())]


def flag(o: Option, **changes) -> inspect.Parameter:
    """The command's parameter for an option (``changes``: another help or default text for this
    command). Values reach the command as given, text (None: not given), and are checked by the
    spec; a flag (``--fully-sharded-loras``, ``--no-check``) is True when given."""
    o = replace(o, **changes)
    if o.kind is Kind.FLAG:
        return inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, annotation=bool,
                                 default=typer.Option(False, *o.flags, help=o.describe()))
    return inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, annotation=str,
                             default=typer.Option(None, *o.flags, help=o.describe()))


def path(name: str, help: str) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=Path,
                             default=typer.Option(None, "--" + name.replace("_", "-"), help=help))


def switch(name: str, help: str) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=bool,
                             default=typer.Option(False, "--" + name, help=help))


def command(name: str, params: list[inspect.Parameter], run, doc: str) -> None:
    """A command of ``app`` whose parameters are ``params`` (built from the declarations): ``run``
    gets them as keyword arguments."""
    def cmd(**kwargs):
        return run(**kwargs)

    cmd.__name__, cmd.__doc__ = name, doc
    cmd.__signature__ = inspect.Signature(params)
    cmd.__annotations__ = {p.name: p.annotation for p in params}
    app.command(name)(cmd)


def spec_flags(given: dict) -> dict:
    """The spec's options among a command's arguments, None where not given (a flag given: the
    opposite of its default)."""
    flags = {}
    for name, value in given.items():
        o = OPTIONS.get(name)
        if o is not None and o.kind is Kind.FLAG:
            flags[name] = (not o.default) if value else None
        elif o is not None:
            flags[name] = value
    return flags


def placement(given: dict):
    from lorabench.commands.sweep import Placement

    return Placement.parse(given["executor"], given["gpus"], given["scheduler"])


PLACEMENT = [flag(Executor), flag(Gpus), flag(Scheduler)]


def run_sweep(**given):
    from lorabench.commands.sweep import sweep as run

    where = placement(given)
    return run(spec_flags(given), given["spec"], console, resume=given["resume"], force=given["force"], placement=where)


SPEC_FIRST = list(OPTIONS)[:list(OPTIONS).index("capture_sizes") + 1]  # --help lists --spec after these
command("sweep", [
    *(flag(o) for o in OPTIONS.values() if o.name in SPEC_FIRST),
    path("spec", "A TOML spec (e.g. sweeps/card.toml); flags override it."),
    *(flag(o) for o in OPTIONS.values() if o.name not in SPEC_FIRST),
    path("resume", "A run folder whose sweep ended early (killed, interrupted, or with failed points): measure its "
                   "missing and failed points into it, under its own spec."),
    switch("force", "With --resume: resume even when this lorabench plans the run differently, runs other code, or "
                    "finds another GPU (the run.json records it)."),
    *PLACEMENT,
], run_sweep, "Measure decode steps over max_loras x strategy x concurrency x active count; write Parquet.")


def run_check(**given):
    from lorabench.commands.check import check as run

    where = placement(given)
    return run(spec_flags(given), given["spec"], console, where)


CHECKED = ["max_loras", "strategy", "kernels", "capture_sizes", "max_cudagraph_capture_size", "mixed_capture_sizes",
           "model", "layers", "tp",
           "fully_sharded_loras", "share_expert_weights", "rank", "ranks", "adapters", "dtype", "device", "seed", "out"]  # what a check builds
command("check", [
    *(flag(OPTIONS[name], **{
        "capture_sizes": {"shown": ",".join(map(str, OPTIONS["concurrency"].default))},
        "out": {"help": "Output root; checks.json goes to OUT/<run_id>"},
        "max_cudagraph_capture_size": {"shown": "0"},
        "adapters": {"help": "A folder of PEFT adapters (or a glob of them): the slots hold their own weights, and "
                             "the check verifies those", "shown": "random adapters"},
    }.get(name, {})) for name in CHECKED),
    path("spec", "A TOML spec; its configurations are checked, nothing is timed."),
    *PLACEMENT,
], run_check, """Replay every captured graph of each configuration on all-adapter, all-base and mixed
    batches at every active count, against the plain-torch reference. Exit 1 if any is wrong.""")


@app.command()
def recommend(
    run_dir: Path = typer.Argument(..., help="A sweep's run folder (its points.parquet is the cost model)."),
    workload: str = typer.Option("uniform", "--workload", help="The workload to optimise for: uniform, zipf:S, single, base:P, joined by +; or trace:PATH."),
    graph_memory_budget: str = typer.Option(None, "--graph-memory-budget", help="Most graph memory the set may take, MiB (free-memory delta, as sweeps measure it)."),
    startup_budget: str = typer.Option(None, "--startup-budget", help="Most startup (build + compile + capture) the set may take, s."),
    kernels: str = typer.Option(None, "--kernels", help=f"Only these backends, {LIST} [default: every lorabench backend in the run]."),
    max_loras: str = typer.Option(None, "--max-loras", help=f"Only these max_loras, {LIST} [default: every one in the run]."),
    adapters: str = typer.Option(None, "--adapters", help="Recommend the whole LoRA configuration for this many adapters (or as many as a folder of PEFT adapters holds; the run's slots, at its --rank, price their loads): max_loras from adapter residency (LRU slots, loads timed by the run), the capture set, --max-cpu-loras, and what it all costs in KV cache."),
    concurrency: str = typer.Option(None, "--concurrency", help="With --adapters: clients keeping one request each in flight (vllm bench's --max-concurrency) [default: the run's largest concurrency]."),
    output_tokens: OutputTokens = None,
    max_cpu_loras: MaxCpuLoras = None,
    gpu_memory_budget: str = typer.Option(None, "--gpu-memory-budget", help="With --adapters: most GPU memory the LoRA configuration may take (its graphs and adapter slots, which come out of the KV cache), GiB [default: no limit]."),
    host_memory_budget: str = typer.Option(None, "--host-memory-budget", help="With --adapters and without --max-cpu-loras: most host memory vLLM's CPU cache of adapters may take per worker, GiB; the cache is the smallest within 2 % of the fastest that fits, misses priced at the run's cold read of an adapter's file [default: no limit]."),
    ttft_p99_ms: str = typer.Option(None, "--ttft-p99-ms", help="Choose among the run's serving runs (--input-tokens): per workload and kernels, the configuration with the most output tokens/s whose TTFT p99 is shown within this many ms (its 95 % interval below it)."),
    also: list[Path] = typer.Option(None, "--also", help="With --ttft-p99-ms: another run whose serving runs to choose among too (e.g. one per --max-cudagraph-capture-size), of the same GPU model; repeatable."),
):
    """Choose the capture set (strategy auto) that minimises the expected step time under a
    workload within the budgets, from what a run measured; compare it with max, pow2 and dense.
    With --adapters N: choose max_loras, the capture set and the CPU cache for N adapters, by
    tokens per second with adapter loads, and what they cost in memory and KV cache.
    With --ttft-p99-ms X: among the run's serving runs, the most output tokens/s within that TTFT.
    Exit status 2 when no (kernels, max_loras) gets a set; those that get none are named."""
    from lorabench.commands.recommend import recommend as run
    from lorabench.commands.recommend import recommend_residency

    if ttft_p99_ms is not None:
        given = [f for f, v in (("--adapters", adapters), ("--graph-memory-budget", graph_memory_budget),
                                ("--startup-budget", startup_budget), ("--max-loras", max_loras)) if v is not None]
        if given:
            raise UserError(f"{given[0]}: not with --ttft-p99-ms (it chooses among the run's serving runs as measured)")
        from lorabench.commands.recommend_serving import recommend_serving

        return recommend_serving(run_dir, ttft_p99_ms, kernels, console, also)

    if also:
        raise UserError("--also: goes with --ttft-p99-ms (other runs' serving runs to choose among)")
    if adapters is not None:
        given = [f for f, v in (("--graph-memory-budget", graph_memory_budget), ("--startup-budget", startup_budget)) if v is not None]
        if given:
            raise UserError(f"{given[0]} prices strategy auto alone; with --adapters use --gpu-memory-budget")
        return recommend_residency(run_dir, workload, adapters, concurrency, output_tokens, max_cpu_loras,
                                   gpu_memory_budget, kernels, max_loras, console, host_memory_budget)
    given = [f for f, v in (("--concurrency", concurrency), ("--output-tokens", output_tokens), ("--max-cpu-loras", max_cpu_loras),
                            ("--gpu-memory-budget", gpu_memory_budget), ("--host-memory-budget", host_memory_budget))
             if v is not None]
    if given:
        raise UserError(f"{given[0]}: goes with --adapters N")
    return run(run_dir, workload, graph_memory_budget, startup_budget, kernels, max_loras, console)


@app.command()
def report(
    runs: list[Path] = typer.Argument(None, help="Run folders [default: the newest run under --results]."),
    results: Path = typer.Option(Path("results"), "--results", help="Where to look for the newest run."),
):
    """Plots, report.md and recommendation.json, written into each run's folder."""
    from lorabench.commands.report import write_reports
    from lorabench.storage.results import find_newest_run

    for run_dir, paths in write_reports(runs or [find_newest_run(results)], console).items():
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


def run_tune(**given):
    from lorabench.commands.tune import tune as run

    resume = given.pop("resume")
    return run({name: value for name, value in given.items()}, resume, console)


command("tune", [
    flag(TUNE_OPTIONS["kernels"]), flag(OPTIONS["model"]), flag(OPTIONS["tp"]), flag(OPTIONS["rank"]),
    flag(TUNE_OPTIONS["dtype"]), flag(OPTIONS["max_loras"]), flag(TUNE_OPTIONS["tokens"]), flag(TUNE_OPTIONS["budget_s"]),
    flag(TUNE_OPTIONS["out"]),
    inspect.Parameter("resume", inspect.Parameter.KEYWORD_ONLY, annotation=bool, default=typer.Option(
        True, "--resume/--fresh", help="Reuse OUT/cache.jsonl (skip what it has measured), or start over.")),
    flag(OPTIONS["device"]), flag(OPTIONS["seed"]),
    flag(Executor, help="Where the shapes are tuned: local (this process; with --gpus, one worker per chosen GPU of "
                        "this host) or dask (the GPU workers of a Dask cluster: pip install 'lorabench[dask]')",
         shown="local, this process"),
    flag(Gpus), flag(Scheduler),
], run_tune, """Search kernel configs per shape within a time budget; write lorabench's tuned table and
    vLLM's VLLM_TUNED_CONFIG_FOLDER files. Rerun the same command to resume. With several GPUs
    (--gpus 0,1, or --executor dask), the shapes are dealt out to one worker per GPU and their
    measurements merged into the one folder.""")


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
    args = sys.argv[1:] if argv is None else argv
    try:
        rv = app(args=args or ["--help"], standalone_mode=False, prog_name="lorabench")  # no command: the help, as --help
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
