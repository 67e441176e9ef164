"""One tuning class per kernel backend: its shapes, default config, search space, the configs
that waste a launch, and the problem (inputs on the device, a launcher per config) it is timed
on. ``TUNERS`` maps a backend name to its class; the search itself knows no backend."""

import hashlib
import importlib
import inspect
import itertools
import random
from contextlib import contextmanager, nullcontext
from dataclasses import asdict

import torch
import triton

from lorabench.commands.tune.shapes import SMEM_BYTES, Shape
from lorabench.config.batches import fixed_batch
from lorabench.config.strategies import STRATEGIES, Vllm
from lorabench.kernels import (expand, fused_lora, gemm_configs, gemm_lora, launch, lora_configs, meta, moe_gemm, shrink, tiles,
                               triton_lora, vllm_lora)
from lorabench.runtime.lora_meta import MetaBuffer
from lorabench.runtime.vllm_rules import VllmRules

p2 = triton.next_power_of_2


@contextmanager
def substituted(owner, name: str, value):
    """``owner.name`` is ``value`` within the block, and what it was after it."""
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


class Problem:
    """One shape's random inputs on the device and the buffer its launches write."""

    def __init__(self, shape: Shape, rank: int, dtype: torch.dtype, device, seed: int):
        m, L, k, slices = shape.tokens, shape.max_loras, shape.k, shape.slices
        self.shape, self.dtype, self.device = shape, dtype, device
        self.gen = torch.Generator().manual_seed(seed)
        self.x = self.randn(m, k)
        self.lora_a = self.randn(L, len(slices) * rank, k, std=k**-0.5)
        self.lora_b = self.randn(L, sum(slices), rank, std=rank**-0.5)
        self.starts = tuple(itertools.accumulate(slices, initial=0))
        self.slots = fixed_batch(m, shape.active, L, random.Random(seed))

    def randn(self, *size, std=1.0, dt=None):
        return (torch.randn(size, generator=self.gen) * std).to(device=self.device, dtype=dt or self.dtype)


class TuneBackend:
    """What the tune needs of a backend. ``revision``: a hash of its kernels' sources (cache rows
    timed with other sources are not reused), or None when the kernels are not lorabench's."""

    name = ""
    revision: str | None = None

    def shapes(self, linear: str, k: int, slices: tuple, tokens: int, max_loras: int, rank: int) -> list[Shape]:
        raise NotImplementedError

    def default(self, shape: Shape) -> dict:
        raise NotImplementedError

    def space(self, shape: Shape) -> dict[str, list]:
        raise NotImplementedError

    def waste(self, shape: Shape, c: dict, rank: int, elem: int, sm90: bool, default: dict) -> str | None:
        """Why ``c`` need not run: it only pads a smaller config's tiles, or cannot fit."""
        raise NotImplementedError

    def problem(self, shape: Shape, rank: int, dtype: torch.dtype, device, seed: int):
        raise NotImplementedError

    def launcher(self, problem, cfg: dict):
        """A no-argument call that runs one launch of ``cfg`` on the problem into ``problem.output``."""
        raise NotImplementedError

    def configured(self, problem, cfg: dict):
        """A context within which ``launcher(problem, cfg)``'s launches run with ``cfg``."""
        return nullcontext()


# Every module whose source decides what lorabench's kernels compute or how fast: a change to any
# of them makes earlier tune timings stale.
KERNEL_SOURCES = (triton_lora, shrink, expand, tiles, launch, lora_configs, meta, fused_lora, gemm_configs, gemm_lora,
                  moe_gemm)  # moe_gemm: gathered_dot, the gemm backend's K loop


def _source_hash() -> str:
    return hashlib.sha256("".join(inspect.getsource(m) for m in KERNEL_SOURCES).encode()).hexdigest()[:12]


class LorabenchProblem(Problem):
    """lorabench's metadata for the timing batch, the expand's fp32 input, and the output."""

    def __init__(self, shape, rank, dtype, device, seed):
        super().__init__(shape, rank, dtype, device, seed)
        self.meta = MetaBuffer(shape.tokens, shape.max_loras, device)
        self.meta.load(self.meta.pack(self.slots)[0])
        self.h = self.randn(shape.tokens, len(shape.slices) * rank, dt=torch.float32)  # the expand's input
        self.output = (torch.zeros_like(self.h) if shape.op == "shrink"  # zeroed per check run; timing adds on
                       else torch.zeros(shape.tokens, sum(shape.slices), dtype=dtype, device=device))


class TritonPair(TuneBackend):
    """lorabench's shrink and expand, each tuned per shape, launch count = the batch's adapters."""

    name = "triton"

    def __init__(self):
        self.revision = _source_hash()

    def shapes(self, linear, k, slices, tokens, max_loras, rank):
        common = dict(linear=linear, k=k, slices=slices, tokens=tokens, max_loras=max_loras)
        out = []
        for n in sorted({1, min(tokens, max_loras)}):
            out.append(Shape(self.name, "shrink", key=triton_lora.shape_key("shrink", tokens, k, len(slices) * rank, 0, n), active=n, **common))
            out.append(Shape(self.name, "expand", key=triton_lora.shape_key("expand", tokens, rank, max(slices), len(slices), n), active=n, **common))
        return out

    def default(self, shape):
        return asdict(triton_lora.default_config(*shape.key))

    def space(self, shape):
        return triton_lora.SEARCH_SPACE[shape.op]

    def waste(self, shape, c, rank, elem, sm90, default):
        bm, bn, bk, stages = c["block_m"], c["block_n"], c.get("block_k", 16), c["num_stages"]
        br = max(16, p2(rank))
        if shape.op == "shrink":  # fp32 atomics when split
            redundant = bn > max(16, p2(len(shape.slices) * rank)) or bk * (c["split_k"] - 1) >= shape.k
            smem = stages * (bm * bk + bk * bn) * elem
        else:  # its fp32 input tile, then B
            redundant = bn > p2(max(shape.slices))
            smem = stages * (bm * br * 4 + br * bn * elem)
        return _waste(redundant, smem)

    def problem(self, shape, rank, dtype, device, seed):
        return LorabenchProblem(shape, rank, dtype, device, seed)

    def launcher(self, pr, cfg):
        tc = triton_lora.CONFIGS[pr.shape.op](**cfg)
        if pr.shape.op == "shrink":
            return lambda: triton_lora.lora_shrink(pr.x, pr.lora_a, pr.output, pr.meta.meta, pr.shape.active, 1.0, config=tc)
        return lambda: triton_lora.lora_expand(pr.h, pr.lora_b, pr.output, pr.starts, pr.meta.meta, pr.shape.active, config=tc)


class Fused(TritonPair):
    """lorabench's fused kernel: one launch per LoRA linear."""

    name = "fused"

    def shapes(self, linear, k, slices, tokens, max_loras, rank):
        common = dict(linear=linear, k=k, slices=slices, tokens=tokens, max_loras=max_loras)
        return [Shape(self.name, "fused", key=fused_lora.shape_key(tokens, k, max(slices), rank, len(slices), n), active=n, **common)
                for n in sorted({1, min(tokens, max_loras)})]

    def default(self, shape):
        return fused_lora.config_dict(fused_lora.default_config(*shape.key))

    def space(self, shape):
        return fused_lora.SEARCH_SPACE

    def waste(self, shape, c, rank, elem, sm90, default):
        bm, bn, bk, stages = c["block_m"], c["block_n"], c.get("block_k", 16), c["num_stages"]
        br = max(16, p2(rank))
        redundant = bk > p2(shape.k) or bn > p2(max(shape.slices)) or bk * (c["split_k"] - 1) >= shape.k
        return _waste(redundant, (stages * (bm * bk + bk * br) + br * bn) * elem)

    def launcher(self, pr, cfg):
        fc = fused_lora.FusedConfig(**cfg)
        return lambda: fused_lora.lora_apply(pr.output, pr.x, pr.lora_a, pr.lora_b, pr.starts, pr.meta.meta,
                                             pr.shape.active, 1.0, config=fc)


class GemmProblem(LorabenchProblem):
    """The base weight besides the LoRA inputs, and the [T, N] output the GEMM writes."""

    def __init__(self, shape, rank, dtype, device, seed):
        super().__init__(shape, rank, dtype, device, seed)
        self.weight = self.randn(sum(shape.slices), shape.k, std=shape.k**-0.5)
        self.output = torch.zeros(shape.tokens, sum(shape.slices), dtype=dtype, device=device)


class Gemm(TritonPair):
    """The gemm backend's GEMM (its epilogue expanding one adapter's tokens), tuned per (tokens, K,
    N): its base GEMM's tiling is what sets its time. Its shrink is the pair's, tuned by ``triton``."""

    name = "gemm"

    def shapes(self, linear, k, slices, tokens, max_loras, rank):
        if tokens > gemm_lora.GEMM_MAX_TOKENS:  # the backend runs the pair there: ``--kernels triton`` tunes it
            return []
        return [Shape(self.name, "gemm", key=gemm_configs.shape_key(tokens, k, sum(slices)), linear=linear, k=k,
                      slices=slices, tokens=tokens, max_loras=max_loras, active=1)]

    def default(self, shape):
        return gemm_configs.config_dict(gemm_configs.default_config(*shape.key[1:]))

    def space(self, shape):
        return gemm_configs.SEARCH_SPACE

    def waste(self, shape, c, rank, elem, sm90, default):
        # No shared-memory estimate: what Triton makes of a tiling (its pipeliner's buffers, the
        # epilogue's dot operands) differs from stages x tiles by up to 5x across dtypes; one that
        # does not fit fails its launch (OutOfResources) and is pruned.
        redundant = c["block_k"] > max(16, p2(shape.k)) or c["block_n"] > max(16, p2(sum(shape.slices)))
        return _waste(redundant, 0)

    def problem(self, shape, rank, dtype, device, seed):
        return GemmProblem(shape, rank, dtype, device, seed)

    def launcher(self, pr, cfg):
        gc = gemm_configs.GemmConfig(**cfg)
        return lambda: gemm_lora._launch(pr.output, pr.x, pr.weight, None, pr.h, pr.lora_b, pr.starts, pr.meta.meta,
                                         pr.shape.active, gc, False)


# vLLM's kernels: the search space of vLLM's README_TUNING.md, plus the small tiles its defaults use.
VLLM_SPACE = {
    "shrink": {"block_m": [16, 32, 64, 128, 256], "block_n": [16, 32, 64, 128, 256], "block_k": [32, 64, 128, 256],
               "split_k": [1, 4, 8, 16, 32, 64], "num_warps": [4, 8], "num_stages": [2, 3, 4, 5]},
    "expand": {"block_m": [16, 32, 64, 128, 256], "block_n": [32, 64, 128, 256], "block_k": [16, 32, 64, 128],
               "num_warps": [4, 8], "num_stages": [2, 3, 4, 5]},
}


class VllmProblem(Problem):
    """vLLM's weights layout and its default grid's metadata (max_loras + 1, no
    --specialize-active-lora) over a batch of min(m, max_loras) adapters."""

    def __init__(self, shape, rank, dtype, device, seed):
        super().__init__(shape, rank, dtype, device, seed)
        self.ops = vllm_lora.load_ops()
        # vLLM caches its weights' pointers and strides by data_ptr(), for weights that live as long
        # as the server; problems come and go here, and a new one may reuse a freed address.
        utils = importlib.import_module("vllm.lora.ops.triton_ops.utils")
        utils._LORA_A_PTR_DICT.clear()
        utils._LORA_B_PTR_DICT.clear()
        self.a, self.b = vllm_lora.vllm_weights(self.lora_a, self.lora_b, self.starts)
        default = next(s for s in STRATEGIES.values() if s.vllm is Vllm.DEFAULT)  # max_loras + 1
        rules = VllmRules(default, shape.max_loras, shape.tokens, device)
        rules.load(self.slots)
        self.args = rules.kernel_meta.meta_args(shape.tokens, False)
        self.h = self.randn(len(shape.slices), shape.tokens, rank, dt=torch.float32)  # vLLM's fp32 buffer
        self.output = (torch.zeros_like(self.h) if shape.op == "shrink"
                       else torch.zeros(shape.tokens, sum(shape.slices), dtype=dtype, device=device))


class VllmOps(TuneBackend):
    """vLLM's shrink and expand, keyed as vLLM looks them up, (max_loras + 1, slices, m, k, n), and
    timed at vLLM's default grid."""

    name = "vllm"

    def shapes(self, linear, k, slices, tokens, max_loras, rank):
        common = dict(linear=linear, k=k, slices=slices, tokens=tokens, max_loras=max_loras, active=min(tokens, max_loras))
        return [Shape(self.name, "shrink", key=(max_loras + 1, len(slices), tokens, k, rank), **common),
                Shape(self.name, "expand", key=(max_loras + 1, len(slices), tokens, rank, max(slices)), **common)]

    def default(self, shape):
        """vLLM's built-in default, as ``get_lora_op_configs`` returns it with no tuned folder."""
        utils = importlib.import_module("vllm.lora.ops.triton_ops.utils")
        max_loras, slices, m, k, n = shape.key
        hidden, rank = (k, n) if shape.op == "shrink" else (n, k)
        with substituted(utils, "load_lora_op_config", lambda *a: None):  # whatever VLLM_TUNED_CONFIG_FOLDER says
            return dict(utils.get_lora_op_configs.__wrapped__(shape.op, max_loras, m, hidden, rank, slices,
                                                              True if shape.op == "expand" else None))

    def space(self, shape):
        return VLLM_SPACE[shape.op]

    def waste(self, shape, c, rank, elem, sm90, default):
        bm, bn, bk, stages = c["block_m"], c["block_n"], c.get("block_k", 16), c["num_stages"]
        br = max(16, p2(rank))
        if shape.op == "shrink":
            redundant = bn > br or bk * (c["split_k"] - 1) >= shape.k  # splits with no K left to reduce
            smem = stages * (bm * bk + bk * bn) * elem
        else:
            if sm90 and stages != default["num_stages"]:
                return "vLLM runs its fp32-input expand with num_stages 1 on sm90, whatever the config says"
            redundant = bk > br or bn > p2(max(shape.slices))
            smem = stages * (bm * bk * 4 + bk * bn * elem)  # its input is vLLM's fp32 buffer
        return _waste(redundant, smem)

    def problem(self, shape, rank, dtype, device, seed):
        return VllmProblem(shape, rank, dtype, device, seed)

    def configured(self, pr, cfg):
        """vLLM's ops read their config from ``get_lora_op_configs``, which their modules import
        by name: within this context that name returns ``cfg``."""
        module = importlib.import_module(f"vllm.lora.ops.triton_ops.lora_{pr.shape.op}_op")
        return substituted(module, "get_lora_op_configs", lambda *a, **kw: cfg)

    def launcher(self, pr, cfg):
        shrink, expand = pr.ops[:2]
        if pr.shape.op == "shrink":
            return lambda: shrink(pr.x, pr.a, pr.output, *pr.args, 1.0)
        return lambda: expand(pr.h, pr.b, pr.output, *pr.args, offset_start=0, add_inputs=True)


def _waste(redundant: bool, smem: int) -> str | None:
    if redundant:
        return "tiles past the shape (a smaller config does the same work)"
    return f"~{smem // 1024} KiB of shared memory" if smem > SMEM_BYTES else None


TUNERS: dict[str, type[TuneBackend]] = {cls.name: cls for cls in (TritonPair, Fused, Gemm, VllmOps)}
