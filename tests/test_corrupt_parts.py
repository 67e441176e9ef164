"""A run whose part file cannot be read (points.parquet/part-N.parquet: a disk error, a copy cut
short): every reader says so in one line, naming the part and what to do (remove it; resume),
exit 2, no traceback, not pyarrow's own text."""

import os
import shutil
from pathlib import Path

import pytest

from lorabench.cli import main
from lorabench.commands import sweep as sweep_module
from lorabench.storage.results import read_points

TESTS = Path(__file__).parent
STUB = ["--concurrency", "1,2", "--max-loras", "1,2", "--strategy", "max", "--iters", "2", "--warmup", "1",
        "--device", "cpu", "--no-check"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished run of two groups (two parts), made by the tests' stand-in worker."""
    out = tmp_path_factory.mktemp("corrupt")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sweep_module, "WORKER", "stub_worker")
        mp.setenv("STUB_SLOW", "0")
        mp.setenv("LORABENCH_GIT_SHA", "tests-of-corrupt-parts")
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
        assert main(["sweep", "--out", str(out), *STUB]) == 0
    [run] = [p.parent for p in out.glob("*/points.parquet")]
    assert sorted(p.name for p in (run / "points.parquet").iterdir()) == ["part-0000.parquet", "part-0001.parquet"]
    return run


@pytest.fixture
def broken(run, tmp_path):
    """A copy of the run whose second part is garbage."""
    copy = tmp_path / run.name
    shutil.copytree(run, copy)
    (copy / "points.parquet" / "part-0001.parquet").write_bytes(b"PAR1 not really")
    return copy


def one_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("argv", [
    ["report", "{run}"],
    ["recommend", "{run}"],
    ["compare", "{good}", "{run}"],
    ["compare", "{run}", "{good}"],
    ["sweep", "--resume", "{run}"],
], ids=["report", "recommend", "compare-b", "compare-a", "resume"])
def test_every_reader_names_the_part_and_what_to_do(broken, run, argv, capsys, monkeypatch):
    monkeypatch.setattr(sweep_module, "WORKER", "lorabench_test_a_resume_must_not_start")
    capsys.readouterr()
    code = main([a.replace("{run}", str(broken)).replace("{good}", str(run)) for a in argv])
    line = one_line(capsys)
    assert code == 2
    assert f"{broken}/points.parquet/part-0001.parquet cannot be read (not a Parquet file, or cut short)" in line
    assert "remove it" in line and f"lorabench sweep --resume {broken}" in line
    assert "magic bytes" not in line and "Parquet magic" not in line  # not pyarrow's text


def test_once_it_is_removed_the_other_parts_read_and_resume_measures_its_points(broken, capsys, monkeypatch):
    (broken / "points.parquet" / "part-0001.parquet").unlink()
    df = read_points(broken)
    assert set(df.max_loras) == {1} and (df.status == "ok").all()
    monkeypatch.setattr(sweep_module, "WORKER", "stub_worker")
    monkeypatch.setenv("STUB_SLOW", "0")
    monkeypatch.setenv("LORABENCH_GIT_SHA", "tests-of-corrupt-parts")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
    assert main(["sweep", "--resume", str(broken)]) == 0
    assert set(read_points(broken).max_loras) == {1, 2}
