"""The other ways an adapter can reach its slot, timed beside vLLM's (``lorabench.runtime.adapters``):

- ``one-copy``: the adapter's slot-shaped weights held in one pinned buffer, copied to the GPU in
  one transfer into a staging buffer, then scattered into the slots by one multi-tensor copy
  (``torch._foreach_copy_``): a few host calls where vLLM's ``set_lora`` queues four per slice
  (vLLM #31317 keeps one contiguous pinned buffer per adapter);
- ``pageable``: the same from pageable host memory, what a server that does not pin pays (by
  itself only);
- ``overlapped``: ``one-copy`` on a side stream while the decode steps run on theirs (vLLM's and
  SGLang's ``--enable-lora-overlap-loading``): when the adapter is usable, and what a step that
  runs beside the load loses;
- ``storage``: an adapter's safetensors file read into host memory, cold (its pages dropped from
  the page cache first, ``posix_fadvise(DONTNEED)``) and warm; only for the user's adapters
  (``--adapters DIR``), whose files are where a server would read them.

Every path leaves the slots as ``AdapterLoader.load`` does (tests check it).
"""

import fcntl
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from lorabench.runtime.adapters import BANK, LOADS, WARMUP, AdapterLoader, time_loads
from lorabench.runtime.dispatch import Dispatcher
from lorabench.runtime.timing import Events, time_steps

ONE_COPY, PAGEABLE, OVERLAPPED, STORAGE, HOST_LINK = "one-copy", "pageable", "overlapped", "storage", "host-link"
LINK_BYTES = 256 * 2**20  # the host link's copy: large enough that its fixed costs vanish
ONE_COPY_CALLS = 2  # host calls of a one-copy load: the transfer and the scatter
STORAGE_LOCK = os.path.join(tempfile.gettempdir(), "lorabench-storage-reads.lock")


class OneCopy:
    """``AdapterLoader``'s bank, each entry's one host buffer (``loader.flat``; pageable: copies of
    the first ``BANK`` entries in pageable memory) loaded by one copy into a device staging
    buffer (one slot's bytes more on the GPU while it lives) and one scatter into the slot;
    adapter ``a`` is entry ``a`` modulo their count, as ``AdapterLoader.load`` takes it."""

    def __init__(self, loader: AdapterLoader, pageable: bool = False, staging: torch.Tensor | None = None):
        """staging: another OneCopy's, shared (one slot's bytes on the GPU, not two)."""
        self.loader, self.cuda, self.max_loras = loader, loader.cuda, loader.max_loras
        self.flat = [buf.clone() for buf in loader.flat[:BANK]] if pageable and self.cuda else loader.flat
        numel = self.flat[0].numel()
        device = loader.parts[0][0].device
        self.staging = torch.empty(numel, dtype=self.flat[0].dtype, device=device) if staging is None else staging
        shapes = [t.shape for pair in loader.bank[0] for t in pair]
        self.views = [v.view(s) for v, s in zip(torch.split(self.staging, [int(np.prod(s)) for s in shapes]), shapes)]

    @property
    def ops(self) -> int:
        """Host calls of one load (and the loader's ``slot_ops``)."""
        return ONE_COPY_CALLS + self.loader.slot_ops

    def place(self, adapters: list[int]) -> None:
        """As ``AdapterLoader.place`` (untimed: by its per-slice loads)."""
        self.loader.place(adapters)

    def load(self, slot: int, adapter: int) -> None:
        """Adapter ``adapter`` into ``slot``, queued on the current stream."""
        k = adapter % len(self.flat)
        lo = self.loader
        lo.begin(slot, k)
        self.staging.copy_(self.flat[k], non_blocking=True)
        dests = [t for a, ar, b, br in lo.parts for t in (a[slot, ar], b[slot, br])]
        torch._foreach_copy_(dests, self.views)
        lo.done(slot, k)


def time_overlap(one: OneCopy, d: Dispatcher, loads: int = LOADS, warmup: int = WARMUP,
                 most_steps: int = 1000) -> dict[str, np.ndarray] | None:
    """``one`` loading on a side stream while one-adapter-token steps replay on the step's stream
    (into slots 1, 2, ..., never slot 0, which the steps read), step after step until the load
    is done (at most ``most_steps``): ``usable_ms``, the load's own events from its first copy to
    its last; ``lost_ms``, what the steps beside it took more, together, than as many plain steps
    (the median of ``loads`` plain ones). None without a GPU or with one slot."""
    if not one.cuda or one.max_loras < 2:
        return None
    plain = float(np.median(time_steps(d, [[0]], loads, warmup).step_ms))
    side = torch.cuda.Stream()
    usable, lost = np.empty(loads), np.empty(loads)
    load_start, load_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(most_steps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(most_steps)]
    for i in range(warmup + loads):
        slot = 1 + i % (one.max_loras - 1)
        prep = d.prepare([0])  # the step's metadata first, so that the first step follows the load's issue at once
        d.load(prep)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            load_start.record()
            one.load(slot, i)
            load_end.record()
        steps = 0
        while steps < most_steps:  # steps until the load has ended, each timed by its own events (as plain ones are)
            starts[steps].record()
            d.run(prep.route)
            ends[steps].record()
            steps += 1
            ends[steps - 1].synchronize()  # the host must not queue far past the load's end
            if load_end.query():
                break
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        if i >= warmup:
            usable[i - warmup] = load_start.elapsed_time(load_end)
            lost[i - warmup] = sum(starts[j].elapsed_time(ends[j]) for j in range(steps)) - steps * plain
    return {"usable_ms": usable, "lost_ms": lost}


def time_host_link(device: torch.device, nbytes: int = LINK_BYTES, copies: int = 10) -> np.ndarray:
    """The host link's bandwidth (GB/s, 1e9 bytes), pinned host memory to the device: ``copies``
    copies of ``nbytes``, each in CUDA events after one untimed (the bound a load path is held
    to: its adapter's bytes over this)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    events = Events(copies)
    for i in range(copies):
        events.start(i)
        dev.copy_(host, non_blocking=True)
        events.stop(i)
        events.wait(i)
    out = nbytes / (events.ms() * 1e6)
    del host, dev
    torch.cuda.empty_cache()
    getattr(torch._C, "_host_emptyCache", lambda: None)()  # the pinned buffer back to the host
    return out


def drop_cached(path: str) -> None:
    """Ask the kernel to drop ``path``'s pages from the page cache (clean pages go; a file on a
    memory-backed filesystem, tmpfs, stays in memory whatever is asked)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def filesystem(path: str) -> str | None:
    """The type of the filesystem ``path`` is on (/proc/mounts: its longest mount point), or None."""
    try:
        mounts = [line.split()[1:3] for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return None
    real = os.path.realpath(path)
    best = max((m for m in mounts if real == m[0] or real.startswith(m[0].rstrip("/") + "/")),
               key=lambda m: len(m[0]), default=None)
    return best[1] if best else None


class StorageReads:
    """A residency run's CPU-cache misses: adapter ``a``'s file (``files[a]``) read with
    safetensors into host memory, cold (``drop`` first, outside the step's time), as vLLM reads
    an adapter its CPU cache lacks before activating it. What was read is dropped: the load
    itself then copies the bank's pinned entry, as vLLM copies the adapter it has just read.
    Not isolated from other workers of the same host reading the same folder at once (one GPU
    each): one's read can warm a file another has just dropped (``time_storage`` takes a lock,
    a timed step cannot wait for one)."""

    def __init__(self, files: list[str]):
        self.files = files

    def drop(self, adapter: int) -> None:
        drop_cached(self.files[adapter % len(self.files)])

    def read(self, adapter: int) -> int:
        """Read the file; returns its bytes."""
        from safetensors.torch import load_file

        path = self.files[adapter % len(self.files)]
        load_file(path, device="cpu")
        return os.path.getsize(path)


def time_storage(paths: list[str], reads: int = LOADS) -> dict[str, np.ndarray]:
    """Each file of ``paths`` in turn read with safetensors into host memory, ``reads`` times:
    ``cold_ms`` after its pages were dropped, then ``warm_ms`` read again at once; ``bytes``,
    each read file's size."""
    from safetensors.torch import load_file

    cold, warm, sizes = np.empty(reads), np.empty(reads), np.empty(reads)
    with open(STORAGE_LOCK, "a") as lock:  # one worker of this host at a time: another's reads would warm or drop these files
        fcntl.flock(lock, fcntl.LOCK_EX)
        for i in range(reads):
            path = paths[i % len(paths)]
            drop_cached(path)
            t0 = time.perf_counter()
            load_file(path, device="cpu")
            t1 = time.perf_counter()
            load_file(path, device="cpu")
            cold[i], warm[i] = (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3
            sizes[i] = os.path.getsize(path)
    return {"cold_ms": cold, "warm_ms": warm, "bytes": sizes}


def time_load_paths(loader: AdapterLoader, d: Dispatcher, files: list[str], loads: int = LOADS) -> dict[str, dict]:
    """Every path but vLLM's per-slice one (``time_loads`` times that): path -> its samples, as
    ``time_loads`` gives them (``load_ms`` in a step, ``alone_ms``, ``host_us``), the overlapped
    path's ``usable_ms`` and ``lost_ms``, storage's ``cold_ms`` and ``warm_ms`` (``files``: the
    user's adapters' files; none: not timed), and on a GPU the host link's ``gb_s``."""
    one = OneCopy(loader)
    out = {ONE_COPY: time_loads(one, d, loads)}
    overlap = time_overlap(one, d, loads)
    if overlap is not None:
        out[OVERLAPPED] = overlap
    out[PAGEABLE] = time_loads(OneCopy(loader, pageable=True, staging=one.staging), d, loads, in_step=False)
    del one
    if files:
        out[STORAGE] = time_storage(files, loads)
    if loader.cuda:
        torch.cuda.empty_cache()  # the staging buffer's memory back to the device
        out[HOST_LINK] = {"gb_s": time_host_link(loader.parts[0][0].device)}
    if loader.held is not None:  # the timed loads moved the user's adapters
        loader.restore()
    return out


def read_line(storage: dict | None) -> dict:
    """A cold read's time as a line in its file's bytes, ms = fixed + bytes / rate, fitted to the
    timed reads (least squares) where their files differ in size, else through the origin (their
    bytes over their time): the columns ``storage_read_cold_gb_s`` and ``..._fixed_ms``."""
    if storage is None:
        return {"storage_read_cold_gb_s": None, "storage_read_cold_fixed_ms": None}
    sizes, ms = storage["bytes"], storage["cold_ms"]
    if len(np.unique(sizes)) > 1:
        slope, fixed = np.polyfit(sizes, ms, 1)
        if slope > 0 and fixed >= 0:
            return {"storage_read_cold_gb_s": float(1 / slope / 1e6), "storage_read_cold_fixed_ms": float(fixed)}
    return {"storage_read_cold_gb_s": float(sizes.sum() / ms.sum() / 1e6), "storage_read_cold_fixed_ms": 0.0}


def columns(paths: dict[str, dict], files: list[str], loader: AdapterLoader) -> dict:
    """The rows' medians of ``time_load_paths``' samples (None where a path was not timed)."""
    def median(path, key):
        return float(np.median(paths[path][key])) if path in paths else None

    return {"load_one_copy_ms_median": median(ONE_COPY, "load_ms"),
            "load_one_copy_alone_ms_median": median(ONE_COPY, "alone_ms"),
            "load_one_copy_ops": ONE_COPY_CALLS + loader.slot_ops if ONE_COPY in paths else None,
            "load_pageable_alone_ms_median": median(PAGEABLE, "alone_ms"),
            "load_overlap_usable_ms_median": median(OVERLAPPED, "usable_ms"),
            "load_overlap_lost_ms_median": median(OVERLAPPED, "lost_ms"),
            "storage_read_cold_ms_median": median(STORAGE, "cold_ms"),
            "storage_read_warm_ms_median": median(STORAGE, "warm_ms"),
            "storage_fs": filesystem(files[0]) if files and STORAGE in paths else None,
            **read_line(paths.get(STORAGE)),
            "host_link_gb_s_median": median(HOST_LINK, "gb_s")}


def samples(paths: dict[str, dict]) -> dict[str, tuple[list, list, list]]:
    """Each path's samples as the loads files keep them: (what a load added to its step, the
    load by itself, the host's queueing) in ms, ms, us; None where a path has no such figure
    (overlapped: the step's loss, the time until usable; storage: each read, cold and warm)."""
    out = {}
    for path, t in paths.items():
        if path == OVERLAPPED:
            out[path] = (t["lost_ms"].tolist(), t["usable_ms"].tolist(), [None] * len(t["lost_ms"]))
        elif path == HOST_LINK:
            continue  # one figure per worker, in its rows
        elif path == STORAGE:
            for kind in ("cold", "warm"):
                reads = t[f"{kind}_ms"].tolist()
                out[f"{STORAGE}-{kind}"] = ([None] * len(reads), reads, [None] * len(reads))
        else:
            out[path] = tuple([None if np.isnan(v) else float(v) for v in t[k]] for k in ("load_ms", "alone_ms", "host_us"))
    return out
