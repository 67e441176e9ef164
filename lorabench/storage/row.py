"""One row of a run's ``points.parquet``: a point measured (or failed), as the worker writes it,
the protocol carries it (``lorabench.runtime.protocol``), the sweep stores it and readers read it
(``lorabench.storage.results``: a DataFrame of these columns, in ``lorabench.storage.schema``'s
types).

Every field of ``Row`` is a column, in the file's order: the original ones first, then the
extensions (columns are extended, never renamed; a run written before a column existed reads it as
null). Each column's doc is its entry in the design's table (``python -m lorabench.storage.schema``
prints it); a ``column()`` without one shares the doc of the column before it. ``Env`` is the
environment a worker reports: run.json's ``env``, and the columns of it every row carries."""

from dataclasses import dataclass, field, fields


def column(doc: str = ""):
    return field(default=None, metadata={"doc": doc})


@dataclass(frozen=True)
class Row:
    """A point's row; every column may be null (a failed point has few)."""

    run_id: str | None = column("the run's folder name")
    started_at: str | None = column("when the run started, UTC, ISO 8601")
    git_sha: str | None = column(
        "commit of the checkout (`-dirty` with uncommitted changes; `LORABENCH_GIT_SHA` overrides)")
    device: str | None = column("`cuda` or `cpu`")
    gpu_name: str | None = column("the GPU's name (null on the CPU)")
    driver: str | None = column("NVIDIA driver version (null on the CPU)")
    torch: str | None = column("torch version")
    triton: str | None = column("Triton version")
    cuda: str | None = column("CUDA version torch was built with (null on the CPU)")
    model: str | None = column(
        "the model's name: a preset (`llama-2-7b`, `llama-3.1-8b`, ...), a config folder's name or a Hugging Face id")
    layers: int | None = column("decoder layers built")
    hidden: int | None = column("hidden size")
    rank: int | None = column("LoRA rank")
    dtype: str | None = column("`float16`, `bfloat16` or `float32`")
    kernels: str | None = column("kernel backend label: `triton`, `fused`, `gemm`, `torch`, `vllm`, or `<backend>+tuned`")
    max_loras: int | None = column("resident adapter slots")
    strategy: str | None = column(
        "canonical strategy name (`max`, `pow2`, `dense`, `agnostic`, `auto`, or a list like `[1,2,4]`)")
    captured_counts: list[int] | None = column(
        "the capture set the worker captured (for `vllm`: vLLM's keys, `max_loras + 1` included)")
    capture_sizes: list[int] | None = column("the buckets that got graphs")
    concurrency: int | None = column("`c`, tokens per decode step")
    n_active: int | None = column("fixed points: the active count `n` (null on workload points)")
    base_tokens: int | None = column("fixed points: base-model requests in the batch (`c` when `n = 0`, else 0)")
    graph_tokens: int | None = column("the bucket a batch of `c` tokens is served by (`c` itself when it runs eagerly)")
    graph_loras: int | None = column("fixed points: the launch count the served graph's LoRA kernels run with")
    mode: str | None = column("`fixed` (exactly `n` adapters) or `workload` (batches drawn from a workload)")
    workload: str | None = column("workload points: the workload's name")
    iters: int | None = column("timed steps per point")
    step_ms_median: float | None = column("median step time, ms")
    step_ms_p10: float | None = column("10th percentile of the step times")
    step_ms_p90: float | None = column("90th percentile")
    step_ms_p99: float | None = column("99th percentile")
    step_ms_mean: float | None = column("mean step time")
    step_ms_std: float | None = column("standard deviation of the step times (sample)")
    step_ms_iqr: float | None = column("interquartile range (p75 − p25)")
    host_us_median: float | None = column("host µs per step to build the batch metadata and choose the graph, median")
    tokens_per_s: float | None = column("`c` / median step")
    build_s: float | None = column("model and dispatcher build, s")
    compile_s: float | None = column("warm-up of every graph's step (Triton compiles), s")
    capture_s: float | None = column("capture of every graph, s")
    startup_s: float | None = column("build + compile + capture, s")
    graph_mem_bytes: int | None = column("free device memory consumed by the capture (null on the CPU)")
    pool_bytes: int | None = column("growth of torch's reserved memory over the capture (null on the CPU)")
    num_graphs: int | None = column("graphs captured, no-LoRA graphs included")
    noisy: bool | None = column("IQR / median ≥ 10 %, host-bound steps (launches ≥ 90 % of the GPU time), a loop's stalled steps (≥ 5x steps of their size), a slowdown or a clock drop")
    status: str | None = column("`ok` or `failed`")
    error: str | None = column("failed rows: the error, or the end of the worker's log")
    point: int | None = column("index of the point in its run's plan")
    argv: str | None = column("the command line")
    seed: int | None = column("seed for weights and batches")
    context_len: int | None = column("KV-cache positions each request attends over")
    warmup: int | None = column("untimed steps before the point")
    timing: str | None = column("`cuda_events` (GPU time) or `cpu_wall` (CPU wall time of eager steps)")
    host_us_p90: float | None = column("90th percentile of the host time above")
    copy_us_median: float | None = column("host µs of the call that queues the metadata's copy, median")
    launch_us_median: float | None = column("host µs of the replay call (on the CPU, the eager step itself), median")
    n_active_mean: float | None = column(
        "mean active count over the timed steps (the useful figure on workload points)")
    graph_loras_mean: float | None = column("mean launch count over the timed steps")
    process_s: float | None = column("worker start until the model build begins: interpreter, imports, device init")
    triton_cache: str | None = column(
        "`cold` if the compile step wrote new kernels to Triton's cache, else `warm` (null for non-Triton or "
        "interpreted kernels)")
    lora_bytes_per_slot: int | None = column("bytes of one adapter's A and B over every LoRA linear")
    lora_io_bytes_per_token: int | None = column("bytes the dense LoRA linears move per adapter token beside the "
                                                 "base GEMMs: each input read once, each LoRA output read and "
                                                 "written once (the prefill floor's activation term)")
    vllm: str | None = column("vLLM's version, on rows of `--kernels vllm`")
    correct: bool | None = column("the configuration's check: true, false, or null (not checked or inconclusive)")
    check_detail: str | None = column(
        "the verdict in words; when wrong, the smallest failing batch, its graph and error")
    check_max_err: float | None = column(
        "worst relative logit error over the check's batches, mixed steps too (their own tolerance: check_detail)")
    check_batches: int | None = column("batches the check ran")
    check_s: float | None = column("seconds the check took")
    predicted_ms: float | None = column(
        "strategy auto, workload points: the cost model's expected step from the `--auto-from` run")
    probe_copy_gbs: float | None = column("the worker's device-to-device copy bandwidth, read + write, GB/s")
    probe_rmw_gbs: float | None = column("the worker's in-place add bandwidth over float32, read + write, GB/s")
    probe_kernel_us: float | None = column("the worker's cost of one more tiny kernel in a CUDA graph, µs")
    tuned: str | None = column("`+tuned` rows: the `lorabench tune` folder whose configs they ran with")
    pdl: bool | None = column(
        "lorabench's Triton kernels launched with programmatic dependent launch (sm90+, not with `LORABENCH_PDL=0`; "
        "the `gemm` backend's not at 32 to 64 tokens where its own GEMM runs); null for other backends")
    timed_steps: int | None = column("steps timed at the point: `iters`, or fewer when `--ci-target` stopped it")
    step_ms_ci_low: float | None = column(
        "95 % percentile-bootstrap interval of the median step, from the point's samples")
    step_ms_ci_high: float | None = column()
    ci_target: float | None = column("`--ci-target`: the half-width (% of the median) at which a point stops timing")
    arms: str | None = column(
        "the strategies timed in alternating turns at this point (`max,pow2,dense`); a point re-measured by "
        "`--resume` lists only those timed with it then")
    noisy_why: str | None = column("why `noisy` is set: a wide IQR, host-bound steps, a loop's stalled steps, a slowdown reason, a clock drop")
    host: str | None = column("the machine the worker ran on")
    gpu_uuid: str | None = column("the GPU the point ran on (`GPU-…`, as NVML and nvidia-smi write it)")
    sm_mhz_start: int | None = column("NVML's SM and memory clocks before the point's first step and after its last")
    sm_mhz_end: int | None = column()
    mem_mhz_start: int | None = column()
    mem_mhz_end: int | None = column()
    temp_c_start: int | None = column("temperature and power at the same two moments")
    temp_c_end: int | None = column()
    power_w_start: float | None = column()
    power_w_end: float | None = column()
    throttle_reasons: str | None = column(
        "NVML's clock-event reasons set at either moment, comma-joined (`\"\"`: none)")
    throttled: bool | None = column(
        "a power or thermal slowdown reason was set (sw_power_cap, hw_slowdown, sw_thermal, hw_thermal, "
        "hw_power_brake)")
    clock_drop: bool | None = column("the SM clock fell by more than 5 % over the point")
    first_capture_s: float | None = column(
        "what the worker's process paid once for its first warm-up and capture, before any strategy (not in any "
        "strategy's startup or graph memory)")
    first_capture_bytes: int | None = column()
    model_source: str | None = column(
        "where the shapes came from (`preset`, a `config.json` path, a Hugging Face id) and the architecture built")
    architecture: str | None = column()
    heads: int | None = column(
        "the whole model's shapes (a TP rank holds 1/`tp` of the heads, intermediate features and vocabulary, and of "
        "the KV heads where there are `tp` or more, else one)")
    kv_heads: int | None = column()
    head_dim: int | None = column()
    intermediate: int | None = column()
    vocab: int | None = column()
    tp: int | None = column("tensor-parallel size: the row times one rank's shapes")
    ranks: str | None = column("`--ranks`: the adapters' own ranks and shares, and each slot's (zero-padded to `rank`)")
    slot_ranks: list[int] | None = column()
    fully_sharded_loras: bool | None = column("LoRA cut as vLLM's `--fully-sharded-loras` cuts it")
    allreduce: str | None = column("`left out` when `tp` > 1: the rank's collectives are not in its step times")
    adapters: int | None = column("`--adapters`: the residency runs' adapters and CPU cache")
    adapter_dir: str | None = column("`--adapters DIR`: the folder of PEFT adapters whose own weights fill the slots "
                                     "(slot i: its adapter i); empty: random adapters")
    max_cpu_loras: int | None = column()
    output_tokens: str | None = column("residency and serving runs: tokens each request decodes, N or LO-HI "
                                       "(uniform); a trace's output_tokens column overrides it")
    tokens_per_step: float | None = column(
        "residency rows: mean running requests and adapter loads per timed step (`tokens_per_s` = all tokens / all "
        "step time)")
    loads_per_step: float | None = column()
    storage_reads_per_step: float | None = column(
        "residency rows: adapter files read from storage per timed step, inside its events (its CPU-cache misses; "
        "`--adapters DIR` only: random adapters have no files, their misses are counted, not read); and the path "
        "the run's loads took (`--load-path`)")
    storage_read_bytes_per_step: float | None = column()
    load_path: str | None = column()
    load_ms_median: float | None = column(
        "what loading one adapter into a slot from pinned host memory adds to the step that waits for it: the "
        "worker's median of 30 and its 95 % interval")
    load_ms_ci_low: float | None = column()
    load_ms_ci_high: float | None = column()
    load_alone_ms_median: float | None = column(
        "the same load by itself (CUDA events around its copies), the host's time of queueing them, and its device "
        "operations (a zeroing and a copy of A and of B per slice)")
    load_host_us_median: float | None = column()
    load_ops: int | None = column()
    load_one_copy_ms_median: float | None = column(
        "the other load paths, medians (`lorabench.runtime.load_paths`): one pinned buffer per adapter copied at once "
        "then scattered, in a step and alone, and its host calls; the same from pageable memory, alone; on a side "
        "stream beside the steps, until usable and what a step beside it lost")
    load_one_copy_alone_ms_median: float | None = column()
    load_one_copy_ops: int | None = column()
    load_pageable_alone_ms_median: float | None = column()
    load_overlap_usable_ms_median: float | None = column()
    load_overlap_lost_ms_median: float | None = column()
    storage_read_cold_ms_median: float | None = column(
        "`--adapters DIR`: one adapter's safetensors file read into host memory after its pages were dropped from the "
        "page cache, and again at once, medians; the filesystem it is on (tmpfs: never cold)")
    storage_read_warm_ms_median: float | None = column()
    storage_fs: str | None = column()
    storage_read_cold_gb_s: float | None = column(
        "a cold read as a line in its file's bytes, ms = fixed + bytes / rate (rate in GB/s, 1e9 B), fitted to the "
        "timed reads where their files differ in size, else fixed 0: what a CPU-cache miss is priced by")
    storage_read_cold_fixed_ms: float | None = column()
    adapter_file_bytes: list[int] | None = column("`--adapters DIR`: each adapter's safetensors file's size, in the "
                                                  "folder's order")
    host_link_gb_s_median: float | None = column(
        "pinned host memory to the device, GB/s (1e9 B), a 256 MiB copy, median of 10: the bound a load path is held to")
    experts: int | None = column("MoE models: routed experts per MoE layer, experts per token, each expert's "
                                 "intermediate size (one rank's) and the shared expert's (0: none)")
    top_k: int | None = column()
    moe_intermediate: int | None = column()
    shared_intermediate: int | None = column()
    shared_expert_weights: bool | None = column("MoE models: every MoE layer read one set of routed-expert weights "
                                                "(`--share-expert-weights`)")
    expert_lora_bytes_per_slot: int | None = column("the part of `lora_bytes_per_slot` on the experts (vLLM's "
                                                    "w13 and w2 A and B of every expert)")
    moe_lora_path: str | None = column("the expert-LoRA path the bucket's graph runs: `per-entry` (its grid ignores "
                                       "the active count), `sorted` (it follows it), `in-gemm` (inside the expert "
                                       "GEMM, its walk over the slots bounded by the launch count) or `in-gemm+shrink` "
                                       "(the same after the sorted shrink), the backend's rule for the bucket's tokens and the "
                                       "graph's launch count; several, joined by `, `, where the steps launched "
                                       "counts that differ in it")
    prefill_tokens: int | None = column("prefill points: the step's prompt tokens (chunks of at most `context_len` "
                                        "from `concurrency` requests, `n_active` adapters among them; `mode` `prefill`)")
    max_num_batched_tokens: int | None = column("vLLM's `--max-num-batched-tokens`: the most tokens a step holds")
    max_cudagraph_capture_size: int | None = column(
        "vLLM's `--max-cudagraph-capture-size`: mixed steps up to this many tokens replay PIECEWISE graphs (0: none)")
    mixed_capture_sizes: list[int] | None = column("the buckets mixed steps have PIECEWISE graphs for (vLLM's sizes)")
    num_mixed_graphs: int | None = column("PIECEWISE graphs captured: every mixed key's pieces (layers + 1 per key)")
    mixed_capture_s: float | None = column("capturing them, s (not in `capture_s`)")
    mixed_graph_mem_bytes: int | None = column("device memory they took (not in `graph_mem_bytes`)")
    mixed_route: str | None = column("prefill points: `piecewise` (the step replays its bucket's PIECEWISE graphs) "
                                     "or `eager` (past `max_cudagraph_capture_size`)")
    input_tokens: str | None = column("serving runs (`mode` `serving`): each request's prompt, N tokens or LO-HI "
                                      "(uniform); a trace's input_tokens column overrides it")
    ttft_requests: int | None = column("serving runs: requests the TTFT percentiles count: those that arrived in the "
                                       "timed steps at least the longest TTFT seen before their end")
    ttft_censored: int | None = column("serving runs: of those, the ones still waiting at the end: counted above every "
                                       "timed one (a percentile among them is +inf)")
    ttft_pending: int | None = column("serving runs: every request that arrived in the timed steps and had no token at "
                                      "their end")
    output_tokens_per_s: float | None = column("serving runs: output tokens per second over the timed steps "
                                               "(`tokens_per_s` counts prompt tokens too)")
    prefill_token_share: float | None = column("serving runs: the timed steps' prompt tokens over all their tokens")
    mixed_step_share: float | None = column("serving runs: the timed steps holding a prompt chunk (PIECEWISE graphs or "
                                            "eager) over all of them (the rest: decode steps on FULL graphs)")
    ttft_ms_p50: float | None = column("serving runs: time to first token, ms, median: from the start of the step a "
                                       "request arrived in to the end of the step that made its first token (+inf: "
                                       "among the censored requests)")
    ttft_ms_p50_low: float | None = column("serving runs: its 95 % interval (distribution-free), low")
    ttft_ms_p50_high: float | None = column("serving runs: its 95 % interval, high")
    ttft_ms_p90: float | None = column("serving runs: time to first token, ms, p90")
    ttft_ms_p90_low: float | None = column("serving runs: its 95 % interval, low (null: fewer than 36 requests)")
    ttft_ms_p90_high: float | None = column("serving runs: its 95 % interval, high")
    ttft_ms_p99: float | None = column("serving runs: time to first token, ms, p99")
    ttft_ms_p99_low: float | None = column("serving runs: its 95 % interval, low (null: fewer than 368 requests)")
    ttft_ms_p99_high: float | None = column("serving runs: its 95 % interval, high")
    itl_ms_p50: float | None = column("serving runs: inter-token latency, ms, median: between a request's consecutive "
                                      "tokens")
    itl_ms_p50_low: float | None = column("serving runs: its 95 % interval, low")
    itl_ms_p50_high: float | None = column("serving runs: its 95 % interval, high")
    itl_ms_p90: float | None = column("serving runs: inter-token latency, ms, p90")
    itl_ms_p90_low: float | None = column("serving runs: its 95 % interval, low")
    itl_ms_p90_high: float | None = column("serving runs: its 95 % interval, high")
    itl_ms_p99: float | None = column("serving runs: inter-token latency, ms, p99")
    itl_ms_p99_low: float | None = column("serving runs: its 95 % interval, low")
    itl_ms_p99_high: float | None = column("serving runs: its 95 % interval, high")

    def to_dict(self) -> dict:
        """The row as a record (column -> value), in the columns' order."""
        return {name: getattr(self, name) for name in COLUMNS}

    @classmethod
    def from_dict(cls, record: dict) -> "Row":
        """A stored record: the columns it has (an older run's lack the later ones)."""
        return cls(**{name: record[name] for name in COLUMNS if name in record})


COLUMNS: tuple[str, ...] = tuple(f.name for f in fields(Row))


@dataclass(frozen=True)
class Env:
    """Where a worker runs: run.json's ``env``; its fields that are columns (``ENV_COLUMNS``) are
    on every row the worker writes."""

    device: str
    gpu_name: str | None = None
    gpu_uuid: str | None = None  # GPU-..., as NVML and nvidia-smi write it
    driver: str | None = None
    cuda: str | None = None
    torch: str | None = None
    triton: str | None = None
    git_sha: str | None = None
    python: str | None = None
    host: str | None = None
    cpu: str | None = None

    def columns(self) -> dict:
        """Its values for a row."""
        return {name: getattr(self, name) for name in ENV_COLUMNS}


ENV_COLUMNS: tuple[str, ...] = tuple(f.name for f in fields(Env) if f.name in COLUMNS)
