"""A run's state, read back: what its sweep planned (``run.json``), what it finished
(``points.parquet``), and what it lacks. The console, ``report`` and ``recommend`` say from this
whether a run is complete, and which points are missing.

A sweep writes into ``run.json`` its status (``running`` until it ends, then ``finished`` or
``interrupted``), the process id and host of its parent process, and its plan: every job's
(kernels, max_loras, strategy) and points. A run still ``running`` whose parent process is gone
from this host was killed (SIGKILL, a crash, a lost machine): it is shown as ``killed``. Runs from
before the plan was written carry only each job's point count; their missing points are counted,
not named.
"""

import json
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from lorabench.storage.files import write_json
from lorabench.storage.results import read_points

if TYPE_CHECKING:
    import pandas as pd

RUNNING, FINISHED, INTERRUPTED, KILLED = "running", "finished", "interrupted", "killed"


def write_info(run_dir: Path, info: dict) -> None:
    """run.json, written whole."""
    write_json(Path(run_dir) / "run.json", info)


def read_info(run_dir: Path) -> dict:
    """run.json, or {} when the folder has none (or it cannot be read)."""
    try:
        return json.loads((Path(run_dir) / "run.json").read_text())
    except (OSError, ValueError):
        return {}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process holds that id now
        return True
    return True


def run_status(info: dict) -> str:
    """The status run.json states, with ``running`` turned into ``killed`` when the sweep's
    process is gone from this host (on another host it cannot be told, and stays ``running``)."""
    status = info.get("status", FINISHED if info else RUNNING)
    if status == RUNNING and info.get("host") == socket.gethostname() and info.get("pid"):
        if not _alive(int(info["pid"])):
            return KILLED
    return status


@dataclass(frozen=True)
class Coverage:
    """Planned points against finished rows (ok or failed)."""

    status: str  # RUNNING, FINISHED, INTERRUPTED or KILLED (see run_status)
    planned: int  # points in the plan
    finished: int  # planned points with a row, ok or failed
    failed: int  # planned points whose row is failed
    missing: tuple[int, ...] = ()  # planned point indices without a row (empty when the plan is not known)
    missing_by_config: dict = field(default_factory=dict)  # (kernels, max_loras, strategy) -> points without a row
    planned_concurrency: dict = field(default_factory=dict)  # (kernels, max_loras, strategy) -> the concurrencies planned

    @property
    def complete(self) -> bool:
        return self.status == FINISHED and self.finished >= self.planned

    def incomplete(self) -> str | None:
        """What the run lacks, in one line (``line``), or None when it is complete."""
        return None if self.complete else self.line()

    def summary(self) -> str:
        """One line: e.g. ``killed: 38 of 126 planned points finished (88 missing, 2 failed)``."""
        missing = self.planned - self.finished
        return (f"{self.status}: {self.finished} of {self.planned} planned points finished "
                f"({missing} missing, {self.failed} failed)")

    def missing_text(self) -> str:
        """Which configurations lack how many points: ``triton/4/pow2 10, triton/4/dense 19``, or ''."""
        return ", ".join(f"{k}/{m}/{s} {n}" for (k, m, s), n in self.missing_by_config.items())

    def line(self) -> str:
        """The summary and, when points are missing, where: what the console and report.md say of
        an incomplete run."""
        text = self.missing_text()
        return self.summary() + (f"; missing: {text}" if text else "")

    def to_dict(self) -> dict:
        """JSON (recommendation.json's ``coverage``)."""
        return {"status": self.status, "complete": self.complete, "planned": self.planned, "finished": self.finished,
                "missing": self.planned - self.finished, "failed": self.failed,
                "missing_by_config": [{"kernels": k, "max_loras": m, "strategy": s, "missing": n}
                                      for (k, m, s), n in self.missing_by_config.items()]}


def coverage(run_dir: Path, df: "pd.DataFrame | None" = None) -> Coverage | None:
    """The run's coverage, or None for a folder whose run.json lists no jobs."""
    info = read_info(run_dir)
    jobs = info.get("jobs") or []
    if not jobs:
        return None
    if df is None:
        try:
            df = read_points(run_dir)
        except OSError:
            import pandas as pd

            df = pd.DataFrame(columns=["point", "status"])
    rows = df.dropna(subset=["point"]) if "point" in df else df.iloc[0:0]
    done = set(rows.point.astype(int))
    failed_points = set(rows[rows.status == "failed"].point.astype(int)) - set(rows[rows.status == "ok"].point.astype(int))
    spec_conc = [int(c) for c in (info.get("spec") or {}).get("concurrency") or []]
    planned, missing, by_config, conc = 0, [], {}, {}
    for job in jobs:
        key = (job["kernels"], int(job["max_loras"]), job["strategy"])
        points = job["points"]
        if isinstance(points, int):  # a run from before the plan was written: a count only
            planned += points
            conc.setdefault(key, set()).update(spec_conc)
            have = int(((df.kernels == key[0]) & (df.max_loras == key[1]) & (df.strategy == key[2])).sum()) if len(df) else 0
            if points > have:
                by_config[key] = points - have
            continue
        planned += len(points)
        # a prefill point's concurrency is its step's requests, not a concurrency the run sweeps
        conc.setdefault(key, set()).update(int(p["concurrency"]) for p in points if p.get("mode") != "prefill")
        lacking = [p["index"] for p in points if p["index"] not in done]
        missing += lacking
        if lacking:
            by_config[key] = len(lacking)
    finished = planned - sum(by_config.values())
    return Coverage(status=run_status(info), planned=planned, finished=finished, failed=len(failed_points),
                    missing=tuple(sorted(missing)), missing_by_config=by_config,
                    planned_concurrency={k: tuple(sorted(v)) for k, v in conc.items()})
