"""The runs a sweep adds next to each swept backend: ``<backend>+tuned`` with the configs of
``--tuned DIR``, and ``<backend>+unpadded`` with ``--ranks`` (each adapter at its own rank)."""

import os
from pathlib import Path

from lorabench.config.backends import KernelsLabel
from lorabench.config.flags import Machine
from lorabench.config.ranks import parse_ranks
from lorabench.errors import UserError
from lorabench.kernels import BACKENDS
from lorabench.storage.tune_files import tuned_file, tuned_table, vllm_folder


def add_unpadded(spec, names, adapter_ranks: tuple[int, ...] = ()) -> None:
    """--ranks, or --adapters DIR (``adapter_ranks``: its adapters' own): adapters of their own
    ranks, padded to --rank. Every swept lorabench backend that can skip the padding also runs as
    "<backend>+unpadded", next to its padded run."""
    wants = [k for k in spec.labels if k.unpadded]
    if spec.ranks is None and not adapter_ranks:
        if wants:
            raise UserError(f"--kernels {wants[0]}: needs --ranks or --adapters DIR (adapters of their own ranks, "
                            "padded to --rank)")
        return
    if adapter_ranks:
        padded = min(adapter_ranks) < spec.rank
    else:
        try:
            mix = parse_ranks(spec.ranks, spec.rank)
        except ValueError as e:
            raise UserError(f"{names('ranks')}: {e}") from None
        spec.ranks = str(mix)
        padded = mix.shares != ((spec.rank, 1.0),)
    if not padded:
        return  # no padding to skip
    for k in list(spec.labels):
        unpadded = str(KernelsLabel(k.backend, k.tuned, True))
        if not k.unpadded and BACKENDS[k.backend].unpadded and unpadded not in spec.kernels:
            spec.kernels.insert(spec.kernels.index(str(k)) + 1, unpadded)


def add_tuned(spec, machine: Machine) -> None:
    """--tuned DIR: every swept backend DIR has configs for also runs as "<backend>+tuned" with
    them, next to its defaults in the same run."""
    wants = [k for k in spec.labels if k.tuned]
    if not spec.tuned:
        if wants:
            raise UserError(f"--kernels {wants[0]}: needs --tuned DIR (the output of `lorabench tune`)")
        return
    folder = Path(spec.tuned)
    if not os.path.isdir(folder):  # also False for a name too long, not an OSError
        raise UserError(f"--tuned: {folder} is not a folder (run `lorabench tune --out {folder}` first)")
    spec.tuned = str(folder.resolve())
    meta = tuned_file(folder)
    if meta:  # configs chosen by timings on another machine or dtype are not this sweep's tuned configs
        gpu = machine.gpu_name if spec.device == "cuda" else None
        for what, theirs, ours in (("device", meta.get("device"), spec.device), ("GPU", meta.get("gpu"), gpu),
                                   ("dtype", meta.get("dtype"), spec.dtype)):
            if theirs != ours:
                raise UserError(f"--tuned: {folder} was tuned for {what} {theirs}, this sweep runs {ours} "
                                f"(tune again here: lorabench tune --out DIR)")
    entries = tuned_table(folder)
    has = {"triton": any(e.get("kernel") == "triton" for e in entries),
           "fused": any(e.get("kernel", "fused") == "fused" for e in entries),
           "vllm": any(vllm_folder(folder).glob("*.json"))}
    for k in wants:
        if not has[k.backend]:
            raise UserError(f"--kernels {k}: {folder} holds no tuned configs for {k.backend}")
    for k in list(spec.labels):  # every swept backend the folder has configs for
        tuned = KernelsLabel(k.backend, True, k.unpadded)
        if not k.tuned and has.get(k.backend) and str(tuned) not in spec.kernels:
            spec.kernels.insert(spec.kernels.index(str(k)) + 1, str(tuned))
    if not any(k.tuned for k in spec.labels):
        raise UserError(f"--tuned: {folder} holds no tuned configs for any of --kernels {','.join(spec.kernels)}")
