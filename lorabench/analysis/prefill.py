"""Prefill points: what LoRA adds to a step of T prompt tokens, against its floor and across kernels.

A prefill point's LoRA overhead is its step time minus the same configuration's step of the same T
tokens with no adapter (n = 0: the base model alone, no LoRA kernels). Its floor is what any LoRA
that runs beside the base GEMMs must move through device memory, over the worker's measured copy
bandwidth, plus one kernel per LoRA linear (``analysis.roofline``'s launch term):

    floor = (n · lora_bytes_per_slot + T · lora_io_bytes_per_token) / bw + 4 · layers · k

``lora_io_bytes_per_token``: each LoRA linear's input read once (the shrink) and its output read
and written once (the expand adds into it). At decode sizes the adapters' bytes dominate; at
thousands of tokens the activations' do, which only LoRA inside the base GEMM (its epilogue) avoids.
The arithmetic (2 · T · rank · (K + N) per linear) is left out: at the ranks LoRA uses it takes a
fraction of the traffic's time.
"""

import pandas as pd

from lorabench.analysis.intervals import interval_of
from lorabench.analysis.points import CONFIG, not_found_wrong, ok_points
from lorabench.analysis.roofline import bandwidth_gbs
from lorabench.config.models import LORA_LINEARS_PER_LAYER
from lorabench.config.plan import PREFILL

KEY = CONFIG + ["prefill_tokens"]


def prefill_overhead(df: pd.DataFrame) -> pd.DataFrame:
    """Prefill points with their configuration's n = 0 step at the same prompt tokens (``base_ms``,
    ``base_point``), ``overhead_ms`` and ``overhead_pct``; with the probe's figures and the rows'
    byte counts also ``floor_ms`` and ``x_floor`` (n > 0). Empty when the run has none."""
    pts = not_found_wrong(ok_points(df))
    pts = pts[pts["mode"] == PREFILL].copy()
    if pts.empty:
        return pts
    base = pts[pts.n_active == 0].drop_duplicates(KEY).set_index(KEY)
    key = pd.MultiIndex.from_frame(pts[KEY])
    pts["base_ms"] = base.step_ms_median.reindex(key).to_numpy()
    pts["base_point"] = base.point.reindex(key).to_numpy()
    pts["overhead_ms"] = pts.step_ms_median - pts.base_ms
    pts["overhead_pct"] = 100 * pts.overhead_ms / pts.base_ms
    pts["floor_ms"] = float("nan")
    if "lora_io_bytes_per_token" in pts and "probe_copy_gbs" in pts:
        moved = pts.n_active * pts.lora_bytes_per_slot + pts.prefill_tokens * pts.lora_io_bytes_per_token
        launches = (pts.n_active > 0) * LORA_LINEARS_PER_LAYER * pts.layers * pts.probe_kernel_us
        pts["floor_ms"] = (moved / (bandwidth_gbs(pts) * 1e9) * 1e3 + launches / 1e3).where(pts.n_active > 0)
    pts["x_floor"] = pts.overhead_ms / pts.floor_ms
    return pts


def overhead_ratio(samples, ours: pd.Series, theirs: pd.Series) -> tuple[float, tuple | None]:
    """One backend's LoRA overhead over another's at one point, (ours_n - ours_0) / (theirs_n -
    theirs_0), and its 95 % interval as (low, high) from the four points' samples (None without)."""
    ratio = ours.overhead_ms / theirs.overhead_ms
    a, a0, b, b0 = (int(ours.point), int(ours.base_point), int(theirs.point), int(theirs.base_point))
    iv, _ = interval_of(samples, lambda m: (m[a] - m[a0]) / (m[b] - m[b0]), (a, a0, b, b0))
    return ratio, (None if iv is None else (iv.low, iv.high))
