"""Compile every Triton kernel, called through its real launcher, to an sm_90 (Hopper) cubin.

Triton's CPU interpreter accepts code the GPU compiler rejects (e.g. a variable that is a pointer
in one branch and an integer in the other). Compiling ahead of time with the ptxas that Triton
ships catches those without a GPU. The launchers are recorded, not run: their argument lists
give each kernel's signature at Llama-2-7B shapes, in every dtype and config the sweeps use.
The variants compile in COMPILE_JOBS forked workers (default: one per core this process may use).
"""

import gc
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch
import triton
from lorabench import kernels
from lorabench.kernels import (base_ops, expand, expert_call, extended_gemm, fused_lora, gemm_configs, gemm_lora, launch, moe_align, moe_gemm,
                               moe_gemm_lora,
                               moe_lora, moe_lora_per_entry, producer_shrink, prompt_shrink, shrink,
                               triton_lora, varlen_attention)

from lorabench.runtime.lora_meta import MetaBuffer

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    HOPPER = GPUTarget("cuda", 90, 32)
except ImportError:  # very old Triton
    HOPPER = None

TYPES = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int32: "*i32", torch.int64: "*i64"}


class Recorder:
    """Stands in for a @triton.jit kernel: ``kernel[grid](*args, **kwargs)`` records the call."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


def compile_inputs(fn, args, kwargs, specialise=False):
    """What ``triton.compile`` is given for the call ``fn[grid](*args, **kwargs)``: (signature,
    constexprs, attrs, options). ``specialise``: as Triton's launcher does, integers equal to 1
    become constants and pointers and integers that are multiples of 16 are declared so (what lets
    loads be vectorised)."""
    kwargs = dict(kwargs)
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    kwargs.pop("launch_pdl", None)  # a launch option: the kernel's USE_PDL is what compiles differently
    signature, constexprs, attrs = {}, {}, {}
    for i, (name, value) in enumerate(zip(fn.arg_names, list(args) + [kwargs[n] for n in fn.arg_names[len(args):]])):
        if isinstance(value, torch.Tensor):
            signature[name] = TYPES[value.dtype]
            if specialise:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in kwargs or (specialise and value == 1 and not isinstance(value, float)):
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            signature[name] = "i32" if abs(value) < 2**31 else "i64"
            if specialise and value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs, options


def compile_inputs_for_hopper(fn, inputs):
    """Compile ``fn`` for sm_90 from what ``compile_inputs`` gave."""
    signature, constexprs, attrs, options = inputs
    return triton.compile(ASTSource(fn, signature, constexprs=constexprs, attrs=attrs), target=HOPPER, options=options)


def compile_call(fn, args, kwargs, specialise=False):
    return compile_inputs_for_hopper(fn, compile_inputs(fn, args, kwargs, specialise))


def vector_loads(ptx: str) -> int:
    return len(re.findall(r"ld\.global(?:\.\w+)*\.v4", ptx))


def two_byte_loads(ptx: str) -> int:
    return len(re.findall(r"ld\.global[\w.:]*\.b16\b", ptx))


def ranked_loads_stay_vectorised() -> str | None:
    """The ``+unpadded`` (RANKED) kernels load B and h 128 bits at a time, as the padded ones do:
    a rank mask ending at an arbitrary runtime bound would make those loads one element each."""
    recorders = record_launches()
    k, slices, loras, rank = 4096, (4096, 1024, 1024), 4, 64
    starts = tuple(sum(slices[:i]) for i in range(len(slices) + 1))
    for tokens in (1, 8):
        buf = MetaBuffer(tokens, loras, "cpu")
        ranked = buf.meta._replace(slot_rank=torch.empty(loras, dtype=torch.int32))
        x, y = torch.empty(tokens, k, dtype=torch.float16), torch.empty(tokens, sum(slices), dtype=torch.float16)
        a = torch.empty(loras, len(slices) * rank, k, dtype=torch.float16)
        b = torch.empty(loras, sum(slices), rank, dtype=torch.float16)
        scratch = torch.empty(tokens, 3 * rank, dtype=torch.float32)
        for meta in (buf.meta, ranked):
            triton_lora.lora_apply(y, x, a, b, starts, meta, loras, 1.0, scratch)
            fused_lora.lora_apply(y, x, a, b, starts, meta, loras, 1.0)
    for name in ("_expand_kernel", "_fused_kernel"):
        loads = {}
        for args, kwargs in recorders[name].calls:
            key = (kwargs["RANKED"], kwargs["BLOCK_M"])
            if key not in loads:
                loads[key] = vector_loads(compile_call(recorders[name].fn, args, kwargs, True).asm["ptx"])
        for (is_ranked, block_m), count in loads.items():
            if is_ranked and count < loads[(False, block_m)]:
                return (f"{name}: {count} 128-bit loads with each slot's own rank, {loads[(False, block_m)]} padded "
                        f"(BLOCK_M {block_m})")
    return None


def extended_rows_stay_vectorised() -> str | None:
    """The shrink reads its x from the model's extended rows (K + ``tail_width`` wide) 16 bytes at a
    time, at every slot count, slice count and rank: at a width of 8 modulo 16 Triton cannot prove
    the rows aligned and the x tile compiles to 2-byte loads (3 slots x 3 slices x rank 8 did, when
    tails rounded up to 8)."""
    recorders = record_launches()
    k, tokens = 4096, 128
    for slices, slots, rank in [(3, 3, 8), (1, 1, 8), (2, 4, 16), (3, 4, 16), (1, 5, 1)]:
        width = k + kernels.tail_width(slices, slots, rank)
        x_ext = torch.empty(tokens, width, dtype=torch.bfloat16)
        a = torch.empty(slots, slices * rank, k, dtype=torch.bfloat16)
        h = torch.zeros(tokens, slices * rank, dtype=torch.float32)
        recorders["_shrink_kernel"].calls.clear()
        shrink.lora_shrink(x_ext[:, :k], a, h, MetaBuffer(tokens, slots, "cpu").meta, slots, 0.5, rank=rank,
                           slices=slices, pdl=False)
        args, kwargs = recorders["_shrink_kernel"].calls[-1]
        ptx = compile_call(recorders["_shrink_kernel"].fn, args, kwargs, True).asm["ptx"]
        narrow = two_byte_loads(ptx)
        if narrow:
            return f"_shrink_kernel: {narrow} 2-byte loads of x from rows of {width} (slices {slices}, slots {slots}, rank {rank})"
    return None


def record_launches():
    """Replace every kernel with a Recorder; returns them by name."""
    assert not launch.INTERPRET, "compile what the GPU runs: run without TRITON_INTERPRET"
    recs = {}
    for module, name in [(shrink, "_shrink_kernel"), (expand, "_expand_kernel"), (fused_lora, "_fused_kernel"),
                         (base_ops, "_add_rmsnorm_kernel"), (base_ops, "_rope_cache_kernel"), (base_ops, "_silu_mul_kernel"),
                         (moe_gemm, "_route_kernel"), (moe_gemm, "_expert_gemm_kernel"), (moe_align, "_align_kernel"),
                         (moe_lora_per_entry, "_per_entry_kernel"), (moe_lora, "_sorted_shrink_kernel"),
                         (moe_lora, "_sorted_expand_kernel"), (moe_gemm_lora, "_expert_gemm_lora_kernel"),
                         (gemm_lora, "_gemm_lora_kernel"), (extended_gemm, "_pack_step_kernel"),
                         (producer_shrink, "_producer_shrink_kernel"), (prompt_shrink, "_silu_mul_shrink_kernel"),
                         (varlen_attention, "_varlen_attention_kernel")]:
        kernel = getattr(module, name)
        recs[name] = Recorder(kernel.fn if isinstance(kernel, Recorder) else kernel)
        setattr(module, name, recs[name])
    return recs


def use_pdl(on: bool) -> None:
    """Launch as on an sm90 GPU with PDL (on) or as with ``LORABENCH_PDL=0`` (off)."""
    for module in (shrink, expand, fused_lora, base_ops, gemm_lora, producer_shrink, moe_gemm, moe_lora_per_entry):
        module.pdl_enabled = lambda device: on  # where each launcher looks it up
    moe_lora_per_entry.PER_ENTRY_PDL = on  # on by default: compiled as it launches either way


def launch_everything(dtype, tokens):
    """Call every launcher at Llama-2-7B shapes (tensors on the CPU; nothing runs)."""
    hidden, inter, rank, loras = 4096, 11008, 16, 4
    meta = MetaBuffer(tokens, loras, "cpu").meta
    linears = [(hidden, (4096, 4096, 4096)), (hidden, (4096,)), (hidden, (inter, inter)), (inter, (hidden,))]
    for k, slices in linears:
        starts = tuple(sum(slices[:i]) for i in range(len(slices) + 1))
        x = torch.empty(tokens, k, dtype=dtype)
        a = torch.empty(loras, len(slices) * rank, k, dtype=dtype)
        b = torch.empty(loras, sum(slices), rank, dtype=dtype)
        y = torch.empty(tokens, sum(slices), dtype=dtype)
        scratch = torch.empty(tokens, 3 * rank, dtype=torch.float32)
        triton_lora.lora_apply(y, x, a, b, starts, meta, loras, 1.0, scratch)
        fused_lora.lora_apply(y, x, a, b, starts, meta, loras, 1.0)  # split over K (atomics) up to 128 tokens
        fused_lora.lora_apply(y, x, a, b, starts, meta, loras, 1.0, config=fused_lora.FusedConfig(split_k=1))
    x = torch.empty(tokens, hidden, dtype=dtype)
    base_ops.add_rmsnorm(x, x, torch.empty(hidden, dtype=dtype), 1e-5, pdl=True)
    base_ops.add_rmsnorm(x, None, torch.empty(hidden, dtype=dtype), 1e-5, pdl=True)
    cache = torch.empty(tokens, 8, 64, 128, dtype=dtype)
    base_ops.rope_and_cache(torch.empty(tokens, (32 + 16) * 128, dtype=dtype), torch.empty(64, 64), torch.empty(64, 64),
                            torch.empty(tokens, dtype=torch.int64), cache, cache, 32, 8, pdl=True)
    base_ops.silu_mul(torch.empty(tokens, 2 * inter, dtype=dtype), pdl=True)
    # into an extended GEMM's input (rows wider than the op's output), and its tail packed
    wide = torch.empty(tokens, hidden + 192, dtype=dtype)
    base_ops.add_rmsnorm(x, x, torch.empty(hidden, dtype=dtype), 1e-5, out=wide[:, :hidden])
    base_ops.silu_mul(torch.empty(tokens, 2 * inter, dtype=dtype), out=torch.empty(tokens, inter + 64, dtype=dtype)[:, :inter])
    extended_gemm.pack_step(wide, hidden, torch.empty(6144, 192, dtype=dtype), torch.empty(tokens, 48, dtype=torch.float32),
                            torch.empty(4, 6144, 16, dtype=dtype), (0, 4096, 5120, 6144), meta, loras)
    if tokens > 64:  # down's prompt-size shrink in SiLU·mul, into an extended input; K split, and not; +unpadded;
        # its widest A (MAX_ROWS)
        for m in (meta, meta._replace(slot_rank=torch.empty(loras, dtype=torch.int32))):
            for parts in (1, 4):
                prompt_shrink.silu_mul_shrink(torch.empty(tokens, 2 * inter, dtype=dtype),
                                              torch.empty(loras, rank, inter, dtype=dtype),
                                              torch.empty(tokens, rank, dtype=torch.float32), m, loras, 1.0, rank,
                                              out=torch.empty(tokens, inter + 64, dtype=dtype)[:, :inter],
                                              config=prompt_shrink.PromptShrinkConfig(parts=parts))
        r = prompt_shrink.MAX_ROWS
        prompt_shrink.silu_mul_shrink(torch.empty(tokens, 2 * inter, dtype=dtype), torch.empty(loras, r, inter, dtype=dtype),
                                      torch.empty(tokens, r, dtype=torch.float32), meta, loras, 1.0, r)
    # a mixed step's attention: rotary and cache writes at each token's row, then the varlen kernel
    # (Llama-3.1-8B's 32 heads over 8 KV heads, and llama-2-7b's 32 over 32)
    rows = torch.empty(tokens, dtype=torch.int64)
    base_ops.rope_and_cache(torch.empty(tokens, (32 + 16) * 128, dtype=dtype), torch.empty(64, 64), torch.empty(64, 64),
                            rows, cache, cache, 32, 8, rows=rows)
    for kv_heads in (8, 32):
        kv = torch.empty(4, kv_heads, 64, 128, dtype=dtype)
        varlen_attention.varlen_attention(torch.empty(tokens, 32, 128, dtype=dtype), kv, kv,
                                          torch.empty(tokens, 4, dtype=torch.int64))


def gemm_inputs(dtype, tokens, k, slices, loras, rank):
    starts = tuple(sum(slices[:i]) for i in range(len(slices) + 1))
    x, w = torch.empty(tokens, k, dtype=dtype), torch.empty(sum(slices), k, dtype=dtype)
    b = torch.empty(loras, sum(slices), rank, dtype=dtype)
    h = torch.empty(tokens, len(slices) * rank, dtype=torch.float32)
    return torch.empty(tokens, sum(slices), dtype=dtype), x, w, h, b, starts, MetaBuffer(tokens, loras, "cpu").meta


def launch_gemm(dtype, tokens):
    """The gemm backend's kernels at Llama-2-7B's shapes: the GEMM with its LoRA epilogue at the four
    linears in their default tilings, at 4 slots and at 32 (several epilogue steps), with a bias,
    the base GEMM alone; the shrinks in the norms and SiLU·mul."""
    for k, slices in ((4096, (4096, 4096, 4096)), (4096, (4096,)), (4096, (11008, 11008)), (11008, (4096,))):
        for loras in (4, 32):
            y, x, w, h, b, starts, meta = gemm_inputs(dtype, tokens, k, slices, loras, 16)
            gemm_lora._launch(y, x, w, None, h, b, starts, meta, loras, None, gemm_lora.pdl_enabled(x.device))
            # the gathered epilogue in the default tiling, padded and +unpadded, and at a large rank
            cfg = replace(gemm_configs.config_for(tokens, k, sum(slices)), gather=True)
            for m in (meta, meta._replace(slot_rank=torch.empty(loras, dtype=torch.int32))):
                gemm_lora._launch(y, x, w, None, h, b, starts, m, loras, cfg, gemm_lora.pdl_enabled(x.device))
    y, x, w, h, b, starts, meta = gemm_inputs(dtype, tokens, 4096, (4096, 1024, 1024), 4, 128)
    gemm_lora._launch(y, x, w, None, h, b, starts, meta, 4, replace(gemm_configs.config_for(tokens, 4096, 6144),
                                                                               gather=True), False)
    y, x, w, h, b, starts, meta = gemm_inputs(dtype, tokens, 4096, (4096,), 4, 16)
    gemm_lora._launch(y, x, w, torch.empty(4096, dtype=dtype), h, b, starts, meta, 4, None, False)
    gemm_lora._launch(y, x, w, None, None, None, (0,), None, 0, None, False)
    # the shrinks in the norms and SiLU·mul (qkv, gate_up, down), with each slot's own rank too
    buf = MetaBuffer(tokens, 4, "cpu")
    for meta in (buf.meta, buf.meta._replace(slot_rank=torch.empty(4, dtype=torch.int32))):
        x, norm = torch.empty(tokens, 4096, dtype=dtype), torch.empty(4096, dtype=dtype)
        h = torch.empty(tokens, 48, dtype=torch.float32)
        for slices in (3, 2):
            a = torch.empty(4, slices * 16, 4096, dtype=dtype)
            producer_shrink.add_rmsnorm_shrink(x, x, norm, 1e-5, a, h, meta, 4, 1.0, 16, slices, pdl=True)
        producer_shrink.add_rmsnorm_shrink(x, None, norm, 1e-5, a, h, meta, 4, 1.0, 16, 2, pdl=True)
        wide, wide_norm = torch.empty(tokens, 8192, dtype=dtype), torch.empty(8192, dtype=dtype)  # a hidden size of 8192
        producer_shrink.add_rmsnorm_shrink(wide, wide, wide_norm, 1e-5, torch.empty(4, 48, 8192, dtype=dtype), h, meta, 4,
                                           1.0, 16, 3, pdl=True)
        producer_shrink.silu_mul_shrink(torch.empty(tokens, 2 * 11008, dtype=dtype), torch.empty(4, 16, 11008, dtype=dtype),
                                        h, meta, 4, 1.0, 16, pdl=True)


def gemm_fits_by_stepping_down() -> str | None:
    """In fp32 the 16-bit tilings can exceed a block's shared memory (the runtime then steps down,
    ``gemm_configs.smaller``): from each default tiling at 40 tokens and 32 slots x 3 slices (fp32 at
    40 tokens once failed to launch on an H200), the steps reach one the compiler fits."""
    kernel = gemm_lora._gemm_lora_kernel
    for k, slices in ((4096, (4096, 4096, 4096)), (4096, (11008, 11008))):
        rec = Recorder(kernel.fn if isinstance(kernel, Recorder) else kernel)
        gemm_lora._gemm_lora_kernel = rec
        y, x, w, h, b, starts, meta = gemm_inputs(torch.float32, 40, k, slices, 32, 16)
        cfg = gemm_configs.default_config(40, k, sum(slices))
        try:
            while cfg is not None:
                rec.calls.clear()
                gemm_lora._launch(y, x, w, None, h, b, starts, meta, 32, cfg, False)
                shared = compile_call(rec.fn, *rec.calls[0]).metadata.shared
                if shared <= SHARED_LIMIT:
                    break
                cfg = gemm_configs.smaller(cfg)
        finally:
            gemm_lora._gemm_lora_kernel = kernel
        if cfg is None:
            return f"gemm fp32, 40 tokens, N {sum(slices)}: no tiling down from the default fits in {SHARED_LIMIT} bytes"
    return None


def launch_moe(dtype, tokens):
    """The MoE launchers at Qwen3-30B-A3B's and Mixtral-8x7B's shapes (tensors allocated, never
    touched): routing, the alignment (the base MoE's and vLLM's per slot), the grouped GEMMs, and
    the expert LoRA of w13 and w2 inside the grouped GEMM (ranks 16 and 128: one and four steps of its rank walk), on the per-entry path (its K loop in steps of several sizes), the
    sorted path, and the sorted path with its expand grouped (several output tiles per program)."""
    loras, rank = 4, 16
    meta = MetaBuffer(tokens, loras, "cpu").meta
    for hidden, experts, top_k, inter in ((2048, 128, 8, 768), (4096, 8, 2, 14336)):
        numel = tokens * top_k
        ids, weights = torch.empty(tokens, top_k, dtype=torch.int64), torch.empty(tokens, top_k, dtype=torch.float32)
        moe_gemm.route(torch.empty(tokens, experts, dtype=torch.float32), top_k, True, ids, weights)
        layout = moe_align.align_blocks(ids, experts, moe_gemm.BLOCK_M)
        moe_align.align_blocks(ids, experts, 16, loras, torch.empty(tokens, dtype=torch.int32),
                               torch.empty(loras + 1, dtype=torch.int32), torch.empty(loras, dtype=torch.int32))
        x, act = torch.empty(tokens, hidden, dtype=dtype), torch.empty(numel, inter, dtype=dtype)
        moe_gemm.expert_gemm(x, torch.empty(experts, 2 * inter, hidden, dtype=dtype), ids, layout)
        w13_base, w2_base = torch.empty(experts, 2 * inter, hidden, dtype=dtype), torch.empty(experts, hidden, inter, dtype=dtype)
        moe_gemm.expert_gemm(act, w2_base, ids, layout, weights, x_per_entry=True)
        enabled = torch.empty(loras, dtype=torch.int32)
        w13 = expert_call.ExpertCall(torch.empty(numel, 2 * inter, dtype=dtype), x,
                                     torch.empty(2, loras, experts, rank, hidden, dtype=dtype),
                                     torch.empty(2, loras, experts, inter, rank, dtype=dtype), ids, weights, False, layout, enabled)
        w2 = expert_call.ExpertCall(torch.empty(numel, hidden, dtype=dtype), act,
                                    torch.empty(1, loras, experts, rank, inter, dtype=dtype),
                                    torch.empty(1, loras, experts, hidden, rank, dtype=dtype), ids, weights, True, layout, enabled)
        for call, base in ((w13, w13_base), (w2, w2_base)):
            moe_gemm_lora.expert_gemm_lora(base, call, meta, loras, 1.0)  # the gemm backend's
            moe_gemm_lora.expert_gemm_lora(base, call, meta, loras, 1.0, shrink_first=True)
            moe_gemm_lora.expert_gemm_lora(base, call, meta, loras, 1.0, shrink_first=False, one_pass=False)
            wide = call._replace(lora_a=call.lora_a.new_empty(*call.lora_a.shape[:3], 128, call.lora_a.shape[4]),
                                 lora_b=call.lora_b.new_empty(*call.lora_b.shape[:4], 128))
            moe_gemm_lora.expert_gemm_lora(base, wide, meta, loras, 1.0)  # rank 128: four steps of its rank walk
            moe_lora.moe_lora_apply(call, meta, loras, 1.0, moe_lora.PER_ENTRY)
            for tiling in ((8192, 4), (16384, 8), (32768, 8, 1), (32768, 8, 1056)):  # moe_lora_bench's --per-entry
                moe_lora.moe_lora_apply(call, meta, loras, 1.0, moe_lora.PER_ENTRY,
                                        per_entry=moe_lora_per_entry.PerEntryTiling(*tiling))
            moe_lora.moe_lora_apply(call, meta, loras, 1.0, moe_lora.SORTED)
            moe_lora.moe_lora_apply(call, meta, loras, 1.0, moe_lora.SORTED, moe_lora.SortedTiling(expand_programs=512))
            moe_lora.moe_lora_apply(call, meta, loras, 1.0, moe_lora.SORTED, moe_lora.SortedTiling(512, 64))


def launch_ranks(dtype, tokens):
    """The LoRA launchers at large ranks (the expand's rank loop, the fused kernel's smaller
    tiles), with each slot's own rank (``+unpadded``), and one fully sharded rank's shrink."""
    k, slices, loras = 4096, (4096, 1024, 1024), 4
    starts = tuple(sum(slices[:i]) for i in range(len(slices) + 1))
    buf = MetaBuffer(tokens, loras, "cpu")
    ranked = buf.meta._replace(slot_rank=torch.empty(loras, dtype=torch.int32))
    for rank in (128, 320, 512):
        x, y = torch.empty(tokens, k, dtype=dtype), torch.empty(tokens, sum(slices), dtype=dtype)
        a = torch.empty(loras, len(slices) * rank, k, dtype=dtype)
        b = torch.empty(loras, sum(slices), rank, dtype=dtype)
        scratch = torch.empty(tokens, 3 * rank, dtype=torch.float32)
        for meta in (buf.meta, ranked):
            triton_lora.lora_apply(y, x, a, b, starts, meta, loras, 1.0, scratch)
            fused_lora.lora_apply(y, x, a, b, starts, meta, loras, 1.0)
        half = torch.empty(loras, len(slices) * rank // 2, k, dtype=dtype)  # fully sharded at TP 2
        triton_lora.lora_apply(y, x, half, b, starts, buf.meta, loras, 1.0, scratch)


SHARED_LIMIT = 232448  # bytes of shared memory one H100/H200 block may use (227 KiB)
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def stack_bytes(cubin: bytes) -> int | None:
    """Per-thread stack (register spills, local arrays) of a cubin, from cuobjdump; None without it."""
    if not CUOBJDUMP.is_file():
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"STACK:(\d+)", out)
    return int(found.group(1)) if found else None


VARIANTS: list = []  # (kernel name, its function, compile_inputs, its launch's keywords but tensors): what main's workers compile, by index


def check_variant(i: int) -> tuple[bool, str]:
    """Compile VARIANTS[i] for sm_90 and check its PTX and resources: (passed, the line to print)."""
    name, fn, inputs, kwargs = VARIANTS[i]
    try:
        kernel = compile_inputs_for_hopper(fn, inputs)
    except Exception as e:  # the variant's name and keywords with the compiler's message, not a bare traceback
        return False, f"{name} {sorted(kwargs.items())} does not compile: {e!r}"
    ptx = kernel.asm["ptx"]
    waits, triggers = ptx.count("griddepcontrol.wait"), ptx.count("griddepcontrol.launch_dependents")
    # LoRA kernels wait on both paths (early exit, write) and let dependents launch once;
    # base ops wait once, first, and trigger nothing.
    lora = name in ("_shrink_kernel", "_expand_kernel", "_fused_kernel")
    # the gemm kernel waits once and lets its consumer launch at once
    pdl_want = (2, 1) if lora else (1, 1) if name in ("_gemm_lora_kernel", "_producer_shrink_kernel") else (1, 0)
    want = pdl_want if kwargs.get("USE_PDL") else (0, 0)
    if name == "_per_entry_kernel":  # waits on every path: the early exits' (merged into one) and y's
        want = (2, 0) if kwargs.get("USE_PDL") else (0, 0)
    if name == "_expert_gemm_kernel":  # lets its PDL successor launch at once, waits for nothing
        want = (0, 1) if kwargs.get("LAUNCH_DEPENDENTS") else (0, 0)
    if (min(waits, want[0]) if lora else waits, triggers) != want:
        return False, (f"{name}: USE_PDL={kwargs.get('USE_PDL')} but {waits} griddepcontrol.wait and "
                       f"{triggers} launch_dependents in its PTX (want {want})")
    if kernel.metadata.shared > SHARED_LIMIT:
        return False, (f"{name}: {kernel.metadata.shared} bytes of shared memory, more than an sm_90 block has "
                       f"({SHARED_LIMIT}): {sorted(kwargs.items())}")
    stack = stack_bytes(kernel.asm["cubin"])
    large = kwargs.get("R_STEPS", 1) > 1 or kwargs.get("BLOCK_R", 16) > 64 or kwargs.get("BLOCK_M", 16) > 32
    if stack and name == "_producer_shrink_kernel" and kwargs.get("ROW", 0) > 4096:  # the rows of A it holds shrink with K
        return False, f"{name}: {stack} bytes of stack per thread (register spills): {sorted(kwargs.items())}"
    if stack > 64 and name == "_silu_mul_shrink_kernel":  # up to MAX_ROWS rows of A: at most a small frame (64 rows spilled 280 bytes)
        return False, f"{name}: {stack} bytes of stack per thread (register spills): {sorted(kwargs.items())}"
    if stack and name == "_varlen_attention_kernel":  # 128 query rows of 128: must fit in registers
        return False, f"{name}: {stack} bytes of stack per thread (register spills): {sorted(kwargs.items())}"
    if stack and stack > 8 and lora and not large:  # decode tiles at ranks up to 64: no spills (8 bytes: the fused kernel's frame)
        return False, f"{name}: {stack} bytes of stack per thread (register spills): {sorted(kwargs.items())}"
    return True, (f"{name}: {len(kernel.asm['cubin'])} bytes of sm_90 cubin, {kernel.metadata.shared} bytes shared memory"
                  f"{f', {stack} bytes stack' if stack else ''}{', PDL' if waits else ''}")


PARTS = ("pdl-off", "pdl-on")  # launched as with LORABENCH_PDL=0 (and the vectorised loads' checks), and as on sm90 with PDL


def main(part: str) -> int:
    if HOPPER is None:
        print("this Triton cannot compile ahead of time")
        return 3
    if part not in PARTS:
        print(f"usage: compile_sm90.py {'|'.join(PARTS)}")
        return 2
    pdl = part == "pdl-on"
    if not pdl:
        for check in (ranked_loads_stay_vectorised, extended_rows_stay_vectorised, gemm_fits_by_stepping_down):
            problem = check()
            if problem:
                print(problem)
                return 1
    recorders = record_launches()
    use_pdl(pdl)
    for dtype in (torch.float16, torch.bfloat16):
        for tokens in (1, 8, 128):  # 128: more than one token tile, the slot-sorted tiles
            launch_everything(dtype, tokens)
        for tokens in (1, 64):
            launch_moe(dtype, tokens)
            launch_gemm(dtype, tokens)
    for tokens in (1, 128):
        launch_ranks(torch.float16, tokens)
    variants, seen = [], set()
    for name, rec in recorders.items():
        if not rec.calls:
            print(f"{name} was never launched")
            return 1
        for args, kwargs in rec.calls:
            # what the compiler is given (launches that differ only in runtime integers compile alike)
            inputs = compile_inputs(rec.fn, args, kwargs)
            key = name + repr(inputs)
            if key not in seen:
                seen.add(key)
                variants.append((name, rec.fn, inputs, {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}))
        rec.calls.clear()
    VARIANTS[:] = variants
    gc.collect()  # the recorded launches' tensors: a fork of a process that holds them may be refused (ENOMEM)
    jobs = max(1, min(len(variants), int(os.environ.get("COMPILE_JOBS", 0)) or len(os.sched_getaffinity(0))))
    # A pool of forked workers compiles the variants (they inherit VARIANTS; an index goes over): the compiles are
    # independent and take minutes one after another.
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
        results = list(pool.map(check_variant, range(len(variants))))
    for _, line in results:
        print(line)
    failed = [line for ok, line in results if not ok]
    if failed:
        print(f"{len(failed)} of {len(results)} variants failed; the first: {failed[0]}")
        return 1
    compiled = len(results)
    print(f"compiled {compiled} kernel variants for sm_90 ({part})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ""))
