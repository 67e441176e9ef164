"""Every kernel backend against the plain-torch reference, on mixed base/adapter batches."""

import random

import pytest
import torch
import triton
import triton.language as tl
from conftest import DEVICE, HAS_CUDA
from lorabench.kernels import RANKS, expand, fused_lora, get_backend, shrink, tiles, triton_lora
from lorabench.kernels.launch import WAVE_PROGRAMS
from lorabench.kernels.reference import lora_delta

from lorabench.config.tolerance import TOLERANCE
from lorabench.runtime.lora_meta import MetaBuffer

KERNELS = ["triton", "fused", "gemm", "torch"]  # every backend in this repository (gemm: its epilogue over y, the pair over more than 2 launched slots; tests/test_gemm_lora.py: its whole linear; vllm: tests/test_vllm.py)
# Triton's CPU interpreter returns garbage from bf16 dots (the kernels upcast there): bf16 is tested on the GPU.
DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if HAS_CUDA else [])
# float32 dots run as tf32 on the GPU
TOL = {torch.float16: 2e-2, torch.bfloat16: 3e-2, torch.float32: 5e-3 if HAS_CUDA else 1e-4}


def make_case(tokens, k, slice_sizes, rank, max_loras, dtype, base_frac, seed):
    """Random inputs with a batch mixing base-model tokens (-1) and adapter tokens."""
    g = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    n_total = sum(slice_sizes)
    starts = tuple([0] + [sum(slice_sizes[: i + 1]) for i in range(len(slice_sizes))])
    x = torch.randn(tokens, k, generator=g).to(DEVICE, dtype)
    a = (torch.randn(max_loras, len(slice_sizes) * rank, k, generator=g) / k**0.5).to(DEVICE, dtype)
    b = torch.randn(max_loras, n_total, rank, generator=g).to(DEVICE, dtype)
    y = torch.randn(tokens, n_total, generator=g).to(DEVICE, dtype)
    slots = [-1 if rnd.random() < base_frac else rnd.randrange(max_loras) for _ in range(tokens)]
    return x, a, b, y, slots, starts


def run_backend(name, x, a, b, y, slots, starts, max_loras, launch_count, scale=0.5):
    buf = MetaBuffer(x.shape[0], max_loras, DEVICE)
    packed, n = buf.pack(slots)
    buf.load(packed)
    out = y.clone()
    scratch = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=DEVICE)
    get_backend(name).lora_apply(out, x, a, b, starts, buf.meta, launch_count, scale, scratch)
    return out, buf, n


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def kernel_err(out, ref):
    """The tolerance table's kernel measure: max |diff| / max(1, max |ref|)."""
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1)).item()


def check(out, y, x, a, b, slots, starts, scale=0.5):
    ref = y.float() + lora_delta(x, a, b, starts, torch.tensor(slots, device=DEVICE), scale)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL[out.dtype], rel_err(out, ref)
    # base-model rows are bit-identical to the input
    base = torch.tensor([s < 0 for s in slots], device=DEVICE)
    assert torch.equal(out[base], y[base])
    # adapter rows really changed (the test would notice a kernel that does nothing)
    if (~base).any():
        assert (out[~base].float() - y[~base].float()).abs().max() > 1e-2


def test_the_reference_side_by_side_equals_slot_by_slot(monkeypatch):
    """The reference's two paths (the active slots side by side, or past its memory limit one at a
    time) give the same update: base tokens zero, B wider than the slices, A of R / 2 rows per slice
    (a fully sharded rank), the shrink rounded to the dtype or not; inference-mode slots too."""
    from lorabench.kernels import reference

    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, 64, generator=g).to(DEVICE)
    a, b = torch.randn(5, 2 * 4, 64, generator=g).to(DEVICE), torch.randn(5, 40, 8, generator=g).to(DEVICE)
    slots = torch.tensor([random.Random(i).randrange(-1, 5) for i in range(40)], device=DEVICE)
    for h_dtype in (None, torch.bfloat16):
        side = reference.lora_delta(x, a, b, (0, 16, 36), slots, 0.5, h_dtype)
        with monkeypatch.context() as m:
            m.setattr(reference, "REFERENCE_SIDE_BY_SIDE_FLOATS", 0)
            alone = reference.lora_delta(x, a, b, (0, 16, 36), slots, 0.5, h_dtype)
        torch.testing.assert_close(side, alone, rtol=1e-5, atol=1e-5)
        assert (side[slots[:37] < 0] == 0).all() and (side[:, 36:] == 0).all() and side.abs().max() > 0.1
    with torch.inference_mode():
        frozen = slots.clone()
    torch.testing.assert_close(reference.lora_delta(x, a, b, (0, 16, 36), frozen, 0.5),
                               reference.lora_delta(x, a, b, (0, 16, 36), slots, 0.5))


@pytest.mark.usefixtures("epilogue_at_any_launch")
@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rank", RANKS + (5, 100))  # every rank vLLM allows, and two it does not (the kernels take any)
def test_backend_matches_reference_all_ranks(backend, dtype, rank):
    # q/k/v-like slices of unequal width, none a multiple of the N tile
    x, a, b, y, slots, starts = make_case(9, 96, (40, 24, 24), rank, 4, dtype, 0.3, seed=rank)
    out, _, n = run_backend(backend, x, a, b, y, slots, starts, 4, launch_count=4)
    check(out, y, x, a, b, slots, starts)


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("tokens", [1, 2, 17, 64, 512])
@pytest.mark.parametrize("slice_sizes", [(72,), (48, 48), (32, 16, 16)], ids=["1slice", "2slices", "3slices"])
def test_backend_token_counts_and_slices(backend, tokens, slice_sizes):
    max_loras = 6
    x, a, b, y, slots, starts = make_case(tokens, 80, slice_sizes, 16, max_loras, torch.float16, 0.25, tokens)
    n = len({s for s in slots if s >= 0})
    # launch count exactly n, and larger than n (extra programs must exit without writing)
    for launch in sorted({max(n, 1), max_loras}):
        out, _, _ = run_backend(backend, x, a, b, y, slots, starts, max_loras, launch)
        check(out, y, x, a, b, slots, starts)


@pytest.mark.parametrize("backend", KERNELS)
def test_all_base_batch_is_untouched(backend):
    x, a, b, y, slots, starts = make_case(8, 64, (32,), 8, 4, torch.float16, 1.0, 1)
    assert all(s < 0 for s in slots)
    out, _, _ = run_backend(backend, x, a, b, y, slots, starts, 4, launch_count=4)
    assert torch.equal(out, y)


@pytest.mark.parametrize("backend", KERNELS)
def test_launch_count_short_of_active_skips_last_adapters(backend):
    """The grid semantics the dispatcher relies on: with a launch count below n, tokens of the
    active slots past the launch count get no update. (The dispatcher must never do this.)"""
    slots = [0, 2, -1, 2, 3, 0]
    x, a, b, y, _, starts = make_case(6, 64, (32,), 8, 4, torch.float16, 0.0, 2)
    out, _, n = run_backend(backend, x, a, b, y, slots, starts, 4, launch_count=2)
    assert n == 3  # active slots sorted: [0, 2, 3]; launching 2 serves slots 0 and 2 only
    served = [s in (0, 2) for s in slots]
    full, _, _ = run_backend(backend, x, a, b, y, slots, starts, 4, launch_count=3)
    for t, ok in enumerate(served):
        if ok:
            assert torch.allclose(out[t].float(), full[t].float(), atol=1e-2)
        else:
            assert torch.equal(out[t], y[t])


@pytest.mark.parametrize("backend", KERNELS)
def test_every_launch_count_serves_every_active_count_beside_base_tokens(backend):
    """What the dispatcher sends through its graphs, whatever the strategy: a graph of launch count
    L (1..max_loras) serves batches of n = 0..L active adapters, here each batch with base-model
    tokens between the adapters' (one or two tokens per adapter, slots in any order)."""
    max_loras = 4
    rnd = random.Random(5)
    x, a, b, y, _, starts = make_case(2 * max_loras + 2, 64, (32, 16, 16), 8, max_loras, torch.float16, 0.0, 5)
    for launch in range(1, max_loras + 1):
        for n in range(launch + 1):
            slots = [-1, -1] + [s for s in rnd.sample(range(max_loras), n) for _ in range(rnd.randint(1, 2))]
            rnd.shuffle(slots)
            t = len(slots)
            out, _, active = run_backend(backend, x[:t], a, b, y[:t], slots, starts, max_loras, launch)
            assert active == n
            check(out, y[:t], x[:t], a, b, slots, starts)


@pytest.mark.parametrize("split_k", [1, 2, 4])
@pytest.mark.parametrize("block_m", [16, 32])
def test_triton_shrink_configs(split_k, block_m):
    """Shrink tilings, split-K by atomics included, all give the reference's intermediate."""
    x, a, b, y, slots, starts = make_case(33, 256, (32, 32), 16, 4, torch.float16, 0.3, split_k)
    buf = MetaBuffer(33, 4, DEVICE)
    buf.load(buf.pack(slots)[0])
    h = torch.zeros(33, a.shape[1], dtype=torch.float32, device=DEVICE)
    cfg = triton_lora.ShrinkConfig(block_m=block_m, block_n=16, block_k=32, split_k=split_k)
    triton_lora.lora_shrink(x, a, h, buf.meta, 4, 0.5, config=cfg)
    idx = torch.tensor([max(s, 0) for s in slots], device=DEVICE)
    ref = 0.5 * torch.einsum("tk,trk->tr", x.float(), a[idx].float())
    ref[torch.tensor(slots, device=DEVICE) < 0] = 0
    assert rel_err(h, ref) < 1e-2


class GridRecorder:
    """A kernel whose launches' grids are kept, then run as asked."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


# Slot-sorted counts for the packed tiles: 1 token, 3 tiles and one over, exactly one tile, one tile
# and one over, with base tokens between them (tiles of 16 tokens).
PACKED_SLOTS = [0] + [1] * 33 + [-1] * 3 + [2] * 16 + [3] * 17 + [-1, 5]


@pytest.mark.parametrize("launch", [3, 5, 6, 8], ids=["launch-below-n", "launch-n", "launch-above-n", "launch-max"])
@pytest.mark.parametrize("split_k", [1, 4])
def test_packed_token_tiles_serve_uneven_slots_in_as_many_programs_as_their_tiles(monkeypatch, launch, split_k):
    """Above one token tile the shrink and the expand walk the launched slots' tiles laid end to
    end (``tiles.packed_tile``): slots of 1, 33, 16, 17 and 1 tokens (1 + 3 + 1 + 2 + 1 tiles of 16),
    base tokens between them, a launch count below, at and above the active count. Their grids
    hold cdiv(T, 16) + launch - 1 token tiles in one column, not launch columns of cdiv(T, 16)."""
    slots = list(PACKED_SLOTS)
    random.Random(launch).shuffle(slots)
    tokens, max_loras = len(slots), 8
    x, a, b, y, _, starts = make_case(tokens, 64, (32, 16), 8, max_loras, torch.float16, 0.0, 11)
    buf = MetaBuffer(tokens, max_loras, DEVICE)
    packed, n = buf.pack(slots)
    buf.load(packed)
    assert n == 5
    shrinks, expands = GridRecorder(shrink._shrink_kernel), GridRecorder(expand._expand_kernel)
    fuseds = GridRecorder(fused_lora._fused_kernel)
    monkeypatch.setattr(shrink, "_shrink_kernel", shrinks)
    monkeypatch.setattr(expand, "_expand_kernel", expands)
    monkeypatch.setattr(fused_lora, "_fused_kernel", fuseds)
    h = torch.zeros(tokens, a.shape[1], dtype=torch.float32, device=DEVICE)
    out = y.clone()
    shrink.lora_shrink(x, a, h, buf.meta, launch, 0.5, config=triton_lora.ShrinkConfig(16, 16, 32, split_k), rank=8,
                       slices=2)
    expand.lora_expand(h, b, out, starts, buf.meta, launch, config=triton_lora.ExpandConfig(16, 32))
    served = sorted(set(s for s in slots if s >= 0))[:launch]
    check(out, y, x, a, b, [s if s in served else -1 for s in slots], starts)
    fused = y.clone()
    fused_lora.lora_apply(fused, x, a, b, starts, buf.meta, launch, 0.5, config=fused_lora.FusedConfig(16, 32, 32, split_k))
    check(fused, y, x, a, b, [s if s in served else -1 for s in slots], starts)
    tiles = -(-tokens // 16) + launch - 1
    assert shrinks.grids == [(split_k * tiles * 1, 1, 1)]  # 16 rank columns: one output tile
    assert expands.grids == [(tiles * 1, 2, 1)]  # the widest slice, 32 columns: one output tile
    assert fuseds.grids == [(tiles * split_k * 1, 2, 1)]


@pytest.mark.parametrize("launch", [1, 3])
def test_a_batch_of_one_token_tile_keeps_a_grid_column_per_launched_slot(monkeypatch, launch):
    """Decode: one token tile holds the batch, so the kernels keep the launch count as the grid's
    adapter axis (the packed tiles are for longer batches)."""
    slots = [0, -1, 2, 0, 1, -1]
    x, a, b, y, _, starts = make_case(len(slots), 64, (32,), 8, 4, torch.float16, 0.0, 3)
    buf = MetaBuffer(len(slots), 4, DEVICE)
    buf.load(buf.pack(slots)[0])
    recorders = {m: GridRecorder(getattr(m, k)) for m, k in
                 ((shrink, "_shrink_kernel"), (expand, "_expand_kernel"), (fused_lora, "_fused_kernel"))}
    for module, rec in recorders.items():
        monkeypatch.setattr(module, rec.kernel.fn.__name__, rec)
    scratch = torch.zeros(len(slots), a.shape[1], dtype=torch.float32, device=DEVICE)
    triton_lora.lora_apply(y.clone(), x, a, b, starts, buf.meta, launch, 0.5, scratch)
    fused_lora.lora_apply(y.clone(), x, a, b, starts, buf.meta, launch, 0.5)
    for rec in recorders.values():
        assert [g[2] for g in rec.grids] == [launch], rec.grids


@triton.jit
def _packed_tile_probe(out_ptr, sorted_ptr, active_ptr, start_ptr, launch, BLOCK_M: tl.constexpr,
                       LAUNCH_PAD: tl.constexpr):
    """Each program's packed tile: its slot, first row, rows in the tile and whether it is idle."""
    pid = tl.program_id(0)
    slot, rows, mask, idle = tiles.packed_tile(pid, launch, sorted_ptr, active_ptr, start_ptr, BLOCK_M, LAUNCH_PAD,
                                               False)
    tl.store(out_ptr + pid * 4, slot)
    tl.store(out_ptr + pid * 4 + 1, tl.min(tl.where(mask, rows, 1 << 30), axis=0).to(tl.int32))
    tl.store(out_ptr + pid * 4 + 2, tl.sum(mask.to(tl.int32), axis=0))
    tl.store(out_ptr + pid * 4 + 3, idle.to(tl.int32))


@pytest.mark.parametrize("launch", [1, 2, 5, 6, 8])
def test_every_program_of_the_packed_grid_gets_its_slots_tile_and_the_rest_are_idle(launch):
    """``packed_tile`` against a host model of the layout, for every program of the grid, those
    past the last slot's tiles included (idle: they must not run a K loop, nor add to a split-K
    workspace): slot z's tiles follow slots 0..z-1's, each tile its slot's next BLOCK_M sorted rows."""
    slots = list(PACKED_SLOTS)
    random.Random(launch).shuffle(slots)
    buf = MetaBuffer(len(slots) + 3, 8, DEVICE)
    buf.load(buf.pack(slots)[0])
    meta, block_m = buf.meta, 16
    grid = tiles.packed_tiles(len(slots), block_m, launch)
    out = torch.full((grid, 4), -7, dtype=torch.int32, device=DEVICE)
    _packed_tile_probe[(grid,)](out, meta.sorted_tokens, meta.active_slots, meta.slot_start, launch, BLOCK_M=block_m,
                                LAUNCH_PAD=triton.next_power_of_2(launch))
    active = sorted(set(s for s in slots if s >= 0))
    want = []
    for slot in active[:launch]:
        rows = [t for t in meta.sorted_tokens.tolist()[:sum(s >= 0 for s in slots)] if slots[t] == slot]
        want += [(slot, rows[i], min(block_m, len(rows) - i), 0) for i in range(0, len(rows), block_m)]
    got = [tuple(r) for r in out.tolist()]
    assert [g[:3] for g in got[:len(want)]] == [w[:3] for w in want] and all(g[3] == 0 for g in got[:len(want)])
    assert all(g[2] == 0 and g[3] == 1 for g in got[len(want):]), got[len(want):]


def test_packed_tiles_bound_every_batchs_slot_tiles():
    """Σ cdiv(count_z, BLOCK_M) over any split of T tokens among the launched slots is at most
    ``packed_tiles`` (each slot's last tile adds at most one partial tile), and reaches it."""
    rnd = random.Random(3)
    for _ in range(2000):
        block_m, launch = rnd.choice([16, 32, 64]), rnd.randint(1, 16)
        counts = [rnd.randint(1, 200) for _ in range(launch)]
        need = sum(-(-c // block_m) for c in counts)
        assert need <= tiles.packed_tiles(sum(counts) + rnd.randint(0, 50), block_m, launch)
    assert sum(-(-c // 16) for c in [17, 17, 17]) == tiles.packed_tiles(51, 16, 3)


@pytest.mark.parametrize("tokens", [1, 8, 32, 128])
@pytest.mark.parametrize("launch", [1, 4, 32])
def test_default_shrink_split_fits_the_shape(tokens, launch):
    """The default split gives every split K to reduce, and a decode launch of few tiles is split
    to the program target: splitting stops at 64, at one 64-wide K block per split, or at the target."""
    for k, n in [(64, 16), (256, 48), (4096, 16), (4096, 48), (11008, 16)]:
        cfg = triton_lora.shrink_config(tokens, k, n, launch)
        assert cfg.block_k * (cfg.split_k - 1) < k
        tiles = launch * triton.cdiv(tokens, cfg.block_m) * triton.cdiv(n, cfg.block_n)
        if tokens <= 64 and tiles <= triton_lora.FEW_TILES:
            assert cfg.split_k * tiles <= max(WAVE_PROGRAMS, tiles)
            assert cfg.split_k == 64 or cfg.block_k * cfg.split_k * 2 > k or 2 * cfg.split_k * tiles > WAVE_PROGRAMS


@pytest.mark.parametrize("tokens", [65, 128, 512, 1616, 2048, 8192])
def test_a_prefill_shrink_is_split_until_its_token_tiles_fill_the_gpu(tokens):
    """Above decode sizes the split follows the token tiles, whatever the launch count: K is split
    until the tiles make the program target, at least 4 ways, stopping only at 64, at one K block
    per split, or at the target; every split has K to reduce."""
    for k, n in [(64, 16), (4096, 16), (4096, 48), (14336, 16)]:
        cfg = triton_lora.shrink_config(tokens, k, n, 16)
        assert cfg == triton_lora.shrink_config(tokens, k, n, 1)
        assert cfg.block_k * (cfg.split_k - 1) < k
        tiles = triton.cdiv(tokens, cfg.block_m) * triton.cdiv(n, cfg.block_n)
        assert cfg.split_k * tiles <= max(WAVE_PROGRAMS, 4 * tiles)
        assert (cfg.split_k == 64 or cfg.block_k * cfg.split_k * 2 > k
                or 2 * cfg.split_k * tiles > WAVE_PROGRAMS or cfg.split_k == 4)


@pytest.mark.parametrize("base_frac,max_loras", [(0.0, 1), (0.1, 3)], ids=["one-adapter", "mixed"])
def test_a_prefill_shrink_at_its_default_split_matches_the_reference(base_frac, max_loras):
    """130 tokens (3 token tiles) at the default prefill split (8 ways over K = 1024): one adapter
    holding every token, and three adapters among base tokens."""
    x, a, b, y, slots, starts = make_case(130, 1024, (48, 16), 16, max_loras, torch.float16, base_frac, 7)
    assert triton_lora.shrink_config(130, 1024, 32, max_loras).split_k == 8
    out, _, _ = run_backend("triton", x, a, b, y, slots, starts, max_loras, launch_count=max_loras)
    check(out, y, x, a, b, slots, starts)


@pytest.mark.parametrize("cfg", [
    fused_lora.FusedConfig(block_m=16, block_n=16, block_k=32, split_k=1),
    fused_lora.FusedConfig(block_m=16, block_n=32, block_k=16, split_k=3),  # parts of unequal length
    fused_lora.FusedConfig(block_m=32, block_n=64, block_k=16, split_k=8),  # a part with no K left
    fused_lora.FusedConfig(block_m=64, block_n=16, block_k=128, split_k=2),
], ids=lambda c: f"m{c.block_m}n{c.block_n}k{c.block_k}s{c.split_k}")
@pytest.mark.parametrize("rank", [8, 64])
def test_fused_configs(cfg, rank):
    """Every tiling of the fused kernel (token tiles, output tiles, K parts) gives the reference,
    on a batch of 40 tokens whose adapter tokens need several token tiles at block_m 16."""
    x, a, b, y, slots, starts = make_case(40, 112, (40, 24, 24), rank, 3, torch.float16, 0.2, rank)
    buf = MetaBuffer(40, 3, DEVICE)
    buf.load(buf.pack(slots)[0])
    out = y.clone()
    fused_lora.lora_apply(out, x, a, b, starts, buf.meta, 3, 0.5, config=cfg)
    check(out, y, x, a, b, slots, starts)


def test_fused_tuned_configs_are_looked_up_by_nearest_shape():
    small = fused_lora.FusedConfig(block_n=32, split_k=2)
    big = fused_lora.FusedConfig(block_n=256, split_k=1)
    try:
        fused_lora.load_tuned([{"shape": [1, 4096, 4096, 16, 3, 1], "config": fused_lora.config_dict(small)},
                               {"shape": [32, 4096, 4096, 16, 3, 32], "config": fused_lora.config_dict(big)}])
        assert fused_lora.config_for(2, 4096, 4096, 16, 3, 1) == small
        assert fused_lora.config_for(24, 4096, 4096, 16, 3, 1) == big  # nearer in tokens, launch count second
        assert fused_lora.config_for(1, 11008, 4096, 16, 1, 1) == fused_lora.default_config(1, 11008, 4096, 16, 1, 1)
    finally:
        fused_lora.load_tuned([])


@pytest.mark.parametrize("backend", ["triton", "fused"])
@pytest.mark.parametrize("tiles_path", ["packed-tiles", "sorted-tiles", "batch-order-tiles"])
@pytest.mark.parametrize("padded", [False, True], ids=["exact-buffer", "padded-buffer"])
@pytest.mark.parametrize("short", [False, True], ids=["launch-n", "launch-below-n"])
def test_every_token_tile_path_agrees_with_the_reference(monkeypatch, backend, tiles_path, padded, short):
    """Each kernel's token-tile paths (the launched slots' sorted tiles packed end to end, a grid
    column of sorted tiles per slot, batch order with a slot mask), forced on the same batch: a
    metadata buffer longer than the batch (padding tokens are -1) and a launch count below the
    active count (the last active slot's tokens stay as they were)."""
    sorted_path = tiles_path != "batch-order-tiles"
    monkeypatch.setattr(tiles, "sorted_tiles", lambda tokens, block_m: sorted_path)  # every launcher's token_grid
    monkeypatch.setattr(tiles, "PACKED_TILES", tiles_path == "packed-tiles")
    slots = [2, -1, 0, 3, 2, -1, 0, 3, 3, -1, 2, 0]
    x, a, b, y, _, starts = make_case(len(slots), 64, (32, 16), 8, 4, torch.float16, 0.0, 7)
    buf = MetaBuffer(len(slots) + (5 if padded else 0), 4, DEVICE)
    packed, n = buf.pack(slots)
    buf.load(packed)
    launch = n - 1 if short else n
    served = sorted(set(s for s in slots if s >= 0))[:launch]  # active slots are sorted
    out = y.clone()
    scratch = torch.zeros(len(slots), a.shape[1], dtype=torch.float32, device=DEVICE)
    get_backend(backend).lora_apply(out, x, a, b, starts, buf.meta, launch, 0.5, scratch)
    check(out, y, x, a, b, [s if s in served else -1 for s in slots], starts)


@pytest.mark.parametrize("k, slice_sizes, max_loras, tokens, launch", [
    (8192, (64,), 2, 4, 2),  # K parts: 8 by default
    (13824, (32, 32), 2, 3, 2),  # odd hidden sizes: 16 parts of unequal length
    (5504, (40, 24, 24), 2, 4, 2),  # 8
    (2049, (40, 24, 24), 4, 6, 4),  # 2
], ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_fused_bf16_is_as_accurate_as_the_pair(k, slice_sizes, max_loras, tokens, launch):
    """bf16 at large and odd K, base and adapter tokens mixed, default tilings (split over K): the
    fused kernel meets the tolerance table's bound the pair meets, and its error is no larger than
    the pair's (adding each K part into y in bf16 made it several times larger at such K)."""
    x, a, b, y, slots, starts = make_case(tokens, k, slice_sizes, 16, max_loras, torch.bfloat16, 0.3, k)
    slots[0] = -1  # at least one base token
    assert any(s >= 0 for s in slots)
    ref = y.float() + lora_delta(x, a, b, starts, torch.tensor(slots, device=DEVICE), 0.5)
    out = {name: run_backend(name, x, a, b, y, slots, starts, max_loras, launch)[0] for name in ("triton", "fused")}
    for name, o in out.items():
        check(o, y, x, a, b, slots, starts)
        assert kernel_err(o, ref) < TOLERANCE["bfloat16"].kernel, name
    assert rel_err(out["fused"], ref) <= 1.05 * rel_err(out["triton"], ref)


def test_fused_split_leaves_its_workspace_zero():
    """Split over K, every launch leaves the workspace's sums and counts zero, so the next launch
    (a graph replay) needs no memset and gives the same answer."""
    x, a, b, y, slots, starts = make_case(6, 128, (40, 24), 16, 3, torch.bfloat16, 0.2, 3)
    buf = MetaBuffer(6, 3, DEVICE)
    buf.load(buf.pack(slots)[0])
    for _ in range(2):
        out = y.clone()
        fused_lora.lora_apply(out, x, a, b, starts, buf.meta, 3, 0.5,
                              config=fused_lora.FusedConfig(block_m=16, block_n=32, block_k=32, split_k=4))
        check(out, y, x, a, b, slots, starts)
        for dtype in (torch.float32, torch.int32):
            assert not fused_lora._workspace(out.device, dtype, 1).any()


def zero_padding(a, b, slot_ranks, rank, slices, upto=None):
    """The weights with every slot's rows/columns past its own rank zeroed (vLLM's padding), up
    to ``upto(own rank)`` when given (past it they keep what they held)."""
    a, b = a.clone(), b.clone()
    for slot, r in enumerate(slot_ranks):
        end = upto(r) if upto else rank
        for s in range(slices):
            a[slot, s * rank + r:s * rank + end] = 0
        b[slot, :, r:end] = 0
    return a, b


def computed_rank(own: int, rank: int) -> int:
    """What the RANKED kernels compute of a slot: its own rank rounded up to 16, at most the rank."""
    return min(rank, -(-own // 16) * 16)


@pytest.mark.usefixtures("epilogue_at_any_launch")
@pytest.mark.parametrize("backend", ["triton", "fused", "gemm"])
@pytest.mark.parametrize("rank,slot_ranks", [(64, (8, 64, 16, 1)), (128, (8, 128, 64, 100)), (16, (16, 16, 8, 8))])
@pytest.mark.parametrize("tokens", [6, 40])  # one token tile, and slot-sorted tiles
def test_unpadded_kernels_read_only_each_slots_own_rank(backend, rank, slot_ranks, tokens):
    """With ``meta.slot_rank`` the kernels compute each adapter at its own rank rounded up to 16:
    garbage in the padding past that changes nothing, and the result is the padded adapters'
    (whose padding is zero)."""
    slices = (40, 24, 24)
    x, a, b, y, slots, starts = make_case(tokens, 96, slices, rank, 4, torch.float16, 0.25, rank + tokens)
    a0, b0 = zero_padding(a, b, slot_ranks, rank, len(slices))
    a, b = zero_padding(a, b, slot_ranks, rank, len(slices), upto=lambda own: computed_rank(own, rank))
    buf = MetaBuffer(tokens, 4, DEVICE)
    packed, _ = buf.pack(slots)
    buf.load(packed)
    ranked = buf.meta._replace(slot_rank=torch.tensor(slot_ranks, dtype=torch.int32, device=DEVICE))
    out = y.clone()
    scratch = torch.zeros(tokens, a.shape[1], dtype=torch.float32, device=DEVICE)
    get_backend(backend).lora_apply(out, x, a, b, starts, ranked, 4, 0.5, scratch)  # a, b: garbage padding
    check(out, y, x, a0, b0, slots, starts)
    padded, _, _ = run_backend(backend, x, a0, b0, y, slots, starts, 4, launch_count=4)
    assert rel_err(out, padded.float()) < TOL[torch.float16]
