#!/usr/bin/env bash
# The GPU runs behind BENCHMARKS.md, stage by stage, on a GPU machine without a package index (an
# H200 for the committed figures); logs and a tarball of the runs under $OUT (default /tmp/out).
# Usage there:  LORABENCH_GIT_SHA=<sha> scripts/h200.sh card slots report
#   tests  - the test suite on the GPU (scripts/gpu-tests.sh: kernels in fp16/bf16, real CUDA graphs; SHARDS=N workers,
#            PART=i/n the i-th of n parts, for a suite longer than one call)
#   smoke  - sweeps/smoke.toml (2 layers), to see the whole path run
#   card   - sweeps/card.toml at llama-2-7b (32 layers), wall time recorded; repeatable
#   wide, slots, backends - sweeps/wide.toml, sweeps/slots.toml, sweeps/backends.toml
#   card-vllm - sweeps/card.toml with both backends (--kernels triton,vllm)
#   backends-4-32, backends-128 - sweeps/backends.toml split by max_loras (one call's time limit)
#   parity - scripts/vllm_parity.py: vLLM's kernels in the harness vs its ops timed alone
#   auto-card, auto-32 - strategy auto validated: the source sweep (card.toml / auto-32.toml with
#            uniform, zipf:1.2, base:0.5), then one `--strategy auto --auto-from` sweep per workload,
#            and one under a graph-memory budget just below what dense took
#   auto-budget - auto at 32 slots under a budget just below what pow2 took (results/auto/32),
#            with max and pow2 measured in the same run
#   kernel-tests - the kernel, graph and check tests selected by TESTS_K (default: fused or agnostic)
#   STAGE_TIMEOUT - seconds a sweep stage may run before it is stopped (its finished rows stay)
#   kernels-card, kernels-32, kernels-128 - sweeps/kernels-*.toml: fused vs triton vs vLLM, strategy agnostic
#            (kernels-card adds the +tuned kernels when the tune stage ran on this machine; SWEEP_KERNELS overrides the kernels of all three)
#   tune   - lorabench tune (TUNE_KERNELS, default triton,fused,gemm,vllm) into results/tuned-h200 (kept on a warm machine for
#            kernels-card's --tuned, and packed with the runs), TUNE_BUDGET_S seconds (default 150)
#   profile - scripts/profile_step.py: floor, replays, kernel breakdown, host cost
#   eager-host - scripts/eager_host.py: an eager prefill step's host time (Triton's launcher, the CUDA runtime's calls)
#            without and with an adapter, at EH_TOKENS (default 512,2048,8192), EH_ARGS more options (e.g. --kernels fused)
#   card-check - the kernels against vLLM's in one run: sweeps/kernels-card.toml at c = 1, 8, triton and
#            vllm (default and +tuned with results/tuned), max and pow2 (~3 min)
#   linear-bench - scripts/linear_bench.py: each LoRA linear's overhead after its GEMM, per kernel design, PDL on/off
#            (with results/tuned-h200's configs when the tune stage ran on this machine); LB_LORAS, LB_POINTS
#            (tokens:active[:launch]), LB_VARIANTS (e.g. triton,fused)
#   shrink-grid - scripts/shrink_grid.py: the shrink configs of a small grid per shape against the default (~3 min)
#   bf16-grid - scripts/bf16_error_grid.py: the pair's and the fused kernel's worst error in fp16/bf16 against fp32
#   first-run - the README's two commands as a new user runs them (sweep --max-loras 4 --concurrency 1,2,4,8;
#            report), timed from process start to the end of each
#   resume - sweeps/card.toml stopped by SIGTERM (RESUME_AFTER s, default 25) and by SIGKILL, each resumed
#            with --resume, timed; the rows compared with the plan
#   confidence - sweeps/card.toml twice (the A/A), once with --ci-target 0.3 (each timed from process start to
#            table), with both backends (triton vs vllm), and max vs pow2 at 128 slots: results/confidence/
#   ci-target - the card sweep without and with --ci-target 0.3, timed, into results/confidence/
#   models - sweeps/llama-3.1-8b.toml and sweeps/llama-3.1-70b-tp4.toml at ranks 16, 64, 128, sweeps/qwen2.5-7b.toml:
#            results/models/ (triton vs vLLM's kernels in each run)
#   qwen   - sweeps/qwen2.5-7b.toml alone (the last run of the models stage): results/models/
#   fully-sharded - sweeps/llama-3.1-70b-tp4.toml at rank 16 with --fully-sharded-loras: results/models/
#   padding - sweeps/padding.toml at --rank 64, 128 (rank-8 adapters padded, and +unpadded) and at rank 8: results/padding/
#   gpus   - sweeps/backends.toml on GPU 0 alone, then over GPUs 0,1 (--executor local, and --executor dask on a
#            LocalCluster of the two), each timed from process start; the two-GPU runs' winners per (kernels, max_loras, c)
#            compared with the one-GPU run's, and lorabench compare on the points both measured on one GPU: results/gpus/
#   adapters - sweeps/adapters.toml (200 adapters, max_loras 4..64, residency runs under uniform, zipf:1, zipf:1.2),
#            then lorabench recommend --adapters 200 per workload: results/adapters/
#   loads  - what loading one adapter costs: llama-2-7b and llama-3.1-8b at ranks 16 and 64 (small sweeps whose
#            workers time 30 loads each): results/loads/
#   tune-gpus - the same tune (TUNE_KERNELS, default triton,fused) on GPU 0 alone, then over GPUs 0,1 (--gpus 0,1) and on a
#            Dask LocalCluster of the two, each timed from process start, into results/tune-gpus/{one,local,dask};
#            the shapes each tuned, and how many of them chose one GPU's config
#   moe-smoke - the MoE kernels' tests and 2-layer sweeps of qwen3-30b-a3b and mixtral-8x7b, triton vs vllm
#   moe-qwen3, moe-mixtral - sweeps/moe-qwen3.toml, sweeps/moe-mixtral.toml (all layers; MOE_LORAS picks one
#            max_loras, MOE_ARGS adds sweep options, STAGE_TIMEOUT stops it resumably): results/moe/
#   moe-shared-check - Qwen3-30B-A3B at 4 slots, c = 1, 8, 64, with each layer's own expert weights and with
#            --share-expert-weights, then lorabench compare of the two on the same GPU: results/moe/shared-check/
#            (MOE_ARGS="--share-expert-weights" then times 16 slots and Mixtral-8x7B on an 80 GB card)
#   moe-bench - scripts/moe_lora_bench.py on qwen3-30b-a3b and mixtral-8x7b at MB_LORAS (default 16) slots: lorabench's
#            paths (the sorted path's expand grouped to 512 programs (its default), 2048, and one per tile; its blocks walked by 132) at pow2's and max's launch counts vs vLLM's
#            fused_moe_lora, one base token in every batch (MB_POINTS tokens:active[:launch]), the per-entry path's K loop
#            in other steps, warps and grid sizes (MB_PER_ENTRY A_ELEMENTS:WARPS[:PROGRAMS],...; default: 2^20 programs, i.e. up to 16 an entry at any count, then 264 and 528), MB_ARGS more options (e.g. --with-gemm: each
#            after its grouped GEMM, beside the GEMM alone and the expert LoRA inside it): $OUT/bench-<model>.json
#   gemm-bench - scripts/gemm_bench.py: the gemm backend's base GEMM vs cuBLAS at llama-2-7b's and Llama-3.1-8B's linears
#            (decode and prefill token counts, a grid of tilings at GB_GRID), and each linear's LoRA overhead, triton vs gemm
#   gemm-sweep - sweeps/gemm.toml (GS_ARGS adds sweep options, STAGE_TIMEOUT stops it resumably): results/gemm/
#   mixed-tests - the mixed steps' tests alone (attention with context in 16 bit, PIECEWISE graphs, prefill sweeps): a minute
#   prefill-check - lorabench check of PIECEWISE graphs (lorabench's and vLLM's rules, max and pow2) on 2 layers of
#            Llama-3.1-8B, fp16 (in bf16 a 2-layer update is too small for a pass to mean anything)
#   prefill - sweeps/prefill.toml (PF_ARGS adds sweep options, STAGE_TIMEOUT stops it resumably; on a warm machine the
#            stage resumes the run a stopped call left), reported: results/prefill/
#   serving - sweeps/serving.toml (SV_ARGS adds sweep options, STAGE_TIMEOUT stops it; resumed as prefill), reported: results/serving/
#   serving-ranges - sweeps/serving-ranges.toml (request lengths drawn from ranges), as serving: results/serving-ranges/
#   moe-adapters - sweeps/moe-adapters.toml (Qwen3-30B-A3B, 64 adapters), then recommend --adapters 64: results/moe-adapters/
#   load-paths - every load path (per-slice, one-copy, pageable, overlapped, storage cold/warm) and the host link, for
#            Llama-3.1-8B with 4 PEFT adapters (scripts/peft_adapters.py) at each rank of LP_RANKS (16 64 128): results/load-paths/
#   peft-residency - 64 PEFT adapters of Llama-3.1-8B (ranks 8-64, all or attention targets) in PEFT_ROOT, residency runs
#            at --max-cpu-loras 16 (misses read their files) per load path (PR_PATHS), then recommend with that cache
#            and with the cache chosen: results/peft-residency/<path>/
#   report - lorabench report on every run made here; all runs are packed into $OUT/runs.tgz
# vLLM's Python files: .vllm-bundle/ beside this checkout (scripts/vllm-bundle.sh packs it), unpacked here when present.
# Dask's wheels: .dask-wheels/ beside this checkout (scripts/dask-wheels.sh downloads them), installed here when present.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
pack() { tar czf "$OUT/runs.tgz" results/*/ 2>/dev/null || true; }  # what finished, should the call be cut short
log() { echo "== $(date +%T) $*" | tee -a "$OUT/stages.log"; }
# The sweep's arguments for spec $2 into folder $1 (then $3...: more options), or, where a stopped call
# left a run there unfinished (run.json's status not "finished"), those resuming it: on a machine
# still warm a stage goes on with its run instead of starting again.
sweep_args() {
  local dir=$1 spec=$2 r run=; shift 2
  for r in "$dir"/2*/; do [ -f "$r/run.json" ] && ! grep -q '"status": "finished"' "$r/run.json" && run=${r%/}; done
  if [ -n "$run" ]; then echo "--resume $run"; else echo "--spec $spec $* --out $dir"; fi
}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv \
  | tee -a "$OUT/stages.log"
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/install.log" 2>&1 \
  || { log "install failed"; tail -5 "$OUT/install.log"; exit 1; }
if [ -d .vllm-bundle ]; then  # unpack as the bundle's header says
  mkdir -p /tmp/vllm-site && tar xzf .vllm-bundle/vllm-py.tgz -C /tmp/vllm-site \
    && python3 -m pip install -q --no-index --no-deps --target /tmp/vllm-site .vllm-bundle/*.whl >>"$OUT/install.log" 2>&1
  export PYTHONPATH=/tmp/vllm-site:$PWD/.vllm-bundle${PYTHONPATH:+:$PYTHONPATH}
fi
if [ -d .dask-wheels ]; then  # --executor dask without a package index
  python3 -m pip install -q --no-index --no-deps --target /tmp/dask-site .dask-wheels/*.whl >>"$OUT/install.log" 2>&1
  export PYTHONPATH=/tmp/dask-site${PYTHONPATH:+:$PYTHONPATH}
fi
for stage in "$@"; do
  t0=$SECONDS
  case "$stage" in
    tests) LOG="$OUT/gpu-tests.log" scripts/gpu-tests.sh 2>&1 | tail -n 40 | tee -a "$OUT/stages.log" ;;
    profile) python3 scripts/profile_step.py 2>&1 | tee -a "$OUT/profile.log" ;;
    eager-host) python3 scripts/eager_host.py --tokens "${EH_TOKENS:-512,2048,8192}" ${EH_ARGS:-} 2>&1 | tee -a "$OUT/eager-host.log" ;;
    card-check) lorabench sweep --spec sweeps/kernels-card.toml --kernels triton,vllm --strategy max,pow2 --concurrency 1,8 \
                  --tuned results/tuned --out results 2>&1 | tail -n 4 | tee -a "$OUT/stages.log" ;;
    linear-bench)
      tuned=(); [ -d results/tuned-h200 ] && tuned=(--tuned results/tuned-h200)
      vars=(); [ -n "${LB_VARIANTS:-}" ] && vars=(--variants "$LB_VARIANTS")
      python3 scripts/linear_bench.py --max-loras "${LB_LORAS:-4}" --points "${LB_POINTS:-1:1,8:4}" "${tuned[@]}" "${vars[@]}" \
        --json "$OUT/linear-bench-$SECONDS.json" 2>&1 | tee -a "$OUT/linear-bench.log" ;;
    shrink-grid) python3 scripts/shrink_grid.py --json "$OUT/shrink-grid.json" 2>&1 | tee -a "$OUT/shrink-grid.log" ;;
    mixed-tests) python3 -m pytest -q -x -p no:cacheprovider tests/test_mixed_attention.py tests/test_mixed_steps.py \
                   tests/test_piecewise_graphs.py tests/test_prefill_sweep.py 2>&1 | tail -n 15 | tee -a "$OUT/stages.log" \
                   || { log "mixed-tests failed: the stages after it would measure a broken step"; exit 1; } ;;
    kernel-tests) python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels.py tests/test_graphs.py tests/test_check.py \
                    -k "${TESTS_K:-fused or agnostic}" 2>&1 | tail -n 15 | tee -a "$OUT/stages.log" ;;
    kernels-32|kernels-128)
      kern=(); [ -n "${SWEEP_KERNELS:-}" ] && kern=(--kernels "$SWEEP_KERNELS")
      timeout -s INT -k 30 "${STAGE_TIMEOUT:-3000}" lorabench sweep --spec "sweeps/$stage.toml" "${kern[@]}" --out results 2>&1 | tail -n 4 | tee -a "$OUT/stages.log" ;;
    kernels-card)  # with the tune stage's configs when it ran on this machine (fused+tuned, vllm+tuned)
      tuned=(); [ -d results/tuned-h200 ] && tuned=(--tuned results/tuned-h200)
      kern=(); [ -n "${SWEEP_KERNELS:-}" ] && kern=(--kernels "$SWEEP_KERNELS")
      timeout -s INT -k 30 "${STAGE_TIMEOUT:-3000}" lorabench sweep --spec sweeps/kernels-card.toml "${tuned[@]}" "${kern[@]}" --out results 2>&1 | tail -n 4 | tee -a "$OUT/stages.log" ;;
    tune) lorabench tune --kernels "${TUNE_KERNELS:-triton,fused,gemm,vllm}" --tokens "${TUNE_TOKENS:-1,8,32}" --max-loras "${TUNE_LORAS:-4,32}" --budget-s "${TUNE_BUDGET_S:-150}" \
            --out results/tuned-h200 2>&1 | tail -n 60 | tee -a "$OUT/tune.log" ;;
    smoke|card|wide|slots|backends) lorabench sweep --spec "sweeps/$stage.toml" --out results 2>&1 | tee -a "$OUT/stages.log" ;;
    card-vllm) lorabench sweep --spec sweeps/card.toml --kernels triton,vllm --out results 2>&1 | tee -a "$OUT/stages.log" ;;
    backends-4-32) lorabench sweep --spec sweeps/backends.toml --max-loras 4,32 --out results 2>&1 | tee -a "$OUT/stages.log" ;;
    backends-128) lorabench sweep --spec sweeps/backends.toml --max-loras 128 --out results 2>&1 | tee -a "$OUT/stages.log" ;;
    parity) python3 scripts/vllm_parity.py --json "$OUT/parity.json" 2>&1 | tee -a "$OUT/parity.log" ;;
    auto-card|auto-32)
      toml=sweeps/${stage#auto-}.toml; [ "$stage" = auto-32 ] && toml=sweeps/auto-32.toml
      lorabench sweep --spec "$toml" --workload uniform,zipf:1.2,base:0.5 --out results 2>&1 | tail -n 3 | tee -a "$OUT/stages.log"
      src=$(ls -td results/2*/ | head -1)
      for w in uniform zipf:1.2 base:0.5; do
        lorabench sweep --spec "$toml" --strategy auto --auto-from "$src" --workload "$w" --out results 2>&1 | tail -n 3 | tee -a "$OUT/stages.log"
      done
      below=$(python3 -c "import pandas as p; d=p.read_parquet('$src/points.parquet'); print(d[d.strategy=='dense'].graph_mem_bytes.dropna().iloc[0] / 2**20 - 1)")
      lorabench sweep --spec "$toml" --strategy auto --auto-from "$src" --workload uniform --graph-memory-budget "$below" --out results 2>&1 | tail -n 3 | tee -a "$OUT/stages.log" ;;
    auto-budget)  # a budget that excludes pow2 (and dense), with max and pow2 measured in the same run
      below=$(python3 -c "import pandas as p; d=p.read_parquet('results/auto/32/points.parquet'); print(d[d.strategy=='pow2'].graph_mem_bytes.dropna().iloc[0] / 2**20 - 1)")
      lorabench sweep --spec sweeps/auto-32.toml --strategy auto,max,pow2 --auto-from results/auto/32 --workload uniform --graph-memory-budget "$below" --out results 2>&1 | tail -n 3 | tee -a "$OUT/stages.log" ;;
    bf16-grid) python3 scripts/bf16_error_grid.py 2>&1 | tee -a "$OUT/bf16-grid.log" | tail -n 12 | tee -a "$OUT/stages.log" ;;
    first-run)
      /usr/bin/time -f "sweep wall %e s" lorabench sweep --max-loras 4 --concurrency 1,2,4,8 2>&1 | tail -n 4 | tee -a "$OUT/stages.log"
      /usr/bin/time -f "report wall %e s" lorabench report 2>&1 | tail -n 2 | tee -a "$OUT/stages.log" ;;
    resume)
      for sig in TERM KILL; do
        lorabench sweep --spec sweeps/card.toml --out results >"$OUT/resume-$sig.log" 2>&1 &
        pid=$!; sleep "${RESUME_AFTER:-25}"; kill -s "$sig" "$pid"; wait "$pid"; echo "sweep after SIG$sig: rc=$?" | tee -a "$OUT/stages.log"
        sleep 2; run=$(ls -td results/2*/ | head -1)
        echo "workers left: $(pgrep -fc lorabench.runtime.worker)" | tee -a "$OUT/stages.log"
        /usr/bin/time -f "resume wall %e s" lorabench sweep --resume "$run" 2>&1 | tail -n 4 | tee -a "$OUT/stages.log"
        python3 -c "
import json, sys, pandas as pd
run = sys.argv[1]; info = json.load(open(run + 'run.json')); df = pd.read_parquet(run + 'points.parquet')
planned = {p['index'] for j in info['jobs'] for p in j['points']}
print(f'{run}: {info[\"status\"]}, resumes {[r[\"previous_status\"] for r in info[\"resumes\"]]}, rows {len(df)} ok {int((df.status == \"ok\").sum())} of {len(planned)} planned, same points: {set(df.point) == planned}')
" "$run" | tee -a "$OUT/stages.log"
      done ;;
    ci-target)  # the card sweep with and without --ci-target 0.3, each timed from process start to table
      /usr/bin/time -f "card wall %e s" lorabench sweep --spec sweeps/card.toml --out results/confidence 2>&1 | tail -n 3 | tee -a "$OUT/stages.log"
      /usr/bin/time -f "card --ci-target 0.3 wall %e s" lorabench sweep --spec sweeps/card.toml --ci-target 0.3 --out results/confidence 2>&1 | tail -n 3 | tee -a "$OUT/stages.log"
      tar czf "$OUT/confidence.tgz" results/confidence ;;
    confidence)  # the A/A, the A/Bs and --ci-target, into results/confidence/<run_id>
      for run in aa-1 aa-2; do
        /usr/bin/time -f "card ($run) wall %e s" lorabench sweep --spec sweeps/card.toml --out results/confidence 2>&1 | tail -n 3 | tee -a "$OUT/stages.log"
      done
      /usr/bin/time -f "card --ci-target 0.3 wall %e s" lorabench sweep --spec sweeps/card.toml --ci-target 0.3 --out results/confidence 2>&1 | tail -n 3 | tee -a "$OUT/stages.log"
      lorabench sweep --spec sweeps/card.toml --kernels triton,vllm --strategy max,pow2 --out results/confidence 2>&1 | tail -n 3 | tee -a "$OUT/stages.log"
      lorabench sweep --max-loras 128 --strategy max,pow2 --concurrency 1,2,4,8 --out results/confidence 2>&1 | tail -n 3 | tee -a "$OUT/stages.log"
      tar czf "$OUT/confidence.tgz" results/confidence ;;
    moe-smoke)  # the MoE path end to end at 2 layers of Qwen3-30B-A3B and Mixtral: the kernels' tests, then small sweeps
      python3 -m pytest -q -p no:cacheprovider -rfE tests/test_moe_kernels.py tests/test_moe_align.py >"$OUT/moe-tests.log" 2>&1
      grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/moe-tests.log" | tail -n 20 | tee -a "$OUT/stages.log"
      for m in qwen3-30b-a3b mixtral-8x7b; do
        lorabench sweep --model $m --layers 2 --max-loras 4 --concurrency 1,8,64 --strategy max,pow2 --kernels triton,vllm \
          --iters 10 --warmup 2 --context-len 128 --out results/moe-smoke 2>&1 | tail -n 30 | tee -a "$OUT/stages.log"
      done
      tar czf "$OUT/moe-smoke.tgz" results/moe-smoke ;;
    moe-qwen3 | moe-mixtral)  # sweeps/moe-*.toml: lorabench's expert LoRA vs vLLM's fused_moe_lora: results/moe/
      # One spec takes longer than a 10-minute call: MOE_LORAS (e.g. 4, then 16) splits it, STAGE_TIMEOUT stops
      # it with its finished rows kept; the next call resumes a run it left unfinished in results/moe/ (as prefill).
      # MOE_ARGS adds sweep options (e.g. "--concurrency 1,2,4,8,16 --active-counts 1,8,16").
      lor=; [ -n "${MOE_LORAS:-}" ] && lor="--max-loras $MOE_LORAS"
      /usr/bin/time -f "$stage wall %e s" timeout -s INT -k 30 "${STAGE_TIMEOUT:-3000}" lorabench sweep \
        $(sweep_args results/moe sweeps/$stage.toml $lor ${MOE_ARGS:-}) 2>&1 | tail -n 60 | tee -a "$OUT/stages.log"
      tar czf "$OUT/$stage.tgz" results/moe ;;
    moe-shared-check)  # --share-expert-weights against each layer's own experts on one GPU (Qwen3-30B-A3B, 4 slots, where
      # both fit 80 GB): whether one set of expert weights read by every layer times a step as its own would
      d=results/moe/shared-check
      for w in own shared; do
        extra=; [ "$w" = shared ] && extra=--share-expert-weights
        timeout -s INT -k 30 "${STAGE_TIMEOUT:-3000}" lorabench sweep --spec sweeps/moe-qwen3.toml --max-loras 4 \
          --concurrency 1,8,64 --active-counts 0,1,4 --strategy pow2 --kernels triton,vllm $extra --out "$d/$w" 2>&1 \
          | tail -n 4 | tee -a "$OUT/stages.log"
      done
      lorabench compare "$d"/own/2* "$d"/shared/2* 2>&1 | tail -n 40 | tee -a "$OUT/stages.log"
      tar czf "$OUT/$stage.tgz" "$d" ;;
    moe-bench)  # the expert LoRA alone: which path, which expand grouping, and vLLM's specialised sorted path's check
      l=${MB_LORAS:-16}; points="2:1,2:1:$l,8:4,8:4:$l,64:$l"  # every point fits l >= 4
      [ "$l" -ge 16 ] && points="2:1,2:1:$l,8:4,8:4:$l,32:8,32:8:$l,64:16"
      for m in qwen3-30b-a3b mixtral-8x7b; do
        python3 scripts/moe_lora_bench.py --model "$m" --max-loras "$l" \
          --points "${MB_POINTS:-$points}" --expand-programs 2048 --block-programs 132 --base-tokens 1 \
          --per-entry "${MB_PER_ENTRY:-32768:8:1048576,32768:8:264,32768:8:528}" ${MB_ARGS:-} \
          --json "$OUT/bench-$m.json" 2>&1 | tee -a "$OUT/moe-bench.log"
      done ;;
    gemm-bench)  # the gemm backend's base GEMM vs cuBLAS per shape (a grid of tilings at GB_GRID), each linear's LoRA overhead
      timeout -s INT "${STAGE_TIMEOUT:-3000}" python3 scripts/gemm_bench.py --grid "${GB_GRID-1,32,2048}" ${GB_ARGS:-} \
        --json "$OUT/gemm-bench.json" 2>&1 | tee -a "$OUT/gemm-bench.log" | tail -n 80 ;;
    gemm-sweep)  # sweeps/gemm.toml: the gemm backend against the pair and vLLM's kernels in whole steps: results/gemm/
      /usr/bin/time -f "gemm-sweep wall %e s" timeout -s INT -k 30 "${STAGE_TIMEOUT:-3000}" lorabench sweep \
        --spec sweeps/gemm.toml ${GS_ARGS:-} --out results/gemm 2>&1 | tail -n 40 | tee -a "$OUT/stages.log"
      tar czf "$OUT/gemm.tgz" results/gemm ;;
    prefill-check)  # the check alone of PIECEWISE graphs, lorabench's and vLLM's rules (default and specialised), 2 layers
      timeout -s INT -k 30 "${STAGE_TIMEOUT:-3000}" lorabench check --kernels triton,vllm --strategy max,pow2 --max-loras 4 \
        --model llama-3.1-8b --layers 2 --capture-sizes 1,2,4 --mixed-capture-sizes 4,8,16 --dtype float16 \
        --out results/prefill 2>&1 | tail -n 40 | tee -a "$OUT/stages.log" ;;
    prefill)  # sweeps/prefill.toml: LoRA overhead at 128..8192 prompt tokens, lorabench's kernels and vLLM's: results/prefill/
      /usr/bin/time -f "prefill wall %e s" timeout -s INT -k 30 "${STAGE_TIMEOUT:-3000}" lorabench sweep \
        $(sweep_args results/prefill sweeps/prefill.toml ${PF_ARGS:-}) 2>&1 | tail -n 40 | tee -a "$OUT/stages.log"
      for run in results/prefill/2*/; do lorabench report "$run" >/dev/null 2>&1; done
      tar czf "$OUT/prefill.tgz" results/prefill ;;
    serving|serving-ranges)  # sweeps/$stage.toml: TTFT, ITL and tokens/s of a loop with prompts, lorabench's kernels and vLLM's: results/$stage/
      /usr/bin/time -f "$stage wall %e s" timeout -s INT -k 30 "${STAGE_TIMEOUT:-3000}" lorabench sweep \
        $(sweep_args results/$stage sweeps/$stage.toml ${SV_ARGS:-}) 2>&1 | tail -n 40 | tee -a "$OUT/stages.log"
      for run in results/$stage/2*/; do lorabench report "$run" >/dev/null 2>&1; done
      tar czf "$OUT/$stage.tgz" results/$stage ;;
    moe-adapters)  # how many expert-LoRA slots for 64 adapters of Qwen3-30B-A3B: results/moe-adapters/
      /usr/bin/time -f "moe-adapters wall %e s" timeout -s INT -k 30 "${STAGE_TIMEOUT:-3000}" lorabench sweep \
        --spec sweeps/moe-adapters.toml --out results/moe-adapters 2>&1 | tail -n 12 | tee -a "$OUT/stages.log"
      run=$(ls -td results/moe-adapters/2*/ | head -1)
      lorabench recommend "$run" --adapters 64 --workload zipf:1 2>&1 | tee -a "$OUT/recommend.log" | tail -n 16 \
        | tee -a "$OUT/stages.log"
      tar czf "$OUT/moe-adapters.tgz" results/moe-adapters ;;
    models)  # real models' configs at the card's points, triton vs vLLM, ranks 16, 64, 128: results/models/
      for rank in 16 64 128; do
        for spec in llama-3.1-8b llama-3.1-70b-tp4; do
          /usr/bin/time -f "$spec rank $rank wall %e s" lorabench sweep --spec sweeps/$spec.toml --rank $rank \
            --out results/models 2>&1 | tail -n 3 | tee -a "$OUT/stages.log"; pack
        done
      done
      lorabench sweep --spec sweeps/qwen2.5-7b.toml --out results/models 2>&1 | tail -n 3 | tee -a "$OUT/stages.log"; pack
      tar czf "$OUT/models.tgz" results/models ;;
    fully-sharded) lorabench sweep --spec sweeps/llama-3.1-70b-tp4.toml --rank 16 --fully-sharded-loras --out results/models 2>&1 \
                     | tail -n 3 | tee -a "$OUT/stages.log" ;;
    qwen) lorabench sweep --spec sweeps/qwen2.5-7b.toml --out results/models 2>&1 | tail -n 3 | tee -a "$OUT/stages.log" ;;
    padding)  # rank-8 adapters padded to 64 and 128 (triton, vllm) vs at their own rank (triton+unpadded), and a rank-8 run
      for rank in 64 128; do
        lorabench sweep --spec sweeps/padding.toml --rank $rank --out results/padding 2>&1 | tail -n 3 | tee -a "$OUT/stages.log"; pack
      done
      lorabench sweep --spec sweeps/padding.toml --rank 8 --out results/padding 2>&1 | tail -n 3 | tee -a "$OUT/stages.log"
      tar czf "$OUT/padding.tgz" results/padding ;;
    gpus)  # one GPU against two: wall time from process start, and the same verdicts
      for how in "one:--gpus 0" "local:--executor local --gpus 0,1" "dask:--executor dask --gpus 0,1"; do
        name=${how%%:*}
        # shellcheck disable=SC2086
        /usr/bin/time -f "backends on $name wall %e s" lorabench sweep --spec sweeps/backends.toml ${how#*:} --out "results/gpus/$name" \
          2>&1 | tail -n 3 | tee -a "$OUT/stages.log"; pack
      done
      one=$(ls -td results/gpus/one/2*/ | head -1)
      for name in local dask; do
        two=$(ls -td "results/gpus/$name"/2*/ | head -1)
        python3 - "$one" "$two" <<'PY' 2>&1 | tee -a "$OUT/stages.log"
import sys
import pandas as pd
def winners(run):
    d = pd.read_parquet(run + "points.parquet")
    d = d[(d.status == "ok") & (d["mode"] == "workload")]
    return d.loc[d.groupby(["kernels", "max_loras", "concurrency"]).step_ms_median.idxmin()].set_index(
        ["kernels", "max_loras", "concurrency"]).strategy, d.groupby(["kernels", "max_loras"]).gpu_uuid.nunique().max()
(a, _), (b, per_group) = winners(sys.argv[1]), winners(sys.argv[2])
same = (a == b.reindex(a.index))
print(f"{sys.argv[2]}: the same winner as on one GPU at {int(same.sum())} of {len(a)} (kernels, max_loras, c); "
      f"GPUs per group: {per_group}; GPUs in the run: {pd.read_parquet(sys.argv[2] + 'points.parquet').gpu_uuid.nunique()}")
for key in a.index[~same]:
    print(f"  differs at {key}: one GPU {a[key]}, two GPUs {b.get(key)}")
PY
        lorabench compare "$one" "$two" 2>&1 | tail -n 6 | tee -a "$OUT/stages.log"
      done
      tar czf "$OUT/gpus.tgz" results/gpus ;;
    tune-gpus)
      for how in "one:--gpus 0" "local:--gpus 0,1" "dask:--executor dask --gpus 0,1"; do
        name=${how%%:*}
        # shellcheck disable=SC2086
        /usr/bin/time -f "tune on $name wall %e s" lorabench tune --kernels "${TUNE_KERNELS:-triton,fused}" --tokens 1,8,32 \
          --max-loras 4,32 --budget-s "${TUNE_BUDGET_S:-120}" --fresh ${how#*:} --out "results/tune-gpus/$name" 2>&1 | tail -n 3 | tee -a "$OUT/stages.log"
      done
      python3 - <<'PY' 2>&1 | tee -a "$OUT/stages.log"
import json
tables = {n: {(e["kernel"], e["op"], tuple(e["shape"])): e["config"]
              for e in json.load(open(f"results/tune-gpus/{n}/lorabench_tuned.json"))["entries"]} for n in ("one", "local", "dask")}
for n, t in tables.items():
    same = sum(t.get(k) == c for k, c in tables["one"].items())
    print(f"{n}: {len(t)} tuned shapes; {same} of one GPU's {len(tables['one'])} with the same config")
PY
      tar czf "$OUT/tune-gpus.tgz" results/tune-gpus ;;
    adapters)
      /usr/bin/time -f "adapters wall %e s" timeout -s INT -k 30 "${STAGE_TIMEOUT:-3000}" lorabench sweep --spec sweeps/adapters.toml \
        --out results/adapters 2>&1 | tail -n 12 | tee -a "$OUT/stages.log"; pack
      run=$(ls -td results/adapters/2*/ | head -1)
      for w in uniform zipf:1 zipf:1.2; do
        lorabench recommend "$run" --adapters 200 --workload "$w" 2>&1 | tee -a "$OUT/recommend.log" | tail -n 12 | tee -a "$OUT/stages.log"
      done
      tar czf "$OUT/adapters.tgz" results/adapters ;;
    load-paths)  # every load path per adapter size: Llama-3.1-8B, 4 PEFT adapters (all targets) at each of LP_RANKS
      for rank in ${LP_RANKS:-16 64 128}; do
        dir=${PEFT_ROOT:-/tmp/peft}/r$rank
        python3 scripts/peft_adapters.py "$dir" --model llama-3.1-8b --count 4 --ranks "$rank" --targets all 2>&1 | tail -n 1 \
          | tee -a "$OUT/stages.log"
        lorabench sweep --model llama-3.1-8b --rank "$rank" --max-loras 4 --concurrency 1 --strategy max --iters 20 --no-check \
          --adapters "$dir" --out results/load-paths 2>&1 | tail -n 2 | tee -a "$OUT/stages.log"
        rm -rf "$dir"
      done
      python3 - <<'PY' 2>&1 | tee -a "$OUT/stages.log"
import glob
import pandas as pd
for run in sorted(glob.glob("results/load-paths/2*/")):
    r = pd.read_parquet(run + "points.parquet").iloc[0]
    bound = r.lora_bytes_per_slot / (r.host_link_gb_s_median * 1e6)
    print(f"{run}: rank {r['rank']}, {r.lora_bytes_per_slot / 2**20:.0f} MiB, link {r.host_link_gb_s_median:.1f} GB/s "
          f"(bound {bound:.2f} ms): per-slice {r.load_alone_ms_median:.2f} ms alone / {r.load_ms_median:.2f} in a step, "
          f"one-copy {r.load_one_copy_alone_ms_median:.2f} / {r.load_one_copy_ms_median:.2f}, pageable "
          f"{r.load_pageable_alone_ms_median:.2f}, overlapped usable {r.load_overlap_usable_ms_median:.2f} lost "
          f"{r.load_overlap_lost_ms_median:.3f}, storage cold {r.storage_read_cold_ms_median:.1f} warm "
          f"{r.storage_read_warm_ms_median:.1f} ({r.storage_fs}); best/bound "
          f"{min(r.load_alone_ms_median, r.load_one_copy_alone_ms_median) / bound:.2f}")
PY
      tar czf "$OUT/load-paths.tgz" results/load-paths ;;
    peft-residency)  # 64 PEFT adapters (ranks 8-64, all or attention targets), CPU cache 16, per load path; recommend
      dir=${PEFT_ROOT:-/tmp/peft}/64
      [ -d "$dir" ] || python3 scripts/peft_adapters.py "$dir" --model llama-3.1-8b --count 64 --ranks 8,16,32,64 \
        --targets all,attention 2>&1 | tail -n 1 | tee -a "$OUT/stages.log"
      for path in ${PR_PATHS:-per-slice one-copy}; do
        /usr/bin/time -f "peft-residency $path wall %e s" timeout -s INT -k 30 "${STAGE_TIMEOUT:-3000}" lorabench sweep \
          --model llama-3.1-8b --rank 64 --adapters "$dir" --max-cpu-loras 16 --max-loras "${PR_LORAS:-8}" \
          --concurrency 4,8,16 --strategy max --workload zipf:1 --output-tokens 64 --iters "${PR_ITERS:-200}" \
          --load-path "$path" --no-check --out "results/peft-residency/$path" 2>&1 | tail -n 3 | tee -a "$OUT/stages.log"
        run=$(ls -td results/peft-residency/$path/2*/ | head -1)
        lorabench report "$run" 2>&1 | tail -n 1 | tee -a "$OUT/stages.log"
        grep -A6 "Residency runs: measured against predicted" "$run/report.md" | tee -a "$OUT/stages.log"
        lorabench recommend "$run" --adapters "$dir" --workload zipf:1 --max-cpu-loras 16 --output-tokens 64 2>&1 \
          | tee -a "$OUT/recommend.log" | tail -n 14 | tee -a "$OUT/stages.log"
        lorabench recommend "$run" --adapters "$dir" --workload zipf:1 --output-tokens 64 2>&1 \
          | tee -a "$OUT/recommend.log" | tail -n 16 | tee -a "$OUT/stages.log"
      done
      tar czf "$OUT/peft-residency.tgz" results/peft-residency ;;
    loads)
      for model in llama-2-7b llama-3.1-8b; do
        for rank in 16 64; do
          lorabench sweep --model $model --rank $rank --max-loras 4 --concurrency 1 --strategy max --iters 20 --no-check \
            --out results/loads 2>&1 | tail -n 2 | tee -a "$OUT/stages.log"
        done
      done
      python3 - <<'PY' 2>&1 | tee -a "$OUT/stages.log"
import glob
import pandas as pd
for run in sorted(glob.glob("results/loads/2*/")):
    r = pd.read_parquet(run + "points.parquet").iloc[0]
    print(f"{run}: {r.model} rank {r['rank']}: load in a step {r.load_ms_median:.3f} ms ({r.load_ms_ci_low:.3f}..{r.load_ms_ci_high:.3f}), "
          f"alone {r.load_alone_ms_median:.3f} ms, {r.lora_bytes_per_slot / 2**20:.0f} MiB, "
          f"{r.lora_bytes_per_slot / r.load_alone_ms_median / 1e6:.1f} GB/s, host {r.load_host_us_median:.0f} us, {r.load_ops} ops")
PY
      tar czf "$OUT/loads.tgz" results/loads ;;
    report) for r in results/2*/ results/models/2*/ results/padding/2*/ results/adapters/2*/; do [ -d "$r" ] || continue; lorabench report "$r" 2>&1 | tail -n 2 | tee -a "$OUT/stages.log"; done ;;
    *) log "unknown stage $stage"; exit 2 ;;
  esac
  log "$stage: rc=${PIPESTATUS[0]} wall $((SECONDS - t0)) s"
  pack
done
