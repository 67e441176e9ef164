"""How far a step's LoRA overhead is from its floor.

A step with n active adapters must at least read each active adapter's A and B once (its bytes,
``n · lora_bytes_per_slot``) and run one kernel per LoRA linear (``4 · layers``: qkv, o, gate_up,
down). With the device's bandwidth ``bw`` and the cost ``k`` of one more small kernel in a CUDA
graph, both measured by ``probe`` in the same worker, the floor of what LoRA can add over the
same configuration's n = 0 step is

    floor = n · lora_bytes_per_slot / bw + 4 · layers · k

and a point's distance from it is its measured overhead (step - the n = 0 step) over the floor.
The probe's figures travel with every row (``probe_copy_gbs``, ``probe_kernel_us``).
"""

import numpy as np
import pandas as pd

from lorabench.analysis import lora_overhead

LORA_LINEARS_PER_LAYER = 4


def replay_ms(graph) -> float:
    """One replay of a CUDA graph between CUDA events, waited for (ms)."""
    import torch

    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    graph.replay()
    e.record()
    e.synchronize()
    return s.elapsed_time(e)


def _graph_ms(graph, replays: int = 50) -> float:
    """Median ms of one replay over ``replays``."""
    return float(np.median([replay_ms(graph) for _ in range(replays)]))


def probe(kernels: int = 256, copy_mib: int = 512) -> dict:
    """Measure on the current GPU: device-to-device copy bandwidth (read + write, GB/s) and the
    cost of one more tiny kernel inside a CUDA graph (us): a graph of ``kernels`` one-element
    adds against a graph of one."""
    import torch

    t = {"src": torch.empty(copy_mib * 2**20, dtype=torch.uint8, device="cuda"), "x": torch.zeros(1, device="cuda")}
    t["dst"] = torch.empty_like(t["src"])
    bodies = {"copy": lambda: t["dst"].copy_(t["src"]), "one": lambda: t["x"].add_(1),
              "many": lambda: [t["x"].add_(1) for _ in range(kernels)]}
    graphs = {}
    for name, body in bodies.items():
        body()  # warm up outside capture
        torch.cuda.synchronize()
        graphs[name] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[name]):
            body()
    copy_ms, one_ms, many_ms = (_graph_ms(graphs[name]) for name in ("copy", "one", "many"))
    t.clear()
    graphs.clear()
    torch.cuda.empty_cache()
    return {"probe_copy_gbs": 2 * copy_mib * 2**20 / (copy_ms * 1e-3) / 1e9,
            "probe_kernel_us": (many_ms - one_ms) * 1e3 / (kernels - 1)}


def floors(df: pd.DataFrame) -> pd.DataFrame:
    """Fixed GPU points with n > 0 of configurations not found wrong: LoRA bytes read per step,
    the floor they and the minimum kernel count imply, the measured overhead, and overhead /
    floor. Empty without probe data."""
    if "probe_copy_gbs" not in df or df.probe_copy_gbs.isna().all():
        return pd.DataFrame()
    pts = lora_overhead(df)
    pts = pts[(pts.n_active > 0) & pts.probe_copy_gbs.notna() & pts.base_ms.notna()].copy()
    if "correct" in pts:  # a configuration that failed its check may look fast by skipping work
        pts = pts[~pts.correct.eq(False)]
    if pts.empty:
        return pts
    pts["lora_mb"] = pts.n_active * pts.lora_bytes_per_slot / 1e6
    pts["min_kernels"] = LORA_LINEARS_PER_LAYER * pts.layers
    pts["bytes_us"] = pts.lora_mb * 1e6 / (pts.probe_copy_gbs * 1e9) * 1e6
    pts["kernels_us"] = pts.min_kernels * pts.probe_kernel_us
    pts["floor_ms"] = (pts.bytes_us + pts.kernels_us) / 1e3
    pts["overhead_ms"] = pts.step_ms_median - pts.base_ms
    pts["x_floor"] = pts.overhead_ms / pts.floor_ms
    return pts
