"""The report's figures drawn side by side (``lorabench.commands.report.drawing``): every file is
written by the time ``wait`` returns, and a figure that fails raises its error in the report's
process, as it did when figures were drawn one by one."""

from pathlib import Path

import pytest

from lorabench.commands.report.drawing import Drawing


def test_every_figure_is_written_before_wait_returns(tmp_path):
    def plot(text, path):
        Path(path).write_text(text)
        return path

    drawing = Drawing()
    paths = [drawing.draw(plot, str(i), tmp_path / f"{i}.png") for i in range(5)]
    drawing.wait()
    assert [p.read_text() for p in paths] == [str(i) for i in range(5)]


def test_a_figure_that_fails_raises_in_the_reports_process(tmp_path):
    def broken(path):
        raise RuntimeError(f"cannot draw {Path(path).name}")

    drawing = Drawing()
    with pytest.raises(RuntimeError, match="cannot draw bad.png"):
        drawing.draw(broken, tmp_path / "bad.png")  # one CPU: it raises here
        drawing.wait()  # several: here
