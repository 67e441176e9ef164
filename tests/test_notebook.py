"""notebooks/explore.ipynb executed top to bottom the way its users run it from the shell:
papermill, with ``-p run PATH`` or without (the newest run under results/), standing in a folder
that is not notebooks/. The runs are frozen H200 rows (tests/data), so no sweep is needed."""

import os
import shutil
from pathlib import Path

import pytest
from conftest import H200_CARD

H100_SERVING = H200_CARD.parent / "h100-serving"

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "explore.ipynb"


@pytest.fixture
def standing_in(tmp_path, monkeypatch):
    """A folder with results/old and results/new (newer), where the user stands (cwd and $PWD)."""
    for i, name in enumerate(("old", "new")):
        run = tmp_path / "results" / name
        run.mkdir(parents=True)
        shutil.copy(H200_CARD / "points.parquet", run / "points.parquet")
        os.utime(run / "points.parquet", (1_700_000_000 + i, 1_700_000_000 + i))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PWD", str(tmp_path))
    monkeypatch.delenv("LORABENCH_RUN", raising=False)
    return tmp_path


def execute(tmp_path: Path, **parameters):
    """papermill NOTEBOOK out.ipynb [-p name value ...]; returns the executed notebook."""
    papermill = pytest.importorskip("papermill")
    return papermill.execute_notebook(str(NOTEBOOK), str(tmp_path / "out.ipynb"), parameters=parameters,
                                      kernel_name="python3", progress_bar=False)


def printed(nb) -> str:
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))


def images(nb) -> int:
    return sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))


def test_the_notebook_has_a_parameters_cell():
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    [cell] = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert "run = None" in cell.source
    assert not any(c.get("outputs") for c in nb.cells if c.cell_type == "code"), "committed without outputs"


def test_a_relative_run_is_read_from_where_the_user_stands(standing_in):
    nb = execute(standing_in, run="results/old")
    assert str(standing_in / "results" / "old") in printed(nb)
    assert images(nb) >= 2


def test_without_a_run_it_loads_the_newest_run_under_results(standing_in):
    nb = execute(standing_in)
    assert str(standing_in / "results" / "new") in printed(nb)
    assert "no prefill points in this run" in printed(nb) and "no serving loops in this run" in printed(nb)


def test_a_serving_run_shows_its_prompt_steps_and_its_loops(standing_in):
    """A run with prefill points and serving loops (frozen H100 rows): the overhead against prompt
    tokens is drawn, and each kernels' loops are listed with their tokens/s and latencies."""
    shutil.copytree(H100_SERVING, standing_in / "results" / "serving")
    nb = execute(standing_in, run="results/serving")
    out = printed(nb)
    assert "no prefill points" not in out and "no serving loops" not in out
    assert "triton under zipf:1" in out and "vllm under zipf:1" in out
    assert images(nb) >= 3
