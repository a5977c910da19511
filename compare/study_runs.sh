#!/usr/bin/env bash
# The long CPU study runs of issues 50 and 52, each resumable from its committed cells: start one in the background
# (one torch thread, its log and PID in $RUNS, default /tmp/runs), see how far each is, stop them. Two cores take two
# runs; a third slows all three. Memory (RSS, the weights' pages among it): h2o-1.5b holds 7-10 GB (its 6 GB of
# weights file-backed, 1-4 GB of its own; it grew 1 GB a sample before its caches were freed as they were let go,
# compare/cycle_collector), kvpress-1.5b 8-10 GB; the two run together on the 24 GB machine with room for a small
# probe (a probe's process takes `echo 1000 > /proc/self/oom_score_adj`, so the out-of-memory killer takes it first).
# An h2o-kv run goes on at the commit it started from (a git worktree of it beside this checkout: a cell's key holds
# the source digest, so a run at another commit would start again), writing its cells into this checkout's results/
# (commit them often: they are what `--resume` reads after a fresh clone).
#
#   compare/study_runs.sh start h2o-0.5b       # h2o-kv compress-once, Qwen2.5-Coder-0.5B, every policy of the size
#   compare/study_runs.sh start h2o-1.5b       # h2o-kv compress-once, 1.5B (`make qwen-1.5b`): the query-agnostic ones
#   compare/study_runs.sh start kvpress-1.5b   # kvpress compress-once, 1.5B: KVzip (its best on the 0.5B), the issue's others
#   compare/study_runs.sh start ruler-0.5b-agnostic   # issue 52 step 1: RULER-4k, 0.5B, 4 fractions, 5 per task
#   compare/study_runs.sh start ruler-0.5b-aware      # the same, the question inside the compressed prompt
#   compare/study_runs.sh start kvpress-ruler-agnostic  # kvpress's presses on the same ids (-aware: that setting)
#   compare/study_runs.sh start ruler-0.5b-25-aware   # issue 52 step 2: 25 % kept, 10 per task (5 reused); -agnostic
#   compare/study_runs.sh start kvpress-ruler-25-aware  # kvpress's side of step 2 (ratio 0.75, 10 per task); -agnostic
#   compare/study_runs.sh start ruler-1.5b-aware      # step 3: Qwen2.5-Coder-1.5B (`make qwen-1.5b`), 25 %, 5 per task
#   compare/study_runs.sh start kvpress-ruler-1.5b-aware  # kvpress's side of step 3; -agnostic
#   compare/study_runs.sh queue A B C          # B once A ends (A started now unless running), then C: one core's plan
#   compare/study_runs.sh status               # running or not, and each h2o-kv run's answers so far
#   compare/study_runs.sh stop                 # every run this script started
set -euo pipefail
ROOT=$(git rev-parse --show-toplevel)
RUNS=${RUNS:-/tmp/runs}
mkdir -p "$RUNS"
RULER_POLICIES=snapkv,adakv,pyramidkv,tova,h2o,streamingllm,keydiff,kvzipwindow  # issue 52's candidates (globalkv:
# SnapKV's tokens on Qwen2.5, docs/accuracy.md)
H2O_KV="import sys; from h2o_kv.cli import main; sys.argv = ['h2o-kv'] + sys.argv[1:]; sys.exit(main())"

detached() {  # NAME COMMAND...: COMMAND in the background as its own session, log and PID (= its group) in $RUNS;
  # the out-of-memory killer takes a study run before a shell or a test (a run resumes from its cells)
  local name=$1
  shift
  setsid bash -c 'echo 500 > /proc/self/oom_score_adj; echo $$ > "$0"; exec "$@"' "$RUNS/$name.pid" "$@" \
    > "$RUNS/$name.log" 2>&1 < /dev/null &
}

at_commit() {  # NAME COMMIT ARGS...: `h2o-kv ARGS` from a worktree of COMMIT, this checkout's venv
  local name=$1 commit=$2 tree="$ROOT/../runs/run-$2"
  shift 2
  [ -d "$tree" ] || git -C "$ROOT" worktree add -q "$tree" "$commit"
  local site=""  # a commit whose caches were reference cycles: the collector runs every minute (its docstring)
  git -C "$ROOT" show "$commit:h2o_kv/cache/kvcache.py" | grep -q "def layer_class_to_replicate" \
    || site="$ROOT/compare/cycle_collector"
  (cd "$tree" && PYTHONPATH="$site" H2O_KV_MALLOC=system MALLOC_MMAP_THRESHOLD_=131072 OMP_NUM_THREADS=1 \
    detached "$name" "$ROOT/.venv/bin/python" -c "$H2O_KV" "$@")
}

case "${1:-status}" in
start)
  case "${2:?start what: h2o-0.5b, h2o-1.5b, kvpress-1.5b, ruler-0.5b[-25]-agnostic|aware, ruler-1.5b-..., kvpress-ruler[-25|-1.5b]-...}" in
  h2o-0.5b)
    at_commit h2o-0.5b 7963655 eval --model qwen2.5-coder-0.5b --size compress-once --threads 1 --resume \
      --out "$ROOT/results/compress-once/qwen2.5-coder-0.5b" ;;
  h2o-1.5b)
    at_commit h2o-1.5b 2626967 eval --model qwen2.5-coder-1.5b --size compress-once --threads 1 --resume \
      --policies kvzipwindow,kvzipwhole,keydiff --out "$ROOT/results/compress-once/qwen2.5-coder-1.5b" ;;
  kvpress-1.5b)
    (cd "$ROOT" && OMP_NUM_THREADS=1 detached kvpress-1.5b nice -n 5 make -f compare/kvpress/Makefile \
      kvpress-compress-once KVP_MODEL=qwen2.5-coder-1.5b \
      KVP_ONCE_PRESSES=kvzip,expected_attention,snapkv,tova,keydiff,streamingllm) ;;
  ruler-0.5b-agnostic | ruler-0.5b-aware)  # samples round by round over the 13 tasks: a partial run is balanced
    at_commit "$2" 5cee28d eval --model qwen2.5-coder-0.5b --tasks retrieval --size ruler4k --threads 1 --resume \
      --setting "query-${2#ruler-0.5b-}" --policies "$RULER_POLICIES" --budgets 0.75,0.5,0.25,0.125 --samples 5 \
      --out "$ROOT/results/ruler/qwen2.5-coder-0.5b" ;;
  ruler-0.5b-25-agnostic | ruler-0.5b-25-aware)  # step 2: the same cells at 25 % for samples 1-5, new ones 6-10
    at_commit "$2" 5cee28d eval --model qwen2.5-coder-0.5b --tasks retrieval --size ruler4k --threads 1 --resume \
      --setting "query-${2#ruler-0.5b-25-}" --policies "$RULER_POLICIES" --budgets 0.25 --samples 10 \
      --out "$ROOT/results/ruler/qwen2.5-coder-0.5b" ;;
  ruler-1.5b-agnostic | ruler-1.5b-aware)  # step 3
    at_commit "$2" 5cee28d eval --model qwen2.5-coder-1.5b --tasks retrieval --size ruler4k --threads 1 --resume \
      --setting "query-${2#ruler-1.5b-}" --policies "$RULER_POLICIES" --budgets 0.25 --samples 5 \
      --out "$ROOT/results/ruler/qwen2.5-coder-1.5b" ;;
  kvpress-ruler-agnostic | kvpress-ruler-aware)
    (cd "$ROOT" && OMP_NUM_THREADS=1 detached "$2" nice -n 5 make -f compare/kvpress/Makefile kvpress-ruler \
      KVP_SETTING="query-${2#kvpress-ruler-}") ;;
  kvpress-ruler-25-agnostic | kvpress-ruler-25-aware)
    (cd "$ROOT" && OMP_NUM_THREADS=1 detached "$2" nice -n 5 make -f compare/kvpress/Makefile kvpress-ruler \
      KVP_SETTING="query-${2#kvpress-ruler-25-}" KVP_RULER_N=10 KVP_RULER_RATIOS=0.75 \
      KVP_RULER=compare/kvpress/samples-ruler4k-qwen2.5-coder-0.5b-n10.jsonl) ;;
  kvpress-ruler-1.5b-agnostic | kvpress-ruler-1.5b-aware)
    (cd "$ROOT" && OMP_NUM_THREADS=1 detached "$2" nice -n 5 make -f compare/kvpress/Makefile kvpress-ruler \
      KVP_SETTING="query-${2#kvpress-ruler-1.5b-}" KVP_MODEL=qwen2.5-coder-1.5b KVP_RULER_RATIOS=0.75) ;;
  *) echo "study_runs.sh: no run named $2" >&2; exit 2 ;;
  esac ;;
queue)  # NAME...: each started when the one before it ends; the first started now unless it is running
  shift
  [ $# -ge 1 ] || { echo "study_runs.sh: queue NAME [NAME...]" >&2; exit 2; }
  RUNS=$RUNS detached "queue-$1" bash -c 'for name in "$@"; do
      pid="$RUNS/$name.pid"
      if ! { [ -e "$pid" ] && kill -0 "$(cat "$pid")" 2> /dev/null; }; then
        rm -f "$pid"
        echo "$(date -u +%FT%TZ) start $name"
        "$0" start "$name" || exit 1
        while [ ! -e "$pid" ]; do sleep 1; done
      fi
      while kill -0 "$(cat "$pid")" 2> /dev/null; do sleep 60; done
      echo "$(date -u +%FT%TZ) $name ended"
    done' "$ROOT/compare/study_runs.sh" "$@"
  echo "queued: $*" ;;
status)
  for pid in "$RUNS"/*.pid; do
    [ -e "$pid" ] || continue
    name=$(basename "$pid" .pid)
    if kill -0 "$(cat "$pid")" 2> /dev/null; then echo "$name: running"; else echo "$name: not running"; fi
  done
  for cells in "$ROOT"/results/compress-once/*/cells.jsonl "$ROOT"/results/ruler/*/cells.jsonl; do
    [ -e "$cells" ] && "$ROOT/.venv/bin/python" "$ROOT/compare/interim_counts.py" "$cells" | sed -n "1s|^|$cells: |p"
  done
  for done_ in "$ROOT"/results/kvpress-compress-once-*/results.json "$ROOT"/results/ruler/kvpress-*/results.json; do
    [ -e "$done_" ] && python3 -c 'import json, sys, collections; c = json.load(open(sys.argv[1]))["cells"]
n = collections.Counter()
for v in c.values(): n[v["press"], v["ratio"]] += len(v["samples"])
least = {press: min(k for (p, _), k in n.items() if p == press) for press, _ in n}
print("%s: samples per press (its least answered ratio) %s" % (sys.argv[1], least))' "$done_"
  done ;;
stop)
  for pid in "$RUNS"/queue-*.pid "$RUNS"/*.pid; do  # the queues first, so that none starts a run being stopped
    [ -e "$pid" ] || continue
    kill -- -"$(cat "$pid")" 2> /dev/null || kill "$(cat "$pid")" 2> /dev/null || true  # its process group (setsid)
    rm -f "$pid"
  done ;;
*) echo "study_runs.sh: start NAME, queue NAME..., status or stop" >&2; exit 2 ;;
esac
