"""An A/B of two runs (``lorabench compare``): which points the runs share, measured on the same
device, and per point and overall how B's step time differs from A's, with intervals.

A point of A and one of B *match* when both are ok and agree on ``KEY`` (what was measured), and
they are compared only when they were measured on the same device: the same ``gpu_uuid``, or, for
CPU runs (no uuid), the same ``host``. Two GPUs of one model differ by more than the changes a
regression gate looks for (up to 1.7 % between two H200s of one host), so a point matched on
another device is counted, never compared. Points ok in one run only are counted and named.

Per compared point: the relative difference of the medians (percent, positive = B slower, as
``lorabench.stats.relative_difference``) with its bootstrap interval, the Mann-Whitney p-value
(the runs' samples are not paired) and ``verdict`` with the margin; overall: the geometric mean of
B/A over the compared points (as ``geometric_mean_ratio``), its interval, and how many points are
faster, slower or the same. Both come from one ``Resampler``: every point's samples are
resampled once, and the overall interval uses the same draws as the points'.
"""

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from lorabench.errors import UserError
from lorabench.stats import (
    LEVEL,
    MIN_SAMPLES,
    N_BOOT,
    Interval,
    Resampler,
    Verdict,
    geomean_ratio_pct,
    rank_test,
    ratio_pct,
    verdict,
)
from lorabench.storage.results import load_run
from lorabench.storage.samples import has_samples, read_samples, step_times

KEY = ("model", "rank", "dtype", "kernels", "max_loras", "strategy", "mode", "concurrency", "n_active", "workload",
       "prefill_tokens", "input_tokens", "max_num_batched_tokens", "adapters", "output_tokens")
INT_KEYS = frozenset({"rank", "max_loras", "concurrency", "n_active", "prefill_tokens", "max_num_batched_tokens",
                      "adapters"})
# What a whole run is set to: when each run holds one value and the values differ (rank 8 against
# rank 64), that difference is what the A/B measures, and points are matched on the rest of KEY
# (a setting outside KEY, such as --share-expert-weights, is only named).
RUN_SETTINGS = ("model", "rank", "dtype", "shared_expert_weights")

# A rerun on the same GPU a minute later differs by up to 0.5 % at a point, two GPUs of one host by up to
# 1.7 %: 1 % keeps reruns on one GPU "the same" and still catches changes a user would care about.
DEFAULT_MARGIN = 1.0

NOT_ENOUGH = "not enough samples"


def _value(v, name: str):
    if v is None or (not isinstance(v, str) and pd.isna(v)):
        return None
    return int(v) if name in INT_KEYS else str(v)


def key_of(row, across: frozenset = frozenset()) -> tuple:
    """The point's ``KEY`` values, nulls as None and counts as ints (NaN never equals NaN); the
    columns in ``across`` (settings the runs differ in) as None."""
    return tuple(None if c in across else _value(row.get(c), c) for c in KEY)


def device_of(row) -> str | None:
    """The GPU's uuid, ``cpu@HOST`` for a CPU point, None when the row does not say (never matched)."""
    uuid = _value(row.get("gpu_uuid"), "gpu_uuid")
    if uuid is not None:
        return uuid
    host = _value(row.get("host"), "host")
    device = _value(row.get("device"), "device")
    if host is None or device not in (None, "cpu"):
        return None
    return f"cpu@{host}"


def label(key: tuple, vary: frozenset = frozenset()) -> str:
    """A point in a few words: ``torch L2 max c1 n0`` or ``triton L32 pow2 c8 uniform``; the
    model, rank and dtype only when they are among ``vary``."""
    k = dict(zip(KEY, key))
    parts = [str(k[c]) for c in ("model", "dtype") if c in vary]
    parts += [f"r{k['rank']}"] if "rank" in vary else []
    parts += [str(k["kernels"]), f"L{k['max_loras']}", str(k["strategy"]), f"c{k['concurrency']}"]
    if k["mode"] == "workload" or k["n_active"] is None:
        parts.append(str(k["workload"]))
    else:
        parts.append(f"n{k['n_active']}")
    return " ".join(parts)


@dataclass(frozen=True)
class PointDiff:
    key: tuple
    point_a: int
    point_b: int
    n_a: int  # samples
    n_b: int
    median_a: float  # ms
    median_b: float
    diff: Interval | None  # percent, positive = B slower; None below MIN_SAMPLES on either side
    p_value: float | None
    verdict: Verdict | None

    def to_dict(self) -> dict:
        return {**dict(zip(KEY, self.key)), "point_a": self.point_a, "point_b": self.point_b,
                "samples_a": self.n_a, "samples_b": self.n_b,
                "median_ms_a": _finite(self.median_a), "median_ms_b": _finite(self.median_b),
                "diff_pct": None if self.diff is None else self.diff.to_dict(),
                "p_value": None if self.p_value is None else float(f"{self.p_value:.4g}"),
                "verdict": NOT_ENOUGH if self.verdict is None else self.verdict.value}


@dataclass(frozen=True)
class RunInfo:
    path: Path
    run_id: str | None
    git_sha: str | None
    gpu_name: str | None
    devices: tuple[str, ...]  # device_of over its ok points

    @property
    def name(self) -> str:
        return Path(os.path.abspath(self.path)).name

    def where(self) -> str:
        gpus = self.gpu_name or ("CPU" if any(d.startswith("cpu@") for d in self.devices) else "device unknown")
        sha = (self.git_sha or "no git sha")[:12]
        return f"{self.run_id or self.name}, {sha}, {gpus}"

    def to_dict(self) -> dict:
        return {"path": str(self.path), "run_id": self.run_id, "git_sha": self.git_sha, "gpu_name": self.gpu_name,
                "devices": list(self.devices)}


@dataclass
class Comparison:
    a: RunInfo
    b: RunInfo
    margin_pct: float
    points: list[PointDiff]  # compared, in the order of A's points
    overall: Interval | None  # geometric mean of B/A - 1 (percent) over points with a diff
    across: dict[str, tuple] = field(default_factory=dict)  # setting -> (A's value, B's value): what B changes
    only_a: list[tuple] = field(default_factory=list)  # keys ok in A only
    only_b: list[tuple] = field(default_factory=list)
    other_device: list[tuple] = field(default_factory=list)  # keys in both, never on one device

    def counts(self) -> dict[str, int]:
        out = {v.value: 0 for v in Verdict} | {NOT_ENOUGH: 0}
        for p in self.points:
            out[NOT_ENOUGH if p.verdict is None else p.verdict.value] += 1
        return out

    def vary(self) -> frozenset:
        """The KEY columns whose value differs between compared points (a label needs them)."""
        keys = [p.key for p in self.points] or self.only_a + self.only_b
        return frozenset(c for i, c in enumerate(KEY) if len({k[i] for k in keys}) > 1)

    def slower_beyond(self, pct: float) -> bool:
        """B is slower than A by more than ``pct`` percent with confidence: the overall interval's
        low end lies above it, and above the margin (the interval knows only each run's own
        sampling, not the drift between runs, which the margin stands for)."""
        return self.overall is not None and self.overall.low > max(pct, self.margin_pct)

    def to_dict(self) -> dict:
        vary = self.vary()
        return {
            "run_a": self.a.to_dict(), "run_b": self.b.to_dict(),
            "margin_pct": self.margin_pct, "level": LEVEL,
            "across": {k: {"a": a, "b": b} for k, (a, b) in self.across.items()},
            "overall": {"geomean_diff_pct": None if self.overall is None else self.overall.to_dict(),
                        "verdict": _overall_verdict(self), "compared": len(self.points), **self.counts()},
            "points": [p.to_dict() | {"label": label(p.key, vary)} for p in self.points],
            "only_a": [dict(zip(KEY, k)) for k in self.only_a],
            "only_b": [dict(zip(KEY, k)) for k in self.only_b],
            "other_device": [dict(zip(KEY, k)) for k in self.other_device],
        }


def _overall_verdict(c: Comparison) -> str:
    v = verdict(c.overall, c.margin_pct)
    return NOT_ENOUGH if v is None else v.value


def _finite(x: float) -> float | None:
    return round(float(x), 6) if math.isfinite(x) else None


def run_settings(df: pd.DataFrame) -> dict[str, set]:
    """Each of ``RUN_SETTINGS``'s values over a run's ok points."""
    ok = df[df.status == "ok"].to_dict("records")
    return {c: {_value(r.get(c), c) for r in ok} for c in RUN_SETTINGS}


def settings_across(df_a: pd.DataFrame, df_b: pd.DataFrame) -> dict[str, tuple]:
    """The run settings in which B differs from A as a whole (one value in each run, not the same):
    setting -> (A's, B's)."""
    sa, sb = run_settings(df_a), run_settings(df_b)
    return {c: (next(iter(sa[c])), next(iter(sb[c]))) for c in RUN_SETTINGS
            if len(sa[c]) == 1 and len(sb[c]) == 1 and sa[c] != sb[c]}


def _index(df: pd.DataFrame, across: frozenset = frozenset()) -> dict[tuple, dict[str | None, int]]:
    """key -> device -> point, over the ok points (a repeated (key, device) keeps the last point)."""
    out: dict[tuple, dict[str | None, int]] = {}
    ok = df[df.status == "ok"]
    if "point" not in ok:
        ok = ok.assign(point=ok.index)
    for row in ok.sort_values("point").to_dict("records"):
        out.setdefault(key_of(row, across), {})[device_of(row)] = int(row["point"])
    return out


def _info(run_dir: Path, df: pd.DataFrame) -> RunInfo:
    ok = df[df.status == "ok"]

    def first(col):
        vals = [v for v in ok.get(col, pd.Series(dtype=object)).dropna().unique()]
        return ", ".join(sorted(map(str, vals))) if vals else None

    devices = tuple(sorted({d for d in (device_of(r) for r in ok.to_dict("records")) if d is not None}))
    return RunInfo(Path(run_dir), first("run_id"), first("git_sha"), first("gpu_name"), devices)


def compare_runs(run_a: Path, run_b: Path, margin_pct: float = DEFAULT_MARGIN, n_boot: int = N_BOOT,
                 seed: int = 0) -> Comparison:
    """B against A over their matched points on the same device; when B differs from A as a whole in
    a run setting (``settings_across``: rank 8 against rank 64), matched without it. UserError (one
    line) for a folder that is not a run, a run without samples, or no point to compare."""
    if not margin_pct >= 0 or not math.isfinite(margin_pct):
        raise UserError(f"the margin must be a percentage >= 0, not {margin_pct}")
    df_a, df_b = load_run(run_a), load_run(run_b)
    for run in (run_a, run_b):
        if not has_samples(run):
            raise UserError(f"{run} has no samples/ (measured before lorabench kept raw samples): re-run it")
    info_a, info_b = _info(run_a, df_a), _info(run_b, df_b)
    across = settings_across(df_a, df_b)
    idx_a, idx_b = _index(df_a, frozenset(across)), _index(df_b, frozenset(across))

    pairs, other = [], []
    for key, devs_a in idx_a.items():
        devs_b = idx_b.get(key)
        if devs_b is None:
            continue
        same = [d for d in devs_a if d is not None and d in devs_b]
        if not same:
            other.append(key)
            continue
        d = same[0]  # a run measures a point on one device; several would each be the same point
        pairs.append((key, devs_a[d], devs_b[d]))
    only_a = [k for k in idx_a if k not in idx_b]
    only_b = [k for k in idx_b if k not in idx_a]
    if not pairs:
        why = (f"{len(other)} matching point{'s' * (len(other) != 1)} measured on another device "
               f"(A on {', '.join(info_a.devices) or 'unknown'}, B on {', '.join(info_b.devices) or 'unknown'})"
               if other else "they share no (model, rank, dtype, kernels, max_loras, strategy, mode, c, n, workload)")
        raise UserError(f"{run_a} and {run_b} have no ok points to compare on the same GPU: {why}")

    times_a = step_times(read_samples(run_a, [p for _, p, _ in pairs]))
    times_b = step_times(read_samples(run_b, [p for _, _, p in pairs]))
    empty = np.empty(0)
    samples = {}
    for i, (_, pa, pb) in enumerate(pairs):
        samples[(i, "a")], samples[(i, "b")] = times_a.get(pa, empty), times_b.get(pb, empty)
    # one set of bootstrap draws for every statistic (stats.Resampler): each point's two sides are
    # resampled independently, as relative_difference and geometric_mean_ratio do, and once only
    boot = Resampler(samples, n_boot, seed)
    points, usable = [], []
    for i, (key, pa, pb) in enumerate(pairs):
        a, b = samples[(i, "a")], samples[(i, "b")]
        diff = boot.interval(ratio_pct((i, "a"), (i, "b")))
        p = rank_test(a, b) if diff is not None else None
        points.append(PointDiff(key, pa, pb, len(a), len(b), boot.median((i, "a")), boot.median((i, "b")),
                                diff, p, verdict(diff, margin_pct)))
        if diff is not None:
            usable.append(i)
    if not usable:
        raise UserError(f"{run_a} and {run_b}: no matched point has {MIN_SAMPLES} samples on both sides")

    overall = boot.interval(geomean_ratio_pct([((i, "a"), (i, "b")) for i in usable]))
    return Comparison(info_a, info_b, margin_pct, points, overall, across, only_a, only_b, other)
