"""The user's own adapters (``--adapters DIR``): PEFT LoRA adapters, each a folder holding
``adapter_config.json`` and ``adapter_model.safetensors``, read and checked against the model's
shapes before any worker starts. Only the safetensors headers are read here (the shapes); the
workers copy the weights into the slots (``lorabench.runtime.peft_slots``).

Names map as vLLM maps them onto its fused LoRA linears: q, k, v -> the slices of qkv; o; gate,
up -> gate_up; down; in a MoE layer each expert's gate/w1, up/w3 -> w13 and down/w2 -> w2
(``mlp.experts.E.*`` or Mixtral's ``block_sparse_moe.experts.E.*``), a shared expert's
(``mlp.shared_expert.*``) -> that layer's gate_up and down; LoRA on a MoE layer's fused expert
parameters (PEFT's ``target_parameters``: ``mlp.experts.gate_up_proj`` and ``down_proj``, stored
as ``mlp.experts.base_layer`` and ``mlp.experts``, A ``[E·r, K]`` and B ``[N, r·E]``, as vLLM's
model manager reads them) -> every expert's w13 (gate and up share the one A) and w2. A linear an adapter does not target
holds zeros in its slot, as vLLM's ``reset_lora`` leaves it. Each module's scale (lora_alpha / r,
or / sqrt(r) with rsLoRA; ``alpha_pattern`` per module) is folded into its B, as vLLM folds it.
"""

import glob
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from lorabench.config.models import ModelConfig, layer_lora_linears, moe_layer
from lorabench.errors import UserError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's tensor names: [base_model.model.]model.layers.<i>.<module path>.lora_<A|B>[.<adapter name>].weight;
# the module's name (what rank_pattern and alpha_pattern match, as PEFT and vLLM match them) is it
# without the prefix and from .lora_ on.
_KEY = re.compile(r"^(?:base_model\.model\.)?(model\.layers\.(\d+)\.(.+))\.lora_([AB])(?:\.[\w-]+)?\.weight$")
_ATTENTION = {"self_attn.q_proj": ("qkv", 0), "self_attn.k_proj": ("qkv", 1), "self_attn.v_proj": ("qkv", 2),
              "self_attn.o_proj": ("o", 0)}
_DENSE_MLP = {"gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0)}
_EXPERT = {"gate_proj": ("w13", 0), "w1": ("w13", 0), "up_proj": ("w13", 1), "w3": ("w13", 1),
           "down_proj": ("w2", 0), "w2": ("w2", 0)}
_EXPERT_PATH = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)$")
# PEFT's target_parameters on a MoE layer's fused experts: the inner wrapper (gate_up_proj) is saved
# as experts.base_layer, the outer (down_proj) as experts, whatever order the config lists them in
# (a set); vLLM reads them so, and the shapes are checked.
_FUSED = {"mlp.experts.base_layer": ("w13", "gate_up_proj"), "mlp.experts": ("w2", "down_proj")}
_FUSED_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
FUSED_EXPERTS = -2  # PeftModule.expert of a fused-experts module: every expert's LoRA in one A and one B


@dataclass(frozen=True)
class PeftModule:
    """One targeted module of one adapter: where its A [r, K] and B [N, r] land in the slots."""

    layer: int
    linear: str  # qkv, o, gate_up, down (a dense MLP's, or a MoE layer's shared expert's); w13, w2 (an expert's)
    slice: int  # which slice of the fused linear (q 0, k 1, v 2; gate 0, up 1)
    expert: int  # the routed expert (w13, w2); -1 for the dense linears; FUSED_EXPERTS: every expert at once
    a_key: str
    b_key: str
    rank: int
    scale: float  # folded into B when the slot is filled


@dataclass(frozen=True)
class PeftAdapter:
    """One PEFT adapter folder, checked against the model."""

    name: str  # its folder's name
    weights: str  # the safetensors file
    rank: int  # its largest module rank: what the slot's unpadded kernels read
    modules: tuple[PeftModule, ...]

    @property
    def has_expert_lora(self) -> bool:
        return bool(self.expert_layers)

    @property
    def expert_layers(self) -> frozenset[int]:
        """The layers whose experts it has LoRA on (vLLM flags each MoE layer's)."""
        return frozenset(m.layer for m in self.modules if m.linear in ("w13", "w2"))


def slot_ranks(adapters: tuple[PeftAdapter, ...], max_loras: int) -> tuple[int, ...]:
    """Each slot's adapter's rank: slot i holds adapter i (modulo their count, when there are
    fewer adapters than slots), as the workers fill them."""
    return tuple(adapters[i % len(adapters)].rank for i in range(max_loras))


def is_count(value) -> bool:
    """``--adapters N`` (random adapters) rather than ``--adapters DIR``: anything that reads as a
    number (then checked as a count; a folder named so is ``./N``)."""
    if isinstance(value, (int, float)):
        return True
    try:
        float(str(value).strip())
    except ValueError:
        return False
    return True


def adapter_folders(source: str, where: str) -> list[Path]:
    """The adapter folders ``source`` names: one adapter's folder, a folder of them (its
    subfolders that hold an adapter_config.json, by name), or a glob of adapter folders."""
    text = str(source).strip()
    if any(c in text for c in "*?["):
        found = [Path(p) for p in sorted(glob.glob(str(Path(text).expanduser())))]
        folders = [p for p in found if (p / CONFIG_FILE).is_file()]
        if not folders:
            raise UserError(f"{where}: {text} matches no adapter folder (one holding {CONFIG_FILE})")
        return folders
    path = Path(text).expanduser()
    if not path.is_dir():
        raise UserError(f"{where}: {text} is neither a count of adapters nor a folder of PEFT adapters")
    if (path / CONFIG_FILE).is_file():
        return [path]
    folders = sorted(p for p in path.iterdir() if (p / CONFIG_FILE).is_file())
    if not folders:
        raise UserError(f"{where}: {path} holds no PEFT adapter (no {CONFIG_FILE} in it or in its subfolders)")
    return folders


def adapter_elements(folder: Path, where: str = "--adapters") -> int:
    """The elements of an adapter folder's LoRA tensors (its header's shapes): what vLLM's CPU
    cache holds of it, at its own rank, in the model's dtype."""
    shapes = _shapes(folder / WEIGHTS_FILE, f"{where}: {folder.name}")
    return sum(math.prod(s) for k, s in shapes.items() if _KEY.match(k))


def read_adapters(source: str, cfg: ModelConfig, max_rank: int, where: str = "--adapters") -> tuple[PeftAdapter, ...]:
    """Every adapter ``source`` names, checked against ``cfg`` (the whole model, not a TP rank's
    shard) and ``max_rank`` (vLLM's --max-lora-rank); one UserError line for the first problem."""
    return tuple(read_adapter(p, cfg, max_rank, where) for p in adapter_folders(source, where))


def read_adapter(folder: Path, cfg: ModelConfig, max_rank: int, where: str = "--adapters") -> PeftAdapter:
    here = f"{where}: {folder}"
    settings = _settings(folder, here)
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        other = " (adapter_model.bin, a pickle, is not read: save it with safe_serialization)" if (
            folder / "adapter_model.bin").is_file() else ""
        raise UserError(f"{here}: no {WEIGHTS_FILE}{other}")
    shapes = _shapes(weights, here)
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    names: dict[tuple[int, str], str] = {}
    for key in shapes:
        m = _KEY.fullmatch(key)
        if m is None:
            raise UserError(f"{here}: tensor {key} is not a LoRA A or B of a decoder layer's module")
        where = (int(m.group(2)), m.group(3))
        pairs.setdefault(where, {})[m.group(4)] = key
        names[where] = m.group(1)
    modules = []
    for (layer, path), keys in sorted(pairs.items()):
        if set(keys) != {"A", "B"}:
            raise UserError(f"{here}: layers.{layer}.{path} has lora_{next(iter(keys))} without lora_"
                            f"{'B' if 'A' in keys else 'A'}")
        if layer >= cfg.full_layers:
            raise UserError(f"{here}: targets layers.{layer}, but {cfg.name} has {cfg.full_layers} layers")
        if layer >= cfg.layers:
            continue  # the model is shortened (--layers): its later layers are not built
        if path in _FUSED and settings["fused_experts"]:
            modules.append(_fused(cfg, layer, path, keys, shapes, names[layer, path], settings, max_rank, here))
            continue
        linear, slice_, expert = _target(cfg, layer, path, here)
        k, n = _expected(cfg, layer, linear, slice_)
        a_shape, b_shape = shapes[keys["A"]], shapes[keys["B"]]
        rank = a_shape[0] if len(a_shape) == 2 else -1
        if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[1] != k or b_shape[0] != n or b_shape[1] != rank:
            raise UserError(f"{here}: layers.{layer}.{path} has A {list(a_shape)} and B {list(b_shape)}; {cfg.name} "
                            f"needs A [r, {k}] and B [{n}, r]")
        scale = _scale(settings, names[layer, path], rank, max_rank, f"{here}: layers.{layer}.{path}", here)
        modules.append(PeftModule(layer, linear, slice_, expert, keys["A"], keys["B"], rank, scale))
    if not modules:
        raise UserError(f"{here}: targets none of the {cfg.layers} layers lorabench builds of {cfg.name}")
    fused = {}
    for m in modules:
        if m.expert == FUSED_EXPERTS:
            fused.setdefault(m.layer, set()).add(m.linear)
    for layer, linears in fused.items():
        if linears != {"w13", "w2"}:
            raise UserError(f"{here}: layers.{layer}.mlp.experts has LoRA on one of gate_up_proj and down_proj only; "
                            "vLLM 0.33 reads fused-expert LoRA as the pair")
    return PeftAdapter(folder.name, str(weights), max(m.rank for m in modules), tuple(modules))


def _fused(cfg: ModelConfig, layer: int, path: str, keys: dict[str, str], shapes: dict, name: str, settings: dict,
           max_rank: int, here: str) -> PeftModule:
    """A fused-experts module (``target_parameters``): its A [E·r, K] and B [N, r·E], checked."""
    linear, parameter = _FUSED[path]
    if not moe_layer(cfg, layer):
        raise UserError(f"{here}: layers.{layer}.{path}: layer {layer} of {cfg.name} has no experts")
    e = cfg.moe.experts
    k, n = ((cfg.hidden, 2 * cfg.moe.intermediate) if linear == "w13" else (cfg.moe.intermediate, cfg.hidden))
    a_shape, b_shape = shapes[keys["A"]], shapes[keys["B"]]
    ok = len(a_shape) == 2 and len(b_shape) == 2 and a_shape[0] % e == 0 and a_shape[0] > 0
    rank = a_shape[0] // e if ok else -1
    if not ok or a_shape[1] != k or b_shape != (n, rank * e):
        raise UserError(f"{here}: layers.{layer}.mlp.experts.{parameter} has A {list(a_shape)} and B {list(b_shape)}; "
                        f"{cfg.name}'s {e} experts need A [{e}·r, {k}] and B [{n}, r·{e}] (vLLM reads "
                        "experts.base_layer as gate_up_proj, experts as down_proj)")
    name = name.removesuffix(".base_layer") + f".{parameter}"  # what the patterns match, as vLLM's PEFTHelper
    scale = _scale(settings, name, rank, max_rank, f"{here}: layers.{layer}.mlp.experts.{parameter}", here)
    return PeftModule(layer, linear, -1, FUSED_EXPERTS, keys["A"], keys["B"], rank, scale)


def _scale(settings: dict, name: str, rank: int, max_rank: int, module: str, here: str) -> float:
    """A module's scale (lora_alpha / r, / sqrt(r) with rsLoRA; alpha_pattern by its ``name``),
    once its weights' rank is checked against --rank and against rank_pattern. ``module``: how
    refusals name it."""
    if rank > max_rank:
        raise UserError(f"{module} has rank {rank}, above --rank {max_rank} "
                        "(vLLM's --max-lora-rank: raise it, or leave this adapter out)")
    want_rank = _pattern(settings["rank_pattern"], name, settings["r"], here)
    if want_rank != rank:
        raise UserError(f"{module} has rank {rank} in its weights, {want_rank} in {CONFIG_FILE}")
    alpha = float(_pattern(settings["alpha_pattern"], name, settings["lora_alpha"], here))
    return alpha / (math.sqrt(rank) if settings["use_rslora"] else rank)


def _settings(folder: Path, here: str) -> dict:
    try:
        raw = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{here}: {CONFIG_FILE} is not readable JSON ({getattr(e, 'strerror', None) or e})") from None
    if not isinstance(raw, dict):
        raise UserError(f"{here}: {CONFIG_FILE} is not an object of settings")
    if raw.get("peft_type", "LORA") != "LORA":
        raise UserError(f"{here}: a {raw.get('peft_type')} adapter; only LoRA adapters are served")
    for setting, why in (("use_dora", "DoRA"), ("fan_in_fan_out", "transposed (Conv1D) weights"),
                         ("modules_to_save", "fully trained modules")):
        if raw.get(setting):
            raise UserError(f"{here}: {setting} is set ({why}); vLLM serves plain LoRA on linear modules only")
    parameters = raw.get("target_parameters") or []
    if isinstance(parameters, str):
        parameters = [parameters]
    other = [p for p in parameters if not any(str(p).endswith(f) for f in ("experts.gate_up_proj", "experts.down_proj"))]
    if other:
        raise UserError(f"{here}: target_parameters {other[0]!r}: vLLM serves LoRA on bare parameters only on a MoE "
                        f"layer's fused experts ({', '.join(_FUSED_PARAMETERS)})")
    if raw.get("bias", "none") != "none" or raw.get("lora_bias"):
        raise UserError(f"{here}: trained biases (bias {raw.get('bias')!r}, lora_bias {raw.get('lora_bias')!r}): "
                        "vLLM serves LoRA without them")
    r = raw.get("r")
    if not isinstance(r, int) or r < 1:
        raise UserError(f"{here}: r {r!r} in {CONFIG_FILE} is not a rank (a whole number, 1 or more)")
    if "lora_alpha" not in raw:
        raise UserError(f"{here}: no lora_alpha in {CONFIG_FILE} (vLLM requires it: the scale is lora_alpha / r)")
    alpha = raw["lora_alpha"]
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise UserError(f"{here}: lora_alpha {alpha!r} in {CONFIG_FILE} is not a positive number")
    return {"r": r, "lora_alpha": alpha, "use_rslora": bool(raw.get("use_rslora")),
            "rank_pattern": raw.get("rank_pattern") or {}, "alpha_pattern": raw.get("alpha_pattern") or {},
            "fused_experts": bool(parameters)}


def _shapes(weights: Path, here: str) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape, from the file's header (no weights read)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(weights), framework="numpy") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"{here}: {WEIGHTS_FILE} is not a readable safetensors file ({e})") from None


def _pattern(patterns: dict, name: str, default, here: str):
    """rank_pattern / alpha_pattern: the value of the first key that matches the module's name at
    a dot (a regex, as PEFT's ``get_pattern_key`` and vLLM's ``PEFTHelper`` match it), else the
    adapter's own."""
    for key, value in patterns.items():
        try:
            if re.match(rf"(.*\.)?({key})$", name):
                return value
        except re.error as e:
            raise UserError(f"{here}: pattern {key!r} in {CONFIG_FILE} is not a regular expression ({e})") from None
    return default


def _target(cfg: ModelConfig, layer: int, path: str, here: str) -> tuple[str, int, int]:
    """(linear, slice, expert) of module ``path`` of layer ``layer``."""
    if path in _ATTENTION:
        return (*_ATTENTION[path], -1)
    moe = moe_layer(cfg, layer)
    head, _, leaf = path.rpartition(".")
    if head == "mlp" and leaf in _DENSE_MLP and not moe:
        return (*_DENSE_MLP[leaf], -1)
    if head == "mlp.shared_expert" and leaf in _DENSE_MLP and moe and cfg.moe.shared_intermediate:
        return (*_DENSE_MLP[leaf], -1)
    expert = _EXPERT_PATH.fullmatch(path)
    if expert and moe and expert.group(2) in _EXPERT:
        e = int(expert.group(1))
        if e >= cfg.moe.experts:
            raise UserError(f"{here}: layers.{layer}.{path}: {cfg.name} has {cfg.moe.experts} experts per layer")
        return (*_EXPERT[expert.group(2)], e)
    kind = "MoE" if moe else "dense"
    raise UserError(f"{here}: targets layers.{layer}.{path}, which layer {layer} of {cfg.name} ({kind}) has no LoRA "
                    "linear for (vLLM's: q, k, v, o, gate, up, down; experts' in MoE layers)")


def _expected(cfg: ModelConfig, layer: int, linear: str, slice_: int) -> tuple[int, int]:
    """(A's input features, B's output features) of one slice of a linear, at the whole model's shapes."""
    if linear in ("w13", "w2"):
        return (cfg.hidden, cfg.moe.intermediate) if linear == "w13" else (cfg.moe.intermediate, cfg.hidden)
    k, slices = layer_lora_linears(cfg, layer)[linear]
    return k, slices[slice_]
