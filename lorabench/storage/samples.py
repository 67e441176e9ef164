"""Every timed step of every point, kept: ``<run>/samples/point-<index>.parquet``, one file per
point, written when the point's row is (before it), so that any statistic (an interval, a rank
test, another percentile) can be computed again later. Read back as one table with
``read_samples``.

A file per point rather than one growing file while the sweep runs: a point's samples are written
once, atomically (a temporary file renamed), a resumed sweep that re-measures a point replaces its
file, and nothing already written is rewritten as a run grows. A finished sweep packs them into
``samples/points.parquet`` (``pack_samples``): a Parquet file's schema and footer cost more than a
point's few hundred steps, so the pack is about five times smaller than its files. A point's own
file, written after the pack (a resumed run's re-measured point), is read in place of its rows in
the pack; a pack interrupted before its files were removed reads the same as before it.

Columns: ``point`` (the row's ``point``), ``step`` (0, 1, ... in the order timed), ``turn`` (the
round of the interleaving the step was timed in: configurations compared with each other are
timed in alternating turns), ``step_ms`` (GPU time of the step from CUDA events, or the CPU's wall
time), ``host_us``, ``copy_us``, ``launch_us`` (the host's parts of the step), ``n_active`` (the
step's active adapters), ``launches`` (the launch count its LoRA kernels ran with), ``tokens``
(the batch's requests) and ``loads`` (adapters loaded into slots within the step: residency runs);
files written before the last two have them null.

``loads-<group>.parquet``: each worker group's timed adapter loads (``kernels``, ``max_loras``,
``load``, ``load_ms``: what one load adds to the step it blocks, ``alone_ms`` and ``host_us``: the
load by itself and the host's time of queueing it; ``lorabench.runtime.adapters.time_loads``).
``loads-<group>-<path>.parquet``: the same for the other load paths (``path``;
``lorabench.runtime.load_paths``): one-copy and pageable as above; overlapped: ``load_ms`` what
the step beside the load lost, ``alone_ms`` the time until the adapter is usable; storage-cold
and storage-warm: ``alone_ms`` each read of an adapter's file.
"""

import re
import typing
from collections.abc import Mapping
from dataclasses import asdict, fields, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from lorabench.storage.steps import Loads, Steps  # noqa: F401 - what workers send, read from here too
from lorabench.storage.files import write_whole

if TYPE_CHECKING:  # the readers' frames; a sweep writing samples never imports pandas
    import pandas as pd

FOLDER = "samples"
PACKED = f"{FOLDER}/points.parquet"  # a finished sweep's samples, packed (``pack_samples``)
I64, F64 = pa.int64(), pa.float64()


PER_STEP = [f.name for f in fields(Steps)]  # what a worker sends per step
_TYPES = {list[int]: I64, list[float]: F64}
SCHEMA = pa.schema([("point", I64), ("step", I64)] + [(name, _TYPES[t]) for name, t in typing.get_type_hints(Steps).items()])
LOADS = pa.schema([("kernels", pa.string()), ("max_loras", I64), ("load", I64), ("load_ms", F64), ("alone_ms", F64),
                   ("host_us", F64)])
LOAD_PATHS = LOADS.append(pa.field("path", pa.string()))  # loads-<group>-<path>.parquet: the other load paths


def path(run_dir: Path, point: int) -> Path:
    return Path(run_dir) / FOLDER / f"point-{point:06d}.parquet"


def write_samples(run_dir: Path, point: int, per_step: Steps | Mapping[str, list]) -> None:
    """One point's steps (``per_step``: the PER_STEP columns, equally long; one a mapping lacks is
    null) into its file."""
    if is_dataclass(per_step):
        per_step = asdict(per_step)
    n = len(per_step["step_ms"])
    columns = {"point": np.full(n, point, dtype=np.int64), "step": np.arange(n, dtype=np.int64)}
    columns.update({name: per_step.get(name, [None] * n) for name in PER_STEP})
    target = path(run_dir, point)
    target.parent.mkdir(exist_ok=True)
    write_whole(target, lambda tmp: pq.write_table(pa.table(columns, schema=SCHEMA), tmp))


def _point_files(run_dir: Path) -> dict[int, Path]:
    folder = Path(run_dir) / FOLDER
    files = folder.glob("point-*.parquet") if folder.is_dir() else ()
    return {int(f.stem.split("-")[1]): f for f in files}


def has_samples(run_dir: Path) -> bool:
    """Whether the run kept any samples (files of points or a pack)."""
    return bool(_point_files(run_dir)) or (Path(run_dir) / PACKED).is_file()


def _read_table(run_dir: Path, points=None) -> pa.Table:
    files = _point_files(run_dir)
    wanted = None if points is None else {int(p) for p in points}
    tables = []
    packed = Path(run_dir) / PACKED
    if packed.is_file():
        table = _with_schema(pq.read_table(packed))
        keep = pc.invert(pc.is_in(table["point"], pa.array(sorted(files), type=I64)))  # a point's own file wins
        if wanted is not None:
            keep = pc.and_(keep, pc.is_in(table["point"], pa.array(sorted(wanted), type=I64)))
        tables.append(table.filter(keep))
    tables += [_with_schema(pq.read_table(files[p])) for p in sorted(files) if wanted is None or p in wanted]
    tables = [t for t in tables if len(t)]
    return pa.concat_tables(tables).sort_by([("point", "ascending"), ("step", "ascending")]) if tables \
        else SCHEMA.empty_table()


def read_samples(run_dir: Path, points=None) -> "pd.DataFrame":
    """A run's samples (of ``points`` only, when given), one row per timed step, by point and step;
    empty (with the columns) for a run that kept none."""
    return _read_table(run_dir, points).to_pandas()


def pack_samples(run_dir: Path) -> None:
    """The run's point files into its pack, and then removed: the sweep calls it when it finishes."""
    files = _point_files(run_dir)
    if not files:
        return
    packed = Path(run_dir) / PACKED
    write_whole(packed, lambda tmp: pq.write_table(_read_table(run_dir), tmp, compression="zstd"))
    for f in files.values():
        f.unlink()


def _with_schema(table: pa.Table) -> pa.Table:
    """A file's table in today's schema: columns added since it was written are null."""
    for field in SCHEMA:
        if field.name not in table.column_names:
            table = table.append_column(field, pa.nulls(len(table), field.type))
    return table.select(SCHEMA.names).cast(SCHEMA)


def write_loads(run_dir: Path, group: int, loads: Loads) -> None:
    """A group's timed adapter loads into its file (one per load path; vLLM's per-slice path's
    is ``loads-<group>.parquet``, as before there were others)."""
    n = len(loads.load_ms)
    columns = {"kernels": [loads.kernels] * n, "max_loras": np.full(n, loads.max_loras, dtype=np.int64),
               "load": np.arange(n, dtype=np.int64), **{name: getattr(loads, name) for name in ("load_ms", "alone_ms", "host_us")}}
    per_slice = loads.path == Loads.path
    table = pa.table(columns if per_slice else {**columns, "path": [loads.path] * n}, schema=LOADS if per_slice else LOAD_PATHS)
    target = Path(run_dir) / FOLDER / (f"loads-{group:04d}.parquet" if per_slice else f"loads-{group:04d}-{loads.path}.parquet")
    target.parent.mkdir(exist_ok=True)
    write_whole(target, lambda tmp: pq.write_table(table, tmp))


def read_loads(run_dir: Path) -> dict[tuple[str, int], np.ndarray]:
    """(kernels, max_loras) -> what its timed loads added to their steps (ms); empty for a run that timed none."""
    folder = Path(run_dir) / FOLDER
    files = sorted(f for f in folder.glob("loads-*.parquet") if re.fullmatch(r"loads-\d+\.parquet", f.name)) \
        if folder.is_dir() else []
    if not files:
        return {}
    df = pa.concat_tables([pq.read_table(f, schema=LOADS) for f in files]).to_pandas()
    return {(k, int(m)): g.sort_values("load").load_ms.to_numpy() for (k, m), g in df.groupby(["kernels", "max_loras"])}


def read_load_paths(run_dir: Path) -> "pd.DataFrame":
    """Every group's timed loads on the other paths (``LOAD_PATHS``' columns); empty when none."""
    import pandas as pd

    folder = Path(run_dir) / FOLDER
    files = sorted(f for f in folder.glob("loads-*.parquet") if re.fullmatch(r"loads-\d+-[\w-]+\.parquet", f.name)) \
        if folder.is_dir() else []
    if not files:
        return pd.DataFrame(columns=LOAD_PATHS.names)
    return pa.concat_tables([pq.read_table(f, schema=LOAD_PATHS) for f in files]).to_pandas()


def step_times(samples: "pd.DataFrame") -> dict[int, np.ndarray]:
    """point -> its step times (ms), in the order timed."""
    return {int(p): g.sort_values("step").step_ms.to_numpy() for p, g in samples.groupby("point")}
