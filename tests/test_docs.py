"""The docs a newcomer reads stay what they promise: the CLI reference is the CLI's own help, the
README stays short, BENCHMARKS.md's tables have short cells, and nothing points outside the
repository."""

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_BYTES = 12 * 1024
CELL_MAX_CHARS = 200


def _cli_docs():
    spec = importlib.util.spec_from_file_location("cli_docs", ROOT / "scripts" / "cli_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_cli_md_is_the_clis_own_help():
    """Exactly the help text where the Typer it was rendered with is installed (its layout differs
    between versions); with another Typer, every command's every option is still in its section."""
    from importlib import metadata

    import typer.main

    from lorabench.cli import app

    docs = _cli_docs()
    text = (ROOT / "docs" / "cli.md").read_text()
    if docs.TYPER_LINE.format(metadata.version("typer")) in text:
        assert text == docs.render(), "docs/cli.md is stale: run python scripts/cli_docs.py"
        return
    sections = dict(zip(docs.COMMANDS, re.split(r"^## lorabench \w+$", text, flags=re.M)[1:]))
    for name, command in typer.main.get_command(app).commands.items():
        options = {o for p in command.params for o in p.opts if o.startswith("--")}
        missing = sorted(o for o in options if not re.search(rf"{re.escape(o)}\b", sections[name]))
        assert not missing, f"docs/cli.md lacks lorabench {name}'s {missing}: run python scripts/cli_docs.py"


def test_cli_md_covers_every_command():
    from lorabench.cli import app

    commands = {c.name or c.callback.__name__ for c in app.registered_commands}
    assert commands == set(_cli_docs().COMMANDS)


def test_readme_is_short():
    assert (ROOT / "README.md").stat().st_size <= README_MAX_BYTES


def _table_cells(text: str):
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("|") and not re.fullmatch(r"[|\-: ]+", line):
            for cell in line.strip().strip("|").split("|"):
                yield number, cell.strip()


def test_benchmarks_tables_have_short_cells():
    long = [(n, c[:60]) for n, c in _table_cells((ROOT / "BENCHMARKS.md").read_text()) if len(c) > CELL_MAX_CHARS]
    assert not long, f"BENCHMARKS.md cells over {CELL_MAX_CHARS} characters (line, start): {long[:5]}"


def test_a_long_cell_is_found():
    cells = list(_table_cells("| a | b |\n|---|---|\n| " + "x" * 201 + " | y |\n"))
    assert [len(c) for _, c in cells] == [1, 1, 201, 1]


@pytest.mark.parametrize("doc", ["README.md", "BENCHMARKS.md", "docs/design.md", "docs/usage.md", "docs/cli.md",
                                 "docs/testing.md", "docs/gpu-machines.md", "results/README.md"])
def test_docs_link_only_inside_the_repository(doc):
    path = ROOT / doc
    assert path.exists(), f"{doc} is gone: the README links the docs"
    text = path.read_text()
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if "://" in target:
            continue
        assert (path.parent / target).exists(), f"{doc} links to {target}, which does not exist"


def test_design_md_columns_are_the_row_schemas():
    from lorabench.storage.schema import markdown

    assert markdown().strip() in (ROOT / "docs" / "design.md").read_text(), \
        "docs/design.md's Parquet columns differ from lorabench.storage.row: paste python -m lorabench.storage.schema"
