"""How far a step's LoRA overhead is from its floor.

A step with n active adapters must at least read each active adapter's A and B once (its bytes,
``n · lora_bytes_per_slot``) and run one kernel per LoRA linear (``4 · layers``: qkv, o, gate_up,
down). With the device's bandwidth ``bw`` and the cost ``k`` of one more small kernel in a CUDA
graph, both measured by ``lorabench.runtime.probe`` in the same worker, the floor of what LoRA can add over the
same configuration's n = 0 step is

    floor = n · lora_bytes_per_slot / bw + 4 · layers · k

and a point's distance from it is its measured overhead (step - the n = 0 step) over the floor.
The probe's figures travel with every row (``probe_copy_gbs``, ``probe_kernel_us``).
"""

import pandas as pd

from lorabench.analysis.points import lora_overhead, not_found_wrong
from lorabench.config.models import LORA_LINEARS_PER_LAYER


def bandwidth_gbs(pts: pd.DataFrame) -> pd.Series:
    """The bandwidth a floor prices bytes at: the faster of the worker's copy and in-place add
    (rows from before the add's probe: the copy's)."""
    if "probe_rmw_gbs" not in pts:
        return pts.probe_copy_gbs
    return pts[["probe_copy_gbs", "probe_rmw_gbs"]].max(axis=1)


def floors(df: pd.DataFrame) -> pd.DataFrame:
    """Fixed GPU points with n > 0 of configurations not found wrong: LoRA bytes read per step,
    the floor they and the minimum kernel count imply, the measured overhead, and overhead /
    floor. Empty without probe data."""
    if "probe_copy_gbs" not in df or df.probe_copy_gbs.isna().all():
        return pd.DataFrame()
    pts = lora_overhead(df)
    pts = pts[(pts.n_active > 0) & pts.probe_copy_gbs.notna() & pts.base_ms.notna()].copy()
    pts = not_found_wrong(pts)
    if pts.empty:
        return pts
    pts["lora_mb"] = pts.n_active * pts.lora_bytes_per_slot / 1e6
    pts["min_kernels"] = LORA_LINEARS_PER_LAYER * pts.layers
    pts["bandwidth_gbs"] = bandwidth_gbs(pts)
    pts["bytes_us"] = pts.lora_mb * 1e6 / (pts.bandwidth_gbs * 1e9) * 1e6
    pts["kernels_us"] = pts.min_kernels * pts.probe_kernel_us
    pts["floor_ms"] = (pts.bytes_us + pts.kernels_us) / 1e3
    pts["overhead_ms"] = pts.step_ms_median - pts.base_ms
    pts["x_floor"] = pts.overhead_ms / pts.floor_ms
    return pts
