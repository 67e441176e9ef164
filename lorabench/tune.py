"""``lorabench tune``: search Triton configs for the LoRA kernels, shape by shape, within a time
budget, and write them where lorabench (``lorabench_tuned.json``) and vLLM
(``VLLM_TUNED_CONFIG_FOLDER`` = ``vllm/``) read them.

Shapes are the model's four LoRA linears at every token bucket. lorabench's kernels (triton's
shrink and expand, fused) are keyed like their ``shape_key``; their launch count is the timing
batch's active adapters, 1 and min(tokens, max_loras). vLLM's shrink and expand are keyed as vLLM looks them up,
(max_loras + 1, slices, m, k, n), and timed at vLLM's default grid (max_loras + 1, no
--specialize-active-lora) over a batch of min(m, max_loras) adapters.

Per shape the default config runs first: its output is the reference every candidate must match
and its time the baseline. Candidates follow in a seeded random order until the shape's share of
the budget is spent (at least one runs). One that raises is pruned, one whose output differs is
``wrong``; configs that cannot compile or cannot differ from a smaller one never run. Every
measurement is appended to ``OUT/cache.jsonl`` as it is made, so a rerun resumes where the last
one stopped; the outputs are rewritten after every shape.

Timing: on a GPU, ``LAUNCHES`` back-to-back launches captured in one CUDA graph (how serving runs
them), replayed under CUDA events: per-launch median, p10, p90; lorabench's kernels without PDL, so
each launch's full latency is timed. On the CPU, the interpreter's
wall time per call, labelled ``cpu_wall``: CPU figures, never GPU results.
"""

import hashlib
import importlib
import inspect
import itertools
import json
import os
import random
import subprocess
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from unittest import mock

import numpy as np
import torch
import triton
from rich.progress import Progress

from lorabench import env
from lorabench.batches import fixed_batch
from lorabench.kernels import SUPPORTED_DTYPES, SUPPORTED_RANKS, fused_lora, triton_lora, vllm_lora
from lorabench.lora_meta import MetaBuffer
from lorabench.model import PRESETS, preset
from lorabench.spec import MAX_TOKENS, UserError, require_vllm, split_list
from lorabench.tune_files import lorabench_entries, markdown, summarise, vllm_folder, write_json, write_vllm

KERNELS = ("triton", "fused", "vllm")
SMEM_BYTES = 232448  # shared memory one block may use on sm90 (227 KiB)
TOLERANCE = {"float16": 1e-2, "bfloat16": 4e-2, "float32": 1e-4}  # vs the default's output, relative to its largest |value|
LAUNCHES, REPLAYS, CPU_CALLS = 20, 100, 3
# vLLM's kernels: the search space of vLLM's README_TUNING.md, plus the small tiles its defaults use.
VLLM_SPACE = {
    "shrink": {"block_m": [16, 32, 64, 128, 256], "block_n": [16, 32, 64, 128, 256], "block_k": [32, 64, 128, 256],
               "split_k": [1, 4, 8, 16, 32, 64], "num_warps": [4, 8], "num_stages": [2, 3, 4, 5]},
    "expand": {"block_m": [16, 32, 64, 128, 256], "block_n": [32, 64, 128, 256], "block_k": [16, 32, 64, 128],
               "num_warps": [4, 8], "num_stages": [2, 3, 4, 5]},
}


@dataclass
class TuneSpec:
    kernels: list[str]
    model: str
    rank: int
    dtype: str
    max_loras: list[int]
    tokens: list[int]
    budget_s: float
    out: str
    device: str
    seed: int = 0


def _ints(flag: str, text: str, lo: int, hi: int) -> list[int]:
    try:
        values = [int(v) for v in split_list(text)]
    except ValueError:
        raise UserError(f"{flag}: {text!r} is not a list of integers") from None
    if not all(lo <= v <= hi for v in values):
        raise UserError(f"{flag}: {text!r}: every value must be between {lo} and {hi}")
    return sorted(set(values))


def _budget(text: str) -> float:
    try:
        if 0 < float(text) < float("inf"):
            return float(text)
    except ValueError:
        pass
    raise UserError(f"--budget-s: {text!r} is not a positive number of seconds")


def build_tune_spec(flags: dict, cuda: bool) -> tuple[TuneSpec, str | None]:
    """Flags (strings, None = not given) -> a checked spec and a one-line notice or None."""
    device = flags.get("device") or "auto"
    if device not in ("auto", "cuda", "cpu"):
        raise UserError(f"--device: {device!r} is not one of auto, cuda, cpu")
    if device == "cuda" and not cuda:
        raise UserError("--device cuda: no CUDA device is visible to torch on this machine")
    if device == "auto":
        device = "cuda" if cuda else "cpu"
    kernels = split_list(flags["kernels"]) if flags.get("kernels") else None
    notices = []
    if kernels is None:  # vLLM's too where it can run fast: the interpreter makes its shrink slow
        kernels = ["triton", "fused"] + (["vllm"] if device == "cuda" and vllm_lora.available() else [])
        notices.append(f"tuning {', '.join(kernels)} (--kernels to choose)")
    if flags.get("model") is None and device == "cpu":
        notices.append("On the CPU: tuning the tiny preset in Triton's interpreter; its times are CPU figures, not GPU results")
    spec = TuneSpec(kernels=list(dict.fromkeys(kernels)), model=flags.get("model") or ("llama-2-7b" if device == "cuda" else "tiny"),
                    rank=_ints("--rank", flags.get("rank") or "16", 1, 1 << 16)[0], dtype=flags.get("dtype") or "float16",
                    max_loras=_ints("--max-loras", flags.get("max_loras") or "4", 1, 4096),
                    tokens=_ints("--tokens", flags.get("tokens") or "1,8,32", 1, MAX_TOKENS),
                    budget_s=_budget(flags.get("budget_s") or "300"), out=flags.get("out") or "tuned", device=device,
                    seed=_ints("--seed", flags.get("seed") or "0", 0, 2**31)[0])
    _check(spec)
    return spec, "; ".join(notices) or None


def interpreter_child(flags: dict, resume: bool, cuda: bool) -> int | None:
    """On the CPU, Triton's kernels run in its interpreter, which must be on before triton is first
    imported (too late once the CLI runs): so the tune runs in a child process with
    TRITON_INTERPRET=1, as sweeps run their workers. Returns its exit status; None if not needed."""
    if os.environ.get("TRITON_INTERPRET") == "1" or (cuda and flags.get("device") != "cpu"):
        return None
    argv = [f"--{k.replace('_', '-')}={v}" for k, v in flags.items() if v is not None] + ([] if resume else ["--fresh"])
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, "-m", "lorabench", "tune", *argv], env=env).returncode


def _check(spec: TuneSpec) -> None:
    for flag, values, known in (("--kernels", spec.kernels, KERNELS), ("--model", [spec.model], PRESETS),
                                ("--rank", [spec.rank], SUPPORTED_RANKS), ("--dtype", [spec.dtype], SUPPORTED_DTYPES)):
        for v in values:
            if v not in known:
                raise UserError(f"{flag}: {v!r} is not one of {', '.join(map(str, known))}")
    if spec.device == "cpu" and not fused_lora._INTERPRET:
        raise UserError("--device cpu runs Triton's interpreter: set TRITON_INTERPRET=1 before lorabench's kernels are imported")
    if "vllm" in spec.kernels:
        require_vllm(spec.dtype)


@dataclass(frozen=True)
class Shape:
    """One tuned key: the kernel ("triton", "fused" or "vllm"), its op, the key it is looked up
    by, and what the timing problem is built from."""

    kernel: str
    op: str  # "fused", "shrink" or "expand"
    linear: str  # qkv, o, gate_up, down; "o/down" where two linears share a vLLM key
    key: tuple  # triton/fused: their shape_key (launch count last); vLLM: (max_loras + 1, slices, m, k, n)
    k: int
    slices: tuple
    tokens: int
    max_loras: int
    active: int  # adapters in the timing batch = lorabench's kernels' launch count

    @property
    def label(self) -> str:
        return f"{self.kernel} {self.op} {self.linear} {list(self.key)}"


def linears(model: str) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Each LoRA linear of a layer: (input features K, output slices)."""
    c = preset(model)
    d = c.head_dim
    return {"qkv": (c.hidden, (c.heads * d, c.kv_heads * d, c.kv_heads * d)), "o": (c.heads * d, (c.hidden,)),
            "gate_up": (c.hidden, (c.intermediate, c.intermediate)), "down": (c.intermediate, (c.hidden,))}


def build_shapes(spec: TuneSpec) -> list[Shape]:
    found: dict[tuple, Shape] = {}

    def add(s: Shape) -> None:
        old = found.setdefault((s.kernel, s.op, s.key), s)
        if s.linear not in old.linear.split("/"):
            found[(s.kernel, s.op, s.key)] = replace(old, linear=f"{old.linear}/{s.linear}")

    for m, L, (name, (k, slices)) in itertools.product(spec.tokens, spec.max_loras, linears(spec.model).items()):
        widest, r = max(slices), spec.rank
        common = dict(linear=name, k=k, slices=slices, tokens=m, max_loras=L)
        for n in sorted({1, min(m, L)}):
            if "triton" in spec.kernels:
                add(Shape("triton", "shrink", key=triton_lora.shape_key("shrink", m, k, len(slices) * r, 0, n), active=n, **common))
                add(Shape("triton", "expand", key=triton_lora.shape_key("expand", m, r, widest, len(slices), n), active=n, **common))
            if "fused" in spec.kernels:
                add(Shape("fused", "fused", key=fused_lora.shape_key(m, k, widest, r, len(slices), n), active=n, **common))
        if "vllm" in spec.kernels:
            add(Shape("vllm", "shrink", key=(L + 1, len(slices), m, k, r), active=min(m, L), **common))
            add(Shape("vllm", "expand", key=(L + 1, len(slices), m, r, widest), active=min(m, L), **common))
    return sorted(found.values(), key=lambda s: (KERNELS.index(s.kernel), ("fused", "shrink", "expand").index(s.op)))


def default_config(shape: Shape) -> dict:
    """The untuned config: lorabench's kernels' ``default_config``; vLLM's built-in default (as
    ``get_lora_op_configs`` returns it with no tuned folder)."""
    if shape.kernel == "fused":
        return fused_lora.config_dict(fused_lora.default_config(*shape.key))
    if shape.kernel == "triton":
        return asdict(triton_lora.default_config(*shape.key))
    utils = importlib.import_module("vllm.lora.ops.triton_ops.utils")
    max_loras, slices, m, k, n = shape.key
    hidden, rank = (k, n) if shape.op == "shrink" else (n, k)
    with mock.patch.object(utils, "load_lora_op_config", lambda *a: None):  # whatever VLLM_TUNED_CONFIG_FOLDER says
        return dict(utils.get_lora_op_configs.__wrapped__(shape.op, max_loras, m, hidden, rank, slices,
                                                          True if shape.op == "expand" else None))


def static_reason(shape: Shape, c: dict, rank: int, elem: int, sm90: bool, default: dict) -> str | None:
    """Why a config need not run: it cannot compile, or it only pads a smaller config's tiles."""
    bm, bn, bk, stages = c["block_m"], c["block_n"], c.get("block_k", 16), c["num_stages"]
    p2 = triton.next_power_of_2
    if min(bm, bn, bk) < 16:
        return "a block below 16 (tl.dot's minimum)"
    if bm > max(16, p2(shape.tokens)):
        return "block_m past the tokens"
    widest, br = max(shape.slices), max(16, p2(rank))
    if shape.op == "fused":
        redundant = bk > p2(shape.k) or bn > p2(widest) or bk * (c["split_k"] - 1) >= shape.k
        smem = (stages * (bm * bk + bk * br) + br * bn) * elem
    elif shape.kernel == "triton" and shape.op == "shrink":  # lorabench's: fp32 atomics when split
        redundant = bn > max(16, p2(len(shape.slices) * rank)) or bk * (c["split_k"] - 1) >= shape.k
        smem = stages * (bm * bk + bk * bn) * elem
    elif shape.kernel == "triton":  # lorabench's expand: its fp32 input tile, then B
        redundant = bn > p2(widest)
        smem = stages * (bm * br * 4 + br * bn * elem)
    elif shape.op == "shrink":
        redundant = bn > br or bk * (c["split_k"] - 1) >= shape.k  # splits with no K left to reduce
        smem = stages * (bm * bk + bk * bn) * elem
    else:
        redundant = bk > br or bn > p2(widest)
        smem = stages * (bm * bk * 4 + bk * bn * elem)  # its input is vLLM's fp32 buffer
        if sm90 and stages != default["num_stages"]:
            return "vLLM runs its fp32-input expand with num_stages 1 on sm90, whatever the config says"
    if redundant:
        return "tiles past the shape (a smaller config does the same work)"
    return f"~{smem // 1024} KiB of shared memory" if smem > SMEM_BYTES else None


def candidates(shape: Shape, default: dict, rank: int, elem: int, sm90: bool, seed: int) -> list[dict]:
    """The configs worth running besides the default, in a seeded random order."""
    space = {"fused": fused_lora.SEARCH_SPACE, "triton": triton_lora.SEARCH_SPACE.get(shape.op)}.get(shape.kernel) or VLLM_SPACE[shape.op]
    configs = [{**default, **dict(zip(space, values))} for values in itertools.product(*space.values())]
    viable = [c for c in configs if c != default and not static_reason(shape, c, rank, elem, sm90, default)]
    random.Random(f"{seed}/{shape.kernel}/{shape.op}/{shape.key}").shuffle(viable)
    return viable


class Problem:
    """One shape's inputs on the device, its output buffer, and a launcher per config."""

    def __init__(self, shape: Shape, rank: int, dtype: torch.dtype, device, seed: int):
        gen = torch.Generator().manual_seed(seed)

        def randn(*size, std=1.0, dt=dtype):
            return (torch.randn(size, generator=gen) * std).to(device=device, dtype=dt)

        m, L, k, slices = shape.tokens, shape.max_loras, shape.k, shape.slices
        self.shape = shape
        self.x = randn(m, k)
        self.lora_a = randn(L, len(slices) * rank, k, std=k**-0.5)
        self.lora_b = randn(L, sum(slices), rank, std=rank**-0.5)
        self.starts = tuple(itertools.accumulate(slices, initial=0))
        slots = fixed_batch(m, shape.active, L, random.Random(seed))
        if shape.kernel in ("triton", "fused"):
            self.meta = MetaBuffer(m, L, device)
            self.meta.load(self.meta.pack(slots)[0])
            self.h = randn(m, len(slices) * rank, dt=torch.float32)  # the expand's input
            self.output = (torch.zeros_like(self.h) if shape.op == "shrink"  # zeroed per check run; timing adds on
                           else torch.zeros(m, sum(slices), dtype=dtype, device=device))
            return
        from lorabench.vllm_rules import VllmRules

        self.ops = vllm_lora.load_ops()
        # vLLM caches its weights' pointers and strides by data_ptr(), for weights that live as long
        # as the server; problems come and go here, and a new one may reuse a freed address.
        utils = importlib.import_module("vllm.lora.ops.triton_ops.utils")
        utils._LORA_A_PTR_DICT.clear()
        utils._LORA_B_PTR_DICT.clear()
        self.a, self.b = vllm_lora.vllm_weights(self.lora_a, self.lora_b, self.starts)
        rules = VllmRules("max", L, m, device)  # vLLM's default grid, max_loras + 1
        rules.load(slots)
        self.args = rules.kernel_meta.meta_args(m, False)
        self.h = randn(len(slices), m, rank, dt=torch.float32)  # expand's input, vLLM's fp32 buffer
        self.output = (torch.zeros_like(self.h) if shape.op == "shrink"
                       else torch.zeros(m, sum(slices), dtype=dtype, device=device))

    def configured(self, cfg: dict):
        """vLLM's ops read their config from ``get_lora_op_configs``, which their modules import
        by name: within this context that name returns ``cfg``."""
        if self.shape.kernel != "vllm":
            return nullcontext()
        module = importlib.import_module(f"vllm.lora.ops.triton_ops.lora_{self.shape.op}_op")
        return mock.patch.object(module, "get_lora_op_configs", lambda *a, **kw: cfg)

    def launcher(self, cfg: dict):
        if self.shape.op == "fused":
            fc = fused_lora.FusedConfig(**cfg)
            return lambda: fused_lora.lora_apply(self.output, self.x, self.lora_a, self.lora_b, self.starts,
                                                 self.meta.meta, self.shape.active, 1.0, config=fc)
        if self.shape.kernel == "triton":
            tc = triton_lora.CONFIGS[self.shape.op](**cfg)
            if self.shape.op == "shrink":
                return lambda: triton_lora.lora_shrink(self.x, self.lora_a, self.output, self.meta.meta,
                                                       self.shape.active, 1.0, config=tc)
            return lambda: triton_lora.lora_expand(self.h, self.lora_b, self.output, self.starts, self.meta.meta,
                                                   self.shape.active, config=tc)
        shrink, expand = self.ops[:2]
        if self.shape.op == "shrink":
            return lambda: shrink(self.x, self.a, self.output, *self.args, 1.0)
        return lambda: expand(self.h, self.b, self.output, *self.args, offset_start=0, add_inputs=True)


def kernels_rev() -> str:
    """A hash of lorabench's kernel sources: a cache's timings of lorabench's kernels are reused only
    for the same kernels (vLLM's rows do not depend on it)."""
    return hashlib.sha256((inspect.getsource(triton_lora) + inspect.getsource(fused_lora)).encode()).hexdigest()[:12]


def _stats(us, timing: str) -> dict:
    p10, p50, p90 = np.percentile(np.asarray(us), [10, 50, 90])
    return {"us": float(p50), "p10_us": float(p10), "p90_us": float(p90), "timing": timing}


def capture_graph(warm, body=None) -> "torch.cuda.CUDAGraph":
    """Run ``warm`` once off the capture stream (compiles, as torch advises), then capture ``body``
    (default: ``warm``) into a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        warm()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        (body or warm)()
    return graph


def time_cuda(fn, launches: int = LAUNCHES, replays: int = REPLAYS) -> dict:
    """``launches`` calls captured in one CUDA graph, replayed ``replays`` times under events."""
    graph = capture_graph(fn, lambda: [fn() for _ in range(launches)])
    for _ in range(5):
        graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return _stats([s.elapsed_time(e) * 1e3 / launches for s, e in events], "cuda_graph")


def time_cpu(fn, calls: int = CPU_CALLS) -> dict:
    us = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        us.append((time.perf_counter() - t0) * 1e6)
    return _stats(us, "cpu_wall")


def measure(problem: Problem, cfg: dict, ref: torch.Tensor | None, tol: float, timer) -> tuple[dict, torch.Tensor | None]:
    """Run ``cfg`` once from a zeroed output, compare with ``ref``, then time it. Returns the
    row's result fields and the output (None unless it ran)."""
    try:
        with problem.configured(cfg):
            fn = problem.launcher(cfg)
            problem.output.zero_()
            fn()
            out = problem.output.clone()  # ordered after the launch on the device
            if ref is not None:
                err = float((out.float() - ref.float()).abs().max())
                if not err <= tol * max(1.0, float(ref.float().abs().max())):
                    return {"status": "wrong", "error": f"max |diff| {err:.3g} vs the default's output"}, out
            return {"status": "ok", **timer(fn)}, out
    except Exception as e:  # noqa: BLE001 - any failure to compile or run prunes the config
        return {"status": "pruned", "error": f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"}, None


def _cid(cfg: dict) -> str:
    return json.dumps(cfg, sort_keys=True)


class Cache:
    """OUT/cache.jsonl: one line per measured (shape, config), appended the moment it exists.
    Rows of another device, GPU or dtype, and rows of lorabench's kernels timed from other kernel
    sources (``revs``: kernel -> ``kernels_rev``), are kept in the file and ignored."""

    def __init__(self, path: Path, identity: dict, fresh: bool, revs: dict[str, str] | None = None):
        self.path, self.identity, self.revs = path, identity, revs or {}
        if fresh and path.exists():
            path.replace(path.with_name(path.name + ".prev"))
        self.rows = [r for r in self._read() if all(r.get(k) == v for k, v in identity.items())
                     and r.get("kernels_rev") == self.revs.get(r.get("kernel"))]

    def _read(self) -> list[dict]:
        rows = []
        for line in self.path.read_text().splitlines() if self.path.exists() else []:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut short by an interrupt
                pass
        return rows

    def of(self, shape: Shape) -> list[dict]:
        key = list(shape.key)
        return [r for r in self.rows if (r["kernel"], r["op"], r["shape"]) == (shape.kernel, shape.op, key)]

    def append(self, row: dict) -> None:
        row = {**row, **self.identity, "kernels_rev": self.revs.get(row["kernel"])}
        self.rows.append(row)
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")


class Tuner:
    """Runs the search over a spec's shapes and keeps the outputs current."""

    def __init__(self, spec: TuneSpec, command: str, console, fresh: bool = False):
        self.spec, self.console = spec, console
        self.cuda = spec.device == "cuda"
        self.dtype = SUPPORTED_DTYPES[spec.dtype]
        self.sm90 = self.cuda and torch.cuda.get_device_capability() == (9, 0)
        self.out = Path(spec.out)
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"--out: cannot make the folder {self.out}: {e.strerror}") from None
        gpu = torch.cuda.get_device_name() if self.cuda else None
        identity = {"device": spec.device, "gpu": gpu, "dtype": spec.dtype,  # timings of one kind only
                    "timing": "cuda_graph" if self.cuda else "cpu_wall", "launches_per_graph": LAUNCHES if self.cuda else 1}
        rev = kernels_rev()
        self.cache = Cache(self.out / "cache.jsonl", identity, fresh, {"triton": rev, "fused": rev})
        self.shapes = build_shapes(spec)
        self.share = spec.budget_s / len(self.shapes)
        self.session = f"{time.strftime('%Y%m%dT%H%M%S')}-{id(self):x}"
        self.timer = time_cuda if self.cuda else time_cpu
        self.viable: dict[Shape, int] = {}  # configs left after static pruning, per shape
        self.meta = {"gpu": gpu, "device": spec.device, "timing": "cuda_graph" if self.cuda else "cpu_wall",
                     "dtype": spec.dtype, "rank": spec.rank, "model": spec.model, "command": command,
                     "budget_s": spec.budget_s, "launches_per_graph": LAUNCHES if self.cuda else 1, "env": env.collect(spec.device)}

    def run(self) -> list[dict]:
        # lorabench's kernels are timed without PDL: back-to-back PDL launches of one kernel overlap
        # one another, which times their throughput, not the latency a decode step waits for.
        with mock.patch.dict(os.environ, {"LORABENCH_PDL": "0"}), Progress(console=self.console, transient=True) as progress:
            task = progress.add_task("tuning", total=len(self.shapes))
            for shape in self.shapes:
                progress.update(task, description=shape.label)
                self.tune(shape)
                self.write()
                progress.advance(task)
        return self.write()

    def tune(self, shape: Shape) -> None:
        rows = self.cache.of(shape)
        default = default_config(shape)
        done = {_cid(r["config"]) for r in rows}
        spent, tried = sum(r["spent_s"] for r in rows), sum(not r["default"] for r in rows)
        todo = candidates(shape, default, self.spec.rank, self.dtype.itemsize, self.sm90, self.spec.seed)
        self.viable[shape] = len(todo)
        todo = [c for c in todo if _cid(c) not in done]
        old = [r for r in rows if r["default"] and _cid(r["config"]) == _cid(default)]  # today's default only
        if old and (old[0]["status"] != "ok" or not todo or (spent >= self.share and tried)):
            return  # nothing to compare against, or this shape's budget is spent (resume)
        problem = Problem(shape, self.spec.rank, self.dtype, self.spec.device, self.spec.seed)
        ref = self.reference(shape, problem, default, bool(old))
        for cfg in todo:
            if ref is None or (spent >= self.share and tried):
                break
            spent += self.record(shape, problem, cfg, ref, False)["spent_s"]
            tried += 1

    def reference(self, shape: Shape, problem: Problem, default: dict, cached: bool) -> torch.Tensor | None:
        """The default's output: measured and recorded first, or only rerun if the cache has it."""
        if cached:
            return measure(problem, default, None, 0.0, lambda fn: {})[1]
        row = self.record(shape, problem, default, None, True)
        return row.pop("_out") if row["status"] == "ok" else None

    def record(self, shape: Shape, problem: Problem, cfg: dict, ref, is_default: bool) -> dict:
        t0 = time.perf_counter()
        result, out = measure(problem, cfg, ref, TOLERANCE[self.spec.dtype], self.timer)
        row = {"kernel": shape.kernel, "op": shape.op, "linear": shape.linear, "shape": list(shape.key), "config": cfg,
               "default": is_default, **result, "spent_s": time.perf_counter() - t0, "session": self.session}
        self.cache.append(row)
        return {**row, "_out": out}

    def write(self) -> list[dict]:
        """Rewrite every output from the cache; returns one summary per shape."""
        results = [summarise(s, self.cache.of(s), self.viable.get(s)) for s in self.shapes]
        write_json(self.out / "lorabench_tuned.json", {**self.meta, "entries": lorabench_entries(results)})
        if "vllm" in self.spec.kernels:
            write_vllm(vllm_folder(self.out), self.meta["gpu"], results)
        (self.out / "tune.md").write_text(markdown(self.meta, results))
        return results
