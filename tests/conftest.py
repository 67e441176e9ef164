"""Test setup: without a GPU, Triton kernels run in Triton's CPU interpreter; every process the
tests start computes on one thread."""

import os

# One compute thread per process, this one and every process it starts (sweep workers, tunes,
# notebooks): their tensors are tiny, and under ``pytest -n`` several processes share the cores,
# where threads that spin waiting for each other multiply the wall time. Set before torch loads.
THREADS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")
for _var in THREADS:
    os.environ.setdefault(_var, "1")

import random  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker of ``pytest -n``: one thread whatever the environment says
    torch.set_num_threads(1)

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if HAS_CUDA else "cpu"
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
TESTS = Path(__file__).resolve().parent
H200_CARD = TESTS / "data" / "h200-card"  # frozen H200 rows (data/README.md)
H200_SLOTS = TESTS / "data" / "h200-slots"


# Module-scoped fixtures that run sweeps or start a cluster, by module. Under ``pytest -n N`` each
# of these modules runs in one worker, so its fixture is built once, not once in each worker its
# tests land on; every other test is dealt out on its own. Tests that use one are end to end.
SHARED_FIXTURES = {"test_sweep_report.py": "run_dir", "test_adapters.py": "residency_run",
                   "test_executors.py": "cluster", "test_compare.py": "cpu_runs"}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``-n N`` (pytest-xdist's ``load``; a ``--dist`` given is kept): tests one by one, except
    that the modules above go to one worker whole. (pytest-xdist's ``loadgroup`` would do it with
    marks, but its groups are lost on pytest 9, whose node ids it can no longer rename.)"""
    if config.getvalue("dist") != "load" or any(a == "-d" or a.startswith("--dist") for a in config.invocation_params.args):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SharedFixtures(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if module.rsplit("/", 1)[-1] in SHARED_FIXTURES else nodeid

    return SharedFixtures(config, log)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if SHARED_FIXTURES.get(item.path.name) in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture
def epilogue_at_any_launch(monkeypatch):
    """The gemm backend's own GEMM (the expand in its epilogue) at every launch count: its cap
    (``gemm_lora.EPILOGUE_MAX_LAUNCH``) is a speed rule, past which the pair runs; tests of its
    results over more launched slots use this to reach its kernel."""
    from lorabench.kernels import gemm_lora

    monkeypatch.setattr(gemm_lora, "EPILOGUE_MAX_LAUNCH", 1 << 20)


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture(autouse=True)
def seeded_and_finished():
    """Every test draws from seeded generators (the same inputs whatever ran before it) and, on a
    GPU, ends with its device work finished: an asynchronous error fails the test that caused it,
    not the next one."""
    random.seed(0)
    torch.manual_seed(0)
    yield
    if HAS_CUDA:
        torch.cuda.synchronize()


@contextmanager
def fault_injected(fault: str | None):
    """Sweeps and checks started inside the block run ``tests/faulty_worker.py``, which fails as
    ``fault`` says (build, capture, check, point:I, kill:I, slow:S, loads:N); None: the real worker."""
    if fault is None:
        yield
        return
    from lorabench.commands import sweep

    saved = {k: os.environ.get(k) for k in ("FAULT", "PYTHONPATH")}
    worker = sweep.WORKER
    sweep.WORKER = "faulty_worker"
    os.environ["FAULT"] = fault
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), saved["PYTHONPATH"]]))
    try:
        yield
    finally:
        sweep.WORKER = worker
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def with_schema(df):
    """Committed rows reindexed to today's columns, ready for ``to_parquet(schema=SCHEMA)``: the
    list columns they predate hold None, not NaN (pyarrow takes no float as a list)."""
    import pandas as pd

    from lorabench.storage.results import SCHEMA

    df = df.reindex(columns=SCHEMA.names).copy()
    for field in SCHEMA:
        if str(field.type).startswith("list") and df[field.name].isna().all():
            df[field.name] = pd.Series([None] * len(df), index=df.index, dtype=object)
    return df


