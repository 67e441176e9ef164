"""Model shapes: presets, Hugging Face configs, one tensor-parallel rank, and the LoRA linears of a layer.

Weights are random (the benchmark needs shapes and bytes, not a checkpoint), so a model is its
shapes. LoRA sits on q, k, v, o, gate, up and down, fused the way servers fuse them: qkv (3
slices), o (1), gate_up (2), down (1), each one shrink + expand (or one fused kernel) per step.

``--model`` is a preset name, a ``config.json`` (or a folder holding one), or a Hugging Face
model id, read with transformers' ``AutoConfig`` (from the local cache when offline; set
``HF_HUB_OFFLINE=1``). The presets include real models' published configs, shipped in
``model_configs/``, so they work on machines without a network. lorabench builds Llama-style
dense decoders and mixture-of-experts decoders built the same way around a routed MLP
(``ARCHITECTURES``); anything else is refused in one line.

In a MoE layer the MLP is ``MoE``'s routed experts (and a shared expert, Qwen2-MoE), and LoRA
on the experts is expert LoRA as vLLM lays it out (``moe_lora_shapes``); the dense LoRA linears
a layer has are ``layer_lora_linears``'s.
"""

import contextlib
import json
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from lorabench.errors import UserError

CONFIG_FOLDER = Path(__file__).with_name("model_configs")


@dataclass(frozen=True)
class MoE:
    """A mixture-of-experts MLP's shapes (one TP rank's when the model is sharded)."""

    experts: int  # routed experts per MoE layer (num_experts / num_local_experts)
    top_k: int  # num_experts_per_tok
    intermediate: int  # each expert's intermediate size (moe_intermediate_size; Mixtral, OLMoE: intermediate_size)
    renormalize: bool  # top-k weights renormalised to sum 1 (norm_topk_prob; Mixtral: its softmax over the top k)
    shared_intermediate: int = 0  # a shared expert's (Qwen2-MoE shared_expert_intermediate_size); 0: none
    shared_gate: bool = False  # Qwen2-MoE: sigmoid(x · gate) scales the shared expert's output
    # Layers with a dense MLP instead: mlp_only_layers, and layers off decoder_sparse_step (layer i
    # is sparse iff i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0).
    dense_layers: tuple[int, ...] = ()
    # --share-expert-weights: every MoE layer reads one set of routed-expert weights (w13, w2), so a
    # model larger than the GPU's memory can be timed; routers, expert LoRA and the rest stay per layer.
    shared_weights: bool = False

    def __post_init__(self):
        object.__setattr__(self, "dense_layers", tuple(self.dense_layers))  # a list when read back from JSON


@dataclass(frozen=True)
class ModelConfig:
    """A decoder's shapes. ``head_dim`` 0 means hidden / heads (most models); Mistral-Nemo and
    Qwen3 state theirs. ``tp`` > 1: the shapes are one tensor-parallel rank's (``shard``)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    head_dim: int = 0
    qkv_bias: bool = False  # Qwen2: biases on q, k and v
    o_bias: bool = False  # Llama's attention_bias also puts one on o
    qk_norm: bool = False  # Qwen3: an RMSNorm over each q and k head before RoPE
    rope_scaling: str | None = None  # its type (llama3, yarn, ...): it changes the table's values, not the work
    architecture: str = "LlamaForCausalLM"
    source: str = "preset"  # a preset, a config.json path or a Hugging Face id
    tp: int = 1
    full_layers: int = field(default=0, compare=False)  # the model's own layer count (``layers`` may be fewer)
    moe: MoE | None = None  # routed experts in the MoE layers (``moe_layer``); None: a dense decoder
    qk_norm_full: bool = False  # OLMoE: one RMSNorm over all q features (heads x head_dim), one over all k, before RoPE

    def __post_init__(self):
        if isinstance(self.moe, dict):  # read back from a run.json or a plan
            object.__setattr__(self, "moe", MoE(**self.moe))
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        if not self.full_layers:
            object.__setattr__(self, "full_layers", self.layers)

    @property
    def is_moe(self) -> bool:
        return self.moe is not None


def moe_layer(cfg: ModelConfig, i: int) -> bool:
    """Whether layer ``i`` has routed experts (else a dense MLP of ``cfg.intermediate``)."""
    return cfg.moe is not None and i not in cfg.moe.dense_layers


# Hugging Face architectures lorabench builds: Llama-style dense decoders (RMSNorm, RoPE, GQA
# attention, SiLU-gated MLP), with the per-architecture details ``ModelConfig`` carries, and
# decoders of the same build whose MLP is a mixture of SiLU-gated experts (``MoE``).
DENSE_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "OlmoeForCausalLM", "Qwen2MoeForCausalLM")
ARCHITECTURES = DENSE_ARCHITECTURES + MOE_ARCHITECTURES

BUILT_IN = {
    "llama-2-7b": ModelConfig("llama-2-7b", 32, 4096, 32, 32, 11008, 32000),
    "llama-3-8b": ModelConfig("llama-3-8b", 32, 4096, 32, 8, 14336, 128256, rope_theta=500000.0),
    "tiny": ModelConfig("tiny", 2, 128, 4, 2, 256, 512),
    # Mixtral-like: every layer routed, top-2, no shared expert, 16 experts; up to 32 tokens take
    # lorabench's per-entry path, 33 over few adapter columns the sorted one.
    "tiny-moe": ModelConfig("tiny-moe", 2, 128, 4, 2, 256, 512, architecture="MixtralForCausalLM",
                            moe=MoE(experts=16, top_k=2, intermediate=64, renormalize=True)),
    # Qwen2-MoE-like: q, k, v biases, a gated shared expert, layer 1 dense.
    "tiny-moe-shared": ModelConfig("tiny-moe-shared", 2, 128, 4, 2, 256, 512, qkv_bias=True,
                                   architecture="Qwen2MoeForCausalLM",
                                   moe=MoE(experts=6, top_k=2, intermediate=64, renormalize=False,
                                           shared_intermediate=96, shared_gate=True, dense_layers=(1,))),
}
SHIPPED = tuple(sorted(p.stem for p in CONFIG_FOLDER.glob("*.json")))  # real models' config.json
PRESETS = tuple(BUILT_IN) + SHIPPED

LORA_LINEARS = ("qkv", "o", "gate_up", "down")  # per layer, in the order a step runs them
LORA_LINEARS_PER_LAYER = len(LORA_LINEARS)


def resolve(model: str, layers: int | None = None, where: str = "--model") -> ModelConfig:
    """``--model``'s value as shapes, optionally shortened to ``layers`` layers. Bad input ends in
    one ``UserError`` line that starts with ``where``."""
    model = model.strip()
    if model in BUILT_IN:
        cfg = BUILT_IN[model]
    elif model in SHIPPED:
        cfg = from_hf_file(CONFIG_FOLDER / f"{model}.json", model, where, source="preset")
    else:
        path = Path(model).expanduser()
        try:
            is_dir, is_file = path.is_dir(), path.is_file()
        except (OSError, ValueError) as e:  # a name too long, a NUL byte
            raise UserError(f"{where}: {model[:80]!r}: {getattr(e, 'strerror', None) or e}") from None
        if is_dir:
            path = path / "config.json"
            if not path.is_file():
                raise UserError(f"{where}: {model} is a folder without a config.json")
            is_file = True
        if is_file:
            cfg = from_hf_file(path, path.parent.name if path.name == "config.json" else path.stem, where)
        elif model.count("/") == 1 and not model.startswith((".", "/", "~")) and not model.endswith(".json"):
            cfg = from_hf_id(model, where)
        else:
            raise UserError(f"{where}: {model!r} is not a preset ({', '.join(PRESETS)}), "
                            "a config.json or a folder holding one, or a Hugging Face model id (org/name)")
    return shortened(cfg, layers)


def shortened(cfg: ModelConfig, layers: int | None) -> ModelConfig:
    """The model with only its first ``layers`` layers (None: all of them)."""
    if layers is None:
        return cfg
    if layers > cfg.full_layers:
        raise UserError(f"--layers: {layers} is more than {cfg.name}'s {cfg.full_layers} layers (--layers shortens a model)")
    return replace(cfg, layers=layers)


def from_hf_file(path: Path, name: str, where: str, source: str | None = None) -> ModelConfig:
    """A config.json's shapes, read by transformers' AutoConfig (its defaults fill what the file omits)."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{where}: {path} is not a readable JSON config ({getattr(e, 'strerror', None) or e})") from None
    if not isinstance(raw, dict):
        raise UserError(f"{where}: {path} is JSON but not a model config (an object of settings)")
    from transformers import AutoConfig, PretrainedConfig

    try:
        hf = AutoConfig.from_pretrained(str(path))
    except Exception as e:  # transformers raises many kinds (ValueError, OSError, its validators' own)
        if raw.get("model_type") and ("model type" in str(e) or "model_type" in str(e)):  # a model type this transformers is too old to know:
            hf = PretrainedConfig(**raw)  # the file's own values, without that type's defaults
        else:
            raise UserError(f"{where}: {path}: transformers cannot read it ({_first_line(e)})") from None
    return from_hf(hf, name, where, source or str(path))


def from_hf_id(model_id: str, where: str) -> ModelConfig:
    """A Hugging Face model's config: from the local cache first, else from the Hub (only
    config.json is fetched) unless ``HF_HUB_OFFLINE=1``."""
    from transformers import AutoConfig

    try:
        hf = AutoConfig.from_pretrained(model_id, local_files_only=True)
    except Exception as cached:  # transformers raises many kinds
        if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
            raise UserError(f"{where}: cannot read {model_id}'s config: not in the local Hugging Face cache and "
                            f"HF_HUB_OFFLINE is set ({_first_line(cached)})") from None
        _refuse_unreachable_hub(model_id, where)
        try:
            with _hub_quiet():
                hf = AutoConfig.from_pretrained(model_id)
        except Exception as e:
            raise UserError(f"{where}: cannot read {model_id}'s config from the Hugging Face Hub or its local cache "
                            f"({_first_line(e)})") from None
    return from_hf(hf, model_id, where, model_id)


def _refuse_unreachable_hub(model_id: str, where: str) -> None:
    """One line at once where the Hub's host does not resolve (offline), instead of the Hub
    client's ~25 s of retries, each logged."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    host = urlparse(constants.ENDPOINT).hostname or constants.ENDPOINT
    try:
        socket.getaddrinfo(host, 443)
    except OSError as e:
        raise UserError(f"{where}: {model_id} is not in the local Hugging Face cache and {host} cannot be reached "
                        f"({e.strerror or e}): give a preset, a config.json or a folder holding one") from None


@contextlib.contextmanager
def _hub_quiet():
    """The Hub client's retry warnings kept off the terminal: a failure is said in one line."""
    from huggingface_hub.utils import logging as hub_logging

    logger = hub_logging.get_logger("huggingface_hub")
    level = logger.level
    logger.setLevel(hub_logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _first_line(e: BaseException) -> str:
    """An exception's message on one line (transformers' validators spread theirs over several)."""
    return " ".join(part.strip() for part in str(e).splitlines() if part.strip())[:300] or type(e).__name__


def from_hf(hf, name: str, where: str = "--model", source: str = "") -> ModelConfig:
    """Shapes from a transformers ``PretrainedConfig`` of a Llama-style dense decoder or of one of
    the MoE decoders built the same way (``ARCHITECTURES``)."""
    arch = (getattr(hf, "architectures", None) or [type(hf).__name__])[0]
    if arch not in ARCHITECTURES:
        raise UserError(f"{where}: {name} is a {arch}; lorabench builds Llama-style dense decoders "
                        f"({', '.join(DENSE_ARCHITECTURES)}) and mixture-of-experts decoders "
                        f"({', '.join(MOE_ARCHITECTURES)})")
    for attr, want in (("hidden_act", "silu"), ("mlp_bias", False), ("clip_qkv", None)):
        if getattr(hf, attr, want) != want:
            raise UserError(f"{where}: {name} has {attr} = {getattr(hf, attr)!r}; lorabench builds {attr} = {want!r}")
    rope = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    theta = rope.get("rope_theta") or getattr(hf, "rope_theta", None) or 10000.0
    scaling = rope.get("rope_type") or rope.get("type")
    heads = hf.num_attention_heads
    attention_bias = bool(getattr(hf, "attention_bias", False))
    qkv_bias = attention_bias or arch == "Qwen2ForCausalLM"
    if arch == "Qwen2MoeForCausalLM":  # Qwen2's biases on q, k and v (newer transformers name them qkv_bias)
        qkv_bias = attention_bias or bool(getattr(hf, "qkv_bias", True))
    return ModelConfig(
        name=name, layers=hf.num_hidden_layers, hidden=hf.hidden_size, heads=heads,
        kv_heads=getattr(hf, "num_key_value_heads", None) or heads, intermediate=hf.intermediate_size,
        vocab=hf.vocab_size, rope_theta=float(theta), norm_eps=float(getattr(hf, "rms_norm_eps", 1e-6)),
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
        qkv_bias=qkv_bias, o_bias=attention_bias, qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        rope_scaling=None if scaling in (None, "default") else scaling, architecture=arch, source=source,
        moe=_moe_from_hf(hf, arch, name, where), qk_norm_full=arch == "OlmoeForCausalLM")


def _moe_from_hf(hf, arch: str, name: str, where: str) -> MoE | None:
    """The MoE layers' shapes of a MoE architecture's config (None for a dense one). transformers
    spells the expert count num_experts or num_local_experts depending on model and version."""
    if arch not in MOE_ARCHITECTURES:
        return None
    experts = getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts", None) or 0
    top_k = getattr(hf, "num_experts_per_tok", None) or 0
    qwen = arch in ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")
    if qwen:
        inter = getattr(hf, "moe_intermediate_size", None) or 0
    else:  # Mixtral, OLMoE: intermediate_size is each expert's
        inter = hf.intermediate_size
    shared = (getattr(hf, "shared_expert_intermediate_size", None) or 0) if arch == "Qwen2MoeForCausalLM" else 0
    # Mixtral's softmax over the top-k logits is a softmax renormalised over the top k.
    renormalize = arch == "MixtralForCausalLM" or bool(getattr(hf, "norm_topk_prob", False))
    step = getattr(hf, "decoder_sparse_step", None) if qwen else None
    step = 1 if step is None else step
    only = set(getattr(hf, "mlp_only_layers", None) or ()) if qwen else set()
    if not 1 <= top_k <= experts:
        raise UserError(f"{where}: {name} routes each token to {top_k} of {experts} experts; lorabench builds "
                        "1 to all of them")
    if inter < 1:
        raise UserError(f"{where}: {name}'s experts have intermediate size {inter}; lorabench builds 1 or more")
    if step < 1:
        raise UserError(f"{where}: {name} has decoder_sparse_step = {step}; lorabench builds 1 or more")
    dense = tuple(i for i in range(hf.num_hidden_layers) if i in only or (i + 1) % step)
    return MoE(experts=experts, top_k=top_k, intermediate=inter, renormalize=renormalize, shared_intermediate=shared,
               shared_gate=shared > 0, dense_layers=dense)


VOCAB_PADDING = 64  # vLLM pads the vocabulary to a multiple of 64 before splitting it over ranks


def shard(cfg: ModelConfig, tp: int, where: str = "--tp") -> ModelConfig:
    """One tensor-parallel rank's shapes, as vLLM splits a Llama-style model (Megatron style):
    qkv and gate_up column-parallel (each rank a share of the heads and of the intermediate
    features), o and down row-parallel (a share of their inputs, the whole hidden output, summed
    by an all-reduce), embedding and lm_head vocab-parallel. With fewer KV heads than ranks,
    every rank holds one KV head (replicated). LoRA follows the base layer, vLLM's default
    (not ``--fully-sharded-loras``): A whole and B split on column-parallel layers, A split and B
    whole on row-parallel ones; ``lora_linears`` of the rank's shapes gives exactly those.

    MoE layers as vLLM's tensor-parallel MoE (no expert parallelism): every rank holds every
    expert, with intermediate / TP of its features (w13 column-parallel, w2 row-parallel, their
    expert LoRA cut the same way); the shared expert likewise; the router replicated."""
    if tp == 1:
        return cfg
    if cfg.heads % tp:
        raise UserError(f"{where} {tp}: {cfg.name}'s {cfg.heads} attention heads do not split over {tp} ranks")
    if cfg.kv_heads % tp and tp % cfg.kv_heads:
        raise UserError(f"{where} {tp}: {cfg.name}'s {cfg.kv_heads} KV heads neither split over {tp} ranks "
                        "nor replicate evenly")
    dense_mlp = any(not moe_layer(cfg, i) for i in range(cfg.layers))  # a MoE model's may be unused
    if dense_mlp and cfg.intermediate % tp:
        raise UserError(f"{where} {tp}: {cfg.name}'s intermediate size {cfg.intermediate} does not split over {tp} ranks")
    moe = cfg.moe
    if moe is not None:
        if moe.intermediate % tp:
            raise UserError(f"{where} {tp}: {cfg.name}'s expert intermediate size {moe.intermediate} does not split "
                            f"over {tp} ranks")
        if moe.shared_intermediate % tp:
            raise UserError(f"{where} {tp}: {cfg.name}'s shared expert intermediate size {moe.shared_intermediate} "
                            f"does not split over {tp} ranks")
        moe = replace(moe, intermediate=moe.intermediate // tp, shared_intermediate=moe.shared_intermediate // tp)
    padded = math.ceil(cfg.vocab / VOCAB_PADDING) * VOCAB_PADDING
    return replace(cfg, heads=cfg.heads // tp, kv_heads=max(1, cfg.kv_heads // tp),
                   intermediate=cfg.intermediate // tp, vocab=math.ceil(padded / tp), tp=tp, moe=moe)


COLUMN_PARALLEL = ("qkv", "gate_up")  # outputs split over the ranks; o and down are row-parallel


def lora_shares(name: str, tp: int, fully_sharded: bool) -> tuple[int, int]:
    """How one TP rank's LoRA linear ``name`` is cut beyond its base layer: (A's rank divisor,
    B's output divisor). vLLM's default: (1, 1) (``shard``'s shapes say it all). With
    ``--fully-sharded-loras`` (S-LoRA's scheme): a column-parallel linear holds R / TP rows of each
    slice's A, its shrink output all-gathered before the expand; a row-parallel linear holds
    hidden / TP of B's outputs, its shrink output all-reduced first, its update landing in the
    rank's share of the output."""
    if not fully_sharded or tp == 1:
        return 1, 1
    return (tp, 1) if name in COLUMN_PARALLEL else (1, tp)


def check_moe_options(cfg: ModelConfig, fully_sharded: bool, where: str = "--fully-sharded-loras") -> None:
    """Fully sharded LoRA is built for the dense LoRA linears only (``lora_shares``), not for expert LoRA."""
    if cfg.is_moe and fully_sharded:
        raise UserError(f"{where}: {cfg.name} is a mixture-of-experts model; expert LoRA is built without it "
                        "(leave --fully-sharded-loras off)")


def lora_linears(cfg: ModelConfig) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Each LoRA linear of a dense layer: (input features K, output slice widths)."""
    d = cfg.head_dim
    return {"qkv": (cfg.hidden, (cfg.heads * d, cfg.kv_heads * d, cfg.kv_heads * d)), "o": (cfg.heads * d, (cfg.hidden,)),
            "gate_up": (cfg.hidden, (cfg.intermediate, cfg.intermediate)), "down": (cfg.intermediate, (cfg.hidden,))}


def layer_lora_linears(cfg: ModelConfig, i: int) -> dict[str, tuple[int, tuple[int, ...]]]:
    """The dense LoRA linears layer ``i`` has: qkv and o always; gate_up and down in a dense layer
    (of ``cfg.intermediate``) or, in a MoE layer, its shared expert's (of ``shared_intermediate``);
    a MoE layer without a shared expert has only qkv and o (its experts' LoRA: ``moe_lora_shapes``)."""
    linears = lora_linears(cfg)
    if not moe_layer(cfg, i):
        return linears
    attention = {name: linears[name] for name in ("qkv", "o")}
    shared = cfg.moe.shared_intermediate
    if not shared:
        return attention
    return attention | {"gate_up": (cfg.hidden, (shared, shared)), "down": (shared, (cfg.hidden,))}


def moe_lora_shapes(cfg: ModelConfig, rank: int) -> dict[str, tuple[int, ...]]:
    """One adapter slot's expert LoRA in one MoE layer, laid out as vLLM's fused-MoE LoRA layer
    holds it: per slice (w13: gate and up; w2: down), per expert, A [R, K] and B [N, R], with I
    this rank's expert intermediate size. Empty for a dense model."""
    if cfg.moe is None:
        return {}
    e, i, h, r = cfg.moe.experts, cfg.moe.intermediate, cfg.hidden, rank
    return {"w13_a": (2, e, r, h), "w13_b": (2, e, i, r), "w2_a": (1, e, r, i), "w2_b": (1, e, h, r)}
