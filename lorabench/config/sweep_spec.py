"""A sweep's options, each declared once, as a field of ``SweepSpec`` (``lorabench.config.options``):
the command line's flags, the spec file's keys, the checks of their values (``lorabench.config.spec``)
and the columns rows copy from their job all follow from it. Light to import: ``--help`` reads it."""

from dataclasses import asdict, dataclass

from lorabench.config.backends import KernelsLabel
from lorabench.config.models import PRESETS, ModelConfig, shard
from lorabench.config.options import Option, aliases, option, options_of
from lorabench.config.piecewise import capture_sizes as piecewise_capture_sizes
from lorabench.config.strategies import STRATEGIES
from lorabench.kernels import BACKENDS, DTYPES, RANKS

MAX_TOKENS = 512  # decode steps and graphs: the kernels are built and tested for 1 to 512 tokens per step
MAX_BATCHED_TOKENS = 16384  # prefill points and --max-num-batched-tokens (the kernels are tested past 4096 tokens)
MAX_SEED = 2**32 - 1  # numpy's generators take seeds below 2**32 (torch's below 2**64)
MAX_STEPS = 100_000  # --iters, --warmup: a worker draws every timed step's batch up front
MAX_ADAPTERS = 1_000_000  # --adapters, --max-cpu-loras: the residency loop keeps one entry per adapter
OUTPUT_TOKENS = 128  # --output-tokens: decode steps per request by default (vllm bench's random dataset's output length)
LIST = "comma-separated"
LOAD_PATHS = {"per-slice": "vLLM's: every slice zeroed and copied",
              "one-copy": "the adapter's one pinned buffer copied at once, then scattered on the GPU"}


@dataclass
class SweepSpec:
    """A sweep's settings. The fields made by ``option`` are its options, in ``--help``'s order."""

    max_loras: list[int] = option([4], f"Resident adapter slots, {LIST}")
    concurrency: list[int] = option([1, 2, 4, 8], f"Requests per decode step, {LIST}")
    strategy: list[str] = option(["max", "pow2", "dense"], f"Capture sets: {', '.join(STRATEGIES)}, a list like [1,2,4], "
                                 f"or auto (with --auto-from), {LIST}")
    model: str | None = option(None, f"A preset ({', '.join(PRESETS)}), a config.json or a folder holding one, or a "
                               "Hugging Face model id (its config only; weights are random)",
                               shown="llama-2-7b on a GPU, tiny on the CPU")
    layers: int | None = option(None, "Shorten the model to this many layers", shown="the model's")
    tp: int = option(1, "Tensor-parallel ranks: build and time one rank's shapes, LoRA sharded as vLLM shards it; the "
                     "rank's all-reduces are left out", column=True)
    fully_sharded_loras: bool = option(False, "With --tp: cut LoRA as vLLM's --fully-sharded-loras does (A's rank on "
                                       "qkv and gate_up, B's outputs on o and down); its collectives are left out too")
    share_expert_weights: bool = option(
        False, "MoE models: every MoE layer reads one set of routed-expert weights, so a model larger than the GPU's "
        "memory can be timed (each layer still streams its experts from memory: far more than the L2 holds); routers, "
        "expert LoRA, attention and the KV cache stay per layer. Recorded in every row")
    rank: int = option(16, f"LoRA rank, vLLM's --max-lora-rank (every adapter is padded to it): {', '.join(map(str, RANKS))}",
                       aliases=("max_lora_rank",), column=True)
    ranks: str | None = option(None, "The adapters' own ranks and their shares of the slots, e.g. 8:0.5,64:0.5, padded "
                               "to --rank; lorabench's kernels also run as <backend>+unpadded, skipping the padding",
                               shown="all at --rank", column=True)
    context_len: int = option(1024, "KV-cache positions each request attends over", column=True)
    dtype: str | None = option(None, f"{', '.join(DTYPES)}", shown="float16 on a GPU, float32 on the CPU", column=True)
    kernels: list[str] | None = option(None, f"LoRA kernel backends, {LIST}: "
                                       f"{'; '.join(f'{b.name} ({b.doc})' for b in BACKENDS.values())}",
                                       shown="triton on a GPU, torch on the CPU")
    device: str = option("auto", "auto, cuda, cpu")
    workload: list[str] = option(["uniform"], f"Adapter mixes for workload runs, {LIST}: uniform, zipf:S, single, "
                                 "base:P, joined by +; or trace:PATH (CSV/JSONL)")
    iters: int = option(100, "Timed steps per point", maximum=MAX_STEPS, column=True)
    warmup: int = option(10, "Untimed steps before each point", minimum=0, maximum=MAX_STEPS, column=True)
    ci_target: float | None = option(None, "Stop timing a point once the 95 % interval of its median is within +- this "
                                     "percent (at least 20 steps, and two turns per strategy where several share a "
                                     "point; at most --iters)", shown="always --iters", column=True)
    seed: int = option(0, "Seed for weights and batches", minimum=0, maximum=MAX_SEED, column=True)
    out: str = option("results", "Output root; the run goes to OUT/<run_id>")
    capture_sizes: list[int] | None = option(None, f"Batch buckets that get graphs, {LIST}", shown="the concurrency values",
                                             column=True)
    max_cudagraph_capture_size: int | None = option(
        None, "vLLM's --max-cudagraph-capture-size: mixed steps (prefill chunks beside decode tokens) get PIECEWISE "
        "graphs, the model split at attention, at vLLM's capture sizes up to this many tokens (1, 2, 4, multiples of 8, "
        "then of 16), per active count under each strategy as vLLM keys them; larger steps run eagerly; 0: none",
        shown="min(2 x the largest concurrency, 512, --max-num-batched-tokens) with --prefill-tokens, else 0",
        minimum=0, maximum=MAX_TOKENS, column=True)
    mixed_capture_sizes: list[int] | None = option(
        None, f"The PIECEWISE graphs' token buckets themselves, {LIST} (vLLM's --cuda-graph-sizes): a mixed step "
        "replays the smallest bucket that holds it, eagerly past the largest", shown="vLLM's sizes up to "
        "--max-cudagraph-capture-size")  # rows: the worker's mixed_capture_sizes
    active_counts: list[int] | None = option(None, f"Active adapter counts to measure at each concurrency, {LIST} (n = 0, "
                                             "the step every overhead is taken against, always; a count above "
                                             "min(c, max_loras) is skipped there): a workload whose mix reaches a "
                                             "count left out gets no expected step",
                                             shown="every n from 0 to min(c, max_loras)", minimum=0)
    prefill_tokens: list[int] | None = option(
        None, f"Prefill points: steps of this many prompt tokens, {LIST} (e.g. 128,512,2048,8192), at every active count n "
        "from 0 to max_loras (or those of --active-counts): each step holds as many requests as the largest n there "
        "(or as chunks of at most --context-len need), as few long chunks as the tokens need and the other requests "
        "one token each, the same at every n (steps differ in their adapters alone), the n adapters on the long "
        "chunks first",
        shown="none")
    max_num_batched_tokens: int = option(8192, "vLLM's --max-num-batched-tokens: the most tokens one step holds (every "
                                         "prefill point's at most)", maximum=MAX_BATCHED_TOKENS, column=True)
    check: bool = option(True, "Skip the correctness check of each configuration (the `correct` column)")
    auto_from: str | None = option(None, "Strategy auto: the run whose points price the capture sets (see "
                                   "`lorabench recommend`)")
    graph_memory_budget: float | None = option(None, "Strategy auto: most graph memory the set may take, MiB")
    startup_budget: float | None = option(None, "Strategy auto: most startup the set may take, s")
    tuned: str | None = option(None, "A `lorabench tune` output folder: each swept backend it has configs for (triton, "
                               "fused, vllm) also runs as <backend>+tuned")
    adapters: int | None = option(None, "Adapters the requests choose from, held in the max_loras GPU slots by LRU: a "
                                  "count (random adapters at --rank), or a folder of PEFT adapters (or a glob of "
                                  "them), whose own weights, ranks and targets fill the slots; the workload runs "
                                  "become residency runs of the largest concurrency's clients, loading adapters into "
                                  "slots as the steps need them (timed)",
                                  shown="one adapter per slot, none loaded", maximum=MAX_ADAPTERS, column=True)
    max_cpu_loras: int | None = option(None, "With --adapters: vLLM's CPU cache of adapters (at least max_loras); a load "
                                       "of an adapter not in it reads the adapter's file from storage first, its pages "
                                       "dropped from the page cache (--adapters DIR; a count's random adapters have no "
                                       "files: such loads are counted, not read)", shown="every adapter",
                                       maximum=MAX_ADAPTERS)
    load_path: str = option("per-slice", f"With --adapters: how the residency runs load an adapter into its slot: "
                            f"{'; '.join(f'{k} ({v})' for k, v in LOAD_PATHS.items())}", column=True)
    output_tokens: str = option(str(OUTPUT_TOKENS), "With --adapters: tokens each request decodes, N or LO-HI (uniform; "
                                "a trace's output_tokens column overrides it)")
    input_tokens: str | None = option(None, "With --adapters: each request's prompt, N tokens or LO-HI (uniform; a "
                                      "trace's input_tokens column overrides it): the residency runs become serving "
                                      "runs, scheduled with chunked prefill as vLLM's (at most --max-num-batched-tokens "
                                      "per step, decode first, prompts chunked), their mixed steps on PIECEWISE graphs; "
                                      "each reports time to first token and inter-token latency (p50, p90, p99)",
                                      shown="none: requests decode only", column=True)
    # Not options: what planning resolves.
    auto_sets: dict | None = None  # --strategy auto, chosen when planned: "kernels/max_loras" -> counts and predictions
    model_config: ModelConfig | None = None  # --model resolved when planned (the whole model, --layers applied)
    adapter_dir: str | None = None  # --adapters DIR: the PEFT adapters' folder (or glob); adapters is then their count

    @property
    def mixed_sizes(self) -> list[int]:
        """The buckets of the mixed steps' PIECEWISE graphs: ``mixed_capture_sizes`` where given, else
        vLLM's capture sizes up to ``max_cudagraph_capture_size`` (after ``build_spec``: set)."""
        if self.mixed_capture_sizes:
            return sorted(set(self.mixed_capture_sizes))
        largest = self.max_cudagraph_capture_size or 0
        return piecewise_capture_sizes(largest) if largest else []

    @property
    def max_tokens(self) -> int:
        """The token slots a worker's model is built with: the largest step it runs or captures."""
        serving = [self.max_num_batched_tokens] if self.input_tokens else []
        return max(self.capture_sizes + self.concurrency + self.mixed_sizes + (self.prefill_tokens or []) + serving)

    @property
    def cache_rows(self) -> int:
        """The KV cache's requests: a decode step's token t reads row t; with mixed steps, the check's
        mixed cases' rows after those (``runtime.check.mixed_rows``: max_loras, a base request and
        the chunks of the largest step), which also hold the prefill points' requests."""
        rows = max(self.capture_sizes + self.concurrency)  # a serving run's requests too: at most its clients
        if self.prefill_tokens or self.mixed_sizes:
            rows += max(self.max_loras) + 1 + -(-self.max_tokens // self.context_len)
        return rows

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


OPTIONS: dict[str, Option] = options_of(SweepSpec)
FIELDS = set(OPTIONS)  # a spec file's keys
ALIASES = aliases(OPTIONS)  # other keys of a spec file: vLLM's names


def coerce(name: str, value):
    """A flag's or spec file's raw value -> the option's type, with its bounds (comma strings become lists)."""
    return OPTIONS[name].parse(value)
