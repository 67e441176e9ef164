"""The load paths beside vLLM's per-slice one: each leaves the slots as a per-slice load does
(dense and expert LoRA, random and the user's adapters), and each is timed."""

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import DEVICE, HAS_CUDA
from peft_folders import HIDDEN, adapter_files, module_tensors, write

from lorabench.config.models import resolve
from lorabench.config.peft import read_adapters, slot_ranks
from lorabench.kernels import get_backend
from lorabench.runtime.adapters import LOADS, AdapterLoader
from lorabench.runtime.dispatch import Dispatcher
from lorabench.runtime.load_paths import (HOST_LINK, ONE_COPY, OVERLAPPED, PAGEABLE, STORAGE, OneCopy, StorageReads,
                                          drop_cached, filesystem, read_line, time_host_link, time_load_paths, time_overlap)
from lorabench.runtime.timing import time_steps
from lorabench.runtime.model import LlamaLoRA
from lorabench.runtime.peft_slots import fill_slots

DTYPE = torch.float16 if HAS_CUDA else torch.float32


def model(name="tiny", adapters=(), max_loras=3):
    m = LlamaLoRA(resolve(name), max_loras=max_loras, rank=16, max_tokens=4, context_len=8, dtype=DTYPE, device=DEVICE,
                  seed=0, slot_ranks=slot_ranks(adapters, max_loras) if adapters else ())
    if adapters:
        fill_slots(m, adapters)
    return m


@pytest.fixture
def users(tmp_path):
    rng = np.random.default_rng(0)
    write(tmp_path, adapter_files("a", 8, 16, ("q_proj", "o_proj")))
    write(tmp_path, adapter_files("b", 16, 16, ("k_proj",), seed=1,
                                  tensors=module_tensors(0, "block_sparse_moe.experts.2.w1", 16, HIDDEN, 64, rng)))
    return tmp_path


@pytest.mark.parametrize("case", ["tiny", "tiny-moe", "users-tiny-moe"])
@pytest.mark.parametrize("pageable", [False, True], ids=["pinned", "pageable"])
def test_one_copy_leaves_the_slots_as_a_per_slice_load_does(case, pageable, users):
    name = case.removeprefix("users-")
    adapters = read_adapters(str(users), resolve(name), 16) if case.startswith("users") else ()
    per_slice, one = model(name, adapters), model(name, adapters)
    a, b = AdapterLoader(per_slice, adapters=adapters), AdapterLoader(one, adapters=adapters)
    loader = OneCopy(b, pageable)
    assert loader.ops == 2 + 2 * (adapters != ())  # the transfer, the scatter; the users' differ in rank and expert LoRA
    for slot, adapter in ((2, 1), (0, 1), (1, 0)):
        a.load(slot, adapter)
        loader.load(slot, adapter)
    if HAS_CUDA:
        torch.cuda.synchronize()
        assert all(f.is_pinned() != pageable for f in loader.flat)
    for x, y in zip(per_slice.state_dict().values(), one.state_dict().values()):
        assert torch.equal(x, y)
    assert a.held == b.held


def test_every_path_is_timed_and_the_users_adapters_go_back(users):
    adapters = read_adapters(str(users), resolve("tiny-moe"), 16)
    m, want = model("tiny-moe", adapters), model("tiny-moe", adapters)
    d = Dispatcher(m, get_backend("torch"), max_loras=3, capture_sizes=[1], counts=[3], use_graphs=HAS_CUDA)
    d.warm_up()
    d.capture()
    loader = AdapterLoader(m, adapters=adapters)
    t = time_load_paths(loader, d, [a.weights for a in adapters], loads=4)
    assert set(t) == {ONE_COPY, PAGEABLE, STORAGE} | ({OVERLAPPED, HOST_LINK} if HAS_CUDA else set())
    for path in (ONE_COPY, PAGEABLE):
        assert set(t[path]) == {"load_ms", "alone_ms", "host_us"} and all(len(v) == 4 for v in t[path].values())
        assert (t[path]["alone_ms"] > 0).all()
    assert (t[STORAGE]["cold_ms"] > 0).all() and (t[STORAGE]["warm_ms"] > 0).all()
    if HAS_CUDA:
        torch.cuda.synchronize()
        assert (t[OVERLAPPED]["usable_ms"] > 0).all() and len(t[OVERLAPPED]["lost_ms"]) == 4
    for x, y in zip(m.state_dict().values(), want.state_dict().values()):  # slot i holds adapter i again
        assert torch.equal(x, y)


def test_the_one_copy_path_copies_the_banks_own_bytes():
    """Each bank entry is one host buffer whose views are the per-slice path's sources: the
    one-copy path holds no second copy of the adapters."""
    loader = AdapterLoader(model("tiny-moe"))
    one = OneCopy(loader)
    assert one.flat is loader.flat and len(loader.flat) == len(loader.bank)
    for buf, entry in zip(loader.flat, loader.bank):
        base = buf.untyped_storage().data_ptr()
        assert all(t.untyped_storage().data_ptr() == base for pair in entry for t in pair)
        assert sum(t.numel() for pair in entry for t in pair) == buf.numel()


@pytest.mark.skipif(not HAS_CUDA, reason="the host link is timed on a GPU")
def test_the_host_links_bandwidth_is_timed():
    gb_s = time_host_link(torch.device("cuda"), nbytes=2**24, copies=3)
    assert len(gb_s) == 3 and (gb_s > 0.1).all()


def test_a_residency_steps_misses_are_read_inside_the_step_after_their_pages_were_dropped(tmp_path):
    calls = []

    class Recording(StorageReads):
        def drop(self, adapter):
            calls.append(("drop", adapter))
            super().drop(adapter)

        def read(self, adapter):
            calls.append(("read", adapter))
            return super().read(adapter)

    for i in range(3):
        write(tmp_path, adapter_files(f"x{i}", 8, 16, ("q_proj",), seed=i))
    files = sorted(str(p) for p in tmp_path.glob("*/adapter_model.safetensors"))
    m = model()
    d = Dispatcher(m, get_backend("torch"), max_loras=3, capture_sizes=[2], counts=[3], use_graphs=HAS_CUDA)
    d.warm_up()
    d.capture()
    loader = AdapterLoader(m)
    s = time_steps(d, [[0, 1], [1, 2]], 4, 1, loads=[[(1, 2)], []], loader=loader, reads=[[2], []],
                   storage=Recording(files))
    assert s.reads.tolist() == [1, 0, 1, 0] and s.loads.tolist() == [1, 0, 1, 0]
    assert s.read_bytes.tolist() == [Path(files[2]).stat().st_size, 0] * 2
    assert calls == [("drop", 2), ("read", 2)] * 2  # the warm-up step reads nothing


def test_no_overlap_without_a_gpu_or_with_one_slot():
    m = model(max_loras=1)
    d = Dispatcher(m, get_backend("torch"), max_loras=1, capture_sizes=[1], counts=[1], use_graphs=HAS_CUDA)
    assert time_overlap(OneCopy(AdapterLoader(m)), d, loads=2) is None


def test_a_files_pages_can_be_dropped_and_its_filesystem_named(tmp_path):
    f = tmp_path / "x"
    f.write_bytes(b"0" * LOADS)
    drop_cached(str(f))
    assert isinstance(filesystem(str(f)), str)


def test_a_load_that_fails_leaves_its_slot_unknown_and_restore_loads_it_again(users):
    adapters = read_adapters(str(users), resolve("tiny-moe"), 16)
    m, want = model("tiny-moe", adapters), model("tiny-moe", adapters)
    loader = AdapterLoader(m, adapters=adapters)
    good = loader.bank[1]
    loader.bank[1] = [(torch.zeros(7, 3), torch.zeros(7, 3))] + good[1:]  # a copy that cannot be made
    with pytest.raises(RuntimeError):
        loader.load(0, 1)
    assert loader.held[0] == -1
    loader.bank[1] = good
    loader.restore()
    assert loader.held == [0, 1, 0]
    for x, y in zip(m.state_dict().values(), want.state_dict().values()):
        assert torch.equal(x, y)


def test_a_cold_read_is_priced_as_a_line_in_its_files_bytes():
    sizes = np.array([1e7, 4e7, 1e7, 4e7])
    line = read_line({"bytes": sizes, "cold_ms": 5 + sizes / 2e6})  # 5 ms + 2 GB/s
    assert line["storage_read_cold_gb_s"] == pytest.approx(2.0) and line["storage_read_cold_fixed_ms"] == pytest.approx(5)
    alike = read_line({"bytes": np.array([1e7, 1e7]), "cold_ms": np.array([4.0, 6.0])})  # one size: through the origin
    assert alike == {"storage_read_cold_gb_s": pytest.approx(2e7 / 10 / 1e6), "storage_read_cold_fixed_ms": 0.0}
    assert read_line(None) == {"storage_read_cold_gb_s": None, "storage_read_cold_fixed_ms": None}
