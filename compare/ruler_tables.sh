#!/usr/bin/env bash
# Issue 52's RULER-4k tables from the committed runs (minutes: every cell is reused, nothing is generated).
#   compare/ruler_tables.sh                  # Qwen2.5-Coder-0.5B: 4 fractions, 5 samples per task
#
# 1. h2o-kv's summary.md and results.json over both settings: each long run rewrote them with its own setting only;
#    this reruns `h2o-kv eval --setting both` from the commit the runs ran at (a worktree of it: a cell's key holds
#    the source digest), so every cell is read back, none computed.
# 2. compare/side_by_side.py per setting, beside kvpress's run on the same token ids, with the plot of the mean over
#    the thirteen tasks against the fraction kept: results/ruler/side_by_side-MODEL-SETTING.md and .png.
set -euo pipefail
ROOT=$(git rev-parse --show-toplevel)
MODEL=qwen2.5-coder-0.5b
COMMIT=5cee28d  # compare/study_runs.sh's ruler-0.5b-* runs
POLICIES=snapkv,adakv,pyramidkv,tova,h2o,streamingllm,keydiff,kvzipwindow
OUT="$ROOT/results/ruler/$MODEL"
TREE="$ROOT/../runs/run-$COMMIT"
[ -d "$TREE" ] || git -C "$ROOT" worktree add -q "$TREE" "$COMMIT"
(cd "$TREE" && OMP_NUM_THREADS=1 "$ROOT/.venv/bin/python" -c \
  "import sys; from h2o_kv.cli import main; sys.argv = ['h2o-kv'] + sys.argv[1:]; sys.exit(main())" \
  eval --model "$MODEL" --tasks retrieval --size ruler4k --threads 1 --resume --setting both \
  --policies "$POLICIES" --budgets 0.75,0.5,0.25,0.125 --samples 5 --out "$OUT")
for setting in agnostic aware; do
  prefill=$([ "$setting" = agnostic ] && echo agnostic || echo oneshot)
  theirs="$ROOT/results/ruler/kvpress-$MODEL-query-$setting/results.json"
  [ -e "$theirs" ] || echo "ruler_tables.sh: no kvpress run of the query-$setting setting yet: h2o-kv's side alone" >&2
  "$ROOT/.venv/bin/python" "$ROOT/compare/side_by_side.py" --prefill "$prefill" --h2o "$OUT/results.json" \
    --kvpress $([ -e "$theirs" ] && echo "$theirs") \
    --out "$ROOT/results/ruler/side_by_side-$MODEL-$setting.md" --plot "$ROOT/results/ruler/side_by_side-$MODEL-$setting.png"
done
