"""What a sweep's spec is refused for, before anything runs: an output root that cannot hold a
run, a worker that does not fit the memory free on its device, residency options without
``--adapters``, and fully sharded LoRA that cannot be cut. ``spec`` is a ``SweepSpec`` and
``names`` says how an error names a setting (``lorabench.config.spec.Names``)."""

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from lorabench.config.backends import KernelsLabel
from lorabench.config.flags import Machine
from lorabench.config.models import check_moe_options
from lorabench.config.lengths import parse_lengths
from lorabench.config.limits import Shape, culprit, estimate, graph_count, model_bytes, size
from lorabench.config.residency import check_residency
from lorabench.config.strategies import AUTO, Vllm
from lorabench.config.sweep_spec import LOAD_PATHS, MAX_STEPS
from lorabench.config.workload import parse_workload
from lorabench.errors import UserError
from lorabench.kernels import BACKENDS


def check_out(out: str, where: str) -> None:
    """The output root can hold a new run folder: a folder, or a path whose nearest existing
    part is a folder this process can create folders in (tried with an empty folder, removed at
    once: permission bits say nothing for root or on a read-only mount)."""
    if not out.strip():
        raise UserError(f"{where}: empty path; name the output root, e.g. results")
    path = existing = Path(out)
    while True:
        try:
            os.lstat(existing)
            break
        except (FileNotFoundError, NotADirectoryError):
            if existing == existing.parent:
                break
            existing = existing.parent
        except (OSError, ValueError) as e:  # a name too long, a loop of links, a NUL byte
            raise UserError(f"{where}: {out}: {getattr(e, 'strerror', None) or e}") from None
    what = "" if existing == path else f"{path} cannot be made: "
    if os.path.islink(existing) and not os.path.exists(existing):
        raise UserError(f"{where}: {what}{existing} is a broken link")
    if not os.path.isdir(existing):
        kind = "a file, not a folder" if os.path.isfile(existing) else "not a folder"
        raise UserError(f"{where}: {what}{existing} is {kind}")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".lorabench-", dir=existing))
    except OSError as e:
        raise UserError(f"{where}: cannot create folders in {existing} ({e.strerror or e})") from None


def graphs_of(spec, s, label: KernelsLabel, max_loras: int) -> int:
    """Graphs a worker of strategy ``s`` captures (auto: at most dense's), a mixed key's PIECEWISE
    graphs counted as one."""
    counts = list(range(1, max_loras + 1)) if s.name == AUTO else s.counts(max_loras)
    vllm = label.vllm and s.vllm is not Vllm.NONE
    # a mixed key's pieces hold about one FULL graph's nodes
    return graph_count(counts, max_loras, spec.capture_sizes + spec.mixed_sizes, s.bucket_grid, vllm)


def check_memory(spec, machine: Machine, graphs: Callable[[KernelsLabel, int], int]) -> None:
    """Every worker fits the memory free on its device: weights, adapter slots, KV cache,
    activations, ``graphs(label, max_loras)`` graphs and the process's runtime
    (``lorabench.config.limits``). Unknown free memory: not checked."""
    free, what = machine.free_bytes(spec.device)
    if free is None:
        return
    cfg = spec.rank_model
    for m in reversed(spec.max_loras):
        for label in spec.labels:
            shape = Shape(cfg, m, spec.rank, spec.dtype, spec.max_tokens, spec.context_len, vllm=label.vllm,
                          extended=BACKENDS[label.backend].extends_k, fully_sharded=spec.fully_sharded_loras,
                          cache_rows=spec.cache_rows,
                          logit_tokens=max(spec.capture_sizes + spec.concurrency + spec.mixed_sizes))
            count, cuda = graphs(label, m), spec.device == "cuda"
            need = estimate(shape, count, cuda)
            if need.total > free:
                hint = ("; --share-expert-weights holds one set of experts for every layer"
                        if cfg.moe is not None and not cfg.moe.shared_weights else "")
                raise UserError(f"{culprit(shape, count, cuda)} does not fit: {need.describe()} > {size(free)} {what}{hint}")


def check_adapters(spec, names) -> None:
    """--adapters N makes the workload runs residency runs; --max-cpu-loras and --output-tokens
    only mean something with it."""
    if spec.load_path not in LOAD_PATHS:
        raise UserError(f"{names('load_path')}: {spec.load_path!r} is not one of {', '.join(LOAD_PATHS)}")
    spec.output_tokens = str(parse_lengths(spec.output_tokens, names("output_tokens"), MAX_STEPS))
    if spec.adapters is None:
        given = [n for n in ("max_cpu_loras", "output_tokens", "load_path") if getattr(spec, n) != getattr(type(spec), n)]
        if given:
            raise UserError(f"{names(given[0])}: goes with --adapters N (the residency runs it sets up)")
        return
    if spec.ranks is not None:
        raise UserError(f"{names('adapters')}: not with --ranks (each slot's rank is fixed; a residency run moves "
                        "adapters between slots)")
    for w in spec.workload:
        try:
            check_residency(parse_workload(w), spec.adapters, spec.max_cpu_loras, spec.max_loras)
        except ValueError as e:
            raise UserError(f"{names('adapters')}: {e}") from None


def check_adapter_bank(spec, machine: Machine, names) -> None:
    """--adapters DIR: each worker holds every one of the adapters in pinned host memory, padded
    to --rank (vLLM's CPU cache), for the residency runs. Unknown free memory: not checked."""
    if spec.adapter_dir is None or machine.free_ram_bytes is None:
        return
    slot = model_bytes(Shape(spec.rank_model, 1, spec.rank, spec.dtype, 1, 1, fully_sharded=spec.fully_sharded_loras))[1]
    need = spec.adapters * slot
    if need > machine.free_ram_bytes:
        raise UserError(f"{names('adapters')}: its {spec.adapters} adapters at --rank {spec.rank} take {size(need)} of "
                        f"pinned host memory, more than the {size(machine.free_ram_bytes)} available")


def check_fully_sharded(spec, names) -> None:
    """--fully-sharded-loras cuts the rank and the hidden outputs over --tp ranks, and needs an
    all-gather between shrink and expand, which one fused launch has no place for."""
    where, cfg = names("fully_sharded_loras"), spec.model_config
    check_moe_options(cfg, True, where)
    if spec.tp == 1:
        raise UserError(f"{where}: needs --tp 2 or more (one rank has nothing to shard)")
    if spec.rank % spec.tp:
        raise UserError(f"{where}: rank {spec.rank} does not split over {spec.tp} ranks")
    if cfg.hidden % spec.tp:
        raise UserError(f"{where}: {cfg.name}'s hidden size {cfg.hidden} does not split over {spec.tp} ranks")
    cannot = [str(k) for k in spec.labels if k.backend == "fused"]
    if cannot:
        raise UserError(f"{where}: --kernels {cannot[0]} cannot run it (one launch has no place for the all-gather "
                        "between shrink and expand); use triton, torch or vllm")


