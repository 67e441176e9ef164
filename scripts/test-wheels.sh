#!/usr/bin/env bash
# Downloads the wheels of the test extra (pytest, the notebook's papermill and ipykernel,
# import-linter, dask[distributed]) and everything they need, for a GPU machine without a package
# index, so that scripts/gpu-tests.sh runs the whole suite there, not only the tests its image
# happens to have packages for.
#
#   scripts/test-wheels.sh [DEST]      (here, with a package index; DEST defaults to .test-wheels)
#
# Keep DEST out of git (.test-wheels/ is ignored) and send it along (about 30 MB); gpu-tests.sh
# installs lorabench's test extra from it when it finds it, taking from DEST only what the
# machine's image lacks. Env: PYTHON_TAG of the GPU machine's Python (default 3.12).
set -euo pipefail
cd "$(dirname "$0")/.."
python_tag=${PYTHON_TAG:-3.12}
dest=${1:-.test-wheels}
extra=$(python3 - <<'PY'
import tomllib
with open("pyproject.toml", "rb") as f:
    print("\n".join(tomllib.load(f)["project"]["optional-dependencies"]["test"]))
PY
)
mkdir -p "$dest"
rm -f "$dest"/*.whl
mapfile -t requirements <<<"$extra"
python3 -m pip download -q --only-binary=:all: --python-version "$python_tag" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d "$dest" "${requirements[@]}"
# peft (the test extra's) pulls torch, its CUDA wheels and transformers (~3 GB): the GPU image has
# them (and numpy, sympy, networkx, the Hugging Face hub), so they stay behind and carry stays small.
# So do the packages that its torch, transformers, pandas, rich, typer and pytest need, and setuptools (the carry limit is 64 MiB).
for name in torch triton 'nvidia_*' numpy transformers tokenizers huggingface_hub hf_xet kernels \
  safetensors sympy mpmath networkx jinja2 markupsafe filelock fsspec packaging pyyaml regex requests certifi \
  charset_normalizer idna urllib3 tqdm pygments markdown_it_py mdurl rich click shellingham typer typing_extensions \
  python_dateutil tzdata pytest iniconfig pluggy setuptools; do
  rm -f "$dest"/$name-*.whl
done
echo "$(ls "$dest" | wc -l) wheels, $(du -sh "$dest" | cut -f1) in $dest"
