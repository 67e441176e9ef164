#!/usr/bin/env bash
# A/B of two commits' code on one GPU in one call: a command run with an earlier commit's
# lorabench/ and kernels/ in this tree, then with the tree's own, then `lorabench compare` of the
# two runs. The editable install reads the tree (lorabench.kernels maps to kernels/), so a
# baseline put on PYTHONPATH would still import this tree's kernels: the baseline's files are
# swapped in instead, and the tree's restored afterwards, also when the command fails.
#
#   scripts/ab.sh pack COMMIT            (here) the commit's lorabench/ and kernels/ into $AB_DIR/COMMIT/
#                                        with its full sha; $AB_DIR (default .ab/) is ignored by git: send it with carry
#   scripts/ab.sh run COMMIT OUT -- CMD  (on the GPU) CMD --out OUT/base with the packed commit's code and
#                                        LORABENCH_GIT_SHA its sha, then CMD --out OUT/new with the tree's;
#                                        then, where each wrote one run, `lorabench compare` of the two
#
# e.g. scripts/ab.sh run d7010cd /tmp/out/ab -- lorabench sweep --spec sweeps/gemm.toml --kernels gemm --max-loras 4
set -euo pipefail
cd "$(dirname "$0")/.."
AB_DIR=${AB_DIR:-.ab}
die() { echo "ab.sh: $*" >&2; exit 2; }

case "${1:-}" in
  pack)
    [ $# -eq 2 ] || die "usage: scripts/ab.sh pack COMMIT"
    sha=$(git rev-parse --verify --quiet "$2^{commit}") || die "no commit $2 in this repository"
    dest="$AB_DIR/$2"
    rm -rf "$dest" && mkdir -p "$dest"
    git archive "$sha" lorabench kernels | tar -x -C "$dest"
    echo "$sha" > "$dest/SHA"
    echo "packed $sha into $dest (send $AB_DIR with carry)"
    ;;
  run)
    [ $# -ge 5 ] && [ "$4" = "--" ] || die "usage: scripts/ab.sh run COMMIT OUT -- CMD..."
    commit=$2 base="$AB_DIR/$2" out=$3
    shift 4
    [ -d "$base/lorabench" ] && [ -d "$base/kernels" ] && [ -f "$base/SHA" ] || die "$base is not packed: scripts/ab.sh pack $commit first"
    own=$(mktemp -d)
    cp -a lorabench kernels "$own/"
    restore() { rm -rf lorabench kernels && cp -a "$own/lorabench" "$own/kernels" . && rm -rf "$own"; }
    trap restore EXIT
    rm -rf lorabench kernels && cp -a "$base/lorabench" "$base/kernels" .
    echo "== base: $(cat "$base/SHA")"
    base_rc=0
    LORABENCH_GIT_SHA=$(cat "$base/SHA") "$@" --out "$out/base" || base_rc=$?
    rm -rf lorabench kernels && cp -a "$own/lorabench" "$own/kernels" .
    echo "== new: this tree"
    new_rc=0
    "$@" --out "$out/new" || new_rc=$?
    runs() { find "$1" -mindepth 2 -maxdepth 2 -name run.json -printf '%h\n' 2>/dev/null; }
    if [ "$(runs "$out/base" | wc -l)" = 1 ] && [ "$(runs "$out/new" | wc -l)" = 1 ]; then
      lorabench compare "$(runs "$out/base")" "$(runs "$out/new")" || true
    fi
    [ "$base_rc" = 0 ] && [ "$new_rc" = 0 ] || die "base exited $base_rc, new $new_rc"
    ;;
  *) die "usage: scripts/ab.sh pack COMMIT | run COMMIT OUT -- CMD..." ;;
esac
