"""The command line itself: its options come from the declarations, and --help stays light. Bad
input, for every command, is tests/test_bad_input.py."""

import json
import subprocess
import sys

import pytest
import typer

from lorabench.cli import app, main
from lorabench.config.sweep_spec import OPTIONS
from lorabench.config.tune_spec import TUNE_OPTIONS

HEAVY = ("torch", "triton", "scipy", "matplotlib", "pandas", "numpy", "pyarrow", "transformers")
COMMANDS = ["sweep", "check", "report", "recommend", "compare", "tune"]


def test_help_works(capsys):
    assert main(["sweep", "--help"]) == 0
    assert "--max-loras" in capsys.readouterr().out


def test_no_command_prints_the_help_not_an_error(capsys):
    assert main([]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("Usage: lorabench") and "sweep" in out and err == ""


def options(command: str) -> dict[str, str]:
    """flag -> its help, of one command."""
    click = typer.main.get_command(app).commands[command]
    return {name: p.help for p in click.params for name in getattr(p, "opts", [])}


def test_the_sweeps_flags_are_the_spec_options():
    flags = options("sweep")
    for o in OPTIONS.values():
        for name in o.flags:
            assert flags[name] == o.describe(), name
    cli_only = {"--spec", "--resume", "--force", "--executor", "--gpus", "--scheduler"}
    assert set(flags) == {f for o in OPTIONS.values() for f in o.flags} | cli_only


def test_check_and_tune_take_their_share_of_the_declarations():
    check = options("check")
    assert "--concurrency" not in check and "--iters" not in check
    assert check["--capture-sizes"].endswith("[default: 1,2,4,8].")  # check has no --concurrency to follow
    assert check["--model"] == OPTIONS["model"].describe() and "--no-check" not in check  # a check always checks
    tune = options("tune")
    assert tune["--tokens"] == TUNE_OPTIONS["tokens"].describe() == (
        "Tokens per step to tune, comma-separated: decode buckets, and prefill sizes (e.g. 512,2048,8192: a step of "
        "more tokens takes the nearest tuned size's config) [default: 1,8,32].")
    assert tune["--rank"] == OPTIONS["rank"].describe() and "--max-lora-rank" in tune


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_help_is_light(command):
    """``lorabench [COMMAND] --help`` imports none of the heavy libraries, and takes a fraction of
    the CPU time torch's import alone takes (0.3 s on an idle machine; this asserts a loose bound,
    CPU time, which other processes on the machine inflate less than wall time)."""
    argv = [command, "--help"] if command else ["--help"]
    code = ("import json, resource, sys\n"
            "from lorabench.cli import main\n"
            f"rc = main({argv!r})\n"
            "r = resource.getrusage(resource.RUSAGE_SELF)\n"
            f"print(json.dumps([rc, sorted({{m.split('.')[0] for m in sys.modules}} & set({list(HEAVY)!r})), "
            "r.ru_utime + r.ru_stime]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    rc, heavy, cpu_s = json.loads(out.splitlines()[-1])
    assert rc == 0 and heavy == [], heavy
    assert cpu_s < 0.8, cpu_s
