#!/usr/bin/env bash
# A/B of device code in ONE device lease, runs alternated (these machines are noisy: compare
# side by side, never across calls). The device machine gets a copy of the working tree without
# .git, so the two versions travel as files:
#
#   bash scripts/ab.sh prepare OLD [NEW]     here: _ab/old/ and _ab/new/ hold every file under
#                                            gpunet/ and bench/ that differs between the
#                                            revisions OLD and NEW (default HEAD), as in each;
#                                            _ab/ is untracked and not ignored, so a device call
#                                            carries it. Delete it before committing.
#   bash scripts/ab.sh run N CMD [ARGS...]   there: N rounds of new then old: the version's files
#                                            copied over the tree, then CMD ARGS with AB_TAG set to
#                                            new1, old1, new2, ... (use it in output names); the
#                                            new files are put back at the end, whatever happened.
#
# e.g. (device):  bash scripts/ab.sh run 3 sh -c 'python3 -m gpunet.device.testing.mps -- \
#                   python3 bench/ep_profile.py --gpu --ranks 2 --transport p2p --no-kineto \
#                   --iters 20 --hold-us 300 --json $OUT/prof_$AB_TAG.json'
#      then (here): python3 bench/ep_profile_ab.py new='.../prof_new*.json' old='.../prof_old*.json'
set -euo pipefail
cd "$(dirname "$0")/.."
AB=${AB_DIR:-_ab}   # AB_DIR: another directory, for a second A/B in the same call
case "${1:-}" in
  prepare)
    old=${2:?usage: ab.sh prepare OLD [NEW]}
    new=${3:-HEAD}
    rm -rf "$AB"
    mkdir -p "$AB/old" "$AB/new"
    files=$(git diff --name-only "$old" "$new" -- gpunet bench | grep -v '^bench/results/' || true)
    [ -n "$files" ] || { echo "ab.sh: no code differs between $old and $new" >&2; exit 1; }
    for f in $files; do
      for side in old new; do
        rev=$old; [ "$side" = new ] && rev=$new
        if git cat-file -e "$rev:$f" 2>/dev/null; then
          mkdir -p "$AB/$side/$(dirname "$f")"
          git show "$rev:$f" > "$AB/$side/$f"
        else  # absent on that side: a marker, removed from the tree when the side is swapped in
          mkdir -p "$AB/$side/$(dirname "$f")"
          : > "$AB/$side/$f.ab-absent"
        fi
      done
    done
    echo "ab.sh: $(echo "$files" | wc -l) file(s) differ between $old and $new:"
    echo "$files" | sed 's/^/  /'
    ;;
  run)
    n=${2:?usage: ab.sh run N CMD [ARGS...]}
    shift 2
    [ $# -gt 0 ] || { echo "usage: ab.sh run N CMD [ARGS...]" >&2; exit 2; }
    [ -d "$AB/old" ] && [ -d "$AB/new" ] || { echo "ab.sh: no $AB/old and $AB/new (ab.sh prepare)" >&2; exit 2; }
    swap() {  # the side's files over the tree; a marker removes the file
      (cd "$AB/$1" && find . -type f) | while read -r f; do
        f=${f#./}
        if [[ "$f" == *.ab-absent ]]; then rm -f "${f%.ab-absent}"
        else mkdir -p "$(dirname "$f")"; cp "$AB/$1/$f" "$f"; fi
      done
    }
    trap 'swap new' EXIT
    rc=0
    for i in $(seq 1 "$n"); do
      for side in new old; do
        swap "$side"
        echo "=== ab.sh: $side$i ($(date +%T))"
        AB_TAG=$side$i "$@" || { rc=$?; echo "=== ab.sh: $side$i exited $rc"; }
      done
    done
    exit $rc
    ;;
  *)
    sed -n '2,20p' "$0" >&2
    exit 2
    ;;
esac
