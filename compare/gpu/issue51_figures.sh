#!/usr/bin/env bash
# Issue 51's figures on a lent GPU, one command from the repository root: `bash compare/gpu/issue51_figures.sh`.
# 0. compare/gpu/decode_kernel_probe.py: the decode kernel's first pass alone, per variant (decode_kernel.jsonl);
# 1. compare/gpu/check_issue51.py --cells step,engine-step: the engine's steady iteration against the study's
#    captured step for the same ragged batch of 8 (SmolLM2-135M's shapes);
# 2. the GPU study's 8B cells at 32k x 8 (h2o_kv/studies/bench/gpu.py): StaticCache eager, H2O 20 % and the whole
#    context (a 100 % budget: the full cache's bytes) on the same kernel, each replayed from a CUDA graph; prefill
#    at 32k: SDPA, H2O in one call and in the engine's 4,096-token calls; H2O against Full() both in those calls,
#    with H2O's kernels (`prefill-chunked`, gpu_prefill.py: whether bounded attention makes H2O's prefill cheaper);
#    an eager H2O step's kernel table (`profile-step`);
# 3. compare/gpu/serving_run.py: 32 requests of 4k-32k tokens through the engine, H2O 20 % against Full()
#    (SERVE_POLICIES=h2o,full,h2o@1.0 adds the whole prompt kept on the bounded, captured path: Full's bytes).
# Uses .whl/*.whl (the transformers wheel, carried beside the tree). Writes to $OUT (the device tool brings back 8
# files: every log goes to one): machine.txt, decode_kernel.jsonl, issue51.jsonl, gpu.jsonl, serving.jsonl, logs.txt
# (`python -m h2o_kv.studies.bench.gpu --report --out DIR` makes tables.md from gpu.jsonl afterwards). Timeouts
# (seconds): PROBE_TIMEOUT, STEP_TIMEOUT, STUDY_TIMEOUT, SERVE_TIMEOUT. With check_issue51.sh into the same $OUT
# (its pytest.txt the seventh file): `bash compare/gpu/check_issue51.sh; bash compare/gpu/issue51_figures.sh`.
source compare/gpu/prepare.sh  # $OUT, the carried wheels, $OUT/machine.txt
timeout ${PROBE_TIMEOUT:-90} python3 compare/gpu/decode_kernel_probe.py --out "$OUT" 2>>"$OUT/logs.txt" | cut -c1-200
timeout ${STEP_TIMEOUT:-70} python3 compare/gpu/check_issue51.py --out "$OUT" --cells step,engine-step 2>>"$OUT/logs.txt" | cut -c1-400
timeout ${STUDY_TIMEOUT:-170} python3 -m h2o_kv.studies.bench.gpu --shapes llama3-8b --out "$OUT" \
  --only ${CELLS_8B:-static,h2o-captured,full-captured,prefill,prefill-chunked,profile-step} 2>&1 | tee -a "$OUT/logs.txt" | grep -v '^{' | tail -3
timeout ${SERVE_TIMEOUT:-270} python3 compare/gpu/serving_run.py --out "$OUT" --policies ${SERVE_POLICIES:-h2o,full} 2>>"$OUT/logs.txt" | cut -c1-600
