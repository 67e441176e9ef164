"""The graph dispatcher: one decode-step graph per (batch bucket, launch count), and the rule
that picks one for each batch.

Dispatch (DESIGN.md): bucket = smallest capture size >= the batch's tokens; launch count =
smallest captured count >= the batch's active count n; n = 0 uses the no-LoRA graph (no LoRA
kernels at all); a batch larger than every capture size runs eagerly with launch count n.
Because ``active_slots`` lists only adapter slots (never the base slot -1), a launch count >= n
serves every adapter token, whatever mix of base and adapter requests the batch holds.

With ``use_graphs=False`` (the CPU path) every key maps to an eager callable that runs the
same padded shapes with the same launch count, so dispatch is exercised identically.
"""

import bisect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lorabench.kernels import get_backend
from lorabench.lora_meta import MetaBuffer
from lorabench.model import LlamaLoRA, LoRAStep


def choose_bucket(tokens: int, capture_sizes: list[int]) -> int | None:
    """Smallest capture size >= tokens, or None when the batch must run eagerly."""
    i = bisect.bisect_left(capture_sizes, tokens)
    return capture_sizes[i] if i < len(capture_sizes) else None


def choose_launch(n_active: int, counts: list[int]) -> int:
    """Smallest captured launch count >= n_active; 0 (the no-LoRA graph) when n_active = 0."""
    if n_active == 0:
        return 0
    i = bisect.bisect_left(counts, n_active)
    if i == len(counts):
        raise ValueError(f"{n_active} active adapters exceed the largest captured count {counts[-1]}")
    return counts[i]


@dataclass(frozen=True)
class Route:
    """Where a batch goes: ``tokens`` is the bucket (or the batch itself when eager)."""

    tokens: int
    launch: int
    graphed: bool


@dataclass
class Prepared:
    """A batch ready to launch: its packed metadata and its route."""

    packed: list[int]
    n_active: int
    batch_tokens: int
    route: Route


class _GraphRunner:
    def __init__(self, graph: torch.cuda.CUDAGraph, output: torch.Tensor):
        self.graph, self.output = graph, output

    def __call__(self) -> torch.Tensor:
        self.graph.replay()
        return self.output


class Dispatcher:
    def __init__(
        self,
        model: LlamaLoRA,
        backend,
        *,
        max_loras: int,
        capture_sizes: list[int],
        counts: list[int],
        use_graphs: bool,
        lora_scale: float = 1.0,
        seed: int = 0,
    ):
        if max(capture_sizes) > model.max_tokens:
            raise ValueError(f"capture size {max(capture_sizes)} exceeds the model's {model.max_tokens} token slots")
        if counts[-1] != max_loras:
            raise ValueError(f"captured counts {counts} must end at max_loras={max_loras}")
        device = model.embed.device
        self.model, self.backend, self.scale = model, backend, lora_scale
        self.max_loras, self.use_graphs = max_loras, use_graphs
        self.capture_sizes = sorted(set(capture_sizes))
        self.counts = sorted(set(counts))
        self.meta_buf = MetaBuffer(model.max_tokens, max_loras, device)
        gen = torch.Generator(device=device).manual_seed(seed)
        self.input_ids = torch.randint(0, model.cfg.vocab, (model.max_tokens,), device=device, generator=gen)
        self.positions = torch.full((model.max_tokens,), model.context_len - 1, device=device)
        # Only reachable keys: a bucket of b tokens never holds more than b active adapters, so
        # e.g. (bucket 1, launch 4) would cost capture time and memory and never run.
        # Largest first, so smaller graphs reuse the shared pool's blocks.
        self.keys = [
            (b, c)
            for b in reversed(self.capture_sizes)
            for c in sorted({0} | {choose_launch(n, self.counts) for n in range(1, min(b, max_loras) + 1)}, reverse=True)
        ]
        self.runners: dict[tuple[int, int], Callable[[], torch.Tensor]] = {}
        self.pool = None

    # -- building ---------------------------------------------------------------------------
    def forward(self, tokens: int, launch: int, backend=None) -> torch.Tensor:
        """One eager decode step over the first ``tokens`` static inputs at ``launch``."""
        backend = backend or self.backend
        lora = None if launch == 0 else LoRAStep(backend, self.meta_buf.meta, launch, self.scale)
        return self.model(self.input_ids[:tokens], self.positions[:tokens], lora)

    def warm_up(self) -> None:
        """Run every key once eagerly: compiles the Triton kernels each key needs."""
        for tokens, launch in self.keys:
            self.forward(tokens, launch)
        if self.use_graphs:
            torch.cuda.synchronize()

    def capture(self) -> None:
        """Capture every key as a CUDA graph in one shared pool, or bind eager callables."""
        if not self.use_graphs:
            for key in self.keys:
                self.runners[key] = lambda key=key: self.forward(*key)
            return
        self.pool = torch.cuda.graph_pool_handle()
        for key in self.keys:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                output = self.forward(*key)
            self.runners[key] = _GraphRunner(graph, output)
        torch.cuda.synchronize()

    # -- per step ---------------------------------------------------------------------------
    def route(self, tokens: int, n_active: int) -> Route:
        bucket = choose_bucket(tokens, self.capture_sizes)
        if bucket is None:
            return Route(tokens, n_active, graphed=False)
        return Route(bucket, choose_launch(n_active, self.counts), graphed=True)

    def prepare(self, slots: list[int]) -> Prepared:
        """Host work of a step: build the metadata and choose the graph."""
        packed, n = self.meta_buf.pack(slots)
        return Prepared(packed, n, len(slots), self.route(len(slots), n))

    def run(self, route: Route) -> torch.Tensor:
        """Replay the route's graph (or run it eagerly) over the metadata already loaded."""
        return self.runners[(route.tokens, route.launch)]() if route.graphed else self.forward(route.tokens, route.launch)

    def launch(self, prep: Prepared) -> torch.Tensor:
        """Copy the metadata in and run the chosen graph; returns logits [batch tokens, vocab]."""
        self.meta_buf.load(prep.packed)
        return self.run(prep.route)[: prep.batch_tokens]

    def reference(self, slots: list[int], input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The eager plain-torch answer for exactly this batch (no padding, no launch count)."""
        if input_ids is not None:
            self.input_ids[: len(slots)].copy_(input_ids)
        self.meta_buf.load(self.meta_buf.pack(slots)[0])
        return self.forward(len(slots), self.max_loras, backend=get_backend("reference"))

    @property
    def num_graphs(self) -> int:
        return len(self.keys)
