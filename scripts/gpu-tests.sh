#!/usr/bin/env bash
# The whole test suite on a GPU machine without a package index, and its counts.
#
#   scripts/gpu-tests.sh [PYTEST ARGS...]          (from the repository's root)
#
# Installs lorabench from this checkout without fetching anything (torch, Triton, pandas, ... must
# be there), puts vLLM's files on the path when .vllm-bundle/ is present (scripts/vllm-bundle.sh
# makes it; without it the vllm backend's tests skip), runs pytest, and ends with one line:
# "gpu tests: N passed, N failed, N skipped, N errors (GPU name)". Exit status: pytest's.
# LOG=path keeps pytest's whole output (default: gpu-tests.log).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
log=${LOG:-gpu-tests.log}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$log.install" 2>&1 \
  || { echo "install failed:"; tail -5 "$log.install"; exit 1; }
if [ -d .vllm-bundle ]; then
  site=${VLLM_SITE:-/tmp/vllm-site}
  mkdir -p "$site" && tar xzf .vllm-bundle/vllm-py.tgz -C "$site" \
    && python3 -m pip install -q --no-index --no-deps --target "$site" .vllm-bundle/*.whl >>"$log.install" 2>&1
  export PYTHONPATH=$site:$PWD/.vllm-bundle${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pytest -q -p no:cacheprovider -rfEs --durations=10 tests "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
summary=$(tail -n 1 "$log")
count() { echo "$summary" | grep -oE "[0-9]+ $1" | grep -oE "[0-9]+" || echo 0; }
echo "gpu tests: $(count passed) passed, $(count failed) failed, $(count skipped) skipped, $(count error) errors (${gpu:-no GPU found})"
exit "$rc"
