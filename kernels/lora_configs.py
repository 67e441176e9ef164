"""The shrink's and the expand's tilings: their config classes, what ``lorabench tune`` searches,
the tuned table (``load_tuned``, ``config_for``) and the default tilings."""

from dataclasses import dataclass

from .launch import WAVE_PROGRAMS, cdiv, next_pow2, pow2_floor


@dataclass(frozen=True)
class ShrinkConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 2


@dataclass(frozen=True)
class ExpandConfig:
    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2


SEARCH_SPACE = {  # what `lorabench tune` tries, per op
    "shrink": {"block_m": [16, 32, 64], "block_n": [16, 32, 64], "block_k": [32, 64, 128, 256, 512],
               "split_k": [1, 2, 4, 8, 16, 32, 64], "num_warps": [2, 4, 8], "num_stages": [1, 2, 3, 4]},
    "expand": {"block_m": [16, 32, 64], "block_n": [32, 64, 128, 256], "num_warps": [2, 4, 8], "num_stages": [1, 2, 3]},
}
CONFIGS = {"shrink": ShrinkConfig, "expand": ExpandConfig}

# Tuned configs by shape key: filled by ``load_tuned`` (sweeps given ``--tuned DIR``, kernels triton+tuned).
TUNED_CONFIGS: dict[tuple, ShrinkConfig | ExpandConfig] = {}


def shape_key(op: str, tokens: int, k_in: int, n_out: int, slices: int, launch: int) -> tuple:
    """What a tuned config is chosen by. shrink: (K, slices·rank, 0); expand: (rank, widest
    slice, slices); both with the token bucket and the launch count."""
    return (op, tokens, k_in, n_out, slices, launch)


def default_config(op: str, tokens: int, k_in: int, n_out: int, slices: int, launch: int):
    return shrink_config(tokens, k_in, n_out, launch) if op == "shrink" else expand_config(tokens, n_out)


def config_for(op: str, tokens: int, k_in: int, n_out: int, slices: int, launch: int):
    """The tuned config of the nearest tuned shape with the same op and sizes (nearest token
    bucket, then nearest launch count; ties go to the larger), else the default."""
    same = [key for key in TUNED_CONFIGS if (key[0], *key[2:5]) == (op, k_in, n_out, slices)]
    if not same:
        return default_config(op, tokens, k_in, n_out, slices, launch)
    best = min(same, key=lambda key: (abs(key[1] - tokens), -key[1], abs(key[5] - launch), -key[5]))
    return TUNED_CONFIGS[best]


def load_tuned(entries: list[dict]) -> None:
    """Install the triton entries of a tune (``{"kernel": "triton", "shape": [...], "config": {...}}``)."""
    TUNED_CONFIGS.clear()
    for e in entries:
        if e.get("kernel") == "triton":
            TUNED_CONFIGS[tuple(e["shape"])] = CONFIGS[e["shape"][0]](**e["config"])


def _block_m(tokens: int) -> int:
    return 16 if tokens <= 16 else 32 if tokens <= 64 else 64


FEW_TILES = 8  # launched slots x token tiles x output tiles up to which a shrink is split to WAVE_PROGRAMS


def shrink_config(tokens: int, k: int, n: int, launch: int = 1) -> ShrinkConfig:
    """Default shrink tiling. A decode-sized shrink is a GEMV over A: with few launched slots it
    is as fast as the A reads in flight, so K is split (64-wide blocks, 3 stages) until the launch
    has about ``WAVE_PROGRAMS`` programs, at most 64 splits. With many launched slots a graph
    usually serves fewer active ones, whose programs then carry the step: there the tiling stays
    the earlier default (block_k 128, K in ~256-wide parts up to 32, 4 warps, 2 stages), which
    measured faster in the step at 32 slots than the tiling the isolated grid favoured (64 / 16 /
    2 warps / 3 stages). Both from an H200 (BENCHMARKS.md, "How the kernels got there";
    scripts/shrink_grid.py)."""
    block_m, block_n = _block_m(tokens), min(64, max(16, next_pow2(n)))
    if tokens > 64:
        return ShrinkConfig(block_m, block_n, 128, prefill_split(tokens, k, n, block_m, block_n))
    tiles = launch * cdiv(tokens, block_m) * cdiv(n, block_n)
    if tiles > FEW_TILES:
        return ShrinkConfig(block_m, block_n, 128, min(32, next_pow2(max(1, k // 256))))
    split_k = min(64, pow2_floor(WAVE_PROGRAMS // tiles), pow2_floor(k // 64))
    return ShrinkConfig(block_m, block_n, 64, split_k, num_stages=3)


def prefill_split(tokens: int, k: int, n: int, block_m: int, block_n: int) -> int:
    """K splits of a shrink above decode sizes (128-wide K blocks): enough that the batch's token
    tiles alone make about ``WAVE_PROGRAMS`` programs, at least 4, at most 64 and one K block
    each. The token tiles, not the launch: the launched slots' tiles are packed end to end
    (``tiles.packed_tile``), so one adapter holding all 128 tokens works in 2 tiles x the split; at a fixed split of 4 that was
    8 programs on 132 SMs, each walking a quarter of K (LoRA at 128 prompt tokens measured 5.9x its
    byte floor on an H100, against 1.1x at 2048 tokens, where the tiles alone fill the GPU)."""
    tiles = cdiv(tokens, block_m) * cdiv(n, block_n)
    return min(64, pow2_floor(k // 128), max(4, pow2_floor(WAVE_PROGRAMS // tiles)))


def expand_config(tokens: int, n_max_slice: int) -> ExpandConfig:
    return ExpandConfig(_block_m(tokens), min(128, max(16, next_pow2(n_max_slice))))
