"""A run as the analysis reads it: its files read once (``RunView.read``), and what every question
about it starts from computed once, on first use: its ok points, its configurations and their
verdicts, the GPU each (kernels, max_loras) is compared on and the rows measured there, its
samples (one ``lorabench.stats.Resampler``, so every point is bootstrapped once), the expected
steps and comparisons per workload, and one cost model per (kernels, max_loras).

The report, ``lorabench recommend`` (strategy auto, and residency with ``--adapters``) and the
sweep's ``--strategy auto`` ask this view; the path is run files -> view -> decision -> text and
JSON.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
import pandas as pd

from lorabench.analysis.compare import Comparison, comparisons
from lorabench.analysis.costmodel import CostModel
from lorabench.analysis.points import CONFIG, configs, expected_steps, ok_points, same_gpu, verdicts, with_columns
from lorabench.stats import Resampler
from lorabench.storage.results import load_run
from lorabench.storage.runs import Coverage, coverage
from lorabench.storage.samples import read_loads, read_samples, step_times

LOAD = "load"  # a kernels label's timed loads, keyed (LOAD, kernels) among the resampled points


def pooled_loads(loads: Mapping | None) -> dict[str, np.ndarray]:
    """kernels -> every worker's timed loads: a load copies the same bytes in the same operations
    whatever max_loras, and it is host-bound (hundreds of small copies queued one by one), so what
    varies between workers is the host's speed at the moment, not the load: every sample counts."""
    out: dict[str, list] = {}
    for (k, _), v in sorted((loads or {}).items()):
        out.setdefault(k, []).append(np.asarray(v, dtype=float))
    return {k: np.concatenate(v) for k, v in out.items()}


@dataclass(frozen=True, eq=False)
class RunView:
    """One run's rows, samples and plan (see the module's docstring)."""

    rows: pd.DataFrame  # every row, ok or failed, with every column of the schema
    times: Mapping[int, np.ndarray] = field(default_factory=dict)  # point -> its timed steps (ms); empty: none kept
    loads: Mapping[tuple[str, int], np.ndarray] = field(default_factory=dict)  # (kernels, max_loras) -> timed loads (ms)
    planned: dict | None = None  # (kernels, max_loras, strategy) -> the concurrencies planned (None: no plan)
    coverage: Coverage | None = None  # planned against finished points (None: run.json lists no plan)
    steps: pd.DataFrame | None = None  # every timed step with its batch (tokens, loads), as read_samples gives
    _memo: dict = field(default_factory=dict, init=False, repr=False)  # what memo computed

    def memo(self, key, make):
        """``make()``, computed once per view and ``key``: what analysis derives from the run."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    @classmethod
    def read(cls, run_dir: Path) -> "RunView":
        """A run folder's rows, samples, timed loads and plan, each file read once."""
        rows = load_run(run_dir)
        steps = read_samples(run_dir)
        cov = coverage(run_dir, rows)
        return cls(with_columns(rows), step_times(steps), read_loads(run_dir),
                   cov.planned_concurrency if cov else None, cov, steps)

    @classmethod
    def of(cls, df: pd.DataFrame, samples: Mapping | None = None, loads: Mapping | None = None,
           planned: dict | None = None) -> "RunView":
        """A view of rows in hand (tests, the notebook), with their samples and timed loads if any."""
        return cls(with_columns(df), dict(samples or {}), dict(loads or {}), planned)

    @cached_property
    def ok(self) -> pd.DataFrame:
        return ok_points(self.rows)

    @cached_property
    def first(self) -> pd.Series:
        """The first ok row: the run's model, rank, dtype, device (failed rows may lack them)."""
        return self.ok.iloc[0]

    @cached_property
    def _same_gpu(self) -> tuple[pd.DataFrame, dict]:
        return same_gpu(self.rows)

    @property
    def kept(self) -> pd.DataFrame:
        """The rows compared: ok rows measured on another GPU than max's left out (``same_gpu``)."""
        return self._same_gpu[0]

    @property
    def gpus(self) -> dict[tuple[str, int], dict]:
        """Per (kernels, max_loras): the GPU compared on and the strategies measured elsewhere."""
        return self._same_gpu[1]

    @cached_property
    def compared(self) -> pd.DataFrame:
        """The ok rows measured on the GPU compared on."""
        return ok_points(self.kept)

    @cached_property
    def configs(self) -> pd.DataFrame:
        """One row per measured configuration: capture set, costs, verdict (``points.configs``)."""
        return configs(self.rows)

    @cached_property
    def verdicts(self) -> pd.DataFrame:
        return verdicts(self.rows)

    @cached_property
    def wrong(self) -> pd.DataFrame:
        """The configurations that failed their correctness check."""
        return self.verdicts[self.verdicts.correct.map(lambda v: v is False)]

    @cached_property
    def pooled_loads(self) -> dict[str, np.ndarray]:
        return pooled_loads(self.loads)

    @property
    def has_samples(self) -> bool:
        """Whether the run kept its timed steps (runs from before lorabench kept them did not)."""
        return len(self.times) > 0

    @cached_property
    def resampler(self) -> Resampler | None:
        """Every point's steps and every kernels label's pooled loads, in one Resampler (each
        point's draws depend on its position only: points first, loads after); None without either."""
        keyed = {**self.times, **{(LOAD, k): v for k, v in self.pooled_loads.items()}}
        return Resampler(keyed) if keyed else None

    @property
    def samples(self) -> Resampler | None:
        """The Resampler for comparisons of step times: None for a run that kept no samples."""
        return self.resampler if self.has_samples else None

    def expected(self, workloads: tuple[str, ...] | None = None) -> pd.DataFrame:
        """``expected_steps`` of the compared rows under ``workloads`` (None: the run's own)."""
        key = tuple(workloads) if workloads else None
        return self.memo(("expected", key), lambda: expected_steps(self.kept, list(key) if key else None))

    def comparisons(self, workloads: tuple[str, ...] | None = None) -> list[Comparison]:
        """One Comparison per (kernels, max_loras, workload) (``lorabench.analysis.compare``)."""
        key = tuple(workloads) if workloads else None
        return self.memo(("comparisons", key), lambda: comparisons(
            self.rows, self.kept, self.gpus, self.expected(key), list(key) if key else None, self.planned, self.samples))

    def cost_model(self, kernels: str, max_loras: int) -> CostModel:
        """The cost model of (kernels, max_loras), from the compared rows (ValueError: no ok point)."""
        return self.memo(("model", kernels, int(max_loras)), lambda: CostModel(self.compared, kernels, int(max_loras)))

    @cached_property
    def _sets(self) -> dict[tuple[str, int], dict[str, tuple[tuple[int, ...], bool | None]]]:
        first = self.compared.drop_duplicates(CONFIG)
        verdict = {tuple(r[:3]): r[3] for r in self.verdicts[CONFIG + ["correct"]].itertuples(index=False)}
        out: dict = {}
        for k, m, s, counts in zip(first.kernels, first.max_loras, first.strategy, first.captured_counts):
            out.setdefault((k, int(m)), {})[s] = (tuple(int(x) for x in counts), verdict.get((k, m, s)))
        return out

    def measured_sets(self, kernels: str, max_loras: int) -> dict[str, tuple[tuple[int, ...], bool | None]]:
        """Each strategy measured at (kernels, max_loras) on the GPU compared on -> (its capture
        set, its check's verdict), in the order the run measured them."""
        return self._sets.get((kernels, int(max_loras)), {})
