"""The Parquet rows: one per measured point, written as points finish.

A run's ``points.parquet`` is a folder of part files, one per worker group
(``part-<g>.parquet``, the group of ``worker-<g>.log``), read back as one Parquet dataset
(``read_points``); runs written before the parts, and tables made by hand, are a single file there,
read the same way. Groups run at the same time on different GPUs or hosts, so each part is rewritten
whole (to a hidden temporary file, then renamed over the old one) after each of its rows: at any
moment, a Ctrl-C or a killed worker included, the dataset holds every finished row, and a row costs
the rewrite of its group's part only. ``points.jsonl`` is the same rows, appended.
Columns: docs/design.md's list (extend, never rename), the extensions marked below.
``load_run`` and ``find_newest_run`` read runs back for the report, recommend and auto.
"""

import json
import os
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from lorabench.errors import UserError

I64, F64, STR, BOOL = pa.int64(), pa.float64(), pa.string(), pa.bool_()

SCHEMA = pa.schema(
    [
        ("run_id", STR), ("started_at", STR), ("git_sha", STR), ("device", STR), ("gpu_name", STR),
        ("driver", STR), ("torch", STR), ("triton", STR), ("cuda", STR),
        ("model", STR), ("layers", I64), ("hidden", I64), ("rank", I64), ("dtype", STR), ("kernels", STR),
        ("max_loras", I64), ("strategy", STR), ("captured_counts", pa.list_(I64)), ("capture_sizes", pa.list_(I64)),
        ("concurrency", I64), ("n_active", I64), ("base_tokens", I64), ("graph_tokens", I64), ("graph_loras", I64),
        ("mode", STR), ("workload", STR), ("iters", I64),
        ("step_ms_median", F64), ("step_ms_p10", F64), ("step_ms_p90", F64), ("step_ms_p99", F64),
        ("step_ms_mean", F64), ("step_ms_std", F64), ("step_ms_iqr", F64),
        ("host_us_median", F64),  # building the batch metadata + choosing the graph (host CPU)
        ("tokens_per_s", F64),
        ("build_s", F64), ("compile_s", F64), ("capture_s", F64), ("startup_s", F64),
        ("graph_mem_bytes", I64), ("pool_bytes", I64), ("num_graphs", I64), ("noisy", BOOL),
        ("status", STR), ("error", STR),
        # extensions
        ("point", I64),  # index of the point in its run's plan
        ("argv", STR), ("seed", I64), ("context_len", I64), ("warmup", I64),
        ("timing", STR),  # "cuda_events" (GPU time) or "cpu_wall" (eager CPU wall time)
        ("host_us_p90", F64),
        ("copy_us_median", F64),  # host time of the call queueing the metadata copy
        ("launch_us_median", F64),  # host time of the replay call itself
        ("n_active_mean", F64),  # mean active count over the timed steps (it varies in workload runs)
        ("graph_loras_mean", F64),  # mean launch count over the timed steps
        ("process_s", F64),  # worker start: interpreter, imports, device init
        ("triton_cache", STR),  # "cold" when the compile step wrote new kernels, else "warm"
        ("lora_bytes_per_slot", I64),
        ("vllm", STR),  # vLLM's version, on rows of its kernels (--kernels vllm)
        ("correct", BOOL),  # the configuration's check: every served graph equals the reference (null: not checked)
        ("check_detail", STR),  # the verdict in words; the smallest failing batch, its graph and error
        ("check_max_err", F64),  # worst relative logit error over the check's batches
        ("check_batches", I64),
        ("check_s", F64),
        ("predicted_ms", F64),  # strategy auto, workload runs: the cost model's expected step (from --auto-from)
        ("probe_copy_gbs", F64),  # the worker's device-to-device copy bandwidth, read + write (lorabench.runtime.probe)
        ("probe_kernel_us", F64),  # the worker's cost of one more tiny kernel in a CUDA graph
        ("tuned", STR),  # "+tuned" kernels: the `lorabench tune` folder whose configs they ran with
        ("pdl", BOOL),  # lorabench's Triton kernels launched with programmatic dependent launch (sm90+; LORABENCH_PDL=0 turns it off)
        ("timed_steps", I64),  # steps timed (the point's samples): iters, or fewer when --ci-target stopped it early
        ("step_ms_ci_low", F64),  # 95 % bootstrap interval of the median step (lorabench.stats), from the samples
        ("step_ms_ci_high", F64),
        ("ci_target", F64),  # --ci-target: the half-width (% of the median) at which the point stopped timing
        ("arms", STR),  # the strategies timed in alternating turns at this point, on this GPU ("max,pow2,dense")
        ("noisy_why", STR),  # why ``noisy`` is set: a wide IQR, throttling, a clock drop
        ("host", STR),
        ("gpu_uuid", STR),  # the GPU the point ran on: comparisons are made only within one GPU
        ("sm_mhz_start", I64), ("sm_mhz_end", I64),  # NVML readings before the point's first step and after its last
        ("mem_mhz_start", I64), ("mem_mhz_end", I64),
        ("temp_c_start", I64), ("temp_c_end", I64),
        ("power_w_start", F64), ("power_w_end", F64),
        ("throttle_reasons", STR),  # NVML's clock-event reasons at start or end, comma-joined ("" when none)
        ("throttled", BOOL),  # a power or thermal slowdown reason was set
        ("clock_drop", BOOL),  # the SM clock fell by more than 5 % over the point
        ("first_capture_s", F64),  # a process's one-time cost of its first warm-up and capture, paid before any strategy
        ("first_capture_bytes", I64),  # (CUDA/cuBLAS initialisation, the capture workspace): not in any strategy's own columns
        ("model_source", STR),  # "preset", a config.json path or a Hugging Face id
        ("architecture", STR),  # the Hugging Face architecture lorabench built (LlamaForCausalLM, ...)
        ("heads", I64), ("kv_heads", I64), ("head_dim", I64), ("intermediate", I64), ("vocab", I64),  # the whole model's
        ("tp", I64),  # tensor-parallel ranks: the row times one rank's shapes
        ("ranks", STR),  # --ranks: the adapters' own ranks and shares ("8:0.5,64:0.5"), padded to `rank`
        ("slot_ranks", pa.list_(I64)),  # each resident slot's adapter's own rank
        ("fully_sharded_loras", BOOL),  # vLLM's --fully-sharded-loras: LoRA A (qkv, gate_up) or B (o, down) cut over the ranks too
        ("allreduce", STR),  # tp > 1: "left out" (one rank timed alone: no all-reduce after o, down and the embedding, no logits all-gather, no LoRA collectives)
        ("adapters", I64),  # --adapters: residency runs serve this many adapters from the slots
        ("max_cpu_loras", I64),  # vLLM's CPU cache of adapters the residency runs assume
        ("output_tokens", I64),  # decode steps per request of a residency run
        ("tokens_per_step", F64),  # residency runs: mean running requests per step
        ("loads_per_step", F64),  # residency runs: mean adapters loaded into slots per step
        ("load_ms_median", F64),  # what loading one adapter from pinned host memory adds to the step it blocks (the worker's, after its check)
        ("load_ms_ci_low", F64), ("load_ms_ci_high", F64),  # 95 % bootstrap interval of that median
        ("load_alone_ms_median", F64),  # the same load by itself, CUDA events around its copies
        ("load_host_us_median", F64),  # host time of queueing one load's copies
        ("load_ops", I64),  # device operations of one load (a zeroing and a copy of A and of B per slice)
    ]
)
COLUMNS = SCHEMA.names


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
        self.rows: list[dict] = []
        self._place: dict[int, int] = {}  # point -> its row's place in self.rows
        if resume and self.path.exists():
            for row in pq.read_table(self.path).to_pylist():
                self._put({c: row.get(c) for c in COLUMNS})
            if self.path.is_file():  # a run from before the parts: its rows go into parts from now on
                self.path.unlink()
                self.flush()

    @property
    def path(self) -> Path:
        return self.run_dir / "points.parquet"

    def part(self, row: dict) -> int:
        return self.part_of.get(row["point"], 0) if row["point"] is not None else 0

    def append(self, row: dict) -> None:
        unknown = set(row) - set(COLUMNS)
        if unknown:
            raise KeyError(f"unknown columns {sorted(unknown)}")
        full = {c: row.get(c) for c in COLUMNS}
        self._put(full)
        self._write(self.part(full))
        with open(self.run_dir / "points.jsonl", "a") as f:
            f.write(json.dumps(full) + "\n")

    def _put(self, full: dict) -> None:
        place = self._place.get(full["point"]) if full["point"] is not None else None
        if place is not None:
            self.rows[place] = full
        else:
            if full["point"] is not None:
                self._place[full["point"]] = len(self.rows)
            self.rows.append(full)

    def _write(self, part: int) -> None:
        rows = [r for r in self.rows if self.part(r) == part]
        if not rows:
            return
        self.path.mkdir(exist_ok=True)
        target = self.path / f"part-{part:04d}.parquet"
        tmp = self.path / f".{target.name}.tmp"  # a dataset skips hidden files: readers never see it
        pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), tmp)
        os.replace(tmp, target)

    def flush(self) -> None:
        """Every part from the rows held; the sweep calls it again when a signal stops it in the
        middle of an append."""
        for part in sorted({self.part(r) for r in self.rows}):
            self._write(part)


REQUIRED = ("run_id", "kernels", "max_loras", "strategy", "concurrency", "mode", "status")  # what every reader uses


def read_points(run_dir: Path) -> pd.DataFrame:
    """A run's rows: its parts as one dataset, group by group (or an older run's single file)."""
    return pq.read_table(Path(run_dir) / "points.parquet").to_pandas()


def load_run(run_dir: Path) -> pd.DataFrame:
    """A run's rows, or one UserError line saying why there are none to use."""
    run_dir = Path(run_dir)
    if not os.path.isdir(run_dir):  # os.path: Path.is_dir raises on a name too long for the file system
        raise UserError(f"{run_dir} is not a folder")
    if not os.path.exists(run_dir / "points.parquet"):
        raise UserError(f"{run_dir} has no points.parquet (is it a sweep's output folder?)")
    try:
        df = read_points(run_dir)
    except Exception as e:  # noqa: BLE001 - a corrupt file is bad input, not a crash
        raise UserError(f"{run_dir}/points.parquet cannot be read: {e}") from None
    lacking = [c for c in REQUIRED if c not in df.columns]
    if lacking:
        raise UserError(f"{run_dir}/points.parquet is not a lorabench sweep's (no column {', '.join(lacking)})")
    if not (df.status == "ok").any():
        raise UserError(f"{run_dir}/points.parquet holds no successful points to report on")
    return df


def find_newest_run(results: Path) -> Path:
    runs = sorted(p.parent for p in Path(results).glob("*/points.parquet"))
    if not runs:
        raise UserError(f"no runs with a points.parquet under {results}/ (run `lorabench sweep` first)")
    return max(runs, key=lambda p: (p / "points.parquet").stat().st_mtime)
