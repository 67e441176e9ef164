"""``lorabench check``: build every configuration's graphs and replay each one it can serve on
all-adapter, all-base and mixed batches at every active count, against the plain-torch
reference (``lorabench.runtime.check``); nothing is timed. Exit status 1 if any is wrong or has
no verdict."""

import shlex
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from lorabench.commands import sweep as sweep_command
from lorabench.commands.sweep import Placement, Sweep, prepare
from lorabench.config.flags import split_list
from lorabench.config.peft import is_count
from lorabench.config.strategies import AUTO
from lorabench.errors import UserError
from lorabench.storage.checks import Checked


def check_table(checks: list[Checked]) -> Table:
    """One line per configuration: its verdict and, when wrong, the smallest batch that shows it."""
    table = Table(title="correctness: every served graph vs the plain-torch reference")
    for col in ["kernels", "L", "strategy", "graphs", "batches", "verdict", "detail"]:
        table.add_column(col, justify="right" if col in ("L", "graphs", "batches") else "left",
                         no_wrap=col != "detail", overflow="fold")
    for c in checks:
        verdict = {True: "[green]ok[/]", False: "[red]WRONG[/]", None: "[yellow]none[/]"}[c.correct]
        graphs = f"{c.graphs_checked}/{c.graphs_total}" if c.graphs_checked is not None else "-"
        if c.mixed_graphs_total:  # PIECEWISE keys too
            graphs += f" + {c.mixed_graphs_checked}/{c.mixed_graphs_total} mixed"
        detail = c.detail
        if c.correct is True:
            detail = f"max error {c.max_err:.2g} (tolerance {c.tolerance:g})"
            if c.mixed_batches and c.mixed_tolerance and c.mixed_tolerance > c.tolerance:
                detail = (f"max error {c.max_err:.2g}; decode within {c.tolerance:g}, mixed steps within "
                          f"{c.mixed_tolerance:.2g} (over their rounding floor {c.rounding_floor:.2g})")
        batches = "-" if c.batches is None else str(c.batches)
        table.add_row(c.kernels, str(c.max_loras), c.strategy, graphs, batches, verdict, detail)
    return table


def check(flags: dict, spec_file: Path | None, console: Console, placement: Placement = Placement()) -> int:
    if flags.get("strategy") and AUTO in split_list(flags["strategy"]):
        raise UserError("lorabench check takes fixed capture sets: check an auto set by its list, e.g. --strategy '[8,128]'")
    if flags.get("adapters") is not None and is_count(flags["adapters"]):
        raise UserError(f"--adapters {flags['adapters']}: lorabench check takes a folder of PEFT adapters (it times no "
                        "residency runs)")
    spec, notice = prepare({**flags, "check": True}, spec_file)
    executor = placement.executor_for(spec.device)  # refuses a placement before any notice
    if notice:
        console.print(notice)
    try:
        run = Sweep.start(spec, shlex.join(["lorabench"] + sys.argv[1:]), console, sweep_command.WORKER, check_only=True)
        console.print(f"check {run.run_id}: {len(run.jobs)} configurations -> {run.run_dir / 'checks.json'}")
        run.run(executor)
    except KeyboardInterrupt:
        print(f"interrupted: {len(run.checks)} verdicts kept in {run.run_dir / 'checks.json'}", file=sys.stderr)
        return 130
    finally:
        executor.close()
    console.print(check_table(run.checks))
    wrong = sum(c.correct is False for c in run.checks)
    unknown = sum(c.correct is None for c in run.checks)
    console.print(f"{len(run.checks)} configurations: {len(run.checks) - wrong - unknown} correct, {wrong} wrong, {unknown} without a verdict")
    return 1 if wrong or unknown else 0
