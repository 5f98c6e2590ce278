#!/bin/bash
# Issue 29's local comparison: bench/vote of 7c21911 (before issue 29) and of this commit,
# alternately at 2, 4 and 8 ranks on one machine. Run from the repository root, in the venv
# of README's "Developing" section; the old tree is a git worktree beside it.
set -e
OLD=${OLD:-../fiws-7c21911}
OUT=${1:-bench-pair}
test -d "$OLD" || git worktree add "$OLD" 7c21911
mkdir -p "$OUT"
for size in 2 4 8; do
  echo "== $size ranks: old 7c21911"
  (cd "$OLD" && PYTHONPATH="$PWD" FIWS_COMMIT=7c21911 python3 -P bench/vote --sizes $size --reps 20 --timeout 120 --out "$OLDPWD/$OUT/old-$size" | grep -E "ranks, (pass|veto):")
  echo "== $size ranks: new $(git rev-parse --short HEAD)"
  FIWS_COMMIT=$(git rev-parse --short HEAD) python3 bench/vote --sizes $size --reps 20 --timeout 120 --out "$OUT/new-$size" | grep -E "ranks, (pass|veto):"
done
# the round trips (a second run, with the 50 ms pause --count-ops adds):
FIWS_COMMIT=$(git rev-parse --short HEAD) python3 bench/vote --sizes 2 4 8 --reps 10 --count-ops --out "$OUT/ops"
