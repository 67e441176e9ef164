"""A tune's specification (``lorabench tune``): flags, checked up front, one ``UserError`` line
for bad input."""

from collections.abc import Callable
from dataclasses import dataclass

from lorabench.config.backends import require_vllm_dtype
from lorabench.config.flags import Machine, one_of, resolve_device, split_list
from lorabench.config.models import resolve, shard
from lorabench.config.options import Kind, Option
from lorabench.config.sweep_spec import LIST, MAX_BATCHED_TOKENS, MAX_SEED, OPTIONS
from lorabench.errors import UserError
from lorabench.kernels import BACKENDS, DTYPES, RANKS

TUNABLE = tuple(name for name, b in BACKENDS.items() if b.tunable)

# The tune's own options; it shares --model, --tp, --rank, --max-loras, --device and --seed with the sweep (OPTIONS).
TUNE_OPTIONS: dict[str, Option] = {o.name: o for o in (
    Option("kernels", Kind.NAMES, f"Kernels to tune, {LIST}: triton (lorabench's shrink and expand), fused "
           "(lorabench's), gemm (its base GEMM with the expand inside, up to 64 tokens over at most 2 launched slots; its shrink, and the pair elsewhere, are triton's), vllm (vLLM's shrink and expand)", shown="triton,fused, plus vllm on a GPU when vLLM is installed"),
    Option("dtype", Kind.TEXT, "float16, bfloat16, float32 (lorabench's kernels only)",
           shown="the sweep's: float16 on a GPU, float32 on the CPU; float16 when tuning vllm"),
    Option("tokens", Kind.INTS, f"Tokens per step to tune, {LIST}: decode buckets, and prefill sizes (e.g. 512,2048,8192: "
           "a step of more tokens takes the nearest tuned size's config)", default=[1, 8, 32], maximum=MAX_BATCHED_TOKENS),
    Option("budget_s", Kind.NUMBER, "Seconds of search, shared equally by the shapes (each still gets its default and "
           "one candidate)", default=300),
    Option("out", Kind.TEXT, "Output folder: cache.jsonl, lorabench_tuned.json, vllm/, tune.md", default="tuned"),
)}


def _given(flags: dict, name: str) -> str:
    """A flag's text, or its default's (the tune's own options, else the sweep's)."""
    if flags.get(name):
        return flags[name]
    default = (TUNE_OPTIONS.get(name) or OPTIONS[name]).default
    return ",".join(map(str, default)) if isinstance(default, list) else str(default)


@dataclass
class TuneSpec:
    kernels: list[str]  # backends to tune
    model: str
    rank: int
    dtype: str
    max_loras: list[int]
    tokens: list[int]
    budget_s: float
    out: str
    device: str
    seed: int = 0
    tp: int = 1  # tune one tensor-parallel rank's shapes (models.shard)


def _ints(flag: str, text: str, lo: int, hi: int) -> list[int]:
    try:
        values = [int(v) for v in split_list(text)]
    except ValueError:
        raise UserError(f"{flag}: {text!r} is not a list of integers") from None
    if not all(lo <= v <= hi for v in values):
        raise UserError(f"{flag}: {text!r}: every value must be between {lo} and {hi}")
    return sorted(set(values))


def _budget(text: str) -> float:
    try:
        if 0 < float(text) < float("inf"):
            return float(text)
    except ValueError:
        pass
    raise UserError(f"--budget-s: {text!r} is not a positive number of seconds")


def default_dtype(device: str, kernels: list[str]) -> str:
    """The sweep's default dtype on the device (float16 on a GPU, float32 on the CPU), so that
    ``sweep --tuned`` takes the folder as it is; float16 wherever vLLM's ops are tuned (half
    precision only)."""
    return "float16" if device == "cuda" or "vllm" in kernels else "float32"


def build_tune_spec(flags: dict, machine: Machine, vllm_available: Callable[[], bool]) -> tuple[TuneSpec, str | None]:
    """Flags (strings, None = not given) -> a checked spec and a one-line notice or None.
    ``vllm_available()``: whether vLLM's ops load here, asked only when no --kernels is given on a
    GPU (the default then tunes them too; importing vLLM has process-wide side effects)."""
    device = resolve_device(flags.get("device") or "auto", machine)
    kernels = split_list(flags["kernels"]) if flags.get("kernels") else None
    notices = []
    if kernels is None:  # vLLM's too where it can run fast: the interpreter makes its shrink slow
        kernels = ["triton", "fused"] + (["vllm"] if device == "cuda" and vllm_available() else [])
        notices.append(f"tuning {', '.join(kernels)} (--kernels to choose)")
    if flags.get("model") is None and device == "cpu":
        notices.append("On the CPU: tuning the tiny preset in Triton's interpreter; its times are CPU figures, not GPU results")
    if flags.get("dtype") is None and device == "cpu" and default_dtype(device, kernels) == "float32":
        notices.append("in float32, the CPU sweep's dtype (--dtype to choose)")
    spec = TuneSpec(kernels=list(dict.fromkeys(kernels)), model=flags.get("model") or ("llama-2-7b" if device == "cuda" else "tiny"),
                    rank=_ints("--rank", _given(flags, "rank"), 1, 1 << 16)[0], dtype=flags.get("dtype") or default_dtype(device, kernels),
                    max_loras=_ints("--max-loras", _given(flags, "max_loras"), 1, 4096),
                    tokens=_ints("--tokens", _given(flags, "tokens"), 1, MAX_BATCHED_TOKENS),
                    budget_s=_budget(_given(flags, "budget_s")), out=_given(flags, "out"), device=device,
                    seed=_ints("--seed", _given(flags, "seed"), 0, MAX_SEED)[0],
                    tp=_ints("--tp", _given(flags, "tp"), 1, 1024)[0])
    for k in spec.kernels:
        one_of("kernels", k, TUNABLE)
    shard(resolve(spec.model), spec.tp)  # a preset, a config.json or a Hugging Face id, split over --tp; one line otherwise
    one_of("rank", spec.rank, RANKS)
    one_of("dtype", spec.dtype, DTYPES)
    if "vllm" in spec.kernels:
        require_vllm_dtype(spec.dtype)
    return spec, "; ".join(notices) or None
