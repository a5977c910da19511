#!/usr/bin/env bash
# One lent-GPU session's checks, run by the device tool from the repository root: `bash compare/gpu/gpu_check.sh`.
# 1. the GPU study (h2o_kv/studies/bench/gpu.py): SmolLM2-135M's shapes at 4k x 4, then Llama-3-8B's at 32k x 8, random
#    weights, bfloat16: StaticCache eager and compiled, DynamicCache, H2O / SnapKV / int8 eager and replayed from
#    a CUDA graph, the same-memory batch, prefill with exact scores against SDPA;
# 2. the Triton kernels against literal attention and the cache's CUDA paths (tests/backends/test_triton.py, test_cuda.py).
# Variables: TESTS=0 skips 2; SHAPES picks shapes; CELLS_8B / CELLS_SMOL (comma-separated) pick the study's cells.
# Needs, carried beside the tree (ignored): .whl/ (the transformers 5.23.0 wheel; the machine has an older one).
# Writes to $OUT: machine.txt, pytest.txt, gpu.jsonl, tables.md, study.log (the device tool brings back 8 files).
set -o pipefail
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
  nproc
} 2>&1 | tee "$OUT/machine.txt"
for shape in ${SHAPES:-llama3-8b smollm2-135m}; do
  if [ $shape = llama3-8b ]; then limit=260 only=$CELLS_8B; else limit=190 only=$CELLS_SMOL; fi
  timeout ${STUDY_TIMEOUT:-$limit} python3 -m h2o_kv.studies.bench.gpu --shapes $shape --out "$OUT" ${only:+--only $only} \
    2>&1 | tee -a "$OUT/study.log" | grep -v '^{' | tail -4
done
python3 -m h2o_kv.studies.bench.gpu --report --out "$OUT"
if [ "${TESTS:-1}" = 1 ]; then  # -v: each failure's name is printed as it happens, even if the time limit cuts the run
  timeout ${TEST_TIMEOUT:-150} python3 -m pytest -v -p no:cacheprovider -rf -n 8 --tb=short --maxfail=8 \
    tests/backends/test_triton.py tests/backends/test_cuda.py 2>&1 | tee "$OUT/pytest.txt" | grep -E "FAILED|ERROR|[0-9]+ (passed|failed)"
fi
