"""Which GPUs a sweep spreads its worker groups over: this host's, as NVML lists them (narrowed by
CUDA_VISIBLE_DEVICES when it is set), chosen with ``--gpus``; and, on a Dask worker, the one GPU a
task takes while it runs. Imports no torch: NVML sees every GPU without a CUDA context."""

import fcntl
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from lorabench.errors import UserError
from lorabench.runtime import telemetry


@dataclass(frozen=True)
class Device:
    """One GPU of this host: its NVML index, its UUID (``GPU-...``) and its model's name."""

    index: int
    uuid: str
    name: str


def visible() -> list[Device]:
    """This host's GPUs in NVML's order, those CUDA_VISIBLE_DEVICES names (by index or UUID) when
    it is set; [] without a driver. Tests replace it to fake a host's GPUs."""
    nvml = telemetry._nvml()
    if nvml is None:
        return []
    found = []
    for i in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(i)
        found.append(Device(i, telemetry._text(nvml.nvmlDeviceGetUUID(handle)),
                            telemetry._text(nvml.nvmlDeviceGetName(handle))))
    wanted = os.environ.get("CUDA_VISIBLE_DEVICES")
    if wanted is None:
        return found
    picked = []
    for item in filter(None, (w.strip() for w in wanted.split(","))):
        match = [d for d in found if (item.isdigit() and d.index == int(item)) or d.uuid.startswith(item)]
        picked += match[:1]
    return picked


def select(text: str | None, devices: list[Device]) -> list[Device]:
    """``--gpus``: ``all`` (or None) or a comma-separated list of indices into ``devices``; one
    UserError line for anything else."""
    if text is None or text.strip() == "all":
        return list(devices)
    chosen = []
    for item in (t.strip() for t in text.split(",")):
        if not item.isdigit():
            raise UserError(f"--gpus {text}: give GPU indices like 0,1, or all")
        if int(item) >= len(devices):
            raise UserError(f"--gpus {text}: this host has {len(devices)} visible GPU{'s' * (len(devices) != 1)}"
                            + (f" (0-{len(devices) - 1})" if devices else ""))
        if devices[int(item)] not in chosen:
            chosen.append(devices[int(item)])
    return chosen


def one_model(devices: list[Device]) -> None:
    """Refuse, in one line, a set of GPUs of different models: rows of one run, and vLLM's config
    files (named per GPU), are for one GPU model."""
    names = sorted({d.name for d in devices})
    if len(names) > 1:
        raise UserError(f"--gpus: the GPUs are of different models ({', '.join(names)}); choose GPUs of one model")


@contextmanager
def claim(devices: list[Device]) -> Iterator[Device | None]:
    """One of ``devices`` that no other process of this host holds, held until the block ends (a
    lock file per GPU, released when the process dies): Dask workers of one host, each with one
    GPU resource, so take different GPUs. None when the host has no GPU (the CPU path) or all are
    held."""
    folder = Path(tempfile.gettempdir()) / "lorabench-gpus"
    folder.mkdir(exist_ok=True)
    for device in devices:
        f = open(folder / f"{device.uuid}.lock", "w")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            continue
        try:
            yield device
        finally:
            f.close()
        return
    yield None


def triton_cache(device: Device) -> str:
    """The Triton cache folder of the workers on ``device``: their own, beside the default one (or
    inside TRITON_CACHE_DIR), so that processes compiling at the same time never share one."""
    root = os.environ.get("TRITON_CACHE_DIR") or str(Path.home() / ".triton" / "cache")
    return str(Path(root) / f"lorabench-{device.uuid}")


def pinned_env(device: Device | None) -> dict[str, str]:
    """What a worker on ``device`` gets in its environment: the GPU by UUID, its own Triton cache."""
    if device is None:
        return {}
    return {"CUDA_VISIBLE_DEVICES": device.uuid, "TRITON_CACHE_DIR": triton_cache(device)}
