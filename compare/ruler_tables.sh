#!/usr/bin/env bash
# Issue 52's RULER-4k tables from the committed runs (minutes: every cell is reused, nothing is generated).
#   compare/ruler_tables.sh                      # Qwen2.5-Coder-0.5B: 4 fractions x 5 samples per task, and once
#                                                # step 2's cells are all in, 25 % x 10 (results-25-10.json)
#   compare/ruler_tables.sh qwen2.5-coder-1.5b   # step 3: 25 % x 5, once its cells are all in
#
# 1. h2o-kv's summary.md and results.json over both settings: each long run rewrote them with its own setting (and
#    samples) only; this reruns `h2o-kv eval --setting both` from the commit the runs ran at (a worktree of it: a
#    cell's key holds the source digest), so every cell is read back, none computed. A table whose cells are not all
#    in is not made (the eval would compute the missing ones: hours).
# 2. compare/side_by_side.py per setting, beside kvpress's run on the same token ids (each kvpress cell over the
#    samples h2o-kv's ran, --match-samples; at 25 % the ten-sample cells replace the five), with the plot of the mean
#    over the thirteen tasks against the fraction kept: results/ruler/side_by_side-MODEL-SETTING.md and .png (the
#    0.5B's; the 1.5B has one fraction, no curve).
set -euo pipefail
ROOT=$(git rev-parse --show-toplevel)
MODEL=${1:-qwen2.5-coder-0.5b}
COMMIT=5cee28d  # compare/study_runs.sh's ruler-* runs
POLICIES=snapkv,adakv,pyramidkv,tova,h2o,streamingllm,keydiff,kvzipwindow
OUT="$ROOT/results/ruler/$MODEL"
TREE="$ROOT/../runs/run-$COMMIT"
[ -d "$TREE" ] || git -C "$ROOT" worktree add -q "$TREE" "$COMMIT"

complete() {  # SAMPLES BUDGET: OUT/cells.jsonl holds Full's and every policy's cell at BUDGET for SAMPLES samples of
  # each of the 13 tasks in both settings
  "$ROOT/.venv/bin/python" - "$OUT/cells.jsonl" "$1" "$2" "$POLICIES" << 'EOF'
import json, sys
from collections import defaultdict
path, samples, budget, policies = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4].split(",")
seen = defaultdict(set)  # (setting, policy, task): sample seeds
for line in open(path):
    key = json.loads(json.loads(line)["key"])
    if key["budget"] in (None, budget):
        seen[key["setting"], key["policy"], key["subtask"]].add(key["sample_seed"])
tasks = {task for _, _, task in seen}
short = [k for k in ((s, p, t) for s in ("aware", "agnostic") for p in ["full", *policies] for t in tasks)
         if len(seen[k]) < samples]
if len(tasks) < 13 or short:
    print(f"ruler_tables.sh: {path}: {len(tasks)} tasks, {len(short)} (setting, policy, task) with fewer than "
          f"{samples} samples at {budget}", file=sys.stderr)
    sys.exit(1)
EOF
}

eval_cells() {  # SAMPLES BUDGETS: h2o-kv's eval over both settings, every cell read back from OUT's cells
  (cd "$TREE" && OMP_NUM_THREADS=1 "$ROOT/.venv/bin/python" -c \
    "import sys; from h2o_kv.cli import main; sys.argv = ['h2o-kv'] + sys.argv[1:]; sys.exit(main())" \
    eval --model "$MODEL" --tasks retrieval --size ruler4k --threads 1 --resume --setting both \
    --policies "$POLICIES" --budgets "$2" --samples "$1" --out "$OUT")
}

cd "$ROOT"  # the tables name their sources relative to the repository root
h2o=("results/ruler/$MODEL/results.json")
if [ "$MODEL" = qwen2.5-coder-0.5b ]; then
  if complete 10 0.25 2> /dev/null; then  # step 2
    eval_cells 10 0.25
    mv "$OUT/results.json" "$OUT/results-25-10.json"
    mv "$OUT/summary.md" "$OUT/summary-25-10.md"
    h2o+=("results/ruler/$MODEL/results-25-10.json")
  fi
  for budget in 0.75 0.5 0.25 0.125; do complete 5 $budget; done
  eval_cells 5 0.75,0.5,0.25,0.125
else
  complete 5 0.25
  eval_cells 5 0.25
fi
for setting in agnostic aware; do
  prefill=$([ "$setting" = agnostic ] && echo agnostic || echo oneshot)
  theirs="results/ruler/kvpress-$MODEL-query-$setting/results.json"
  [ -e "$theirs" ] || echo "ruler_tables.sh: no kvpress run of the query-$setting setting yet: h2o-kv's side alone" >&2
  out="results/ruler/side_by_side-$MODEL-$setting"
  plot=$([ "$MODEL" = qwen2.5-coder-0.5b ] && echo "--plot $out.png" || true)  # the 1.5B's one fraction: no curve
  .venv/bin/python compare/side_by_side.py --prefill "$prefill" --h2o "${h2o[@]}" --match-samples \
    --kvpress $([ -e "$theirs" ] && echo "$theirs") --out "$out.md" $plot
done
