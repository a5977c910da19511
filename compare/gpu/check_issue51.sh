#!/usr/bin/env bash
# Issue 51's checks on a lent GPU, run by the device tool from the repository root: `bash compare/gpu/check_issue51.sh`.
# 1. compare/gpu/check_issue51.py: the engine with rows in place and captured steps against eager runs (the same
#    tokens), `decode_evict` with a capacity per row (counted), ms per steady step: torch fallback / kernel / graph;
# 2. the Triton kernels' tests with mixed budgets, the steady steps and AdaKV's pooled rows (test_triton_budgets.py,
#    test_triton.py, test_triton_pooled.py), and the engine's CUDA graphs (test_captured_steps.py) on the GPU.
# Variables: TESTS=0 skips 2; CHECK_TIMEOUT, TEST_TIMEOUT (seconds). Uses .whl/*.whl (a transformers wheel, carried
# beside the tree) where present. Writes to $OUT: machine.txt, issue51.jsonl, logs.txt, pytest.txt.
source compare/gpu/prepare.sh  # $OUT, the carried wheels, $OUT/machine.txt
timeout ${CHECK_TIMEOUT:-300} python3 compare/gpu/check_issue51.py --out "$OUT" 2>>"$OUT/logs.txt" | cut -c1-600
if [ "${TESTS:-1}" = 1 ]; then
  timeout ${TEST_TIMEOUT:-150} python3 -m pytest -v -p no:cacheprovider -rf -n 8 --tb=short --maxfail=8 \
    tests/backends/test_triton_budgets.py tests/runtime/test_captured_steps.py tests/backends/test_triton_pooled.py \
    "tests/backends/test_triton.py::test_decode_evict_matches_the_torch_step" \
    "tests/backends/test_triton.py::test_decode_kernel_matches_literal_attention" \
    "tests/backends/test_triton.py::test_flash_with_lse_matches_literal_attention" \
    "tests/backends/test_triton.py::test_prompt_scores_match_literal_attention" \
    2>&1 | tee "$OUT/pytest.txt" | grep -E "FAILED|ERROR|[0-9]+ (passed|failed)"
fi
