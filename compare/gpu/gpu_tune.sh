#!/usr/bin/env bash
# The second lent-GPU command of a session: tile sizes for the Triton kernels, then the study's cells that depend
# on them (h2o_kv/studies/bench/gpu_tune.py). Needs .whl/ carried, as gpu_check.sh. Writes to $OUT: tune.json, gpu.jsonl,
# tables.md, profile_prefill.txt, tune.log.
set -o pipefail
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout ${TUNE_TIMEOUT:-300} python3 -m h2o_kv.studies.bench.gpu_tune --out "$OUT" $TUNE_ARGS 2>&1 | tee "$OUT/tune.log" | grep -v '^{\|^decode \|^key_scores ' | tail -60
