"""The environment every row carries: device, driver, CUDA, library versions, git SHA."""

import os
import platform
import subprocess
from pathlib import Path

import torch
import triton

from lorabench.config.flags import Machine
from lorabench.errors import UserError
from lorabench.kernels import vllm_lora
from lorabench.runtime import telemetry

REPO = Path(__file__).resolve().parents[2]


def git_sha() -> str | None:
    """HEAD of the checkout lorabench runs from, with ``-dirty`` when it has uncommitted changes.
    ``LORABENCH_GIT_SHA`` overrides it, for copies of a checkout that travel without .git."""
    if os.environ.get("LORABENCH_GIT_SHA"):
        return os.environ["LORABENCH_GIT_SHA"]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=5)
        if sha.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=5)
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def driver_version() -> str | None:
    """The NVIDIA driver's version, read through NVML; None without NVML or a driver."""
    return telemetry.driver_version()


def collect(device: str) -> dict:
    cuda = device == "cuda"
    return {
        "device": device,
        "gpu_name": torch.cuda.get_device_name() if cuda else None,
        "gpu_uuid": gpu_uuid() if cuda else None,
        "driver": driver_version() if cuda else None,
        "cuda": torch.version.cuda if cuda else None,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "git_sha": git_sha(),
        "python": platform.python_version(),
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
    }


def gpu_uuid() -> str | None:
    """The UUID of the GPU this process's device 0 is (``GPU-...``, as NVML and nvidia-smi write it)."""
    try:
        return f"GPU-{torch.cuda.get_device_properties(0).uuid}"
    except (RuntimeError, AssertionError, AttributeError):  # no driver; torch without CUDA
        return None


def free_gpu_bytes() -> int | None:
    """Free memory of the GPU the workers get (torch's device 0), read through NVML by its UUID:
    asking torch (``mem_get_info``) would create a CUDA context in the sweep's own process, 0.5 GiB
    held for the whole sweep. None when it cannot be read: the memory check is then skipped."""
    uuid = gpu_uuid()
    gpu = telemetry.Gpu.by_uuid(uuid) if uuid else None
    return gpu.free_bytes() if gpu else None


def machine() -> Machine:
    """This host as a spec sees it: a CUDA device or not, its name, and the memory a worker may
    take (free GPU memory; RAM as Linux's MemAvailable), for the spec's memory check. None where
    unknown: the check is then skipped."""
    cuda = torch.cuda.is_available()
    free_gpu = free_gpu_bytes() if cuda else None
    free_ram = None
    try:
        with open("/proc/meminfo") as f:
            free_ram = next((int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")), None)
    except (OSError, ValueError, IndexError):
        pass
    return Machine(cuda=cuda, gpu_name=torch.cuda.get_device_name() if cuda else None,
                   free_gpu_bytes=free_gpu, free_ram_bytes=free_ram)


def require_vllm() -> None:
    """--kernels vllm: vLLM's ops importable here, or one line saying how to get them."""
    try:
        vllm_lora.load_ops()
    except vllm_lora.VllmUnavailable as e:
        raise UserError(str(e)) from None
