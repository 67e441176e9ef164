"""The house's rules, checked: layers import one way (import-linter's contracts in
pyproject.toml), the report and recommend never load torch or Triton, and the repository points
at nothing outside itself."""

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import H200_CARD

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.e2e
def test_import_contracts_are_kept(tmp_path):
    """import-linter on lorabench as installed (``kernels/`` becomes ``lorabench.kernels``): one-way
    layers, no circles, no torch below the runtime, no test tools in production code."""
    pytest.importorskip("importlinter")
    src = tmp_path / "src"
    shutil.copytree(ROOT / "lorabench", src / "lorabench", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "kernels", src / "lorabench" / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    lint = Path(sys.executable).with_name("lint-imports")
    p = subprocess.run([str(lint), "pyproject.toml", "--no-cache"], cwd=tmp_path, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(src)}, timeout=300)
    assert p.returncode == 0 and "0 broken" in p.stdout, p.stdout[-4000:] + p.stderr[-2000:]


def test_without_an_installed_kernels_package_the_folder_reads_as_none_to_transformers():
    """A machine without Hugging Face's ``kernels`` (the GPU image): run from the repository root,
    a top-level ``import kernels`` gets an empty module (no file, no version), transformers' package
    check says it is not installed, and its configs load."""
    pytest.importorskip("transformers")
    code = ("import importlib.machinery as m\n"
            "find = m.PathFinder.find_spec\n"  # as if no kernels package were installed anywhere
            "m.PathFinder.find_spec = classmethod(lambda cls, name, path=None, target=None: None if name == 'kernels' "
            "and path is not None else find(name, path, target))\n"
            "import importlib.metadata as md\n"
            "version = md.version\n"
            "def no_kernels(name):\n    if name == 'kernels':\n        raise md.PackageNotFoundError(name)\n"
            "    return version(name)\n"
            "md.version = no_kernels\n"
            "import kernels\n"
            "assert getattr(kernels, '__file__', None) is None and not hasattr(kernels, 'RANKS'), kernels\n"
            "try:\n    from kernels import get_kernel\nexcept ImportError:\n    pass\nelse:\n    raise AssertionError\n"
            "from transformers.utils.import_utils import _is_package_available\n"
            "assert not _is_package_available('kernels', return_version=True)[0]\n"
            "from transformers import LlamaConfig\n"
            "import lorabench.kernels\n"
            "print(LlamaConfig.__name__, lorabench.kernels.__file__)")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    name, ours = p.stdout.split()
    assert name == "LlamaConfig" and Path(ours) == ROOT / "kernels" / "__init__.py"


def test_the_kernels_folder_shadows_no_installed_kernels_package():
    """Run from the repository root (``python -m``, ``python -c``), ``kernels/`` would shadow PyPI's
    ``kernels`` (Hugging Face's, which transformers imports): a top-level import gets that package,
    or none, while lorabench.kernels stays this folder."""
    code = ("import kernels\nprint(getattr(kernels, '__file__', None) or 'none')\n"
            "import lorabench.kernels\nprint(lorabench.kernels.__file__)")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    top, ours = p.stdout.split()
    assert Path(ours) == ROOT / "kernels" / "__init__.py"
    assert top == "none" or Path(top).resolve() != Path(ours).resolve(), top


@pytest.mark.e2e
@pytest.mark.parametrize("command", [["report"], ["recommend", "--workload", "uniform"], ["compare"]])
def test_report_and_recommend_load_neither_torch_nor_triton(tmp_path, command):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(H200_CARD / "points.parquet", run / "points.parquet")
    if command == ["compare"]:  # the run against itself: it needs a GPU's uuid and samples
        import pandas as pd

        from lorabench.storage.samples import PER_STEP, write_samples

        df = pd.read_parquet(run / "points.parquet").assign(gpu_uuid="GPU-card")
        df.to_parquet(run / "points.parquet")
        for point, ms in zip(df.point, df.step_ms_median):
            write_samples(run, int(point), {**{c: [1] * 12 for c in PER_STEP},
                                            "step_ms": [ms * (1 + i / 1000) for i in range(12)]})
        command = ["compare", str(run)]
    code = ("import sys; from lorabench.cli import main\n"
            f"rc = main({command[:1] + [str(run)] + command[1:]!r})\n"
            "print(rc, sorted(m for m in ('torch', 'triton') if m in sys.modules))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.stdout.strip().splitlines()[-1:] == ["0 []"], p.stdout[-2000:] + p.stderr[-2000:]


def test_nothing_points_outside_the_repository():
    """Code, tests and docs name no path a clone does not have."""
    outside = ("../" + "shared", "DESIGN" + ".md", "REFERENCES" + ".md")  # in parts: this file names none of them
    found = []
    for folder in ("lorabench", "kernels", "tests", "scripts", "docs", "sweeps", "notebooks", ".ci"):
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and path.suffix in (".py", ".md", ".toml", ".sh", ".ipynb", ""):
                text = path.read_text(errors="replace")
                found += [f"{path.relative_to(ROOT)}: {o}" for o in outside if o in text]
    for name in ("README.md", "BENCHMARKS.md", "pyproject.toml"):
        text = (ROOT / name).read_text()
        found += [f"{name}: {o}" for o in outside if o in text]
    assert not found, found


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "scripts").glob("*.py")))
def test_every_script_imports(script):
    """The GPU scripts run nowhere in CI; at least their imports follow the code they use."""
    spec = importlib.util.spec_from_file_location(script.removesuffix(".py"), ROOT / "scripts" / script)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
