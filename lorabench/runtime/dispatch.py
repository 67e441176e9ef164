"""The graph dispatcher: one decode-step graph per (batch bucket, launch count), and the rule
that picks one for each batch.

Dispatch (``lorabench.config.strategies``): bucket = smallest capture size >= the batch's tokens;
launch count = smallest captured count >= the batch's active count n; n = 0 uses the no-LoRA
graph (no LoRA kernels at all); a batch larger than every capture size runs eagerly with launch
count n.
Because ``active_slots`` lists only adapter slots (never the base slot -1), a launch count >= n
serves every adapter token, whatever mix of base and adapter requests the batch holds.

How a batch's metadata is built, which keys are captured and which key a batch uses are the
dispatcher's *rules*: ``LorabenchRules`` here, or ``lorabench.runtime.vllm_rules.VllmRules``, which
reproduces vLLM's runner (its count includes the base-model id) for its own kernels.

Mixed steps (prefill chunks and decode tokens, a ``MixedLayout``) have their own set, as vLLM's
PIECEWISE graphs: one per (bucket of ``mixed_sizes``, key) under the same rules, each the model's
pieces split at attention (``runtime.piecewise_graphs``); a mixed step past the largest size runs
eagerly. Uniform decode steps keep their FULL graphs.

With ``use_graphs=False`` (the CPU path) every key maps to an eager callable that runs the
same padded shapes with the same launch count, so dispatch is exercised identically.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lorabench.config.strategies import choose_bucket, choose_launch
from lorabench.kernels import get_backend
from lorabench.runtime.graphs import no_collection
from lorabench.runtime.lora_meta import MetaBuffer
from lorabench.runtime.mixed_attention import MixedLayout, index_of
from lorabench.runtime.model import LlamaLoRA, LoRAStep
from lorabench.runtime.piecewise_graphs import PiecewiseStep


@dataclass(frozen=True)
class Route:
    """Where a batch goes: ``tokens`` is the bucket (or the batch itself when eager); ``launch``
    is the dispatch key (lorabench: the launch count; vLLM: its rounded adapter count); ``mixed``:
    a mixed step's (PIECEWISE graphs or eager), else a decode step's (FULL graphs or eager)."""

    tokens: int
    launch: int
    graphed: bool
    mixed: bool = False


@dataclass(frozen=True)
class MixedBatch:
    """A mixed step to run: each token's slot, in the layout's order, and the layout."""

    slots: list[int]
    layout: MixedLayout


@dataclass
class Prepared:
    """A batch ready to launch: its packed metadata and its route."""

    packed: object
    n_active: int
    batch_tokens: int
    route: Route
    layout: MixedLayout | None = None  # a mixed step's pieces


class LorabenchRules:
    """lorabench's own rules: metadata packed on the host and sent in one copy; keys are launch
    counts (the capture set); a batch with n active adapters uses the smallest key >= n.

    ``bucket_grid`` (strategy ``agnostic``): one LoRA graph per bucket, launched with
    min(bucket, max_loras) programs on the adapter axis, as many adapters as a batch of that
    size can hold, so it serves every n without knowing it."""

    def __init__(self, counts: list[int], max_loras: int, max_tokens: int, device, bucket_grid: bool = False):
        if counts[-1] != max_loras:
            raise ValueError(f"captured counts {counts} must end at max_loras={max_loras}")
        self.counts, self.max_loras, self.bucket_grid = sorted(set(counts)), max_loras, bucket_grid
        self.meta_buf = MetaBuffer(max_tokens, max_loras, device)
        self.meta = self.meta_buf.meta

    def keys(self, bucket: int) -> list[int]:
        """Only reachable keys: a bucket of b tokens never holds more than b active adapters, so
        e.g. (bucket 1, launch 4) would cost capture time and memory and never run."""
        return sorted({0} | {self.key(n, bucket) for n in range(1, min(bucket, self.max_loras) + 1)}, reverse=True)

    def key(self, n_active: int, bucket: int | None = None) -> int:
        if self.bucket_grid and bucket is not None and n_active > 0:
            return min(bucket, self.max_loras)
        return choose_launch(n_active, self.counts)

    def pack(self, slots: list[int]) -> tuple[list[int], int]:
        return self.meta_buf.pack(slots)

    def load(self, packed: list[int]) -> None:
        self.meta_buf.load(packed)

    def arm(self, tokens: int, key: int) -> int:
        """Before warming up or capturing a key: the grid it is launched with (its key)."""
        return key

    def eager_key(self, n_active: int) -> int:
        return n_active

    def captured_meta(self, grid: int):
        """The metadata an eager stand-in for a captured graph runs with (the grid is the key)."""
        return self.meta

    def eager_grid(self, route: Route) -> int:
        return route.launch


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
        rules=None,
        bucket_grid: bool = False,
        slot_rank: torch.Tensor | None = None,
        mixed_sizes: list[int] = (),
    ):
        """slot_rank: each slot's own rank, for kernels that skip the padding (``LoRAMeta.slot_rank``;
        None: they compute every adapter at the weights' rank, as vLLM does). mixed_sizes: the
        buckets of the mixed steps' PIECEWISE graphs (empty: none captured, mixed steps run eagerly)."""
        if max(capture_sizes + list(mixed_sizes)) > model.max_tokens:
            raise ValueError(f"capture size {max(capture_sizes + list(mixed_sizes))} exceeds the model's "
                             f"{model.max_tokens} token slots")
        device = model.embed.device
        self.model, self.backend, self.scale, self.slot_rank = model, backend, lora_scale, slot_rank
        self.max_loras, self.use_graphs = max_loras, use_graphs
        self.capture_sizes = sorted(set(capture_sizes))
        self.rules = rules or LorabenchRules(counts, max_loras, model.max_tokens, device, bucket_grid)
        self.counts = self.rules.counts
        # The reference reads only each token's slot: lorabench's metadata serves it for any rules.
        self.ref_buf = getattr(self.rules, "meta_buf", None) or MetaBuffer(model.max_tokens, max_loras, device)
        gen = torch.Generator(device=device).manual_seed(seed)
        self.input_ids = torch.randint(0, model.cfg.vocab, (model.max_tokens,), device=device, generator=gen)
        self.positions = torch.full((model.max_tokens,), model.context_len - 1, device=device)
        # Largest first, so smaller graphs reuse the shared pool's blocks.
        self.keys = [(b, c) for b in reversed(self.capture_sizes) for c in self.rules.keys(b)]
        self.grid: dict[tuple[int, int], int] = {}  # key -> the launch count its kernels were launched with
        self.runners: dict[tuple[int, int], Callable[[], torch.Tensor]] = {}
        self.pool = None
        self.mixed_sizes = sorted(set(mixed_sizes))
        self.mixed_keys = [(b, c) for b in reversed(self.mixed_sizes) for c in self.rules.keys(b)]
        self.mixed_grid: dict[tuple[int, int], int] = {}
        self.mixed_runners: dict[tuple[int, int], PiecewiseStep] = {}
        self.attn = model.attention_buffer(model.max_tokens)  # what a mixed step's attention writes for the piece after it

    # -- building ---------------------------------------------------------------------------
    def lora_step(self, launch: int, backend=None, meta=None) -> LoRAStep | None:
        """What a step at ``launch`` applies LoRA with (0: nothing, the base model)."""
        backend = backend or self.backend
        meta = self.rules.meta if meta is None else meta
        if self.slot_rank is not None:
            meta = meta._replace(slot_rank=self.slot_rank)
        return None if launch == 0 else LoRAStep(backend, meta, launch, self.scale)

    def forward(self, tokens: int, launch: int, backend=None, meta=None, layout: MixedLayout | None = None) -> torch.Tensor:
        """One eager step over the first ``tokens`` static inputs at ``launch`` (0: the base
        model, no LoRA kernels at all): a decode step, or with ``layout`` a mixed one."""
        lora = self.lora_step(launch, backend, meta)
        return self.model(self.input_ids[:tokens], None if layout else self.positions[:tokens], lora, layout)

    def _pieces(self, key: tuple[int, int], meta=None) -> PiecewiseStep:
        tokens, launch = key
        return PiecewiseStep(self.model, self.input_ids[:tokens], self.attn, lambda: self.lora_step(launch, meta=meta))

    def warm_up(self) -> None:
        """Run every key once eagerly, mixed ones too: compiles the Triton kernels each key needs."""
        for tokens, launch in self.keys:
            self.rules.arm(tokens, launch)
            self.forward(tokens, launch)
        for key in self.mixed_keys:
            self.rules.arm(*key)
            self._pieces(key).run_eager()
        if self.mixed_keys:  # attention between the pieces (skipped above): one token of layer 0, row 0
            self.model.attention(0, self.model.first_piece(self.input_ids[:1], None)[1], None, None,
                                 MixedLayout((0,), (1,), (0,), (0,)))
        if self.use_graphs:
            torch.cuda.synchronize()

    def eager_steps(self, batches: "list[list[int]] | list[MixedBatch]") -> list[tuple[object, Prepared]]:
        """The first batch of each eager route among ``batches`` (decode and mixed apart, then by
        token count and launch count), each with its prepared step: what ``warm_eager`` runs."""
        first: dict[tuple[bool, int, int], tuple[object, Prepared]] = {}
        for batch in batches:
            mixed = isinstance(batch, MixedBatch)
            tokens = len(batch.slots) if mixed else len(batch)
            if choose_bucket(tokens, self.mixed_sizes if mixed else self.capture_sizes) is None:
                prep = self.prepare_step(batch)
                first.setdefault((mixed, tokens, prep.route.launch), (batch, prep))
        return list(first.values())

    def warm_eager(self, batches: "list[list[int]] | list[MixedBatch]") -> int:
        """Run one untimed step of each eager route among ``batches``; returns how many.
        Why: an eager step at a token count or launch count not run before JIT-compiles kernels
        (Triton specialises on them, and the kernels' configs are chosen by them) inside whichever
        step meets it first; in a serving loop on an H100 such steps took 0.4-1.2 s against ~60 ms,
        and keyed by token count alone one step of 1615 tokens at a new launch count still took 1 s."""
        todo = self.eager_steps(batches)
        for _, prep in todo:
            self.launch(prep)
        if self.use_graphs and todo:
            torch.cuda.synchronize()
        return len(todo)

    def capture(self) -> None:
        """Capture every key as a CUDA graph in one shared pool, or bind eager callables.
        Before each key the rules set up the metadata the server would capture it with."""
        if not self.use_graphs:
            for key in self.keys:
                self.grid[key] = self.rules.arm(*key)
                meta = self.rules.captured_meta(self.grid[key])  # the grid stays what capture saw
                self.runners[key] = lambda key=key, meta=meta: self.forward(*key, meta=meta)
            return
        self.pool = self.pool or torch.cuda.graph_pool_handle()
        with no_collection():
            for key in self.keys:
                self.grid[key] = self.rules.arm(*key)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    output = self.forward(*key)
                self.runners[key] = _GraphRunner(graph, output)
        torch.cuda.synchronize()

    def capture_mixed(self) -> None:
        """Capture every mixed key's pieces (PIECEWISE graphs) in the shared pool, or bind their
        eager stand-ins; each key's metadata set up by the rules first, as for ``capture``."""
        if self.use_graphs and self.mixed_keys:
            self.pool = self.pool or torch.cuda.graph_pool_handle()
        with no_collection():
            for key in self.mixed_keys:
                self.mixed_grid[key] = self.rules.arm(*key)
                if not self.use_graphs:
                    self.mixed_runners[key] = self._pieces(key, meta=self.rules.captured_meta(self.mixed_grid[key]))
                    continue
                pieces = self.mixed_runners[key] = self._pieces(key)
                pieces.capture(self.pool)
        if self.use_graphs:
            torch.cuda.synchronize()

    # -- per step ---------------------------------------------------------------------------
    def route(self, tokens: int, n_active: int) -> Route:
        """A decode step's: its FULL graph, or eager past the largest capture size."""
        bucket = choose_bucket(tokens, self.capture_sizes)
        if bucket is None:
            return Route(tokens, self.rules.eager_key(n_active), graphed=False)
        return Route(bucket, self.rules.key(n_active, bucket), graphed=True)

    def route_mixed(self, tokens: int, n_active: int) -> Route:
        """A mixed step's: its PIECEWISE graphs, or eager past the largest mixed size."""
        bucket = choose_bucket(tokens, self.mixed_sizes)
        if bucket is None:
            return Route(tokens, self.rules.eager_key(n_active), graphed=False, mixed=True)
        return Route(bucket, self.rules.key(n_active, bucket), graphed=True, mixed=True)

    def grid_of(self, route: Route) -> int:
        """The launch count the route's LoRA kernels run with (after its metadata is loaded)."""
        if not route.graphed:
            return self.rules.eager_grid(route)
        return (self.mixed_grid if route.mixed else self.grid)[(route.tokens, route.launch)]

    def prepare(self, slots: list[int], layout: MixedLayout | None = None) -> Prepared:
        """Host work of a step: build the metadata and choose the graph. layout: a mixed step's
        pieces (``slots`` then holds each of its tokens' slot, in the layout's order)."""
        if layout is not None and layout.tokens != len(slots):
            raise ValueError(f"{len(slots)} token slots for a layout of {layout.tokens} tokens")
        packed, n = self.rules.pack(slots)
        route = self.route(len(slots), n) if layout is None else self.route_mixed(len(slots), n)
        return Prepared(packed, n, len(slots), route, layout)

    def prepare_step(self, batch: "list[int] | MixedBatch") -> Prepared:
        """``prepare`` for a decode batch (its slots) or a mixed one."""
        return self.prepare(batch.slots, batch.layout) if isinstance(batch, MixedBatch) else self.prepare(batch)

    def load(self, prep: Prepared) -> None:
        """Send the batch's metadata to the device (vLLM's rules also build it there)."""
        self.rules.load(prep.packed)

    def run(self, route: Route, layout: MixedLayout | None = None, every_token: bool = False) -> torch.Tensor:
        """Replay the route's graph (or run it eagerly) over the metadata already loaded. A decode
        step: the bucket's logits. A mixed route needs its step's ``layout`` and returns the logits
        of each piece's last token, as vLLM samples them (``every_token``: of all its tokens)."""
        if not route.mixed:
            return self.runners[(route.tokens, route.launch)]() if route.graphed else self.forward(route.tokens, route.launch)
        pieces = self.mixed_runners[(route.tokens, route.launch)] if route.graphed else self._pieces((route.tokens, route.launch))
        h = pieces(layout)
        if every_token:
            return self.model.logits(h[: layout.tokens])
        return self.model.logits(h[index_of(layout, h.device).last])

    def launch(self, prep: Prepared, every_token: bool = False) -> torch.Tensor:
        """Copy the metadata in and run the chosen graph; returns logits [batch tokens, vocab]
        (a mixed step's: [pieces, vocab], or with ``every_token`` [tokens, vocab])."""
        self.load(prep)
        out = self.run(prep.route, prep.layout, every_token)
        return out if prep.layout is not None else out[: prep.batch_tokens]

    def reference(self, slots: list[int], input_ids: torch.Tensor | None = None, reuse_routing: bool = False,
                  layout: MixedLayout | None = None, rounded: bool = False) -> torch.Tensor:
        """The eager plain-torch answer for exactly this batch (no padding, no launch count); with
        ``layout``, of this mixed step (its attention writes the same cache positions the
        launched step wrote, so the two read the same context).
        It overwrites the metadata: launch the next batch with ``launch``, which reloads it.
        reuse_routing: MoE layers send each token to the experts the last launched step chose
        (``runtime.moe``), so the answer differs from that step's only by its LoRA.
        rounded: the reference with its shrink's output in the model's dtype (``reference.ROUNDED``)."""
        if input_ids is not None:
            self.input_ids[: len(slots)].copy_(input_ids)
        self.ref_buf.load(self.ref_buf.pack(slots)[0])
        self.model.reuse_routing = reuse_routing
        try:
            reference = get_backend("reference")
            backend = reference.ROUNDED if rounded else reference
            return self.forward(len(slots), self.max_loras, backend=backend, meta=self.ref_buf.meta,
                                layout=layout)
        finally:
            self.model.reuse_routing = False

    def moe_path(self, tokens: int, launch_count: int) -> str | None:
        """The expert-LoRA path the backend takes for a graph of ``tokens`` launched for
        ``launch_count`` adapter columns (None: a dense model)."""
        moe = self.model.cfg.moe
        if moe is None:
            return None
        return self.backend.moe_path(tokens, moe.top_k, moe.experts, self.max_loras, launch_count)

    @property
    def num_graphs(self) -> int:
        """FULL graphs (decode steps)."""
        return len(self.keys)

    @property
    def num_mixed_graphs(self) -> int:
        """PIECEWISE graphs (mixed steps): each mixed key's pieces."""
        return len(self.mixed_keys) * (len(self.model.layers) + 1)
