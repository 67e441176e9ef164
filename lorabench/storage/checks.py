"""``checks.json``: each configuration's correctness verdict (``lorabench.runtime.check``), as its
worker sends it and ``lorabench check`` prints it; a configuration whose check did not run, or whose
worker ended first, has ``correct`` null and says why in ``detail``."""

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from lorabench.storage.files import write_json

FILE = "checks.json"


@dataclass(frozen=True)
class Checked:
    """One configuration's verdict. Its figures are null when the check did not run."""

    kernels: str
    max_loras: int
    strategy: str
    correct: bool | None  # None: not checked, or inconclusive
    batches: int | None = None  # batches replayed
    graphs_checked: int | None = None  # graphs some batch was served by
    graphs_total: int | None = None
    max_err: float | None = None  # worst relative logit error
    tolerance: float | None = None
    sensitivity: float | None = None  # how far the LoRA update moves the logits
    seconds: float | None = None
    first: dict | None = None  # the smallest failing batch, its graph and error
    failing_graphs: list | None = None  # [bucket, key, grid] of every wrong graph
    eager_wrong: bool | None = None  # a batch past every capture size (run eagerly) was wrong
    mixed_batches: int | None = None  # of ``batches``, mixed steps (prefill chunks and decode tokens)
    mixed_graphs_checked: int | None = None  # mixed keys (PIECEWISE graph sets) some step was served by
    mixed_graphs_total: int | None = None
    failing_mixed_graphs: list | None = None  # [bucket, key, grid] of every wrong mixed key
    mixed_eager_wrong: bool | None = None  # a mixed step past every mixed size was wrong
    first_mixed: dict | None = None  # the smallest failing mixed step (``first`` may be a decode batch)
    mixed_max_err: float | None = None  # worst relative logit error over the mixed steps
    rounding_floor: float | None = None  # what rounding alone moves a mixed step's logits by (``runtime.check``)
    mixed_tolerance: float | None = None  # the mixed steps' tolerance: max(tolerance, NOISE_MARGIN x rounding_floor)
    detail: str = ""  # the verdict in words
    num_graphs: int | None = None
    captured_counts: list[int] | None = None

    @property
    def config(self) -> tuple[str, int, str]:
        return self.kernels, self.max_loras, self.strategy

    @classmethod
    def from_dict(cls, record: dict) -> "Checked":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in record.items() if k in known})


def read_checks(run_dir: Path) -> list[Checked]:
    """The run's verdicts; [] when it has none."""
    path = Path(run_dir) / FILE
    return [Checked.from_dict(c) for c in json.loads(path.read_text())] if path.is_file() else []


def write_checks(run_dir: Path, checks: list[Checked]) -> None:
    """Every verdict, written whole (a temporary file renamed over the last one)."""
    write_json(Path(run_dir) / FILE, [asdict(c) for c in checks])
