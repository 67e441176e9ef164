"""The ``gemm`` backend's GEMM tilings: its config class, what ``lorabench tune`` searches, the
tuned table (``load_tuned``, ``config_for``), the default tilings and the step down for a tiling
that does not fit, and up to how many tokens the backend runs its own GEMM at all."""

from dataclasses import asdict, dataclass, replace

from . import lora_configs

# Above this many tokens (prefill sizes) the backend runs cuBLAS and the shrink + expand pair, as
# ``triton`` does: there its Triton GEMM is 1.4-1.57x cuBLAS (2048 tokens, H200, the best of 12
# tilings; it has no TMA or warp specialisation), which costs more than the epilogue saves (y's
# read-modify-write). Decode sizes up to here, where it keeps up, take LoRA in the GEMM.
GEMM_MAX_TOKENS = 64


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8
    preload: bool = False  # the first epilogue step's h and B loaded before the K loop (held in registers over it; slower on an H200)
    gather: bool = False  # the gathered epilogue (gemm_lora's module doc) where the tile is at most GATHER_TILE; in whole H100 steps no better than the walk


SEARCH_SPACE = {"block_m": [16, 32, 64, 128], "block_n": [16, 32, 64, 128], "block_k": [64, 128, 256, 512],
                "num_warps": [2, 4, 8], "num_stages": [2, 3, 4, 5], "preload": [True, False]}

# Tuned configs by shape key: filled by ``load_tuned`` (sweeps given ``--tuned DIR``).
TUNED_CONFIGS: dict[tuple, GemmConfig] = {}


def shape_key(tokens: int, k: int, n: int) -> tuple:
    return ("gemm", tokens, k, n)


def default_config(tokens: int, k: int, n: int) -> GemmConfig:
    """Decode sizes (up to 64 tokens) are a GEMV over W: one M tile of all the tokens, narrow N
    tiles so the grid has a program or more per SM, deep K steps in flight (4-5 stages). Prefill
    sizes: wide square tiles. The best of a grid of tilings per shape on an H200
    (``scripts/gemm_bench.py --grid``; BENCHMARKS.md, "LoRA inside the GEMM")."""
    wide = n >= 16384  # gate_up: enough N tiles at 64 columns
    if tokens <= 16:
        return GemmConfig(16, 64, 128, num_stages=4) if wide else GemmConfig(16, 32, 256, num_stages=5)
    if tokens <= 32:
        return GemmConfig(32, 64, 128, num_stages=4) if wide else GemmConfig(32, 32, 128, num_stages=4)
    if tokens <= 64:
        return GemmConfig(64, 64, 128, num_stages=5) if wide else GemmConfig(64, 32, 256, num_stages=4)
    return GemmConfig(128, 256, 64, num_warps=8, num_stages=3)


def smaller(cfg: GemmConfig) -> GemmConfig | None:
    """The next tiling down for one that does not fit a block's shared memory: K steps halved
    (to 32), then stages cut (to 2), then the N tile halved (to 16); None below that. The M tile
    stays: decode keeps all its tokens in one tile."""
    if cfg.block_k > 32:
        return replace(cfg, block_k=cfg.block_k // 2)
    if cfg.num_stages > 2:
        return replace(cfg, num_stages=cfg.num_stages - 1)
    if cfg.block_n > 16:
        return replace(cfg, block_n=cfg.block_n // 2)
    return None


def config_for(tokens: int, k: int, n: int) -> GemmConfig:
    """The tuned config of the nearest tuned token bucket with the same K and N, else the default."""
    same = [key for key in TUNED_CONFIGS if key[2:] == (k, n) and key[1] <= GEMM_MAX_TOKENS]
    if not same:
        return default_config(tokens, k, n)
    return TUNED_CONFIGS[min(same, key=lambda key: (abs(key[1] - tokens), -key[1]))]


def load_tuned(entries: list[dict]) -> None:
    """Install the gemm entries of a tune (``{"kernel": "gemm", "shape": [...], "config": {...}}``)
    and the triton entries for its shrink (the pair's tuned shrink)."""
    lora_configs.load_tuned(entries)
    TUNED_CONFIGS.clear()
    for e in entries:
        if e.get("kernel") == "gemm":
            TUNED_CONFIGS[tuple(e["shape"])] = GemmConfig(**e["config"])


def config_dict(cfg: GemmConfig) -> dict:
    return asdict(cfg)
