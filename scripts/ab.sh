#!/usr/bin/env bash
# A/B of two commits' code on one GPU in one call: a command run with an earlier commit's
# lorabench/ and kernels/ in this tree, then with the tree's own, then `lorabench compare` of the
# two runs. The editable install reads the tree (lorabench.kernels maps to kernels/), so a
# baseline put on PYTHONPATH would still import this tree's kernels: the baseline's files are
# swapped in instead, and the tree's put back before the second run, also when the first fails.
#
#   scripts/ab.sh pack COMMIT            (here) the commit's lorabench/ and kernels/ into $AB_DIR/COMMIT/
#                                        with its full sha; $AB_DIR (default .ab/) is ignored by git: send it with carry
#   scripts/ab.sh run COMMIT OUT -- CMD  (on the GPU) CMD --out OUT/base with the packed commit's code and
#                                        LORABENCH_GIT_SHA its sha, then CMD --out OUT/new with the tree's;
#                                        then, where each wrote one run, `lorabench compare` of the two
#
# COMMIT in `run` is the name `pack` was given. Only lorabench/ and kernels/ are swapped: scripts/
# and sweeps/ stay the tree's. The baseline runs first. A kill the shell cannot trap (SIGKILL, a
# call's time limit) leaves the baseline's code in the tree: run it on the GPU machine's copy, not in
# a checkout you are editing. Relative paths are from the repository's root.
#
# e.g. scripts/ab.sh run d7010cd /tmp/out/ab -- lorabench sweep --spec sweeps/gemm.toml --kernels gemm --max-loras 4
set -euo pipefail
cd "$(dirname "$0")/.."
AB_DIR=${AB_DIR:-.ab}
die() { echo "ab.sh: $*" >&2; exit 2; }

case "${1:-}" in
  pack)
    [ $# -eq 2 ] || die "usage: scripts/ab.sh pack COMMIT"
    sha=$(git rev-parse --verify --quiet "$2^{commit}" 2>/dev/null) || die "no commit $2 in this repository"
    git cat-file -e "$sha:lorabench" 2>/dev/null && git cat-file -e "$sha:kernels" 2>/dev/null \
      || die "commit $2 has no lorabench/ or no kernels/"
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
    for side in base new; do
      [ -z "$(ls -A "$out/$side" 2>/dev/null)" ] || die "$out/$side is not empty: give a new OUT"
    done
    own=$(mktemp -d)
    cp -a lorabench kernels "$own/"
    swapped=0
    put_back() {  # the tree's own code, while the baseline's is in it
      if [ "$swapped" = 1 ]; then
        rm -rf lorabench kernels && cp -a "$own/lorabench" "$own/kernels" . \
          || { echo "ab.sh: could not put the tree's lorabench/ and kernels/ back: they are in $own" >&2; exit 2; }
        swapped=0
      fi
    }
    trap 'put_back; rm -rf "$own"' EXIT
    rm -rf lorabench kernels && swapped=1 && cp -a "$base/lorabench" "$base/kernels" .
    echo "== base: $(cat "$base/SHA")"
    base_rc=0
    LORABENCH_GIT_SHA=$(cat "$base/SHA") "$@" --out "$out/base" || base_rc=$?
    put_back
    echo "== new: this tree"
    new_rc=0
    "$@" --out "$out/new" || new_rc=$?
    [ "$base_rc" = 0 ] && [ "$new_rc" = 0 ] || die "base exited $base_rc, new $new_rc"
    runs() { find "$1" -mindepth 2 -maxdepth 2 -name run.json -printf '%h\n' 2>/dev/null; }
    if [ "$(runs "$out/base" | wc -l)" = 1 ] && [ "$(runs "$out/new" | wc -l)" = 1 ]; then
      lorabench compare "$(runs "$out/base")" "$(runs "$out/new")" || die "lorabench compare exited $?"
    else
      echo "== no compare: $out/base and $out/new do not each hold one run (run.json)"
    fi
    ;;
  *) die "usage: scripts/ab.sh pack COMMIT | run COMMIT OUT -- CMD..." ;;
esac
