"""Device helpers every lorabench LoRA kernel shares: which slot and token tile a program serves
(``adapter_tile``, ``packed_tile``, ``token_grid``), whether a token's slot is launched
(``token_served``) and where among the launched slots (``launch_positions``), a slot's own rank
(``own_rank``), a slice's output columns (``slice_bounds``) and the expand's dot that keeps h's
precision (``expand_tile``)."""

from typing import NamedTuple

import triton
import triton.language as tl

from . import MAX_SLICES
from .launch import cdiv, next_pow2

# Above one token tile, the launched slots' tiles end to end (False: a grid column of the batch's
# tiles per launched slot, as before: scripts/linear_bench.py's slot-columns variants).
PACKED_TILES = True


@triton.jit
def adapter_tile(pid_m, lora_idx, tokens, token_slot_ptr, sorted_ptr, active_ptr, start_ptr,
                 BLOCK_M: tl.constexpr, SORTED: tl.constexpr, USE_PDL: tl.constexpr):
    """What program (pid_m, adapter lora_idx) serves: its slot (``active_ptr[lora_idx]``), the rows
    (int64) and mask of its token tile ``pid_m``, and whether it is idle (slot -1, or none of the
    slot's tokens in the tile). Under PDL it also lets the next kernel launch now, so every caller
    must ``pdl_wait`` before it writes and before it exits.

    SORTED: the tile is entries [pid_m·BLOCK_M, +BLOCK_M) of the slot's range of ``sorted_ptr``,
    which takes two dependent loads after the slot's (the range, then the rows). Otherwise the tile
    is tokens [pid_m·BLOCK_M, +BLOCK_M) in batch order with the mask ``token_slot == slot``: one load,
    issued alongside the slot's. Launchers use it when one tile holds the whole batch (decode),
    where it saves a round trip; for many tiles every adapter would scan them all."""
    slot = tl.load(active_ptr + lora_idx)
    offs = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if SORTED:
        start = tl.load(start_ptr + lora_idx)
        count = tl.load(start_ptr + lora_idx + 1) - start
        mask = offs < count
        rows = tl.load(sorted_ptr + start + offs, mask=mask, other=0)
    else:  # padding and base tokens are -1, as is an unused slot: `idle` keeps those apart
        mask = tl.load(token_slot_ptr + offs, mask=offs < tokens, other=-1) == slot
        rows = offs
    if USE_PDL:  # the next kernel (the expand, or the base op that consumes y) may launch now
        tl.extra.cuda.gdc_launch_dependents()
    idle = (slot < 0) | (tl.max(mask.to(tl.int32), axis=0) == 0)
    return slot, rows.to(tl.int64), mask, idle


@triton.jit
def packed_tile(pid_m, launch, sorted_ptr, active_ptr, start_ptr,
                BLOCK_M: tl.constexpr, LAUNCH_PAD: tl.constexpr, USE_PDL: tl.constexpr):
    """``adapter_tile`` over the packed token tiles: tile ``pid_m`` of the launched slots' tiles
    laid end to end (slot z's ``cdiv(count_z, BLOCK_M)`` tiles after those of slots 0..z-1), so
    that ``packed_tiles`` programs cover every launched slot's tokens, not ``launch`` x the batch's
    tiles: a slot that holds a few tokens of a long prompt step costs its tiles, not a column of
    idle programs as long as the batch. Which slot a tile is theirs comes from the launched slots'
    ranges (one load of ``launch + 1`` starts), then the rows (a second): two dependent round
    trips, as ``adapter_tile``'s sorted tiles. A tile past the last slot's is idle."""
    offs_l = tl.arange(0, LAUNCH_PAD)
    in_l = offs_l < launch
    lo = tl.load(start_ptr + offs_l, mask=in_l, other=0)
    hi = tl.load(start_ptr + offs_l + 1, mask=in_l, other=0)
    tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
    ends = tl.cumsum(tiles, axis=0)
    z = tl.minimum(tl.sum(((ends <= pid_m) & in_l).to(tl.int32), axis=0), launch - 1)
    here = offs_l == z
    first = tl.sum(tl.where(here, ends - tiles, 0), axis=0)
    start = tl.sum(tl.where(here, lo, 0), axis=0)
    count = tl.sum(tl.where(here, hi - lo, 0), axis=0)
    slot = tl.load(active_ptr + z)
    offs = (pid_m - first) * BLOCK_M + tl.arange(0, BLOCK_M)  # past the last slot's tiles: past its count
    mask = offs < count
    rows = tl.load(sorted_ptr + start + offs, mask=mask, other=0)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    idle = (slot < 0) | (tl.max(mask.to(tl.int32), axis=0) == 0)
    return slot, rows.to(tl.int64), mask, idle


@triton.jit
def slot_tile(pid_m, lora_idx, launch, tokens, token_slot_ptr, sorted_ptr, active_ptr, start_ptr,
              BLOCK_M: tl.constexpr, SORTED: tl.constexpr, PACKED: tl.constexpr, LAUNCH_PAD: tl.constexpr,
              USE_PDL: tl.constexpr):
    """What a program serves, by the launch's layout: ``packed_tile`` (PACKED: ``pid_m`` walks the
    launched slots' tiles end to end) or ``adapter_tile`` (grid column ``lora_idx``'s slot)."""
    if PACKED:
        return packed_tile(pid_m, launch, sorted_ptr, active_ptr, start_ptr, BLOCK_M, LAUNCH_PAD, USE_PDL)
    return adapter_tile(pid_m, lora_idx, tokens, token_slot_ptr, sorted_ptr, active_ptr, start_ptr, BLOCK_M, SORTED,
                        USE_PDL)


def sorted_tiles(tokens: int, block_m: int) -> bool:
    """Whether a launch needs the slot-sorted token tiles (more than one tile of tokens)."""
    return tokens > block_m


def packed_tiles(tokens: int, block_m: int, launch: int) -> int:
    """The packed tiles a launch of ``launch`` slots over ``tokens`` tokens needs at most: the
    slots' tiles, Σ cdiv(count_z, BLOCK_M) <= cdiv(tokens, BLOCK_M) + launch - 1 (each slot's last
    tile adds at most one partial tile to the batch's)."""
    return cdiv(tokens, block_m) + launch - 1


class TokenGrid(NamedTuple):
    """How a launch of the shrink, the expand or the fused kernel covers its tokens: ``tiles``
    token tiles along the grid's first axis, ``columns`` along its adapter axis, and the
    constexprs ``slot_tile`` reads."""

    tiles: int
    columns: int
    sorted: bool
    packed: bool
    launch_pad: int

    def flags(self) -> dict:
        return dict(SORTED=self.sorted, PACKED=self.packed, LAUNCH_PAD=self.launch_pad)


def token_grid(tokens: int, block_m: int, launch: int) -> TokenGrid:
    """One tile of the batch in batch order, a grid column per launched slot (decode); above one
    tile the launched slots' packed tiles in one column (``PACKED_TILES``)."""
    sorted_ = sorted_tiles(tokens, block_m)
    if sorted_ and PACKED_TILES:
        return TokenGrid(packed_tiles(tokens, block_m, launch), 1, True, True, next_pow2(launch))
    return TokenGrid(cdiv(tokens, block_m), launch, sorted_, False, 1)


@triton.jit
def token_served(token_slot_ptr, t, active_ptr, LAUNCH, LAUNCH_PAD: tl.constexpr):
    """Token t's slot (-1: a base-model token) and whether it is served: 1 when the slot is among
    the first ``LAUNCH`` active slots, else 0 (int32: a scalar bool does not combine into masks
    under the interpreter)."""
    slot = tl.load(token_slot_ptr + t)
    offs_l = tl.arange(0, LAUNCH_PAD)
    launched = tl.load(active_ptr + offs_l, mask=offs_l < LAUNCH, other=-1)
    return slot, tl.max(((launched == slot) & (slot >= 0)).to(tl.int32), axis=0)


@triton.jit
def launch_positions(token_slot_ptr, tokens, mask, active_ptr, LAUNCH, LAUNCH_PAD: tl.constexpr):
    """Each token's place j among the first ``LAUNCH`` active slots (``active_ptr[j]`` is its
    slot), or -1 where it is not served (a base-model token, a slot past the launch count, or
    masked off). ``tokens``: a block of token indices."""
    slot = tl.load(token_slot_ptr + tokens, mask=mask, other=-1)
    offs_l = tl.arange(0, LAUNCH_PAD)
    launched = tl.load(active_ptr + offs_l, mask=offs_l < LAUNCH, other=-1)
    hit = (launched[None, :] == slot[:, None]) & (slot[:, None] >= 0)
    return tl.max(tl.where(hit, offs_l[None, :], -1), axis=1)


@triton.jit
def own_rank(rank_ptr, slot, R):
    """A slot's own rank rounded up to a multiple of 16, at most R: what the ``RANKED`` kernels
    compute of it. The padding they then read is zero; a bound that is a multiple of 16 keeps
    their rank-wise loads vectorised (an arbitrary runtime bound makes them one element each)."""
    return tl.minimum((tl.load(rank_ptr + slot) + 15) // 16 * 16, R)


def slice_ends(slice_starts, kernel: str) -> tuple[list[int], int]:
    """The host side of ``slice_bounds``: the slices' ends past the first, padded to
    ``MAX_SLICES`` (a slice past the last ends where the last does), and the widest slice."""
    slices = len(slice_starts) - 1
    if not 1 <= slices <= MAX_SLICES:
        raise ValueError(f"{slices} slices; the {kernel} kernel takes 1 to {MAX_SLICES}")
    ends = list(slice_starts[1:]) + [slice_starts[-1]] * (MAX_SLICES - slices)
    return ends, max(b - a for a, b in zip(slice_starts, slice_starts[1:]))


@triton.jit
def slice_bounds(s, n1, n2, n3):
    """Slice ``s``'s output columns [n_lo, n_hi) and the widest slice, from the boundaries n1..n3."""
    n_lo = tl.where(s == 0, 0, tl.where(s == 1, n1, n2))
    n_hi = tl.where(s == 0, n1, tl.where(s == 1, n2, n3))
    return n_lo, n_hi, tl.maximum(n1, tl.maximum(n2 - n1, n3 - n2))


@triton.jit
def expand_tile(h, b, UPCAST: tl.constexpr):
    """h @ b in fp32: h [BLOCK_M, BLOCK_R] fp32, b [BLOCK_R, BLOCK_N] in the weights' dtype. In a
    16-bit dtype h goes in as its rounded value plus the remainder of that rounding (two dots), so
    it keeps about 16 bits: y's final rounding is then the only one that shows."""
    if UPCAST:
        return tl.dot(h, b.to(tl.float32))
    hi = h.to(b.dtype)
    acc = tl.dot(hi, b)
    if b.dtype != tl.float32:
        acc = tl.dot((h - hi.to(tl.float32)).to(b.dtype), b, acc)
    return acc
