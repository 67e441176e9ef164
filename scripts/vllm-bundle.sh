#!/usr/bin/env bash
# Packs vLLM's Python files for a GPU machine that has torch and Triton but no package index, so
# that `--kernels vllm` and vLLM's tests run there. vLLM's LoRA ops are Triton kernels called from
# Python: they need none of vLLM's compiled extensions, which are built for one torch release.
#
#   scripts/vllm-bundle.sh [DEST]      (here, with a package index; DEST defaults to .vllm-bundle)
#
# DEST gets vllm-py.tgz (vLLM's .py files, its dist-info and its tuned fused-MoE configs), the pyzmq wheel vLLM imports on the
# way, and a sitecustomize.py that registers empty stand-ins for vLLM's compiled modules. Keep DEST
# out of git (.vllm-bundle/ is ignored) and send it along; scripts/gpu-tests.sh and scripts/h200.sh
# unpack it when they find it. Env: VLLM_VERSION (default 0.33.0), PYTHON_TAG of the GPU machine's
# Python (default 3.12).
set -euo pipefail
version=${VLLM_VERSION:-0.33.0}
python_tag=${PYTHON_TAG:-3.12}
dest=${1:-.vllm-bundle}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$dest"
python3 -m pip download -q --no-deps --only-binary=:all: -d "$tmp/wheel" "vllm==$version"
python3 - "$tmp"/wheel/vllm-*.whl "$tmp/site" <<'PY'
import sys
import zipfile

wheel, site = sys.argv[1:3]
needed_third_party = {"vllm/third_party/__init__.py", "vllm/third_party/pynvml.py"}
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        moe_configs = name.startswith("vllm/model_executor/layers/fused_moe/configs/") and name.endswith(".json")
        if (name.endswith(".py") and "/third_party/" not in name) or ".dist-info/" in name or name in needed_third_party \
                or moe_configs:  # the tuned fused-MoE configs vLLM's expert LoRA derives its kernel configs from
            z.extract(name, site)
PY
tar czf "$dest/vllm-py.tgz" -C "$tmp/site" .
rm -f "$dest"/pyzmq-*.whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$python_tag" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dest" pyzmq
cat > "$dest/sitecustomize.py" <<'PY'
# vLLM's compiled extensions are built for one torch release; its LoRA Triton ops never call them.
import sys
import types

for name in ("vllm._C", "vllm._C_stable_libtorch", "vllm._moe_C_stable_libtorch"):
    sys.modules.setdefault(name, types.ModuleType(name))
PY
du -sh "$dest"/*
