"""Triton LoRA shrink and expand, grouped by adapter slot, grid sized by the launch count.

Where one token tile holds the batch (decode), both kernels launch a grid whose last axis is the
*launch count*: program ``i`` on that axis serves ``active_slots[i]`` and exits at once when that
entry is -1 (fewer adapters active than launched) or when its tile holds none of that adapter's
tokens. Above one tile, the launched slots' token tiles are laid end to end (``tiles.packed_tile``):
cdiv(T, BLOCK_M) + launch - 1 tiles at most, so a slot adds a tile, not a column of the batch's
tiles (the prefill sweep on an H100, before: each further launched slot added ~0.42 ms to a
2048-token step, its one token's work ~0.03 ms of it).
Either way the launch count bounds who is served. Base-model tokens are masked out, so they are
never read or written.

shrink: scratch[t, :] (+)= scale · x[t] @ A[slot]ᵀ      split over K; fp32 atomics when split
expand: y[t, slice s] += scratch[t, s·R:(s+1)·R] @ B[slot][slice s]ᵀ

Decode kernels are latency-bound: a launch is a chain of dependent memory round trips, so the
kernels keep that chain short (``adapter_tile``) and, on sm90+, launch with programmatic dependent
launch (PDL, ``pdl_enabled``): a kernel starts while its predecessor finishes, loads its weights,
and waits (``gdc_wait``) only before it touches what the predecessor writes. The shrink lets the
expand launch at once; the expand's B tile is then loaded while the shrink still runs. The
expand in turn lets its consumer (a base op, PDL-launched, that waits before anything) launch.

The kernels live one op per module (``shrink``, ``expand``), their tilings and tuned
table in ``lora_configs``, the device helpers they share with the fused kernel in ``tiles`` and
the launch environment (interpreter, PDL) in ``launch``; this module is the backend
(``get_backend("triton")``) and keeps every public name importable from here.
"""

import torch

from .expand import RANK_STEP, lora_expand, rank_block  # noqa: F401
from .launch import INTERPRET, pdl_enabled, pdl_launch, pdl_wait  # noqa: F401
from .lora_configs import (  # noqa: F401
    CONFIGS,
    FEW_TILES,
    SEARCH_SPACE,
    TUNED_CONFIGS,
    ExpandConfig,
    ShrinkConfig,
    config_for,
    default_config,
    expand_config,
    load_tuned,
    shape_key,
    shrink_config,
)
from .meta import LoRAMeta
from .moe_lora import moe_lora_apply, moe_path  # noqa: F401 (expert LoRA: lorabench's kernels, its path rule)
from .shrink import lora_shrink, shrink_into  # noqa: F401 (lora_shrink: the backend's public names)
from .tiles import adapter_tile, own_rank, slice_bounds, sorted_tiles  # noqa: F401

# The shrink splits K with fp32 atomics, so its output buffer must start at zero.
NEEDS_ZEROED_SCRATCH = True
# The expand lets its dependents launch at once, so the model PDL-launches the base op after it.
# Contract: the kernel after a LoRA kernel must wait (gdc_wait) before it reads anything; the
# shrink and the fused kernel read x before they wait, so x must not be written by a kernel that
# lets its dependents launch early (e.g. no lora_apply whose x is the previous lora_apply's y).
LETS_CONSUMER_LAUNCH = True


def lora_apply(y, x, lora_a, lora_b, slice_starts, meta: LoRAMeta, launch_count, scale, scratch=None):
    """Shrink then expand into ``y`` in place. ``scratch`` is a float32 [>=T, >=S·R] buffer;
    it must be zero on entry (the shrink splits K with atomics, and a fully sharded rank's A,
    R / TP rows per slice, leaves the rest of each slice to the all-gather; the model zeroes all
    its scratch once per step). Without one, a zeroed buffer is allocated (not allowed inside
    graph capture)."""
    if launch_count <= 0:
        return
    h = shrink_into(x, lora_a, meta, launch_count, scale, len(slice_starts) - 1, lora_b.shape[2], scratch)
    lora_expand(h, lora_b, y, slice_starts, meta, launch_count)
