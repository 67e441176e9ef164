"""The Parquet rows: one per measured point, written as points finish.

A run's ``points.parquet`` is a folder of part files, one per worker group
(``part-<g>.parquet``, the group of ``worker-<g>.log``), read back as one Parquet dataset
(``read_points``); runs written before the parts, and tables made by hand, are a single file there,
read the same way. Groups run at the same time on different GPUs or hosts, so each part is rewritten
whole (to a hidden temporary file, then renamed over the old one) after each of its rows: at any
moment, a Ctrl-C or a killed worker included, the dataset holds every finished row, and a row costs
the rewrite of its group's part only. ``points.jsonl`` is the same rows, appended.
The columns are ``lorabench.storage.row.Row``'s, in ``lorabench.storage.schema.SCHEMA``'s types;
every reader gets them all, those a file predates null. ``load_run`` and ``find_newest_run`` read
runs back for the report, recommend, compare and auto; a part that cannot be read is one error
line saying what to do (``CorruptPart``).
"""

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

from lorabench.errors import UserError
from lorabench.storage.files import write_whole
from lorabench.storage.row import COLUMNS, Row
from lorabench.storage.schema import SCHEMA, conform

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["COLUMNS", "SCHEMA", "CorruptPart", "PointsWriter", "Row", "find_newest_run", "load_run", "read_points"]


class PointsWriter:
    """Writes a run's rows as they arrive, each into its group's part (``part_of``: a point's
    group; all in part 0 when not given). ``resume=True`` starts from the rows already in the
    folder; a row for a point that already has one replaces it (a resumed sweep re-measures
    failed points), so the dataset holds one row per point. The part is written first, then
    ``points.jsonl``, the append-only log: a re-measured point appears in the log twice (the later
    line counts), and a SIGKILL between the two writes leaves the log one line short, never the
    Parquet parts. One thread writes at a time (the sweep's)."""

    def __init__(self, run_dir: Path, resume: bool = False, part_of: dict[int, int] | None = None):
        self.run_dir = Path(run_dir)
        self.part_of = part_of or {}
        self.rows: list[Row] = []
        self._records: list[dict] = []  # the rows as records, made once each
        self._place: dict[int, int] = {}  # point -> its row's place in self.rows
        if resume and self.path.exists():
            for record in _read_table(self.run_dir).to_pylist():
                self._put(Row.from_dict(record))
            if self.path.is_file():  # a run from before the parts: its rows go into parts from now on
                self.path.unlink()
                self.flush()

    @property
    def path(self) -> Path:
        return self.run_dir / "points.parquet"

    def part(self, row: Row) -> int:
        return self.part_of.get(row.point, 0) if row.point is not None else 0

    def append(self, row: Row | dict) -> None:
        """A row (or a record of its columns) into its part and the log."""
        if isinstance(row, dict):
            unknown = set(row) - set(COLUMNS)
            if unknown:
                raise KeyError(f"unknown columns {sorted(unknown)}")
            row = Row.from_dict(row)
        record = self._put(row)
        self._write(self.part(row))
        with open(self.run_dir / "points.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    def _put(self, row: Row) -> dict:
        record = row.to_dict()
        place = self._place.get(row.point) if row.point is not None else None
        if place is not None:
            self.rows[place], self._records[place] = row, record
        else:
            if row.point is not None:
                self._place[row.point] = len(self.rows)
            self.rows.append(row)
            self._records.append(record)
        return record

    def _write(self, part: int) -> None:
        records = [r for row, r in zip(self.rows, self._records) if self.part(row) == part]
        if not records:
            return
        self.path.mkdir(exist_ok=True)
        target = self.path / f"part-{part:04d}.parquet"
        write_whole(target, lambda tmp: pq.write_table(pa.Table.from_pylist(records, schema=SCHEMA), tmp))

    def flush(self) -> None:
        """Every part from the rows held; the sweep calls it again when a signal stops it in the
        middle of an append."""
        for part in sorted({self.part(r) for r in self.rows}):
            self._write(part)


class CorruptPart(UserError):
    """A file of a run's rows that cannot be read: one line naming it and what to do."""

    def __init__(self, run_dir: Path, file: Path, error: Exception):
        self.run_dir, self.file = Path(run_dir), Path(file)
        resume = f"`lorabench sweep --resume {self.run_dir}`"
        if self.file.parent.name == "points.parquet":  # one group's part: the other parts still read
            todo = f"remove it to use the other parts' rows, and {resume} measures its points again"
        elif (self.run_dir / "run.json").is_file():
            todo = f"remove it, and {resume} measures the run's points again"
        else:
            todo = "is it a lorabench sweep's?"
        super().__init__(f"{self.file} cannot be read ({_why(error)}): {todo}")


def _why(error: Exception) -> str:
    """Why a file does not read, in a few words (pyarrow's own text is a paragraph)."""
    if isinstance(error, OSError) and error.strerror:  # permissions, a vanished file
        return error.strerror
    return "not a Parquet file, or cut short"


def _parts(run_dir: Path) -> list[Path]:
    """The files of a run's rows: its parts (hidden temporary files left out), or an older run's one
    file; none before its first row."""
    path = Path(run_dir) / "points.parquet"
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith((".", "_")))
    return [path] if path.exists() else []


def _read_table(run_dir: Path) -> pa.Table:
    tables = []
    for file in _parts(run_dir):
        try:
            table = pq.read_table(file)
        except (pa.ArrowException, OSError) as e:
            raise CorruptPart(run_dir, file, e) from None
        try:
            tables.append(conform(table))
        except pa.ArrowException as e:  # a table made by hand whose column holds another type
            raise UserError(f"{file}: its columns are not a lorabench sweep's ({str(e).split('. ')[0]})") from None
    return pa.concat_tables(tables, promote_options="default") if tables else SCHEMA.empty_table()


REQUIRED = ("run_id", "kernels", "max_loras", "strategy", "concurrency", "mode", "status")  # what every reader uses


def read_points(run_dir: Path) -> "pd.DataFrame":
    """A run's rows: its parts, group by group (or an older run's single file), every column in
    the schema's type (a column a file predates is null); none before the run's first row.
    ``CorruptPart`` when one cannot be read."""
    return _read_table(run_dir).to_pandas()


def load_run(run_dir: Path) -> "pd.DataFrame":
    """A run's rows, or one UserError line saying why there are none to use."""
    run_dir = Path(run_dir)
    if not os.path.isdir(run_dir):  # os.path: Path.is_dir raises on a name too long for the file system
        raise UserError(f"{run_dir} is not a folder")
    if not os.path.exists(run_dir / "points.parquet"):
        raise UserError(f"{run_dir} has no points.parquet (is it a sweep's output folder?)")
    lacking = _lacking(run_dir)
    if lacking:
        raise UserError(f"{run_dir}/points.parquet is not a lorabench sweep's (no column {', '.join(lacking)})")
    df = read_points(run_dir)
    if not (df.status == "ok").any():
        raise UserError(f"{run_dir}/points.parquet holds no successful points to report on")
    return df


def _lacking(run_dir: Path) -> list[str]:
    """The columns every reader uses that a file of the run's rows lacks (a table not a sweep's)."""
    for file in _parts(run_dir):
        try:
            names = pq.read_schema(file).names
        except (pa.ArrowException, OSError) as e:
            raise CorruptPart(run_dir, file, e) from None
        lacking = [c for c in REQUIRED if c not in names]
        if lacking:
            return lacking
    return []


def find_newest_run(results: Path) -> Path:
    runs = sorted(p.parent for p in Path(results).glob("*/points.parquet"))
    if not runs:
        raise UserError(f"no runs with a points.parquet under {results}/ (run `lorabench sweep` first)")
    return max(runs, key=lambda p: (p / "points.parquet").stat().st_mtime)
