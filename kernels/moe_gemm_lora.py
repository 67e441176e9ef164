"""Expert LoRA inside the expert GEMM: ``y = x·W[e]ᵀ + scale · B[slot, e]·(A[slot, e]·x)`` in one launch.

The ``gemm`` backend's MoE op. ``moe_lora`` adds expert LoRA to the grouped GEMM's output with
one or two launches of its own per projection, each reading and writing y again; here the grouped
GEMM's program (one block of ``BLOCK_M`` entries of one expert, one tile of ``BLOCK_N`` outputs)
adds it before y is written: after its K loop over W[e] it walks the launched slots (the launch
count bounds the walk, as it bounds the other kernels' grids), and for each slot that holds
entries of its block computes their h over K (A[s, slot, e], read from L2 by the block's other
output tiles) and adds h·B[s, slot, e]ᵀ over its tile, then multiplies in the routing weights
(w2) and stores y once, rounded once. No launch, no pass over y and no h in memory: what expert
LoRA adds is its A and B bytes and a dot per tile.

A block whose adapter entries all belong to one launched slot (at decode, nearly every block:
few entries per expert) computes h inside the GEMM's K loop, from the x tiles the GEMM loads
anyway, A's tiles streaming beside W's; other blocks walk their slots after the K loop.
Each program recomputes its block's h, one per output tile: cheap where a block's entries are few
(decode) and its A sits in L2, the more costly the more tiles (Mixtral's w13: 448 tiles of 64).
``shrink_first`` computes every entry's h once instead, with the sorted path's shrink
(``moe_lora.sorted_shrink``, one launch more), and the GEMM's programs read it: for blocks of many
entries and wide outputs. ``scripts/moe_lora_bench.py --with-gemm`` times both.
An output tile never straddles two slices (gate and up): the slice width must be a multiple of
the tile's, else the op falls back to the GEMM and ``moe_lora.moe_lora_apply`` after it.

Layouts as ``moe_gemm.expert_gemm`` and ``moe_lora`` (``expert_call.ExpertCall``): A ``[S, L, E, R, K]``,
B ``[S, L, E, N_s, R]``, the base MoE's blocks; a base-model token (slot -1), a slot without
expert LoRA (``enabled`` 0) and a slot past the launch count get no LoRA.
"""

import torch
import triton
import triton.language as tl

from .launch import INTERPRET, cdiv, next_pow2, upcast
from .meta import LoRAMeta
from .moe_gemm import BLOCK_M, block_entries, expert_gemm, gathered_dot, store_entries
from .expert_call import ExpertCall
from .moe_lora import moe_lora_apply, sorted_shrink

IN_GEMM = "in-gemm"  # the path names rows record (``moe_lora``'s are per-entry and sorted): h per output tile,
IN_GEMM_SHRUNK = "in-gemm+shrink"  # and the sorted shrink first
SHRINK_FIRST_ENTRIES_PER_EXPERT = 1  # the gemm backend's rule: shrink first past this many routed entries per expert
MAX_BLOCK_R = 32  # rank columns per step of the LoRA walk (sm_90 compiles: 64 spills registers, 32 does not)
BLOCK_KA = 64  # the LoRA K loop's step over A (128 spilled at rank 16)
BLOCK_K = 64  # the GEMM's K step here (the plain grouped GEMM's is 128: here 128 spilled 250-750 bytes a thread)


@triton.jit
def _expert_gemm_lora_kernel(
    x_ptr,  # [T, K] tokens, or [T·top_k, K] entries (X_PER_ENTRY)
    w_ptr,  # [E, N, K] the experts' weights
    y_ptr,  # [T·top_k, N] out, one row per entry
    a_ptr,  # [S, L, E, R, K] expert LoRA A
    b_ptr,  # [S, L, E, NS, R] expert LoRA B
    sorted_ptr,  # [P] entries grouped per expert in blocks of BLOCK_M, pad value numel
    expert_ids_ptr,  # [P / BLOCK_M] each block's expert
    post_pad_ptr,  # [1] padded entries: blocks past it are idle
    routed_ptr,  # [T·top_k] routing weights (MUL_WEIGHT only)
    token_slot_ptr,  # [T] each token's slot, -1 base
    active_ptr,  # [>= launch_count] the batch's active slots, -1 past them
    enabled_ptr,  # [L] non-zero where the slot's adapter has expert LoRA
    h_ptr,  # [S, P, R] the entries' h from the sorted shrink, scale applied (H_GIVEN only)
    N, K, NS, R, numel, top_k, launch_count, scale,
    stride_xm, stride_we, stride_wn, stride_ym, stride_hs, stride_hp,
    stride_as, stride_al, stride_ae, stride_ar,
    stride_bs, stride_bl, stride_be, stride_bn,
    X_PER_ENTRY: tl.constexpr,  # x has a row per entry (w2's input), not per token (w13's)
    MUL_WEIGHT: tl.constexpr,  # multiply each row (base and LoRA) by its routing weight (w2)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # divides NS: a tile lies in one slice
    BLOCK_K: tl.constexpr,  # the base K loop's step
    BLOCK_KA: tl.constexpr,  # the LoRA K loop's step (over A)
    BLOCK_R: tl.constexpr,  # rank columns per step of the walk, >= 16 for tl.dot
    H_GIVEN: tl.constexpr,  # h read from h_ptr instead of computed over K in every output tile
    ONE_PASS: tl.constexpr,  # a block whose adapter entries are one launched slot's computes h in the GEMM's K loop
    UPCAST: tl.constexpr,  # dots in fp32 (interpreter + bf16 only)
):
    pid_n = tl.program_id(0)  # consecutive programs share a block (and its A, x rows and h), not an output tile
    pid_m = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(post_pad_ptr):
        return
    expert, entry, valid, rows = block_entries(pid_m, sorted_ptr, expert_ids_ptr, numel, top_k, X_PER_ENTRY, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    s = (pid_n * BLOCK_N) // NS  # the tile's slice
    offs_ns = offs_n - s * NS
    slot_of = tl.load(token_slot_ptr + entry // top_k, mask=valid, other=-1)
    one = _one_slot(slot_of, valid, R, launch_count, active_ptr, enabled_ptr, BLOCK_R, ONE_PASS and not H_GIVEN)
    if one >= 0:  # the block's adapter entries are one launched slot's: h in the same K loop as the GEMM
        acc = _one_pass(x_ptr, w_ptr, a_ptr, b_ptr, y_ptr, rows, valid, slot_of == one, one.to(tl.int64), expert, s,
                        offs_n, n_mask, offs_ns, K, R, scale, stride_xm, stride_we, stride_wn, stride_as, stride_al,
                        stride_ae, stride_ar, stride_bs, stride_bl, stride_be, stride_bn,
                        BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_R, UPCAST)
    else:
        acc = gathered_dot(x_ptr, rows, valid, stride_xm, w_ptr + expert * stride_we, offs_n, n_mask, stride_wn, K,
                           BLOCK_M, BLOCK_N, BLOCK_K, UPCAST)
        acc = _walk(acc, x_ptr, a_ptr, b_ptr, y_ptr, h_ptr, rows, valid, slot_of, expert, s, pid_m, offs_n, n_mask,
                    offs_ns, K, R, launch_count, scale, active_ptr, enabled_ptr, stride_xm, stride_hs, stride_hp,
                    stride_as, stride_al, stride_ae, stride_ar, stride_bs, stride_bl, stride_be, stride_bn,
                    BLOCK_M, BLOCK_KA, BLOCK_R, H_GIVEN, UPCAST)
    store_entries(acc, y_ptr, entry, valid, offs_n, n_mask, routed_ptr, stride_ym, MUL_WEIGHT)


@triton.jit
def _one_slot(slot_of, valid, R, launch_count, active_ptr, enabled_ptr, BLOCK_R: tl.constexpr, ENABLED: tl.constexpr):
    """The block's one adapter slot where all its adapter entries are one slot's, that slot is
    among the launched ones with expert LoRA and its rank fits one step; else -1."""
    one = tl.full([], -1, tl.int32)
    if ENABLED:
        adapter = valid & (slot_of >= 0)
        lo = tl.min(tl.where(adapter, slot_of, 2**30), axis=0)
        hi = tl.max(tl.where(adapter, slot_of, -1), axis=0)
        if (hi >= 0) & (lo == hi) & (R <= BLOCK_R):
            launched = 0
            for z in range(0, launch_count):
                launched += (tl.load(active_ptr + z) == hi).to(tl.int32)
            if launched > 0:
                if tl.load(enabled_ptr + hi) != 0:
                    one = hi.to(tl.int32)
    return one


@triton.jit
def _one_pass(x_ptr, w_ptr, a_ptr, b_ptr, y_ptr, rows, valid, mine, slot, expert, s, offs_n, n_mask, offs_ns, K, R, scale,
              stride_xm, stride_we, stride_wn, stride_as, stride_al, stride_ae, stride_ar,
              stride_bs, stride_bl, stride_be, stride_bn,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
              UPCAST: tl.constexpr):
    """The GEMM's K loop with h = A[s, slot, e]·x accumulated from the same x tiles, then h·Bᵀ
    added for ``mine`` (the slot's entries; other rows of h are zeroed): x read once, A's loads in
    the GEMM's pipeline."""
    w_base = w_ptr + expert * stride_we
    a_base = a_ptr + s * stride_as + slot * stride_al + expert * stride_ae
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None], mask=n_mask[None, :] & k_mask[:, None],
                    other=0.0)
        a = tl.load(a_base + offs_r[None, :] * stride_ar + offs_k[:, None], mask=r_mask[None, :] & k_mask[:, None],
                    other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
            a = a.to(tl.float32)
        acc += tl.dot(x, w)
        h += tl.dot(x, a)
    h = (tl.where(mine[:, None], h, 0.0) * scale).to(y_ptr.dtype.element_ty)  # rounded like a shrink's output
    b_base = b_ptr + s * stride_bs + slot * stride_bl + expert * stride_be
    b = tl.load(b_base + offs_ns[None, :] * stride_bn + offs_r[:, None], mask=n_mask[None, :] & r_mask[:, None],
                other=0.0)
    if UPCAST:
        h = h.to(tl.float32)
        b = b.to(tl.float32)
    return acc + tl.dot(h, b)


@triton.jit
def _walk(acc, x_ptr, a_ptr, b_ptr, y_ptr, h_ptr, rows, valid, slot_of, expert, s, pid_m, offs_n, n_mask, offs_ns,
          K, R, launch_count, scale, active_ptr, enabled_ptr, stride_xm, stride_hs, stride_hp,
          stride_as, stride_al, stride_ae, stride_ar, stride_bs, stride_bl, stride_be, stride_bn,
          BLOCK_M: tl.constexpr, BLOCK_KA: tl.constexpr, BLOCK_R: tl.constexpr, H_GIVEN: tl.constexpr,
          UPCAST: tl.constexpr):
    """``acc`` plus the LoRA of every launched slot with entries in the block, each slot's h over K
    (or read, ``H_GIVEN``) in rank steps of BLOCK_R."""
    for z in range(0, launch_count):
        slot = tl.load(active_ptr + z)
        if slot >= 0:
            if tl.load(enabled_ptr + slot) != 0:
                mine = valid & (slot_of == slot)
                if tl.max(mine.to(tl.int32), axis=0) > 0:
                    a_base = a_ptr + s * stride_as + slot.to(tl.int64) * stride_al + expert * stride_ae
                    b_base = b_ptr + s * stride_bs + slot.to(tl.int64) * stride_bl + expert * stride_be
                    for r0 in range(0, R, BLOCK_R):
                        offs_r = r0 + tl.arange(0, BLOCK_R)
                        r_mask = offs_r < R
                        if H_GIVEN:
                            offs_p = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
                            h = tl.load(h_ptr + s * stride_hs + offs_p[:, None] * stride_hp + offs_r[None, :],
                                        mask=mine[:, None] & r_mask[None, :], other=0.0)
                        else:
                            h = gathered_dot(x_ptr, rows, mine, stride_xm, a_base, offs_r, r_mask, stride_ar, K,
                                             BLOCK_M, BLOCK_R, BLOCK_KA, UPCAST)
                            h = (h * scale).to(y_ptr.dtype.element_ty)  # rounded like a shrink's output
                        b = tl.load(b_base + offs_ns[None, :] * stride_bn + offs_r[:, None],
                                    mask=n_mask[None, :] & r_mask[:, None], other=0.0)
                        if UPCAST:
                            h = h.to(tl.float32)
                            b = b.to(tl.float32)
                        acc += tl.dot(h, b)
    return acc


def tile_n(ns: int, slices: int) -> int | None:
    """The output tile's width: the widest of 64, 32, 16 (32 under the interpreter) that a slice's
    width is a multiple of (any, for one slice); None where none is: the op then falls back."""
    widths = (32, 16) if INTERPRET else (64, 32, 16)
    return next((w for w in widths if slices == 1 or ns % w == 0), None)


def moe_path(tokens: int, top_k: int, experts: int, max_loras: int, launch_count: int) -> str:
    """The gemm backend's rule: h per output tile while the routed entries are at most one per
    expert (a block then holds about one entry, so one slot: its h costs R·K of A per tile), the
    shrink first above (blocks of several entries and slots would recompute h for each slot in
    every tile: d·R/BLOCK_N more bytes than the GEMM's own). Timed after the GEMM alone
    (``scripts/moe_lora_bench.py --with-gemm``, H100, 16 slots, as many launched as active, git
    8cb194b): it wins at Qwen3-30B-A3B's 64 tokens of one adapter (1.43 against the sorted path's
    1.92 ms over the GEMM) and loses elsewhere to the per-entry path launched as the GEMM's PDL
    successor (Qwen3 at 2 tokens 0.55 against 0.21; Mixtral-8x7B at 64 tokens of 16 adapters 10.7
    against 4.1)."""
    del max_loras, launch_count
    return IN_GEMM_SHRUNK if tokens * top_k > SHRINK_FIRST_ENTRIES_PER_EXPERT * experts else IN_GEMM


def expert_gemm_lora(w: torch.Tensor, call: ExpertCall, meta: LoRAMeta, launch_count: int, scale: float,
                     shrink_first: bool | None = None, one_pass: bool = True) -> torch.Tensor:
    """The projection's per-entry output with its expert LoRA: ``expert_gemm(call.x, w, ...)`` plus
    ``moe_lora_apply``'s update, in one launch. ``call.y`` is ignored (None is fine): the output
    is a new [T·top_k, N] tensor in x's dtype. Falls back to those two ops where a slice's width
    is no multiple of a tile's, and to the GEMM alone at launch count 0. ``shrink_first``: the
    sorted path's shrink computes every entry's h once first (a launch more), and the GEMM reads
    it instead of recomputing it in each output tile: for blocks of many entries and wide outputs
    (None: as ``moe_path`` says). ``one_pass``: a block whose adapter entries are all one launched
    slot's (at decode, most blocks) computes h in the GEMM's own K loop, from the x tiles it loads
    anyway; False: every block walks its slots after the K loop."""
    x = call.x
    routed = call.topk_weights if call.mul_weight else None
    slices, _, experts, rank, k = call.lora_a.shape
    ns = call.lora_b.shape[3]
    n = w.shape[1]
    block_n = tile_n(ns, slices)
    if launch_count <= 0 or slices * ns != n or block_n is None:
        y = expert_gemm(x, w, call.topk_ids, call.layout, routed=routed, x_per_entry=call.x_per_entry)
        moe_lora_apply(call._replace(y=y), meta, launch_count, scale)  # nothing at launch count 0
        return y
    tokens, top_k = call.topk_ids.shape
    numel = tokens * top_k
    if shrink_first is None:
        shrink_first = moe_path(tokens, top_k, experts, call.lora_a.shape[1], launch_count) == IN_GEMM_SHRUNK
    y = torch.empty((numel, n), dtype=x.dtype, device=x.device)
    if numel == 0:
        return y
    sorted_ids, expert_ids, post_pad = call.layout
    x_s, *a_s = call.shrink_strides()
    *b_s, y_s = call._replace(y=y).expand_strides()
    block_r = max(16, min(MAX_BLOCK_R, next_pow2(rank)))
    h = sorted_shrink(call, meta, launch_count, scale) if shrink_first else y
    hs = h.stride()[:2] if shrink_first else (0, 0)
    grid = (cdiv(n, block_n), cdiv(sorted_ids.shape[-1], BLOCK_M))
    _expert_gemm_lora_kernel[grid](
        x, w, y, call.lora_a, call.lora_b, sorted_ids, expert_ids, post_pad, routed if routed is not None else y,
        meta.token_slot, meta.active_slots, call.enabled, h,
        n, k, ns, rank, numel, top_k, launch_count, scale,
        x_s, w.stride(0), w.stride(1), y_s, *hs, *a_s, *b_s,
        X_PER_ENTRY=call.x_per_entry, MUL_WEIGHT=call.mul_weight, BLOCK_M=BLOCK_M, BLOCK_N=block_n,
        BLOCK_K=32 if INTERPRET else BLOCK_K, BLOCK_KA=32 if INTERPRET else BLOCK_KA, BLOCK_R=block_r, H_GIVEN=shrink_first, ONE_PASS=one_pass,
        UPCAST=upcast(x.dtype), num_warps=4, num_stages=3,
    )
    return y
