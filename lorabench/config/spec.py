"""A sweep's specification: defaults, then a TOML spec file, then command-line flags, checked
once up front so that bad input ends in one clear line (``UserError``) before anything runs.
Its options are declared in ``lorabench.config.sweep_spec``."""

import os
import tomllib
from dataclasses import replace
from pathlib import Path

from lorabench.config.backends import KernelsLabel, require_vllm_dtype
from lorabench.config.extra_runs import add_tuned, add_unpadded
from lorabench.config.flags import Machine, flag, resolve_device
from lorabench.config.lengths import parse_lengths
from lorabench.config.models import resolve, shard, shortened
from lorabench.config.peft import is_count, read_adapters
from lorabench.config.piecewise import max_capture_size
from lorabench.config.spec_checks import (check_adapter_bank, check_adapters, check_fully_sharded, check_memory,
                                          check_out, graphs_of)
from lorabench.config.strategies import AUTO, Vllm, strategy
from lorabench.config.sweep_spec import (  # noqa: F401 - SweepSpec, its options and bounds are read from here too
    ALIASES,
    FIELDS,
    LIST,
    MAX_ADAPTERS,
    MAX_SEED,
    MAX_STEPS,
    MAX_TOKENS,
    OPTIONS,
    SweepSpec,
    coerce,
)
from lorabench.config.workload import parse_workload
from lorabench.errors import UserError
from lorabench.kernels import DTYPES, RANKS


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
            known = ", ".join(sorted(f.replace("_", "-") for f in FIELDS))
            raise UserError(f"spec file {path}: unknown key {key!r} (known: {known})")
        if name in values:
            raise UserError(f"spec file {path}: key `{key}` repeats key `{values[name][0]}`")
        values[name] = (key, value)
    return values


def check_mixed_steps(spec: SweepSpec, names: Names) -> None:
    """Prefill points fit a step (--max-num-batched-tokens); a serving run's requests fit the KV
    cache (--context-len); the PIECEWISE graphs' largest size is vLLM's default where not given:
    min(2 x the largest concurrency (vLLM's 2 x max_num_seqs), 512, --max-num-batched-tokens) with
    prefill points or serving runs, else 0 (no mixed step to serve)."""
    if spec.input_tokens is not None:
        if spec.adapters is None:
            raise UserError(f"{names('input_tokens')}: goes with --adapters N (the residency runs it gives prompts)")
        lengths = parse_lengths(spec.input_tokens, names("input_tokens"))
        spec.input_tokens = str(lengths)
        for w in spec.workload:  # a trace's own lengths, where it has them, must fit too
            try:
                df = getattr(parse_workload(w), "df", None)
            except ValueError:  # a bad workload: said in its own line below
                continue
            prompt = int(df.input_tokens.max()) if df is not None and "input_tokens" in df else lengths.high
            output = (int(df.output_tokens.max()) if df is not None and "output_tokens" in df
                      else parse_lengths(spec.output_tokens, names("output_tokens")).high)
            if prompt + output > spec.context_len:
                raise UserError(f"{names('input_tokens')}: a request of {prompt} prompt and {output} output tokens"
                                f"{f' (trace {w})' if df is not None else ''} does not fit --context-len {spec.context_len}")
        if spec.model_config.moe is not None:
            raise UserError(f"{names('input_tokens')}: serving runs with prompts run dense models only "
                            f"({spec.model_config.name} is a mixture of experts)")
    if spec.prefill_tokens is not None:
        spec.prefill_tokens = sorted(set(spec.prefill_tokens))
        if spec.prefill_tokens[-1] > spec.max_num_batched_tokens:
            raise UserError(f"{names('prefill_tokens')}: {spec.prefill_tokens[-1]} tokens in one step exceed "
                            f"--max-num-batched-tokens {spec.max_num_batched_tokens}")
        if spec.model_config.moe is not None:
            raise UserError(f"{names('prefill_tokens')}: prefill points run dense models only ({spec.model_config.name} "
                            "is a mixture of experts)")
    if spec.mixed_capture_sizes:  # the buckets given: the largest is the PIECEWISE set's
        largest = max(spec.mixed_capture_sizes)
        if largest > MAX_TOKENS:
            raise UserError(f"{names('mixed_capture_sizes')}: at most {MAX_TOKENS} tokens per graph are supported")
        if spec.max_cudagraph_capture_size not in (None, largest):
            raise UserError(f"{names('mixed_capture_sizes')} ends at {largest} tokens, "
                            f"{names('max_cudagraph_capture_size')} says {spec.max_cudagraph_capture_size}: give one")
        spec.max_cudagraph_capture_size = largest
    if spec.max_cudagraph_capture_size is None:
        spec.max_cudagraph_capture_size = (max_capture_size(max(spec.concurrency), spec.max_num_batched_tokens)
                                           if spec.prefill_tokens or spec.input_tokens else 0)
    if spec.max_cudagraph_capture_size > spec.max_num_batched_tokens:
        given = "mixed_capture_sizes" if spec.mixed_capture_sizes else "max_cudagraph_capture_size"
        raise UserError(f"{names(given)}: {spec.max_cudagraph_capture_size} tokens exceed "
                        f"--max-num-batched-tokens {spec.max_num_batched_tokens}")


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
    adapter_dir = given.pop("adapters") if "adapters" in given and not is_count(given["adapters"]) else None
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
    if spec.share_expert_weights:
        if spec.model_config.moe is None:
            raise UserError(f"{names('share_expert_weights')}: {spec.model} has no routed experts to share")
        spec.model_config = replace(spec.model_config, moe=replace(spec.model_config.moe, shared_weights=True))
    shard(spec.model_config, spec.tp, names("tp"))
    if spec.rank not in RANKS:
        raise UserError(f"{names('rank')}: {spec.rank} is not a rank vLLM allows (choose from {', '.join(map(str, RANKS))})")
    if spec.dtype not in DTYPES:
        raise UserError(f"{names('dtype')}: {spec.dtype!r} is not supported (choose from {', '.join(DTYPES)})")
    adapter_ranks: tuple[int, ...] = ()
    if adapter_dir is not None:
        if spec.ranks is not None:
            raise UserError(f"{names('ranks')}: not with --adapters DIR (its adapters have their own ranks)")
        spec.adapter_dir = str(Path(str(adapter_dir).strip()).expanduser().absolute())
        adapters = read_adapters(spec.adapter_dir, spec.model_config, spec.rank, names("adapters"))
        spec.adapters = coerce("adapters", len(adapters))
        adapter_ranks = tuple(a.rank for a in adapters)
    try:
        spec.kernels = list(dict.fromkeys(str(KernelsLabel.parse(k)) for k in spec.kernels))
    except ValueError as e:
        raise UserError(f"{names('kernels')}: {e}") from None
    try:
        add_tuned(spec, machine)
        add_unpadded(spec, names, adapter_ranks)
        if any(k.vllm for k in spec.labels):
            require_vllm_dtype(spec.dtype)
    except UserError as e:
        raise names.renamed("tuned", names.renamed("kernels", e)) from None
    for name in ("concurrency", "capture_sizes"):
        if max(getattr(spec, name)) > MAX_TOKENS:
            raise UserError(f"{names(name)}: at most {MAX_TOKENS} tokens per step are supported")
    check_mixed_steps(spec, names)
    if spec.fully_sharded_loras:  # flags that cannot go together: refused whatever the machine's memory
        check_fully_sharded(spec, names)
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
    check_adapters(spec, names)
    check_adapter_bank(spec, machine, names)
    if spec.active_counts is not None:
        spec.active_counts = sorted(set(spec.active_counts) | {0})
        if max(spec.active_counts) > max(spec.max_loras):
            raise UserError(f"{names('active_counts')}: {max(spec.active_counts)} adapters cannot be active with at most "
                            f"{max(spec.max_loras)} slots (--max-loras)")
        reach = min(max(spec.concurrency), max(spec.max_loras))
        if not any(1 <= n <= reach for n in spec.active_counts):
            raise UserError(f"{names('active_counts')}: {','.join(map(str, spec.active_counts))} measures no adapter "
                            f"step: at most {reach} adapters are active at these concurrencies and slots")
        if spec.adapters is not None or AUTO in spec.strategy:
            raise UserError(f"{names('active_counts')}: residency runs (--adapters) and strategy auto price every active "
                            "count; measure them all")
    no_vllm = [s.name for s in strategies if s.vllm is Vllm.NONE and s.name != AUTO]
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
    check_memory(spec, machine, lambda label, max_loras: sum(graphs_of(spec, s, label, max_loras) for s in strategies
                                                             if not (label.vllm and s.vllm is Vllm.NONE)))
    return spec, notice
