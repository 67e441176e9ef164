"""LoRA inside the base GEMM: ``y = x·Wᵀ (+ bias) + B[slot]·h`` in one launch per LoRA linear.

The ``gemm`` backend. Its shrink (h = scale · x·A[slot]ᵀ into the step's fp32 scratch) runs
inside the op that produces x where the model has one, at decode sizes where its GEMM runs (the
norms for qkv and gate_up, SiLU·mul for down: ``producer_shrink``), else as lorabench's
``shrink.lora_shrink``; the base GEMM and the expand are one Triton kernel, the expand in the GEMM's epilogue. Against cuBLAS + the shrink/expand pair this saves the expand's launch and
its read-modify-write of y (y is written once, rounded once), at the price of running the base
GEMM in Triton: it only pays where that GEMM keeps up with cuBLAS (``scripts/gemm_bench.py``
measures both side by side). Above ``GEMM_MAX_TOKENS`` (prefill sizes, where it does not) the model
runs cuBLAS with the expand inside its K (``extended_gemm``: ``EXTENDS_K``) where a linear's tail
fits, else cuBLAS and this backend's ``lora_apply``, which is then the shrink + expand pair; so
does a decode-sized step over more than ``EPILOGUE_MAX_LAUNCH`` launched slots (``runs_gemm``).

A program owns one output tile ``y[BLOCK_M rows, BLOCK_N columns]``. It adds the LoRA of every
launched slot and slice at once, as one dot over a slot-rank axis (column ``j`` is rank ``j % R`` of
slice ``(j // R) % S`` of launched slot ``active_slots[j // (S·R)]``):

    hm[m, j]  = h[m, s·R + r]   if token m's slot is the column's slot, else 0
    b[j, n]   = B[slot][n, r]   if output column n lies in the column's slice, else 0
    acc[m, n] += Σ_j hm[m, j] · b[j, n]

so each program reads its columns of every active slot's B once, and its rows of h (over all
programs of one M tile: each active B once, the expand's bytes floor; every further M tile reads
them again). Only the active slots' columns are walked (the launched ids past them are -1); a
base-model token (slot -1) matches none. The launched ids and the tokens' slots load before the K
loop; with ``GemmConfig.preload`` the first epilogue step's h and B do too, so their latency hides
behind the weight's stream instead of following it. The launch count bounds that walk, not the
grid: the grid covers y whatever the count. A token whose slot lies past the launch count gets no
LoRA, like the other backends' grids.

Adapters must be finite: a zero of hm times an Inf of another slot's B is NaN in the dot, so one
slot's Inf reaches every token of the M tile (the pair's expand keeps slots apart). Padding past a
slot's own rank is never read under ``+unpadded``.

``GemmConfig.gather`` takes the other epilogue: each token reads its own slot's B over the tile's
columns and sums ``h[m, s·R + r] · B[slot_m][n, r]`` over r in the CUDA cores, so its work follows
the tile's tokens, not the active slots (the walk above reads S·R columns per active slot per tile,
a chain of dependent loads at 32 slots). Made for decode sizes, where a tile's few tokens hold few
of the slots; the launch count still decides who is served (a token's slot must be launched).
Output tiles past ``GATHER_TILE`` elements take the walk (sm_90 compiles of the gather spill from
64 x 64 on, and take minutes at 128 x 256); the tune does not search it (it times one active slot,
where the walk is one step): ``scripts/gemm_bench.py`` times both.
"""

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from . import MAX_SLICES
from .launch import cdiv, next_pow2, pdl_enabled, pdl_launch, pdl_wait, upcast  # noqa: F401 (pdl_enabled: the worker's pdl column)
from .meta import LoRAMeta
from .moe_gemm import gathered_dot
from .moe_gemm_lora import expert_gemm_lora, moe_path  # noqa: F401 (expert LoRA inside the expert GEMM, its rule)
from .moe_lora import moe_lora_apply  # noqa: F401 (expert LoRA where a slice's width fits no tile)
# load_tuned: the backend's interface; GEMM_MAX_TOKENS: the model's rule, bound here and in gemm_configs (patch both)
from .gemm_configs import (  # noqa: F401
    GEMM_MAX_TOKENS, GemmConfig, config_for, load_tuned, smaller,
)
from .shrink import shrink_into
from . import triton_lora
from .tiles import expand_tile, slice_ends

EPILOGUE_ELEMENTS = 4096  # B elements one epilogue step holds (BLOCK_J x BLOCK_N): more spills registers (sm_90 compiles)
GATHER_ELEMENTS = 4096  # the same for a gathered epilogue step (BLOCK_M x BLOCK_N x R_STEP)
GATHER_TILE = 2048  # the largest output tile (BLOCK_M x BLOCK_N) the gathered epilogue takes; larger ones walk

# The shrink splits K with fp32 atomics into the model's scratch: it must start at zero.
NEEDS_ZEROED_SCRATCH = True
# The shrink lets the GEMM launch at once; the GEMM lets its consumer (a base op that waits first) launch.
LETS_CONSUMER_LAUNCH = True
EXTENDS_K = True  # above GEMM_MAX_TOKENS, each linear whose tail fits runs as ``extended_gemm`` (the module doc)
# From this many tokens up to GEMM_MAX_TOKENS, the backend's kernels and the base ops around them launch without PDL:
# at 32 tokens on llama-2-7b (H100, 4 slots) its step's LoRA cost +1.74 ms with PDL and +0.86
# without (one adapter; +1.69 and +1.44 with four), while at one token PDL saved 0.07 ms.
PDL_MAX_TOKENS = 32
# At decode sizes where its GEMM runs (``runs_gemm``) the model fuses the shrink into the op that
# produces the linear's input (the norms, SiLU·mul: ``producer_shrink``) and calls
# ``linear_apply(..., shrunk=True)``.
SHRINK_IN_PRODUCER = True
# Up to this many launched slots a decode-sized step runs the backend's own GEMM; more take cuBLAS and
# the pair, as ``triton`` runs them: the epilogue walks the active slots' rank columns, and over
# 8 and 32 launched slots at 32 tokens (llama-2-7b, rank 16, H100) its steps' LoRA cost +1.50 and
# +3.75 ms against the pair's +0.99 and +1.84 (each linear alone 1.7-2.3x the pair's). Over 4 its
# overhead trailed the pair's in every whole-step run, at (4, 8, 4): +0.735 / +0.611 against
# +0.540 / +0.559 ms (llama-2-7b, two H100s; the steps +1.2 % and equal), +0.791 against +0.678
# (Llama-3.1-8B); over one, today's kernels led in every run (+0.08 to +0.38 ms against +0.35 to
# +0.51 at c = 1). Over 2 it has not been timed: it keeps the epilogue. Past the cap the steps are
# the pair's (at 32 slots to 0.1 %: BENCHMARKS.md).
EPILOGUE_MAX_LAUNCH = 2


@triton.jit
def _lora_chunk(j0, live, token_slot, rows, m_mask, offs_n, n_mask, cols, active_ptr, h_ptr, b_ptr, rank_ptr, n1, n2,
                n3, R, S, stride_hm, stride_bl, stride_bn, BLOCK_J: tl.constexpr, RANKED: tl.constexpr):
    """The epilogue's operands for slot-rank columns [j0, j0 + BLOCK_J): hm [BLOCK_M, BLOCK_J] (h
    where the token's slot is the column's, else 0) and b [BLOCK_J, BLOCK_N] (the column's slot's
    B over the tile's columns of the column's slice, else 0). Column j is rank j % R of slice
    (j // R) % S of launched slot j // (S·R); ``live`` of them hold an active slot. RANKED: a
    column past its slot's own rank (rounded up to 16, ``own_rank``) is left out, its B unread."""
    offs_j = j0 + tl.arange(0, BLOCK_J)
    in_j = offs_j < live
    slot_j = tl.load(active_ptr + offs_j // (S * R), mask=in_j, other=-1)
    s_j = (offs_j // R) % S
    r_j = offs_j % R
    if RANKED:
        own = tl.load(rank_ptr + slot_j, mask=in_j & (slot_j >= 0), other=0)
        in_j = in_j & (r_j < tl.minimum((own + 15) // 16 * 16, R))
    lo_j = tl.where(s_j == 0, 0, tl.where(s_j == 1, n1, n2))
    hi_j = tl.where(s_j == 0, n1, tl.where(s_j == 1, n2, n3))
    match = (token_slot[:, None] == slot_j[None, :]) & in_j[None, :] & m_mask[:, None]
    hm = tl.load(h_ptr + rows[:, None] * stride_hm + (s_j * R + r_j)[None, :], mask=match, other=0.0)
    cols_ok = in_j[:, None] & n_mask[None, :] & (offs_n[None, :] >= lo_j[:, None]) & (offs_n[None, :] < hi_j[:, None])
    b = tl.load(b_ptr + slot_j.to(tl.int64)[:, None] * stride_bl + cols[None, :] * stride_bn + r_j[:, None],
                mask=cols_ok, other=0.0)
    return hm, b


@triton.jit
def _lora_gathered(acc, token_slot, launched, rows, m_mask, offs_n, n_mask, cols, h_ptr, b_ptr, rank_ptr, n1, n2, n3,
                   R: tl.constexpr, stride_hm, stride_bl, stride_bn, R_STEP: tl.constexpr, RANKED: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] plus every served token's own LoRA over the tile's columns:
    Σ_r h[m, s(n)·R + r] · B[slot_m][n, r], s(n) the slice column n lies in; R_STEP ranks at a time
    (a [BLOCK_M, BLOCK_N, R_STEP] gather of B and of h), up to R (not its next power of two: a rank
    of 320 takes 40 steps of 8, not 64). A token is served when its slot is among the launched ones; columns
    past the last slice get nothing."""
    served = tl.sum(((token_slot[:, None] == launched[None, :]) & (launched[None, :] >= 0)).to(tl.int32), axis=1) > 0
    ok_m = m_mask & served
    slot = tl.where(ok_m, token_slot, 0).to(tl.int64)
    s_n = (offs_n >= n1).to(tl.int32) + (offs_n >= n2).to(tl.int32)
    ok_n = n_mask & (offs_n < n3)
    limit = R
    if RANKED:
        own = tl.load(rank_ptr + slot, mask=ok_m, other=0)
        limit = tl.minimum((own + 15) // 16 * 16, R)[:, None, None]
    for r0 in tl.static_range(0, R, R_STEP):
        offs_r = r0 + tl.arange(0, R_STEP)
        mask = ok_m[:, None, None] & ok_n[None, :, None] & (offs_r[None, None, :] < limit)
        b = tl.load(b_ptr + slot[:, None, None] * stride_bl + cols[None, :, None] * stride_bn + offs_r[None, None, :],
                    mask=mask, other=0.0)
        hv = tl.load(h_ptr + rows[:, None, None] * stride_hm + (s_n[None, :, None] * R + offs_r[None, None, :]),
                     mask=mask, other=0.0)
        acc += tl.sum(hv * b.to(tl.float32), axis=2)
    return acc


@triton.jit
def _gemm_lora_kernel(
    x_ptr,  # [T, K] input activations
    w_ptr,  # [N, K] base weight (unused without HAS_BASE)
    bias_ptr,  # [N] base bias (HAS_BIAS only)
    y_ptr,  # [T, N] out; read first without HAS_BASE (y += LoRA)
    h_ptr,  # [T, S·R] float32: the shrink's scale · x·A[slot]ᵀ, slice s at columns s·R..
    b_ptr,  # [L, N_lora, R] stacked B weights (the slices along the output axis)
    token_slot_ptr,  # [T] slot of every token, -1 for base-model tokens
    active_ptr,  # [>= launch count] active slot ids first, then -1
    rank_ptr,  # [max_loras] each slot's own rank (RANKED only)
    T, N, K,
    LAUNCH,  # launch count: the active slots looked at
    n1, n2, n3,  # slice ends in y's columns (slice s: [n_s, n_{s+1}), n0 = 0)
    stride_xm, stride_wn, stride_ym, stride_hm, stride_bl, stride_bn,
    R: tl.constexpr,  # rank: h's columns per slice, B's columns (constant: a rank of 16s keeps B's and h's loads vectorised)
    S: tl.constexpr,  # slices (1..3)
    HAS_BASE: tl.constexpr,  # compute x·Wᵀ (else y's own values are the base)
    HAS_BIAS: tl.constexpr,
    HAS_LORA: tl.constexpr,  # add the epilogue (a launch count of 0 leaves it out)
    BLOCK_M: tl.constexpr,  # token rows per tile
    BLOCK_N: tl.constexpr,  # output columns per tile
    BLOCK_K: tl.constexpr,  # reduction step
    BLOCK_J: tl.constexpr,  # slot-rank columns per epilogue step; the first step's loads go before the K loop
    LAUNCH_PAD: tl.constexpr,  # next power of two >= the launch count
    GROUP_M: tl.constexpr,  # M tiles walked together (L2 reuse of W across M tiles at prefill sizes)
    PRELOAD: tl.constexpr,  # load the first epilogue step's h and B before the K loop (else after it)
    USE_PDL: tl.constexpr,  # PDL-launched: wait for the predecessor first; let the consumer launch at once
    UPCAST: tl.constexpr,  # dots in fp32 (interpreter + bf16 only)
    RANKED: tl.constexpr,  # skip each slot's padding past its own rank (LoRAMeta.slot_rank)
    GATHER: tl.constexpr,  # the gathered epilogue (each token its own slot's B) instead of the walk over the active slots
    R_STEP: tl.constexpr,  # GATHER: ranks per gather step (a power of two)
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(T, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < T
    n_mask = offs_n < N
    rows = offs_m.to(tl.int64)
    cols = offs_n.to(tl.int64)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    pdl_wait(USE_PDL)

    if HAS_LORA:  # the launched ids and the tokens' slots load now, behind the K loop
        offs_l = tl.arange(0, LAUNCH_PAD)
        launched = tl.load(active_ptr + offs_l, mask=offs_l < LAUNCH, other=-1)
        live = tl.sum((launched >= 0).to(tl.int32), axis=0) * S * R  # active slots come first
        token_slot = tl.load(token_slot_ptr + offs_m, mask=m_mask, other=-1)
        if PRELOAD and not GATHER:  # and the epilogue's first operands (registers held over the loop)
            hm, b = _lora_chunk(0, live, token_slot, rows, m_mask, offs_n, n_mask, cols, active_ptr, h_ptr, b_ptr,
                                rank_ptr, n1, n2, n3, R, S, stride_hm, stride_bl, stride_bn, BLOCK_J, RANKED)

    if HAS_BASE:
        acc = gathered_dot(x_ptr, rows, m_mask, stride_xm, w_ptr, cols, n_mask, stride_wn, K, BLOCK_M, BLOCK_N, BLOCK_K,
                           UPCAST)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_tile = y_ptr + rows[:, None] * stride_ym + offs_n[None, :]
    y_mask = m_mask[:, None] & n_mask[None, :]
    if not HAS_BASE:
        acc = tl.load(y_tile, mask=y_mask, other=0.0).to(tl.float32)

    if HAS_LORA and GATHER:
        acc = _lora_gathered(acc, token_slot, launched, rows, m_mask, offs_n, n_mask, cols, h_ptr, b_ptr, rank_ptr,
                             n1, n2, n3, R, stride_hm, stride_bl, stride_bn, R_STEP, RANKED)
    elif HAS_LORA:
        if not PRELOAD:
            hm, b = _lora_chunk(0, live, token_slot, rows, m_mask, offs_n, n_mask, cols, active_ptr, h_ptr, b_ptr,
                                rank_ptr, n1, n2, n3, R, S, stride_hm, stride_bl, stride_bn, BLOCK_J, RANKED)
        acc += expand_tile(hm, b, UPCAST)
        for j0 in range(BLOCK_J, live, BLOCK_J):  # more slot-rank columns than one step holds
            hm, b = _lora_chunk(j0, live, token_slot, rows, m_mask, offs_n, n_mask, cols, active_ptr, h_ptr, b_ptr,
                                rank_ptr, n1, n2, n3, R, S, stride_hm, stride_bl, stride_bn, BLOCK_J, RANKED)
            acc += expand_tile(hm, b, UPCAST)
    tl.store(y_tile, acc.to(y_ptr.dtype.element_ty), mask=y_mask)


# The tiling that fits, per launch that needed a smaller one: (tokens, K, N, dtype, launched slot-rank width, base GEMM) ->
# config. What a tiling takes of shared memory is what Triton's compiler makes of it (its pipeliner's
# buffers, the epilogue's dot operands, layout conversions); no formula predicts it across dtypes,
# so the launch finds out (OutOfResources comes before anything runs) and steps down.
FITTED: dict[tuple, GemmConfig] = {}


def _launch(y, x, weight, bias, h, lora_b, slice_starts, meta, launch_count, config, pdl):
    tokens, n = y.shape
    k = x.shape[1] if weight is not None else 0
    lora = launch_count > 0
    slices = len(slice_starts) - 1 if lora else 1
    ends = slice_ends(slice_starts, "gemm")[0] if lora else [0] * MAX_SLICES  # n1..n3: the slices' ends
    rank = lora_b.shape[2] if lora else 1
    for name, t in (("x", x if weight is not None else None), ("weight", weight), ("bias", bias), ("y", y),
                    ("h", h if lora else None), ("B", lora_b if lora else None)):
        if t is not None and t.stride(-1) != 1:  # the kernel steps its last axis by 1
            raise ValueError(f"the gemm kernel needs {name}'s last axis contiguous (stride {t.stride(-1)})")
    width = next_pow2(launch_count * slices * rank) if lora else 0  # the launched slot-rank columns
    key = (tokens, k, n, y.dtype, width, weight is not None)
    cfg = config or FITTED.get(key) or config_for(tokens, k, n)
    up = upcast(y.dtype)
    ranked = lora and meta.slot_rank is not None
    args = (
        x, weight if weight is not None else y, bias if bias is not None else y, y,
        h if lora else y, lora_b if lora else y, meta.token_slot if lora else y, meta.active_slots if lora else y,
        meta.slot_rank if ranked else y, tokens, n, k, max(1, launch_count), *ends,
        x.stride(0), weight.stride(0) if weight is not None else 0, y.stride(0),
        h.stride(0) if lora else 0, lora_b.stride(0) if lora else 0, lora_b.stride(1) if lora else 0,
    )
    flags = dict(R=rank, S=slices, HAS_BASE=weight is not None, HAS_BIAS=bias is not None, HAS_LORA=lora,
                 LAUNCH_PAD=next_pow2(max(1, launch_count)), USE_PDL=pdl, UPCAST=up, RANKED=ranked,
                 **pdl_launch(pdl))
    while True:
        grid = (cdiv(tokens, cfg.block_m) * cdiv(n, cfg.block_n),)
        block_j = max(16, min(width, EPILOGUE_ELEMENTS // cfg.block_n))
        tile = cfg.block_m * cfg.block_n
        gather = cfg.gather and tile <= GATHER_TILE
        # the gathered epilogue's step: [BLOCK_M, BLOCK_N, R_STEP] of B, at most GATHER_ELEMENTS
        r_step = min(next_pow2(rank), max(1, GATHER_ELEMENTS // tile)) if gather else 1
        try:
            _gemm_lora_kernel[grid](*args, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_J=block_j,
                                    GROUP_M=cfg.group_m, PRELOAD=cfg.preload and not gather, GATHER=gather, R_STEP=r_step,
                                    num_warps=cfg.num_warps, num_stages=cfg.num_stages, **flags)
        except OutOfResources:
            down = smaller(cfg)
            if config is not None or down is None:  # a config asked for (a tune's) is not changed behind its back
                raise
            cfg = FITTED[key] = down
            continue
        return


def runs_gemm(tokens: int, launch_count: int) -> bool:
    """Whether a step of ``tokens`` that launches ``launch_count`` slots runs the backend's own GEMM
    (the expand in its epilogue): at decode sizes (up to ``GEMM_MAX_TOKENS``) over at most
    ``EPILOGUE_MAX_LAUNCH`` slots. Otherwise cuBLAS runs the base GEMM, with the expand inside its K
    (``extended_gemm``, prefill sizes) or followed by the pair (``lora_apply``)."""
    return tokens <= GEMM_MAX_TOKENS and launch_count <= EPILOGUE_MAX_LAUNCH


def pdl_at(tokens: int, launch_count: int) -> bool:
    """Whether a step PDL-launches the backend's kernels and the base ops around them: not where
    its own GEMM runs from ``PDL_MAX_TOKENS`` tokens on; where the pair runs, as ``triton``'s do."""
    return tokens < PDL_MAX_TOKENS or not runs_gemm(tokens, launch_count)


def uses_pdl(x: torch.Tensor) -> bool:
    """Whether the backend's own kernels (the shrink and the GEMM) PDL-launch for x's tokens: the
    model calls them only where they run (``runs_gemm``), so only the tokens count here."""
    tokens = x.shape[0]
    return pdl_enabled(x.device) and (tokens < PDL_MAX_TOKENS or tokens > GEMM_MAX_TOKENS)


def linear_apply(x, weight, bias, lora_a, lora_b, slice_starts, meta: LoRAMeta, launch_count, scale, scratch=None,
                 config=None, shrunk=False):
    """``x·weightᵀ + bias`` with the LoRA of the first ``launch_count`` active slots added, as a new
    [T, N] tensor: the shrink, then one GEMM whose epilogue expands. x [T, K] and weight [N, K]
    contiguous rows; the rest as in ``triton_lora.lora_apply`` (scratch zero on entry).
    ``shrunk``: scratch holds h already (the op that produced x computed it: ``producer_shrink``)."""
    x = x if x.stride(1) == 1 else x.contiguous()
    y = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    h = None
    pdl = uses_pdl(x)
    if launch_count > 0 and shrunk:
        h = scratch[:x.shape[0], :(len(slice_starts) - 1) * lora_b.shape[2]]
    elif launch_count > 0:
        h = shrink_into(x, lora_a, meta, launch_count, scale, len(slice_starts) - 1, lora_b.shape[2], scratch, pdl)
    _launch(y, x, weight, bias, h, lora_b, slice_starts, meta, max(0, launch_count), config, pdl)
    return y


def base_linear(x, weight, bias=None, config=None):
    """``x·weightᵀ + bias`` by the gemm kernel alone (what its base GEMM costs against cuBLAS)."""
    x = x if x.stride(1) == 1 else x.contiguous()
    y = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    _launch(y, x, weight, bias, None, None, (0,), None, 0, config, False)
    return y


def lora_apply(y, x, lora_a, lora_b, slice_starts, meta: LoRAMeta, launch_count, scale, scratch=None):
    """y += LoRA in place (the backend interface for a y that exists already): the shrink, then the
    kernel's epilogue alone over y (no base GEMM); where the backend does not run its own GEMM
    (``runs_gemm``), the pair's. The model calls ``linear_apply`` where it does and this elsewhere."""
    if launch_count <= 0:
        return
    if not runs_gemm(x.shape[0], launch_count):
        triton_lora.lora_apply(y, x, lora_a, lora_b, slice_starts, meta, launch_count, scale, scratch)
        return
    pdl = uses_pdl(x)
    h = shrink_into(x, lora_a, meta, launch_count, scale, len(slice_starts) - 1, lora_b.shape[2], scratch, pdl)
    _launch(y, x, None, None, h, lora_b, slice_starts, meta, launch_count, None, pdl)

