"""A sweep's specification: defaults, then a TOML spec file, then command-line flags, checked
once up front so that bad input ends in one clear line (``UserError``) before anything runs."""

import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lorabench.config.backends import KernelsLabel, require_vllm_dtype
from lorabench.config.flags import (
    Machine,
    resolve_device,
    to_bool,
    to_int,
    to_ints,
    to_positive,
    to_strs,
)
from lorabench.config.models import PRESETS
from lorabench.config.strategies import AUTO, Vllm, strategy
from lorabench.config.workload import parse_workload
from lorabench.errors import UserError
from lorabench.kernels import DTYPES, SUPPORTED_RANKS
from lorabench.storage.tune_files import tuned_file, tuned_table, vllm_folder

MAX_TOKENS = 512  # the kernels are built and tested for 1 to 512 tokens per step


@dataclass
class SweepSpec:
    max_loras: list[int] = field(default_factory=lambda: [4])
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    strategy: list[str] = field(default_factory=lambda: ["max", "pow2", "dense"])
    model: str | None = None  # default: llama-2-7b on a GPU, tiny on the CPU
    layers: int | None = None  # default: the preset's
    rank: int = 16
    context_len: int = 1024
    dtype: str | None = None  # default: float16 on a GPU, float32 on the CPU
    kernels: list[str] | None = None  # kernels labels; default: triton on a GPU, torch on the CPU
    device: str = "auto"
    workload: list[str] = field(default_factory=lambda: ["uniform"])
    iters: int = 100
    warmup: int = 10
    seed: int = 0
    out: str = "results"
    capture_sizes: list[int] | None = None  # default: the concurrency values
    check: bool = True  # replay every graph against the reference before timing (the `correct` column)
    auto_from: str | None = None  # --strategy auto: the run whose points price the capture sets
    graph_memory_budget: float | None = None  # --strategy auto: MiB of graph memory the set may take
    startup_budget: float | None = None  # --strategy auto: seconds of startup the set may take
    auto_sets: dict | None = None  # --strategy auto, chosen when planned: "kernels/max_loras" -> counts and predictions
    tuned: str | None = None  # `lorabench tune`'s output folder: adds a "+tuned" run of each tunable backend

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def labels(self) -> list[KernelsLabel]:
        return [KernelsLabel.parse(k) for k in self.kernels]


LIST_INT = {"max_loras", "concurrency", "capture_sizes"}
LIST_STR = {"strategy", "kernels", "workload"}
INTS = {"layers", "rank", "context_len", "iters", "warmup", "seed"}
STRS = {"model", "dtype", "device", "out", "auto_from", "tuned"}
BOOLS = {"check"}
FLOATS = {"graph_memory_budget", "startup_budget"}
FIELDS = LIST_INT | LIST_STR | INTS | STRS | BOOLS | FLOATS


def coerce(name: str, value):
    """A flag's or spec file's raw value -> the field's type (comma strings become lists)."""
    if name in LIST_INT:
        return to_ints(name, value)
    if name in LIST_STR:
        return to_strs(name, value)
    if name in INTS:
        return to_int(name, value, 0 if name in ("warmup", "seed") else 1)
    if name in FLOATS:
        return to_positive(name, value)
    if name in BOOLS:
        return to_bool(name, value)
    return str(value)


def load_spec_file(path: Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"spec file {path} does not exist")
    try:
        raw = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"spec file {path} is not valid TOML: {e}") from None
    values = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in FIELDS:
            raise UserError(f"spec file {path}: unknown key {key!r} (known: {', '.join(sorted(FIELDS))})")
        values[name] = value
    return values


def build_spec(flags: dict, spec_file: Path | None, machine: Machine) -> tuple[SweepSpec, str | None]:
    """Merge defaults < spec file < flags (None = not given), validate, resolve the automatic
    defaults for this machine. Returns the spec and a one-line notice (CPU fallback) or None.
    Strategy auto's sets are chosen later, by the sweep command (they need a run's points)."""
    given = load_spec_file(spec_file) if spec_file else {}
    given.update({k: v for k, v in flags.items() if v is not None})
    spec = SweepSpec()
    for name, value in given.items():
        setattr(spec, name, coerce(name, value))

    device = resolve_device(spec.device, machine)
    notice = None
    if device == "cpu" and spec.model is None:
        kernels = "torch kernels" if spec.kernels is None else "the " + ",".join(spec.kernels) + " kernels"
        notice = (f"No GPU: running the tiny preset with eager steps and {kernels} on the CPU; "
                  "its figures are CPU figures, not GPU results.")
    spec.device = device
    spec.model = spec.model or ("llama-2-7b" if device == "cuda" else "tiny")
    spec.dtype = spec.dtype or ("float16" if device == "cuda" else "float32")
    spec.kernels = spec.kernels or (["triton"] if device == "cuda" else ["torch"])
    spec.capture_sizes = sorted(set(spec.capture_sizes or spec.concurrency))
    spec.concurrency = sorted(set(spec.concurrency))
    spec.max_loras = sorted(set(spec.max_loras))

    if spec.model not in PRESETS:
        raise UserError(f"--model: unknown preset {spec.model!r} (choose from {', '.join(PRESETS)})")
    if spec.rank not in SUPPORTED_RANKS:
        raise UserError(f"--rank: {spec.rank} is not supported (choose from {', '.join(map(str, SUPPORTED_RANKS))})")
    if spec.dtype not in DTYPES:
        raise UserError(f"--dtype: {spec.dtype!r} is not supported (choose from {', '.join(DTYPES)})")
    try:
        spec.kernels = list(dict.fromkeys(str(KernelsLabel.parse(k)) for k in spec.kernels))
    except ValueError as e:
        raise UserError(f"--kernels: {e}") from None
    _resolve_tuned(spec, machine)
    if any(k.vllm for k in spec.labels):
        require_vllm_dtype(spec.dtype)
    if max(spec.concurrency + spec.capture_sizes) > MAX_TOKENS:
        raise UserError(f"--concurrency/--capture-sizes: at most {MAX_TOKENS} tokens per step are supported")
    try:
        strategies = [strategy(s) for s in spec.strategy]
        for s in strategies:
            for m in spec.max_loras:
                if s.name != AUTO:
                    s.counts(m)
    except ValueError as e:
        raise UserError(f"--strategy: {e}") from None
    spec.strategy = list(dict.fromkeys(s.name for s in strategies))
    for w in spec.workload:
        try:
            wl = parse_workload(w)
            for c in spec.concurrency:  # a trace must cover every swept concurrency
                for m in spec.max_loras:
                    if w.strip().startswith("trace:"):
                        wl.active_count_pmf(c, m)
        except ValueError as e:
            raise UserError(f"--workload: {e}") from None
    spec.workload = list(dict.fromkeys(parse_workload(w).name for w in spec.workload))
    no_vllm = [s.name for s in strategies if s.vllm is Vllm.NONE and s.name != AUTO]
    if any(k.vllm for k in spec.labels) and no_vllm:
        if all(k.vllm for k in spec.labels) and len(no_vllm) == len(spec.strategy):
            raise UserError(f"--strategy {','.join(no_vllm)}: vLLM has no count-agnostic grid; use --kernels triton or fused")
        notice = "; ".join(filter(None, [notice, f"{','.join(no_vllm)} runs with lorabench's kernels only (vLLM's grid follows its count)"]))
    if AUTO in spec.strategy:
        if not spec.auto_from:
            raise UserError("--strategy auto needs --auto-from RUN: the sweep whose points price the capture sets")
        if any(k.vllm for k in spec.labels):
            raise UserError("--strategy auto chooses lorabench's capture sets; vLLM captures max or pow2 only (drop vllm from --kernels)")
    elif spec.auto_from or spec.graph_memory_budget or spec.startup_budget:
        raise UserError("--auto-from and the budgets apply to --strategy auto only")
    return spec, notice


def _resolve_tuned(spec: SweepSpec, machine: Machine) -> None:
    """--tuned DIR: every swept backend DIR has configs for also runs as "<backend>+tuned" with
    them, next to its defaults in the same run."""
    wants = [k for k in spec.labels if k.tuned]
    if not spec.tuned:
        if wants:
            raise UserError(f"--kernels {wants[0]}: needs --tuned DIR (the output of `lorabench tune`)")
        return
    folder = Path(spec.tuned)
    if not folder.is_dir():
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
        tuned = KernelsLabel(k.backend, True)
        if not k.tuned and has.get(k.backend) and str(tuned) not in spec.kernels:
            spec.kernels.insert(spec.kernels.index(str(k)) + 1, str(tuned))
    if not any(k.tuned for k in spec.labels):
        raise UserError(f"--tuned: {folder} holds no tuned configs for any of --kernels {','.join(spec.kernels)}")
