"""What the roofline's floor is built from, measured on the worker's own GPU after capture:
device-to-device copy bandwidth, an in-place add's (read + write of float32, as a LoRA expand
updates its output), and the cost of one more small kernel in a CUDA graph (the
``probe_copy_gbs``, ``probe_rmw_gbs`` and ``probe_kernel_us`` columns; ``lorabench.analysis.roofline``
prices bytes at the faster of the two bandwidths: a floor must not be beaten by a streaming kernel)."""

import numpy as np
import torch

from lorabench.runtime.graphs import capture_graph
from lorabench.runtime.timing import replay_times


def probe(graph_kernels: int = 256, copy_mib: int = 512, replays: int = 50) -> dict:
    """Copy bandwidth (read + write, GB/s) of a ``copy_mib`` copy in a graph, that of an in-place
    add over the same bytes (float32), and the cost (us)
    of one more tiny kernel in a graph: a graph of ``graph_kernels`` one-element adds against a
    graph of one. Each the median of ``replays`` replays, each waited for."""
    t = {"src": torch.empty(copy_mib * 2**20, dtype=torch.uint8, device="cuda"), "x": torch.zeros(1, device="cuda")}
    t["dst"] = torch.empty_like(t["src"])
    rmw = t["dst"].view(torch.float32)
    bodies = {"copy": lambda: t["dst"].copy_(t["src"]), "rmw": lambda: rmw.add_(1.0), "one": lambda: t["x"].add_(1),
              "many": lambda: [t["x"].add_(1) for _ in range(graph_kernels)]}
    ms = {name: float(np.median(replay_times(capture_graph(body), replays, wait_each=True))) for name, body in bodies.items()}
    t.clear()  # the tensors go before the cache is emptied
    torch.cuda.empty_cache()
    return {"probe_copy_gbs": 2 * copy_mib * 2**20 / (ms["copy"] * 1e-3) / 1e9,
            "probe_rmw_gbs": 2 * copy_mib * 2**20 / (ms["rmw"] * 1e-3) / 1e9,
            "probe_kernel_us": (ms["many"] - ms["one"]) * 1e3 / (graph_kernels - 1)}
