"""A sweep's specification: defaults, then a TOML spec file, then command-line flags, checked
once up front so that bad input ends in one clear line (``UserError``) before anything runs."""

import os
import tempfile
import tomllib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lorabench.config.backends import KernelsLabel, require_vllm_dtype
from lorabench.config.flags import (
    Machine,
    flag,
    resolve_device,
    to_bool,
    to_int,
    to_ints,
    to_positive,
    to_strs,
)
from lorabench.config.limits import Shape, culprit, estimate, graph_count, size
from lorabench.config.models import ModelConfig, resolve, shard, shortened
from lorabench.config.ranks import parse_ranks
from lorabench.config.residency import OUTPUT_TOKENS, check_residency
from lorabench.config.strategies import AUTO, Vllm, strategy
from lorabench.config.workload import parse_workload
from lorabench.errors import UserError
from lorabench.kernels import BACKENDS, DTYPES, RANKS
from lorabench.storage.tune_files import tuned_file, tuned_table, vllm_folder

MAX_TOKENS = 512  # the kernels are built and tested for 1 to 512 tokens per step
MAX_SEED = 2**32 - 1  # numpy's generators take seeds below 2**32 (torch's below 2**64)
MAX_STEPS = 100_000  # --iters, --warmup: a worker draws every timed step's batch up front
MAX_ADAPTERS = 1_000_000  # --adapters, --max-cpu-loras: the residency loop keeps one entry per adapter


@dataclass
class SweepSpec:
    max_loras: list[int] = field(default_factory=lambda: [4])
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    strategy: list[str] = field(default_factory=lambda: ["max", "pow2", "dense"])
    model: str | None = None  # a preset, a config.json or a Hugging Face id; default: llama-2-7b on a GPU, tiny on the CPU
    layers: int | None = None  # default: the model's
    tp: int = 1  # tensor-parallel ranks: one rank's decode step is measured (its all-reduces left out)
    fully_sharded_loras: bool = False  # vLLM's --fully-sharded-loras: A (column-parallel) or B (row-parallel) cut over the ranks too
    rank: int = 16  # vLLM's --max-lora-rank: every adapter's weights are padded to it
    ranks: str | None = None  # the adapters' own ranks and their shares of the slots ("8:0.5,64:0.5"); default: all at rank
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
    ci_target: float | None = None  # stop timing a point once its median's 95 % interval is within ± this % (at most iters steps)
    model_config: ModelConfig | None = None  # --model resolved when planned (the whole model, --layers applied)
    adapters: int | None = None  # --adapters N: the workload runs are residency runs over N adapters (LRU slots, loads timed)
    max_cpu_loras: int | None = None  # --max-cpu-loras: vLLM's CPU cache of adapters (default: all of them)
    output_tokens: int = OUTPUT_TOKENS  # --output-tokens: decode steps per request of a residency run

    @property
    def rank_model(self) -> ModelConfig:
        """The shapes one worker builds: one tensor-parallel rank of the model."""
        return shard(self.model_config, self.tp)

    def __post_init__(self):
        if isinstance(self.model_config, dict):  # read back from a run.json
            self.model_config = ModelConfig(**self.model_config)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def labels(self) -> list[KernelsLabel]:
        return [KernelsLabel.parse(k) for k in self.kernels]


LIST_INT = {"max_loras", "concurrency", "capture_sizes"}
LIST_STR = {"strategy", "kernels", "workload"}
INTS = {"layers", "tp", "rank", "context_len", "iters", "warmup", "seed", "adapters", "max_cpu_loras", "output_tokens"}
STRS = {"model", "dtype", "device", "out", "auto_from", "tuned", "ranks"}
BOOLS = {"check", "fully_sharded_loras"}
FLOATS = {"graph_memory_budget", "startup_budget", "ci_target"}
FIELDS = LIST_INT | LIST_STR | INTS | STRS | BOOLS | FLOATS
ALIASES = {"max_lora_rank": "rank"}  # vLLM's name for it


def coerce(name: str, value):
    """A flag's or spec file's raw value -> the field's type (comma strings become lists)."""
    if name in LIST_INT:
        return to_ints(name, value)
    if name in LIST_STR:
        return to_strs(name, value)
    if name in INTS:
        maximum = {"seed": MAX_SEED, "iters": MAX_STEPS, "warmup": MAX_STEPS, "adapters": MAX_ADAPTERS,
                   "max_cpu_loras": MAX_ADAPTERS, "output_tokens": MAX_STEPS}.get(name)
        return to_int(name, value, 0 if name in ("warmup", "seed") else 1, maximum)
    if name in FLOATS:
        return to_positive(name, value)
    if name in BOOLS:
        return to_bool(name, value)
    return str(value)


class Names:
    """How an error names a setting: by its flag, or by its key in the spec file that gave it
    (a spec file's ``check = "yes"`` is key `check`, not a ``--check`` flag that does not exist)."""

    def __init__(self, spec_file: Path | None = None, keys: dict[str, str] | None = None):
        self.spec_file, self.keys = spec_file, keys or {}  # field name -> the key as the file spells it

    def __call__(self, name: str) -> str:
        if name in self.keys:
            return f"{self.spec_file}: key `{self.keys[name]}`"
        return flag(name)

    def value(self, name: str, value: str) -> str:
        """A setting and its value: ``--strategy auto``, or ``FILE: key `strategy` = auto``."""
        return f"{self(name)} = {value}" if name in self.keys else f"{self(name)} {value}"

    def renamed(self, name: str, error: UserError) -> UserError:
        """An error about ``name`` that starts with its flag, naming where the value came from."""
        text, prefix = str(error), flag(name)
        if name in self.keys and text.startswith(prefix) and text[len(prefix):][:1] in (":", " "):
            return UserError(self(name) + text[len(prefix):])
        return error


def read_spec_file(path: Path) -> dict[str, tuple[str, object]]:
    """The spec file's settings: field name -> (its key as the file writes it, its value)."""
    if os.path.isdir(path):
        raise UserError(f"spec file {path} is a folder, not a TOML file")
    if not os.path.isfile(path):
        raise UserError(f"spec file {path} does not exist")
    try:
        raw = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"spec file {path} is not valid TOML: {e}") from None
    except OSError as e:
        raise UserError(f"spec file {path} cannot be read: {e.strerror or e}") from None
    values: dict[str, tuple[str, object]] = {}
    for key, value in raw.items():
        name = ALIASES.get(key.replace("-", "_"), key.replace("-", "_"))
        if name not in FIELDS:
            raise UserError(f"spec file {path}: unknown key {key!r} (known: {', '.join(sorted(FIELDS))})")
        if name in values:
            raise UserError(f"spec file {path}: key `{key}` repeats key `{values[name][0]}`")
        values[name] = (key, value)
    return values


def build_spec(flags: dict, spec_file: Path | None, machine: Machine) -> tuple[SweepSpec, str | None]:
    """Merge defaults < spec file < flags (None = not given), validate, resolve the automatic
    defaults for this machine. Returns the spec and a one-line notice (CPU fallback) or None.
    Errors name the flag, or the spec file's key, that gave the value. Nothing is created here:
    the output folder is only checked, and a configuration that does not fit the machine's free
    memory is refused. Strategy auto's sets are chosen later, by the sweep command (they need a
    run's points)."""
    from_file = read_spec_file(Path(spec_file)) if spec_file else {}
    given = {name: value for name, (_, value) in from_file.items()}
    given.update({k: v for k, v in flags.items() if v is not None})
    names = Names(spec_file, {name: key for name, (key, _) in from_file.items() if flags.get(name) is None})
    spec = SweepSpec()
    for name, value in given.items():
        try:
            setattr(spec, name, coerce(name, value))
        except UserError as e:
            raise names.renamed(name, e) from None

    try:
        device = resolve_device(spec.device, machine)
    except UserError as e:
        raise names.renamed("device", e) from None
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

    try:
        spec.model_config = shortened(resolve(spec.model, None, names("model")), spec.layers)
    except UserError as e:
        raise names.renamed("layers", e) from None
    shard(spec.model_config, spec.tp, names("tp"))
    if spec.rank not in RANKS:
        raise UserError(f"{names('rank')}: {spec.rank} is not a rank vLLM allows (choose from {', '.join(map(str, RANKS))})")
    if spec.dtype not in DTYPES:
        raise UserError(f"{names('dtype')}: {spec.dtype!r} is not supported (choose from {', '.join(DTYPES)})")
    try:
        spec.kernels = list(dict.fromkeys(str(KernelsLabel.parse(k)) for k in spec.kernels))
    except ValueError as e:
        raise UserError(f"{names('kernels')}: {e}") from None
    try:
        _resolve_tuned(spec, machine)
        _resolve_ranks(spec, names)
        if any(k.vllm for k in spec.labels):
            require_vllm_dtype(spec.dtype)
    except UserError as e:
        raise names.renamed("tuned", names.renamed("kernels", e)) from None
    for name in ("concurrency", "capture_sizes"):
        if max(getattr(spec, name)) > MAX_TOKENS:
            raise UserError(f"{names(name)}: at most {MAX_TOKENS} tokens per step are supported")
    check_out(spec.out, names("out"))
    # Before the strategies: a dense set of a huge max_loras is a huge list.
    check_memory(spec, machine, lambda label, max_loras: 2 * len(spec.capture_sizes))
    try:
        strategies = [strategy(s) for s in spec.strategy]
        for s in strategies:
            for m in spec.max_loras:
                if s.name != AUTO:
                    s.counts(m)
    except ValueError as e:
        raise UserError(f"{names('strategy')}: {e}") from None
    spec.strategy = list(dict.fromkeys(s.name for s in strategies))
    for w in spec.workload:
        try:
            wl = parse_workload(w)
            for c in spec.concurrency:  # a trace must cover every swept concurrency
                for m in spec.max_loras:
                    if w.strip().startswith("trace:"):
                        wl.active_count_pmf(c, m)
        except ValueError as e:
            raise UserError(f"{names('workload')}: {e}") from None
    spec.workload = list(dict.fromkeys(parse_workload(w).name for w in spec.workload))
    _check_adapters(spec, names)
    no_vllm = [s.name for s in strategies if s.vllm is Vllm.NONE and s.name != AUTO]
    if spec.fully_sharded_loras:
        _check_fully_sharded(spec, names)
    if any(k.vllm for k in spec.labels) and no_vllm:
        if all(k.vllm for k in spec.labels) and len(no_vllm) == len(spec.strategy):
            raise UserError(f"{names.value('strategy', ','.join(no_vllm))}: vLLM has no count-agnostic grid; use --kernels triton or fused")
        notice = "; ".join(filter(None, [notice, f"{','.join(no_vllm)} runs with lorabench's kernels only (vLLM's grid follows its count)"]))
    if AUTO in spec.strategy:
        if not spec.auto_from:
            raise UserError(f"{names.value('strategy', AUTO)} needs --auto-from RUN: the sweep whose points price the capture sets")
        if any(k.vllm for k in spec.labels):
            raise UserError(f"{names.value('strategy', AUTO)} chooses lorabench's capture sets; vLLM captures max or pow2 only (drop vllm from --kernels)")
    elif spec.auto_from or spec.graph_memory_budget or spec.startup_budget:
        first = next(n for n in ("auto_from", "graph_memory_budget", "startup_budget") if getattr(spec, n))
        raise UserError((f"{names(first)}: " if first in names.keys else "")
                        + "--auto-from and the budgets apply to --strategy auto only")
    # One worker holds every strategy of a (kernels, max_loras): it times them in alternating turns.
    check_memory(spec, machine, lambda label, max_loras: sum(_graphs(spec, s, label, max_loras) for s in strategies
                                                             if not (label.vllm and s.vllm is Vllm.NONE)))
    return spec, notice


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


def _graphs(spec: SweepSpec, s, label: KernelsLabel, max_loras: int) -> int:
    """Graphs a worker of strategy ``s`` captures (auto: at most dense's)."""
    counts = list(range(1, max_loras + 1)) if s.name == AUTO else s.counts(max_loras)
    vllm = label.vllm and s.vllm is not Vllm.NONE
    return graph_count(counts, max_loras, spec.capture_sizes, s.bucket_grid, vllm)


def check_memory(spec: SweepSpec, machine: Machine, graphs: Callable[[KernelsLabel, int], int]) -> None:
    """Every worker fits the memory free on its device: weights, adapter slots, KV cache,
    activations, ``graphs(label, max_loras)`` graphs and the process's runtime
    (``lorabench.config.limits``). Unknown free memory: not checked."""
    free, what = machine.free_bytes(spec.device)
    if free is None:
        return
    cfg = spec.rank_model
    max_tokens = max(spec.capture_sizes + spec.concurrency)
    for m in reversed(spec.max_loras):
        for label in spec.labels:
            shape = Shape(cfg, m, spec.rank, spec.dtype, max_tokens, spec.context_len, vllm=label.vllm,
                          fully_sharded=spec.fully_sharded_loras)
            count, cuda = graphs(label, m), spec.device == "cuda"
            need = estimate(shape, count, cuda)
            if need.total > free:
                raise UserError(f"{culprit(shape, count, cuda)} does not fit: {need.describe()} > {size(free)} {what}")


def _check_adapters(spec: SweepSpec, names: Names) -> None:
    """--adapters N makes the workload runs residency runs; --max-cpu-loras and --output-tokens
    only mean something with it."""
    if spec.adapters is None:
        given = [n for n in ("max_cpu_loras", "output_tokens") if getattr(spec, n) != getattr(SweepSpec, n)]
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


def _check_fully_sharded(spec: SweepSpec, names: Names) -> None:
    """--fully-sharded-loras cuts the rank and the hidden outputs over --tp ranks, and needs an
    all-gather between shrink and expand, which one fused launch has no place for."""
    where, cfg = names("fully_sharded_loras"), spec.model_config
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


def _resolve_ranks(spec: SweepSpec, names: Names) -> None:
    """--ranks: adapters of their own ranks, padded to --rank. Every swept lorabench backend that
    can skip the padding also runs as "<backend>+unpadded", next to its padded run."""
    wants = [k for k in spec.labels if k.unpadded]
    if spec.ranks is None:
        if wants:
            raise UserError(f"--kernels {wants[0]}: needs --ranks (the adapters' own ranks, padded to --rank)")
        return
    try:
        mix = parse_ranks(spec.ranks, spec.rank)
    except ValueError as e:
        raise UserError(f"{names('ranks')}: {e}") from None
    spec.ranks = str(mix)
    if mix.shares == ((spec.rank, 1.0),):
        return  # no padding to skip
    for k in list(spec.labels):
        unpadded = str(KernelsLabel(k.backend, k.tuned, True))
        if not k.unpadded and BACKENDS[k.backend].unpadded and unpadded not in spec.kernels:
            spec.kernels.insert(spec.kernels.index(str(k)) + 1, unpadded)


def _resolve_tuned(spec: SweepSpec, machine: Machine) -> None:
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
