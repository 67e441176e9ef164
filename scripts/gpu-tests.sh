#!/usr/bin/env bash
# The whole test suite on a GPU machine without a package index, and its counts.
#
#   scripts/gpu-tests.sh [PYTEST ARGS...]          (from the repository's root)
#
# Installs lorabench from this checkout without fetching anything (torch, Triton, pandas, ... must
# be there), with its test extra from .test-wheels/ when present (scripts/test-wheels.sh makes it;
# without it the notebook's, the layer contracts' and Dask's tests skip), puts vLLM's files on the
# path when .vllm-bundle/ is present (scripts/vllm-bundle.sh makes it; without it the vllm
# backend's tests skip), runs pytest, and ends with one line:
# "gpu tests: N passed, N failed, N skipped, N errors (GPU name)". Exit status: pytest's.
# LOG=path keeps pytest's whole output (default: gpu-tests.log).
# PART=i/n runs the i-th of n parts of the test files (every n-th, largest first): the suite over n calls.
# FILES="tests/a.py tests/b.py" runs those test files alone (what a change touches, in one short call).
# SHARDS=N runs the test files in N pytest processes at once on the same GPU: the suite's tests
# share no state across files, and a GPU has room for several. With pytest-xdist (in the test
# extra) N workers take one file at a time as they free up (--dist loadfile); without it the
# files are dealt out largest first, round robin (each shard's output in LOG.<i>), and their counts
# added up. Each process's torch gets its share of the host's cores (OMP_NUM_THREADS), so that
# their CPU sweeps do not oversubscribe them (torch's CPU ops take every core by default).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
# Triton's compiled kernels kept in the checkout (ignored by git): a later call on the same warm machine (PART=2/2
# after 1/2) loads what an earlier one compiled instead of compiling it again. A cache hit needs the same source,
# options and compiler, so what runs is what would have been compiled.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton-cache}
log=${LOG:-gpu-tests.log}
shards=${SHARDS:-1}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
if [ -d .test-wheels ]; then  # the test extra too, from what the image lacks
  install=(--find-links .test-wheels -e '.[test]')
else  # without it, the tests of the notebook, the layer contracts and Dask skip
  install=(--no-deps -e .)
fi
if ! python3 -m pip install -q --no-build-isolation --no-index "${install[@]}" >"$log.install" 2>&1; then
  # a wheel the image was expected to have is missing: the suite runs without the test extra
  echo "test extra not installed (its tests skip): $(grep -m1 -iE 'error' "$log.install")"
  python3 -m pip install -q --no-build-isolation --no-index --no-deps -e . >>"$log.install" 2>&1 \
    || { echo "install failed:"; tail -5 "$log.install"; exit 1; }
fi
if [ -d .vllm-bundle ]; then
  site=${VLLM_SITE:-/tmp/vllm-site}
  mkdir -p "$site" && tar xzf .vllm-bundle/vllm-py.tgz -C "$site" \
    && python3 -m pip install -q --no-index --no-deps --target "$site" .vllm-bundle/*.whl >>"$log.install" 2>&1
  export PYTHONPATH=$site:$PWD/.vllm-bundle${PYTHONPATH:+:$PYTHONPATH}
fi
count() { grep -oE "[0-9]+ $1" <<<"$2" | grep -oE "[0-9]+" || echo 0; }
# The test files, the sm_90 compile test (minutes of Triton compiles) first, then the largest first;
# PART=i/n keeps every n-th of them from the i-th (1-based): the suite in n calls of a time-limited machine.
mapfile -t files < <(ls tests/test_compile_sm90.py; ls -S tests/test_*.py | grep -vx tests/test_compile_sm90.py)
if [ -n "${FILES:-}" ]; then  # the named files alone, in the order above
  for f in $FILES; do [ -f "$f" ] || { echo "FILES: no test file $f"; exit 2; }; done
  mapfile -t files < <(printf '%s\n' "${files[@]}" | grep -xF -f <(printf '%s\n' $FILES))
fi
part=${PART:-1/1}
if ! [[ $part =~ ^([0-9]+)/([0-9]+)$ ]] || [ "${BASH_REMATCH[1]}" -lt 1 ] || [ "${BASH_REMATCH[1]}" -gt "${BASH_REMATCH[2]}" ]; then
  echo "PART=$part: i/n with 1 <= i <= n (e.g. PART=1/2)"; exit 2
fi
mine=()
for ((j = BASH_REMATCH[1] - 1; j < ${#files[@]}; j += BASH_REMATCH[2])); do mine+=("${files[j]}"); done
files=("${mine[@]}")
[ "$part" = 1/1 ] || echo "part $part: ${#files[@]} test files"
if [ "$shards" -le 1 ]; then
  python3 -m pytest -q -p no:cacheprovider -rfEs --durations=10 "${files[@]}" "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  summary=$(tail -n 1 "$log")
  echo "gpu tests: $(count passed "$summary") passed, $(count failed "$summary") failed, $(count skipped "$summary") skipped, $(count error "$summary") errors (${gpu:-no GPU found}; part $part)"
  exit "$rc"
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / shards > 0 ? $(nproc) / shards : 1 ))}
if python3 -c "import xdist" 2>/dev/null; then  # fixed shards left some idle for minutes while one ran on
  # Workers take files in the order given (the compile test, then the largest), so that no long file starts last
  # and ends the run alone (a 600 s limit once cut it there).
  python3 -m pytest -q -p no:cacheprovider -rfEs --durations=30 -n "$shards" --dist loadfile "${files[@]}" "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  summary=$(tail -n 1 "$log")
  echo "gpu tests: $(count passed "$summary") passed, $(count failed "$summary") failed, $(count skipped "$summary") skipped, $(count error "$summary") errors (${gpu:-no GPU found}; $shards workers; part $part)"
  exit "$rc"
fi
# Without xdist: fixed shards. The sm_90 compile test is two processes of Triton compiles on the CPU: a shard of its own, started
# first, so that it never ends a GPU shard's run (with pytest arguments, which may deselect it, it is dealt out)
solo=tests/test_compile_sm90.py
[ $# -eq 0 ] && [ "${files[0]}" = "$solo" ] || solo=
[ -z "$solo" ] || files=("${files[@]:1}")
pids=()
# The shards' logs end up in LOG alone (one file to bring back), even when a time limit stops the run:
# a shard cut short has no summary line, and the counts below say so.
gather() { cat "$log".[0-9]* >"$log" 2>/dev/null && rm -f "$log".[0-9]*; }
trap 'kill "${pids[@]}" 2>/dev/null; wait; gather; echo "gpu tests: stopped before every shard ended (LOG has what ran)"; exit 143' TERM INT
if [ -n "$solo" ]; then
  python3 -m pytest -q -p no:cacheprovider -rfEs --durations=5 "$solo" "$@" >"$log.$shards" 2>&1 &
  pids+=($!)
fi
for ((i = 0; i < shards; i++)); do
  mine=()
  for ((j = i; j < ${#files[@]}; j += shards)); do mine+=("${files[j]}"); done
  python3 -m pytest -q -p no:cacheprovider -rfEs --durations=5 "${mine[@]}" "$@" >"$log.$i" 2>&1 &
  pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
passed=0 failed=0 skipped=0 errors=0
trap - TERM INT
last=$shards; [ -n "$solo" ] || last=$((shards - 1))
for ((i = 0; i <= last; i++)); do
  summary=$(tail -n 1 "$log.$i")
  grep -qE "(passed|failed|skipped|deselected|error).* in [0-9.]+s" <<<"$summary" || summary="cut short: no summary line"
  echo "shard $i: $summary"
  passed=$((passed + $(count passed "$summary"))); failed=$((failed + $(count failed "$summary")))
  skipped=$((skipped + $(count skipped "$summary"))); errors=$((errors + $(count error "$summary")))
done
gather
grep -E "^(FAILED|ERROR) " "$log" | head -n 40
echo "gpu tests: $passed passed, $failed failed, $skipped skipped, $errors errors (${gpu:-no GPU found}; $shards shards${solo:+ + the compile test}; part $part)"
exit "$rc"
