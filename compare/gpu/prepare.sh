# Sourced by the GPU check scripts (check_issue51.sh, issue51_figures.sh) on a lent machine: $OUT made, the carried
# wheels in .whl/ installed to /tmp/site (transformers 5.23.0; the machine has an older one), and $OUT/machine.txt
# written (the GPU, the versions, the commit and whether the tree was dirty).
set -o pipefail
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
  git log -1 --format='%h %s' 2>/dev/null; git status --short 2>/dev/null | head -20
} 2>&1 | tee "$OUT/machine.txt"
