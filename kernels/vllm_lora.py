"""vLLM's own LoRA Triton ops (``vllm.lora.ops.triton_ops``) as a lorabench backend.

The kernels are vLLM's, called exactly as vLLM's ``PunicaWrapperGPU.add_lora_linear`` calls them:
a float32 ``[slices, T, rank]`` buffer allocated per call, ``lora_shrink`` (which zeroes it) then
``lora_expand`` with ``add_inputs=True``, and the metadata of vLLM's ``LoRAKernelMeta`` given by
``meta_args(T, specialize_active_lora)``. Its grid's adapter axis is vLLM's count, which
includes the base-model id -1 when the batch has base tokens; how that count is chosen and
captured is vLLM's runner's business, emulated in ``lorabench.runtime.vllm_rules``.

vLLM keeps one contiguous ``[max_loras, rank, K]`` / ``[max_loras, N_s, rank]`` tensor per slice;
lorabench stores the slices stacked, so this backend keeps a per-slice copy of each linear's
adapter weights in vLLM's layout (made on first use, outside graph capture).

vLLM is an optional dependency (``pip install 'lorabench[vllm]'``); ``load_ops`` raises
``VllmUnavailable`` with that advice when it is missing.
"""

import inspect
import os
from typing import NamedTuple

import torch

from . import vllm_moe_lora as _vllm_moe_lora
from .vllm_moe_lora import moe_path  # noqa: F401 (vLLM's rule for its expert-LoRA paths)

NEEDS_ZEROED_SCRATCH = False  # vLLM's shrink zeroes its own buffer

INSTALL_HINT = (
    "--kernels vllm needs vLLM's LoRA ops: pip install 'lorabench[vllm]' "
    "(on a machine without a package index, scripts/vllm-bundle.sh packs its files)"
)


class VllmUnavailable(ImportError):
    """vLLM (or its LoRA Triton ops) cannot be imported here."""


class VllmMeta(NamedTuple):
    """What a LoRA step hands this backend: vLLM's kernel metadata and the runner's flag."""

    kernel_meta: object  # vllm.lora.ops.triton_ops.LoRAKernelMeta
    specialize: bool  # --specialize-active-lora: the grid follows the (rounded) count
    frozen_grid: torch.Tensor | None = None  # CPU [1]: a captured graph's grid, for eager stand-ins


_OPS = None


def load_ops():
    """``(lora_shrink, lora_expand, LoRAKernelMeta, vllm_version)``, imported once."""
    global _OPS
    if _OPS is not None:
        return _OPS
    flags = _torch_flags()
    try:
        if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
            from vllm.lora.ops.triton_ops import (
                LoRAKernelMeta,
                lora_expand,
                lora_shrink,
            )
        else:
            LoRAKernelMeta, lora_expand, lora_shrink = _import_for_interpreter()
        import vllm
    except ImportError as e:  # vllm missing, or a dependency of its import chain missing
        raise VllmUnavailable(f"{INSTALL_HINT} ({type(e).__name__}: {e})") from e
    finally:
        _restore_torch_flags(flags)
    _OPS = (lora_shrink, lora_expand, LoRAKernelMeta, getattr(vllm, "__version__", None))
    return _OPS


# Process-wide torch switches that importing vLLM may flip: vLLM 0.33's CUDA platform module
# turns cuDNN's attention backend off, which changed the base model's attention kernel (and
# step time) in vllm workers only. The backend must differ from the others in its LoRA ops
# and metadata alone, so these are restored after the import.
_SWITCHES = {
    "cudnn_sdp": (torch.backends.cuda.cudnn_sdp_enabled, torch.backends.cuda.enable_cudnn_sdp),
    "flash_sdp": (torch.backends.cuda.flash_sdp_enabled, torch.backends.cuda.enable_flash_sdp),
    "mem_efficient_sdp": (torch.backends.cuda.mem_efficient_sdp_enabled, torch.backends.cuda.enable_mem_efficient_sdp),
    "math_sdp": (torch.backends.cuda.math_sdp_enabled, torch.backends.cuda.enable_math_sdp),
    "float32_matmul_precision": (torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
}


def _torch_flags() -> dict:
    return {name: get() for name, (get, _) in _SWITCHES.items()}


def _restore_torch_flags(flags: dict) -> None:
    for name, value in flags.items():
        if _SWITCHES[name][0]() != value:
            _SWITCHES[name][1](value)


def _import_for_interpreter():
    """CPU only, under TRITON_INTERPRET=1 (how the tests run vLLM's kernels without a GPU):
    vLLM turns Triton off when no GPU driver is active and pins host memory it cannot pin, so
    its import sees an active driver and its host staging is left unpinned. The kernels and
    their launch code are untouched; on a GPU nothing here runs."""
    from triton.backends import backends

    driver = backends["nvidia"].driver
    is_active = inspect.getattr_static(driver, "is_active")  # as defined: a staticmethod stays one
    driver.is_active = staticmethod(lambda: True)
    try:
        from vllm.lora.ops.triton_ops import LoRAKernelMeta, lora_expand, lora_shrink
    finally:
        driver.is_active = is_active
    import vllm.utils.torch_utils

    vllm.utils.torch_utils.PIN_MEMORY = False
    return LoRAKernelMeta, lora_expand, lora_shrink


def available() -> bool:
    try:
        load_ops()
    except VllmUnavailable:
        return False
    return True


def version() -> str | None:
    return load_ops()[3] if available() else None


def vllm_weights(lora_a: torch.Tensor, lora_b: torch.Tensor, slice_starts: tuple[int, ...]):
    """lorabench's stacked weights as vLLM's per-slice tuples: A_s [L, 1, R, K], B_s [L, 1, N_s, R]
    (vLLM's ``lora_a_stacked`` / ``lora_b_stacked`` shapes), contiguous. Made once per linear and
    kept on ``lora_a`` itself, so the copies live exactly as long as the weights they copy."""
    cached = getattr(lora_a, "_vllm_slices", None)
    if cached is None:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("vLLM-layout weights must be made before graph capture (run a warm-up step)")
        slices = len(slice_starts) - 1
        rows = lora_a.shape[1] // slices  # the rank, or a fully sharded rank's share of it
        a = tuple(lora_a[:, s * rows : (s + 1) * rows].unsqueeze(1).contiguous() for s in range(slices))
        b = tuple(lora_b[:, slice_starts[s] : slice_starts[s + 1]].unsqueeze(1).contiguous() for s in range(slices))
        cached = lora_a._vllm_slices = (a, b)
    return cached


def lora_apply(y, x, lora_a, lora_b, slice_starts, meta: VllmMeta, launch_count, scale, scratch=None):
    """``y += LoRA(x)`` with vLLM's ops, as ``PunicaWrapperGPU.add_lora_linear`` does it.

    ``launch_count`` only says whether LoRA runs at all (0 = the no-LoRA graph, which calls no
    LoRA op); the grid is whatever vLLM's metadata says, which is the point of this backend.
    """
    del scratch
    if launch_count <= 0:
        return
    lora_shrink, lora_expand, _, _ = load_ops()
    a, b = vllm_weights(lora_a, lora_b, slice_starts)
    tokens, rank, rows = x.shape[0], lora_b.shape[-1], a[0].shape[2]
    args = meta.kernel_meta.meta_args(tokens, meta.specialize)
    if meta.frozen_grid is not None:
        args = (*args[:-1], meta.frozen_grid)
    buffer = torch.empty((len(a), tokens, rows), dtype=torch.float32, device=x.device)
    lora_shrink(x, a, buffer, *args, scale)
    if rows != rank:  # fully sharded (vLLM's _mcp_apply): the all-gather, left out, makes [S, T, R]; here the
        gathered = torch.zeros((len(a), tokens, rank), dtype=torch.float32, device=x.device)  # other ranks' shares are 0
        gathered[:, :, :rows] = buffer
        buffer = gathered
    lora_expand(buffer, b, y, *args, offset_start=0, add_inputs=True)


def moe_lora_apply(call, meta: VllmMeta, launch_count, scale) -> None:
    """Expert LoRA with vLLM's ``fused_moe_lora`` (``kernels.vllm_moe_lora``)."""
    _vllm_moe_lora.moe_lora_apply(call, meta, launch_count, scale, load_ops)
