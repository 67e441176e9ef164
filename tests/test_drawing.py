"""The report's figures drawn side by side (``lorabench.commands.report.drawing``): every file is
written by the time ``wait`` returns, and a figure that fails raises its error in the report's
process, as it does when figures are drawn one by one."""

import sys
from pathlib import Path

import pytest

from lorabench.commands.report.drawing import Drawing

WAYS = [pytest.param(0, id="here"),
        pytest.param(3, id="forked", marks=pytest.mark.skipif(sys.platform != "linux", reason="fork: Linux only"))]


def plot(text, path):
    Path(path).write_text(text)
    return path


@pytest.mark.parametrize("workers", WAYS)
def test_every_figure_is_written_before_wait_returns(tmp_path, workers):
    drawing = Drawing(workers)
    paths = [drawing.draw(plot, str(i), tmp_path / f"{i}.png") for i in range(5)]
    drawing.wait()
    assert [p.read_text() for p in paths] == [str(i) for i in range(5)]


@pytest.mark.parametrize("workers", WAYS)
def test_a_figure_that_fails_raises_in_the_reports_process(tmp_path, workers):
    def broken(path):
        raise RuntimeError(f"cannot draw {Path(path).name}")

    drawing = Drawing(workers)
    with pytest.raises(RuntimeError, match="cannot draw bad.png"):
        drawing.draw(plot, "fine", tmp_path / "fine.png")
        drawing.draw(broken, tmp_path / "bad.png")  # here: it raises at once
        drawing.wait()  # forked: once it is drawn again here
    assert (tmp_path / "fine.png").read_text() == "fine"


def test_the_reports_figures_are_the_same_forked(tmp_path, monkeypatch):
    """A report drawn with its figures forked writes the same PNG bytes as one drawn here."""
    if sys.platform != "linux":
        pytest.skip("fork: Linux only")
    import shutil

    from conftest import H200_CARD

    from lorabench.commands.report import drawing, write_report

    runs = {}
    for workers in (0, 3):
        monkeypatch.setattr(drawing, "spare_cpus", lambda workers=workers: workers)
        run = tmp_path / f"run-{workers}"
        shutil.copytree(H200_CARD, run)
        write_report(run)
        runs[workers] = {p.name: p.read_bytes() for p in run.glob("*.png")}
    assert len(runs[0]) >= 5 and runs[0] == runs[3]
