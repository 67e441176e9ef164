"""How far a step's LoRA overhead is from its floor.

A step with n active adapters must at least read each active adapter's A and B once (its bytes,
``n · lora_bytes_per_slot``) and run one kernel per LoRA linear (``4 · layers``: qkv, o, gate_up,
down). With the device's bandwidth ``bw`` and the cost ``k`` of one more small kernel in a CUDA
graph, both measured by ``lorabench.runtime.probe`` in the same worker, the floor of what LoRA can add over the
same configuration's n = 0 step is

    floor = n · lora_bytes_per_slot / bw + 4 · layers · k

and a point's distance from it is its measured overhead (step - the n = 0 step) over the floor.
The probe's figures travel with every row (``probe_copy_gbs``, ``probe_kernel_us``).

On an MoE model a step reads only the expert LoRA of the (slot, expert) pairs its tokens route to,
not every expert's: the floor counts n adapters' attention LoRA and ``expert_pairs`` pairs' expert
LoRA (each pair's A and B over every layer).
"""

import pandas as pd

from lorabench.analysis.points import lora_overhead, not_found_wrong
from lorabench.config.models import LORA_LINEARS_PER_LAYER


def expert_pairs(tokens: int, n_active: int, experts: int, top_k: int) -> float:
    """The (slot, expert) pairs a decode step of ``tokens`` adapter tokens over ``n_active``
    adapters routes to, expected when each token picks ``top_k`` of ``experts`` uniformly (random
    router weights do) and the tokens are placed as a fixed point places them (one on each adapter,
    the rest on one of them at random, ``config.batches.fixed_batch``). A slot leaves an expert
    untouched with probability q · E[q^B], q = 1 - top_k / experts, B ~ Binomial(tokens - n_active,
    1 / n_active) its further tokens: q · (1 - (1 - q) / n_active)^(tokens - n_active). One token:
    exactly top_k pairs."""
    if n_active <= 0 or tokens < n_active:
        return 0.0
    q = 1.0 - top_k / experts
    return n_active * experts * (1.0 - q * (1.0 - (1.0 - q) / n_active) ** (tokens - n_active))


def step_lora_bytes(tokens: int, n_active: int, slot_bytes: float, expert_bytes: float, experts: int,
                    top_k: int) -> float:
    """The adapter bytes an MoE decode step of ``tokens`` adapter tokens over ``n_active`` adapters
    must read: their attention LoRA (``slot_bytes - expert_bytes`` each) and the expert LoRA of the
    (slot, expert) pairs its tokens route to (``expert_bytes / experts`` each, every layer's)."""
    pairs = expert_pairs(tokens, n_active, experts, top_k)
    return n_active * (slot_bytes - expert_bytes) + pairs * expert_bytes / experts


def lora_bytes(pts: pd.DataFrame) -> pd.Series:
    """The adapter bytes each point's step must read: n adapters' whole A and B on a dense model; on
    an MoE model ``step_lora_bytes``."""
    out = (pts.n_active * pts.lora_bytes_per_slot).astype(float)
    if "expert_lora_bytes_per_slot" not in pts:
        return out
    moe = pts.expert_lora_bytes_per_slot.notna() & pts.experts.notna() & pts.top_k.notna()
    for i, r in pts[moe].iterrows():
        out[i] = step_lora_bytes(int(r.concurrency), int(r.n_active), r.lora_bytes_per_slot,
                                 r.expert_lora_bytes_per_slot, int(r.experts), int(r.top_k))
    return out


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
    pts["lora_mb"] = lora_bytes(pts) / 1e6
    pts["min_kernels"] = LORA_LINEARS_PER_LAYER * pts.layers
    pts["bandwidth_gbs"] = bandwidth_gbs(pts)
    pts["bytes_us"] = pts.lora_mb * 1e6 / (pts.bandwidth_gbs * 1e9) * 1e6
    pts["kernels_us"] = pts.min_kernels * pts.probe_kernel_us
    pts["floor_ms"] = (pts.bytes_us + pts.kernels_us) / 1e3
    pts["overhead_ms"] = pts.step_ms_median - pts.base_ms
    pts["x_floor"] = pts.overhead_ms / pts.floor_ms
    return pts
