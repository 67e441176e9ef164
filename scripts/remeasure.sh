#!/usr/bin/env bash
# Measures again, with today's code, the committed runs BENCHMARKS.md and the README quote, each
# with the command it was first made with (results/README.md), into results/remeasure/<name>/.
# Each sweep is timed from process start to exit; then `lorabench report` makes its tables.
# Usage on a GPU machine (after scripts/h200.sh's install, or with lorabench installed):
#   OUT=/tmp/out scripts/remeasure.sh card many-slots agnostic-card agnostic-128 vllm vllm-32 auto-card auto-32 resume
# Runs land in results/remeasure/<name>/<run id>/; $OUT/remeasure.log has every wall time and the
# sweeps' last lines; $OUT/remeasure-<first name>.tgz packs the folders made by this call.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" results/remeasure
log() { echo "== $(date +%T) $*" | tee -a "$OUT/remeasure.log"; }
newest() { ls -td "$1"/2*/ | head -1; }

# sweep NAME ARGS...: one timed sweep into results/remeasure/NAME/<run id>, then its report.
sweep() {
  local name=$1; shift
  local t0; t0=$(date +%s.%N)
  lorabench sweep "$@" --out "results/remeasure/$name" 2>&1 | tail -n 4 | tee -a "$OUT/remeasure.log"
  local rc=${PIPESTATUS[0]}
  log "$name: rc=$rc wall $(python3 -c "import time; print(f'{time.time() - $t0:.1f}')") s: lorabench sweep $*"
  lorabench report "$(newest "results/remeasure/$name")" 2>&1 | tail -n 1 | tee -a "$OUT/remeasure.log"
}

# auto SOURCE_TOML NAME: the source sweep, one auto sweep per workload priced from it, and one
# under a graph-memory budget just below what dense took (results/auto/README.md).
auto() {
  local toml=$1 name=$2
  sweep "$name" --spec "$toml" --workload uniform,zipf:1.2,base:0.5
  local src; src=$(newest "results/remeasure/$name")
  for w in uniform zipf:1.2 base:0.5; do
    sweep "$name-${w%%:*}" --spec "$toml" --strategy auto --auto-from "$src" --workload "$w"
  done
  local below
  below=$(python3 -c "import pandas as p; d=p.read_parquet('$src/points.parquet'); print(d[d.strategy=='dense'].graph_mem_bytes.dropna().iloc[0] / 2**20 - 1)")
  sweep "$name-budget" --spec "$toml" --strategy auto --auto-from "$src" --workload uniform --graph-memory-budget "$below"
}

first=${1:-none}
for stage in "$@"; do
  case "$stage" in
    card) sweep card --spec sweeps/card.toml ;;
    many-slots) sweep many-slots --spec sweeps/slots.toml ;;
    agnostic-card) sweep agnostic-card --spec sweeps/kernels-card.toml --kernels triton ;;
    agnostic-128) sweep agnostic-128 --spec sweeps/kernels-128.toml --kernels triton ;;
    vllm) sweep vllm --spec sweeps/kernels-card.toml --kernels triton,vllm --strategy max,pow2 --concurrency 1,8 --tuned results/tuned ;;
    vllm-32) sweep vllm-32 --spec sweeps/kernels-32.toml --kernels triton,vllm ;;
    auto-card) auto sweeps/card.toml auto-card ;;
    auto-32) auto sweeps/auto-32.toml auto-32 ;;
    resume)  # the card sweep stopped by SIGTERM and by SIGKILL after RESUME_AFTER s, each resumed
      for sig in TERM KILL; do
        dir=results/remeasure/resume-sig${sig,,}
        lorabench sweep --spec sweeps/card.toml --out "$dir" >"$OUT/resume-$sig.log" 2>&1 &
        pid=$!; sleep "${RESUME_AFTER:-25}"; kill -s "$sig" "$pid"; wait "$pid"; log "sweep after SIG$sig: rc=$?"
        sleep 2; log "workers left: $(pgrep -fc lorabench.runtime.worker)"
        t0=$(date +%s.%N)
        lorabench sweep --resume "$(newest "$dir")" 2>&1 | tail -n 4 | tee -a "$OUT/remeasure.log"
        log "resume after SIG$sig: rc=${PIPESTATUS[0]} wall $(python3 -c "import time; print(f'{time.time() - $t0:.1f}')") s"
        lorabench report "$(newest "$dir")" 2>&1 | tail -n 1 | tee -a "$OUT/remeasure.log"
      done ;;
    *) log "unknown stage $stage"; exit 2 ;;
  esac
  tar czf "$OUT/remeasure-$first.tgz" results/remeasure
done
