"""The environment every row carries (``Env``: device, GPU, driver, CUDA, library versions, git
SHA), and this host as a sweep's spec sees it (``Machine``).

Only a worker's ``collect`` imports torch (its GPU's name and UUID, its CUDA build). The sweep's own
process never does: ``machine`` and ``host`` read the GPUs through NVML (``lorabench.runtime.gpus``,
as CUDA_VISIBLE_DEVICES narrows them) and the versions from the installed packages' files, so
that a sweep starts its first worker without paying torch's import (seconds) itself."""

import ast
import importlib.util
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

from lorabench.config.flags import Machine
from lorabench.errors import UserError
from lorabench.runtime import gpus, telemetry
from lorabench.storage.row import Env

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


def _installed(*names: str) -> str | None:
    """The version of the first of these distributions that is installed (as ``torch.__version__``
    and ``triton.__version__`` say it), without importing it."""
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _torch_build() -> tuple[str | None, str | None]:
    """torch's ``__version__`` and CUDA build as ``torch/version.py`` states them, without importing
    torch: a distribution's metadata may drop the local tag (``2.11.0`` for ``2.11.0+cu130``), and
    a resumed run compares this with its rows' ``torch.__version__``."""
    spec = importlib.util.find_spec("torch")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        try:
            tree = ast.parse((Path(folder) / "version.py").read_text())
        except (OSError, SyntaxError, ValueError):
            continue
        values = {}
        for node in tree.body:
            target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
            if isinstance(target, ast.Name) and isinstance(getattr(node, "value", None), ast.Constant):
                values[target.id] = node.value.value
        if isinstance(values.get("__version__"), str):
            return values["__version__"], values.get("cuda")
    return _installed("torch"), None


def _common(device: str) -> dict:
    return {"device": device, "git_sha": git_sha(), "python": platform.python_version(), "host": platform.node(),
            "cpu": platform.processor() or platform.machine()}


def collect(device: str) -> Env:
    """A worker's environment, from torch itself (its device 0 is the GPU it was pinned to)."""
    import torch
    import triton

    cuda = device == "cuda"
    return Env(gpu_name=torch.cuda.get_device_name() if cuda else None, gpu_uuid=gpu_uuid() if cuda else None,
               driver=driver_version() if cuda else None, cuda=torch.version.cuda if cuda else None,
               torch=torch.__version__, triton=triton.__version__, **_common(device))


def host(device: str) -> Env:
    """This process's environment as a worker here would report it, without importing torch: the
    first visible GPU's name and UUID from NVML, torch's version and CUDA build from its version
    file, triton's from its package's metadata."""
    gpu = next(iter(gpus.visible()), None) if device == "cuda" else None
    torch_version, cuda = _torch_build()
    return Env(gpu_name=gpu.name if gpu else None, gpu_uuid=gpu.uuid if gpu else None,
               driver=driver_version() if gpu else None, cuda=cuda if gpu else None, torch=torch_version,
               triton=_installed("triton", "pytorch-triton"), **_common(device))


def gpu_uuid() -> str | None:
    """The UUID of the GPU this process's device 0 is (``GPU-...``, as NVML and nvidia-smi write it)."""
    import torch

    try:
        return f"GPU-{torch.cuda.get_device_properties(0).uuid}"
    except (RuntimeError, AssertionError, AttributeError):  # no driver; torch without CUDA
        return None


def free_gpu_bytes() -> int | None:
    """Free memory of the GPU the workers get (the first visible one), read through NVML: asking
    torch (``mem_get_info``) would create a CUDA context in the sweep's own process, 0.5 GiB held
    for the whole sweep. None when it cannot be read: the memory check is then skipped."""
    first = next(iter(gpus.visible()), None)
    gpu = telemetry.Gpu.by_uuid(first.uuid) if first else None
    return gpu.free_bytes() if gpu else None


def machine() -> Machine:
    """This host as a spec sees it: a GPU or not (NVML's, as CUDA_VISIBLE_DEVICES narrows them),
    its name, and the memory a worker may take (free GPU memory; RAM as Linux's MemAvailable), for
    the spec's memory check. None where unknown: the check is then skipped."""
    visible = gpus.visible()
    free_ram = None
    try:
        with open("/proc/meminfo") as f:
            free_ram = next((int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")), None)
    except (OSError, ValueError, IndexError):
        pass
    return Machine(cuda=bool(visible), gpu_name=visible[0].name if visible else None,
                   free_gpu_bytes=free_gpu_bytes() if visible else None, free_ram_bytes=free_ram)


def require_vllm() -> None:
    """--kernels vllm: vLLM's ops importable here, or one line saying how to get them."""
    from lorabench.kernels import vllm_lora

    try:
        vllm_lora.load_ops()
    except vllm_lora.VllmUnavailable as e:
        raise UserError(str(e)) from None
