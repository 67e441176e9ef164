#!/usr/bin/env bash
# Downloads the wheels `--executor dask` needs beyond what a GPU machine's image has (dask,
# distributed and the packages distributed needs that such images lack: tornado, tblib, zict,
# partd, locket), for a GPU machine without a package index.
#
#   scripts/dask-wheels.sh [DEST]      (here, with a package index; DEST defaults to .dask-wheels)
#
# Keep DEST out of git (.dask-wheels/ is ignored) and send it along; scripts/h200.sh installs it
# when it finds it. The rest of distributed's needs (click, cloudpickle, fsspec, jinja2, msgpack,
# psutil, pyyaml, sortedcontainers, toolz) come with torch's and Jupyter's images; check with
#   pip install --no-index --find-links DEST 'dask[distributed]'
# Env: PYTHON_TAG of the GPU machine's Python (default 3.12), DASK_VERSION (default: the newest).
set -euo pipefail
python_tag=${PYTHON_TAG:-3.12}
dest=${1:-.dask-wheels}
version=${DASK_VERSION:+==$DASK_VERSION}
mkdir -p "$dest"
rm -f "$dest"/*.whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$python_tag" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d "$dest" "dask$version" "distributed$version" tornado tblib zict partd locket
ls "$dest"
