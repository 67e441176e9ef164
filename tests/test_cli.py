"""Bad input ends in one clear line on stderr and a non-zero exit, never a traceback."""

import subprocess
import sys

import pytest
from conftest import HAS_CUDA

from lorabench.cli import main

BAD_SWEEPS = [
    (["--concurrency", "0"], "--concurrency"),
    (["--concurrency", "1,x"], "--concurrency"),
    (["--concurrency", "-2"], "--concurrency"),
    (["--concurrency", "1,,2"], "--concurrency"),
    (["--concurrency", "1024"], "512"),
    (["--max-loras", "0"], "--max-loras"),
    (["--strategy", "fastest"], "unknown strategy"),
    (["--strategy", "[1,2]", "--max-loras", "4"], "must contain max_loras"),
    (["--model", "gpt-5"], "unknown preset"),
    (["--rank", "12"], "--rank"),
    (["--dtype", "float8"], "--dtype"),
    (["--kernels", "cutlass"], "--kernels"),
    (["--device", "tpu"], "--device"),
    (["--workload", "zipf:-1"], "--workload"),
    (["--iters", "0"], "--iters"),
    (["--spec", "no/such/spec.toml"], "does not exist"),
    (["--no-such-flag"], "no-such-flag"),
]


def run_main(capsys, argv):
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("args,needle", BAD_SWEEPS, ids=[" ".join(a) for a, _ in BAD_SWEEPS])
def test_bad_sweep_input_is_one_line(capsys, tmp_path, args, needle):
    code, out, err = run_main(capsys, ["sweep", "--out", str(tmp_path)] + args)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in err, err
    assert not any(tmp_path.iterdir()), "nothing may be written for bad input"


@pytest.mark.parametrize("content,needle", [("concurrency = [1, 0]", "--concurrency"), ("bogus = 1", "unknown key"),
                                            ("max-loras = [", "not valid TOML")])
def test_bad_spec_files(capsys, tmp_path, content, needle):
    spec = tmp_path / "bad.toml"
    spec.write_text(content)
    code, _, err = run_main(capsys, ["sweep", "--spec", str(spec), "--out", str(tmp_path / "out")])
    assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err


@pytest.mark.skipif(HAS_CUDA, reason="this machine has a GPU")
def test_device_cuda_without_gpu(capsys, tmp_path):
    code, _, err = run_main(capsys, ["sweep", "--device", "cuda", "--out", str(tmp_path)])
    assert code == 2 and "no CUDA device" in err and len(err.strip().splitlines()) == 1


def test_report_on_folder_without_parquet(capsys, tmp_path):
    code, _, err = run_main(capsys, ["report", str(tmp_path)])
    assert code == 2 and "no points.parquet" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_main(capsys, ["report", "--results", str(tmp_path)])
    assert code == 2 and "no runs" in err
    code, _, err = run_main(capsys, ["report", str(tmp_path / "missing")])
    assert code == 2 and "not a folder" in err


def test_report_on_corrupt_parquet(capsys, tmp_path):
    (tmp_path / "points.parquet").write_bytes(b"not parquet")
    code, _, err = run_main(capsys, ["report", str(tmp_path)])
    assert code == 2 and "cannot be read" in err and len(err.strip().splitlines()) == 1


def test_console_entry_point_bad_input():
    """The real `python -m lorabench` process: exit 2, one line, no traceback."""
    p = subprocess.run([sys.executable, "-m", "lorabench", "sweep", "--concurrency", "0,1"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == ["error: --concurrency: 0 must be at least 1"]


def test_help_works(capsys):
    code, out, _ = run_main(capsys, ["sweep", "--help"])
    assert code == 0 and "--max-loras" in out
