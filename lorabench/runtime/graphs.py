"""Capturing CUDA graphs safely: the one rule every capture in lorabench follows."""

import gc
from collections.abc import Callable
from contextlib import contextmanager

import torch


@contextmanager
def no_collection(collect_first: bool = True):
    """No automatic collection of Python's cyclic garbage until the block ends (and, with
    ``collect_first``, one collection now). A collection during capture can destroy an unrelated
    CUDA graph held by dead objects, which CUDA forbids while a stream captures: the capture in
    progress is invalidated ("operation failed due to a previous error during capture")."""
    if collect_first:
        gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def capture_graph(warm: Callable[[], object], body: Callable[[], object] | None = None) -> "torch.cuda.CUDAGraph":
    """Run ``warm`` once off the capture stream (compiles, as torch advises), then capture ``body``
    (default: ``warm``) into a CUDA graph. No upfront collection: the tune captures a graph per
    config, and a full collection each time would eat its budget."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        warm()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with no_collection(collect_first=False), torch.cuda.graph(graph):
        (body or warm)()
    return graph


class _DeviceMemory:
    """A CUDA array interface over a tensor's memory that owns nothing (torch.as_tensor reads it)."""

    def __init__(self, t: torch.Tensor):
        size = t.element_size()
        self.__cuda_array_interface__ = {
            "shape": tuple(t.shape), "typestr": f"<i{size}", "data": (t.data_ptr(), False), "version": 3,
            "strides": tuple(s * size for s in t.stride()),
        }


def weak_view(t: torch.Tensor) -> torch.Tensor:
    """A view of ``t``'s memory that does not keep it allocated (vLLM's ``weak_ref_tensors``): a
    captured graph's output its caller reads after each replay, while the pool may hand the
    block to later captures. On the CPU (no graphs, no pool) ``t`` itself."""
    if t.device.type != "cuda":
        return t
    return torch.as_tensor(_DeviceMemory(t), device=t.device).view(t.dtype)
