"""A sweep's specification: defaults, then a TOML spec file, then command-line flags, checked
once up front so that bad input ends in one clear line (``UserError``) before anything runs."""

import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lorabench.kernels import BACKENDS, SUPPORTED_DTYPES, SUPPORTED_RANKS, TUNABLE, TUNED, backend_of
from lorabench.model import PRESETS
from lorabench.strategies import BUCKET_GRID, capture_counts, canonical
from lorabench.workload import parse_workload

MAX_TOKENS = 512  # the kernels are built and tested for 1 to 512 tokens per step


class UserError(Exception):
    """Bad input: the CLI prints the message as one line and exits with status 2."""


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
    kernels: list[str] | None = None  # default: triton on a GPU, torch on the CPU
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
    auto_sets: dict | None = None  # resolved here: "kernels/max_loras" -> chosen counts and predictions
    tuned: str | None = None  # `lorabench tune`'s output folder: adds a "+tuned" run of each tunable backend

    def to_dict(self) -> dict:
        return asdict(self)


LIST_INT = {"max_loras", "concurrency", "capture_sizes"}
LIST_STR = {"strategy", "kernels", "workload"}
INTS = {"layers", "rank", "context_len", "iters", "warmup", "seed"}
STRS = {"model", "dtype", "device", "out", "auto_from", "tuned"}
BOOLS = {"check"}
FLOATS = {"graph_memory_budget", "startup_budget"}
FIELDS = LIST_INT | LIST_STR | INTS | STRS | BOOLS | FLOATS


def split_list(text: str) -> list[str]:
    """Split on commas outside brackets: ``max,[1,2,4]`` -> ['max', '[1,2,4]']."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    parts.append(cur.strip())
    return parts


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _int(name: str, value, minimum: int) -> int:
    try:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError
        v = int(str(value).strip())
    except ValueError:
        raise UserError(f"{_flag(name)}: {value!r} is not an integer") from None
    if v < minimum:
        raise UserError(f"{_flag(name)}: {v} must be at least {minimum}")
    return v


def _coerce(name: str, value):
    """A flag's or spec file's raw value -> the field's type (comma strings become lists)."""
    if name in LIST_INT or name in LIST_STR:
        items = value if isinstance(value, list) else split_list(str(value))
        if name in LIST_STR:
            items = [str(i) if not isinstance(i, list) else "[" + ",".join(map(str, i)) + "]" for i in items]
            if any(not i.strip() for i in items):
                raise UserError(f"{_flag(name)}: empty entry in {value!r}")
            return [i.strip() for i in items]
        if any(str(i).strip() == "" for i in items):
            raise UserError(f"{_flag(name)}: empty entry in {value!r}")
        return [_int(name, i, 1) for i in items]
    if name in INTS:
        return _int(name, value, 0 if name in ("warmup", "seed") else 1)
    if name in FLOATS:
        try:
            v = float(str(value).strip())
        except ValueError:
            v = -1.0
        if not v > 0:
            raise UserError(f"{_flag(name)}: {value!r} is not a positive number")
        return v
    if name in BOOLS:
        if isinstance(value, bool):
            return value
        if str(value).strip().lower() in ("true", "false"):
            return str(value).strip().lower() == "true"
        raise UserError(f"{_flag(name)}: {value!r} is not true or false")
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


def build_spec(flags: dict, spec_file: Path | None, cuda_available: bool) -> tuple[SweepSpec, str | None]:
    """Merge defaults < spec file < flags (None = not given), validate, resolve the automatic
    defaults for this machine. Returns the spec and a one-line notice (CPU fallback) or None."""
    given = load_spec_file(spec_file) if spec_file else {}
    given.update({k: v for k, v in flags.items() if v is not None})
    spec = SweepSpec()
    for name, value in given.items():
        setattr(spec, name, _coerce(name, value))

    if spec.device not in ("auto", "cuda", "cpu"):
        raise UserError(f"--device: {spec.device!r} is not one of auto, cuda, cpu")
    if spec.device == "cuda" and not cuda_available:
        raise UserError("--device cuda: no CUDA device is visible to torch on this machine")
    device = spec.device if spec.device != "auto" else ("cuda" if cuda_available else "cpu")
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
    if spec.dtype not in SUPPORTED_DTYPES:
        raise UserError(f"--dtype: {spec.dtype!r} is not supported (choose from {', '.join(SUPPORTED_DTYPES)})")
    for k in spec.kernels:
        if backend_of(k) not in BACKENDS or (k.endswith(TUNED) and backend_of(k) not in TUNABLE):
            raise UserError(f"--kernels: unknown backend {k!r} (choose from {', '.join(BACKENDS)}; "
                            f"{', '.join(t + TUNED for t in TUNABLE)} with --tuned DIR)")
    spec.kernels = list(dict.fromkeys(spec.kernels))
    _resolve_tuned(spec)
    if any(backend_of(k) == "vllm" for k in spec.kernels):
        require_vllm(spec.dtype)
    if max(spec.concurrency + spec.capture_sizes) > MAX_TOKENS:
        raise UserError(f"--concurrency/--capture-sizes: at most {MAX_TOKENS} tokens per step are supported")
    for s in spec.strategy:
        for m in spec.max_loras:
            try:
                if s != "auto":
                    capture_counts(s, m)
            except ValueError as e:
                raise UserError(f"--strategy: {e}") from None
    spec.strategy = list(dict.fromkeys(canonical(s) for s in spec.strategy))
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
    agnostic = [s for s in spec.strategy if s in BUCKET_GRID]
    if any(backend_of(k) == "vllm" for k in spec.kernels) and agnostic:
        if all(backend_of(k) == "vllm" for k in spec.kernels) and len(agnostic) == len(spec.strategy):
            raise UserError(f"--strategy {','.join(agnostic)}: vLLM has no count-agnostic grid; use --kernels triton or fused")
        notice = "; ".join(filter(None, [notice, f"{','.join(agnostic)} runs with lorabench's kernels only (vLLM's grid follows its count)"]))
    if "auto" in spec.strategy:
        notice = _resolve_auto(spec) or notice
    elif spec.auto_from or spec.graph_memory_budget or spec.startup_budget:
        raise UserError("--auto-from and the budgets apply to --strategy auto only")
    return spec, notice


def require_vllm(dtype: str) -> None:
    """--kernels vllm: vLLM importable and a dtype its ops take, or one line saying what to do."""
    from lorabench.kernels import vllm_lora

    if dtype == "float32":
        raise UserError("--kernels vllm: vLLM's LoRA ops take float16 or bfloat16 (--dtype float16)")
    try:
        vllm_lora.load_ops()
    except vllm_lora.VllmUnavailable as e:
        raise UserError(str(e)) from None


def _resolve_tuned(spec: SweepSpec) -> None:
    """--tuned DIR: every swept backend DIR has configs for also runs as "<backend>+tuned" with
    them, next to its defaults in the same run."""
    wants = [k for k in spec.kernels if k.endswith(TUNED)]
    if not spec.tuned:
        if wants:
            raise UserError(f"--kernels {wants[0]}: needs --tuned DIR (the output of `lorabench tune`)")
        return
    from lorabench.tune_files import tuned_file, tuned_table, vllm_folder

    folder = Path(spec.tuned)
    if not folder.is_dir():
        raise UserError(f"--tuned: {folder} is not a folder (run `lorabench tune --out {folder}` first)")
    spec.tuned = str(folder.resolve())
    meta = tuned_file(folder)
    if meta:  # configs chosen by timings on another machine or dtype are not this sweep's tuned configs
        import torch

        gpu = torch.cuda.get_device_name() if spec.device == "cuda" else None
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
        if not has[backend_of(k)]:
            raise UserError(f"--kernels {k}: {folder} holds no tuned configs for {backend_of(k)}")
    for k in list(spec.kernels):  # every swept backend the folder has configs for
        if k in TUNABLE and has[k] and k + TUNED not in spec.kernels:
            spec.kernels.insert(spec.kernels.index(k) + 1, k + TUNED)
    if not any(k.endswith(TUNED) for k in spec.kernels):
        raise UserError(f"--tuned: {folder} holds no tuned configs for any of --kernels {','.join(spec.kernels)}")


def _resolve_auto(spec: SweepSpec) -> str | None:
    """Choose strategy auto's capture set per (kernels, max_loras) from the --auto-from run's
    points, for the sweep's first workload, within the budgets; keep the model's predictions."""
    from lorabench.optimise import auto_recommendations
    from lorabench.report import load_run

    if not spec.auto_from:
        raise UserError("--strategy auto needs --auto-from RUN: the sweep whose points price the capture sets")
    if any(backend_of(k) == "vllm" for k in spec.kernels):
        raise UserError("--strategy auto chooses lorabench's capture sets; vLLM captures max or pow2 only (drop vllm from --kernels)")
    df = load_run(Path(spec.auto_from))
    memory = spec.graph_memory_budget * 2**20 if spec.graph_memory_budget else None
    spec.auto_sets = {}
    for k in spec.kernels:
        for m in spec.max_loras:
            try:
                recs = auto_recommendations(df, spec.workload[0], memory, spec.startup_budget, kernels=[k], max_loras=[m])
            except ValueError as e:
                raise UserError(f"--strategy auto: {e}") from None
            if not recs:
                raise UserError(f"--auto-from {spec.auto_from}: no successful {k} points at max_loras {m} to choose from")
            if recs[0]["auto"] is None:
                raise UserError(f"--strategy auto: no capture set fits the budgets at max_loras {m}, not even max")
            if recs[0]["capture_sizes"] != spec.capture_sizes or not set(spec.concurrency) <= set(recs[0]["concurrency"]):
                raise UserError(f"--strategy auto: the set is priced for the --auto-from run's capture sizes "
                                f"{recs[0]['capture_sizes']} and concurrencies {recs[0]['concurrency']}; sweep with those "
                                f"(this sweep: sizes {spec.capture_sizes}, concurrency {spec.concurrency})")
            a = recs[0]["auto"]
            spec.auto_sets[f"{k}/{m}"] = {"counts": a["counts"], "predicted_ms": a["expected_ms_by_c"],
                                          "workload": spec.workload[0], "from": spec.auto_from}
    if len(spec.workload) > 1:
        return f"strategy auto is chosen for the first workload, {spec.workload[0]}"
    return None
