#!/usr/bin/env bash
# One lent-GPU session's checks, run by the device tool from the repository root (results/gpu/README.md):
# the CUDA tests (tests/test_cuda.py), then `h2o-kv bench` at 4096 tokens x batch 4 in bfloat16 and float32 on
# a model with SmolLM2-135M's shapes and random weights (the bundled GGUF is larger than what travels; timings
# do not depend on the weights' values). Needs, carried beside the tree (ignored): .whl/ (transformers 5.23.0,
# gguf 0.19.0 wheels), .gpu/smollm2-shape/ (SmolLM2's config and tokenizer, no weights) and .gpu/cache/data/
# shakespeare/ (the bench's text). Writes 8 files to $OUT (the device tool's limit).
set -o pipefail
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD H2O_KV_CACHE=$PWD/.gpu/cache PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
  nproc
} 2>&1 | tee "$OUT/machine.txt"
timeout 200 python3 -m pytest -q -p no:cacheprovider -rf tests/test_cuda.py 2>&1 | tee "$OUT/pytest.txt" | tail -25
python3 - <<'PY' 2>&1 | tail -2
import shutil, torch, transformers as tf
shutil.copytree(".gpu/smollm2-shape", "/tmp/smol", dirs_exist_ok=True)
torch.manual_seed(0)
tf.AutoModelForCausalLM.from_config(tf.AutoConfig.from_pretrained("/tmp/smol")).save_pretrained("/tmp/smol")
print("random-weight SmolLM2-135M shape saved")
PY
for dtype in bfloat16 float32; do
  profile=$([ $dtype = bfloat16 ] && echo --profile)
  timeout ${BENCH_TIMEOUT:-150} python3 -m h2o_kv.bench $profile --model /tmp/smol --device cuda --dtype $dtype --prompt-lens 4096 \
    --batch-sizes 4 --gen-len 32 --repeats 3 --policies static-sdpa,full-sdpa,h2o,h2o-int8 --interleave --no-progress \
    --out /tmp/bench-$dtype 2>&1 | tee "$OUT/bench-$dtype.txt" | tail -30
  cp /tmp/bench-$dtype/bench.csv "$OUT/bench-$dtype.csv"
done
cp /tmp/bench-bfloat16/profile_*.txt "$OUT/"  # an H2O prefill and decode step's op tables
