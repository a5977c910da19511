"""Worker for tests/runtime/test_tensor_parallel.py: generate with an H2O cache, write what each process held.

Run as `torchrun --nproc-per-node 2 tests/runtime/tp_worker.py MODEL_DIR OUT_DIR [GENERATE FLAGS...]` (tensor
parallel, one JSON per rank; with flags it then runs `h2o-kv generate` in the same processes, capturing
what each process prints, which saves a second torchrun start), or imported by the test for the
single-process reference (`run(MODEL_DIR)`).
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import torch

import h2o_kv
from h2o_kv import cli
from h2o_kv.runtime.distributed import default_tp_plan, rank, shared_seed

PROMPT_LENS = (40, 33)  # two sequences, the second left-padded
NEW_TOKENS = 12


def _inputs(vocab: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (len(PROMPT_LENS), max(PROMPT_LENS)), generator=gen)
    mask = torch.ones_like(ids)
    for row, length in enumerate(PROMPT_LENS):
        mask[row, : max(PROMPT_LENS) - length] = 0
    return {"input_ids": ids, "attention_mask": mask}


def run(model_dir: str) -> dict:
    """Greedy and sampled generation with H2O(heavy=6, recent=6); tokens, bytes and kept positions."""
    model, tokenizer = h2o_kv.load_model(model_dir, tp_plan=default_tp_plan())
    inputs = _inputs(model.config.vocab_size)
    common = dict(max_new_tokens=NEW_TOKENS, pad_token_id=tokenizer.pad_token_id, eos_token_id=None)
    cache = h2o_kv.KVCache(h2o_kv.H2O(heavy=6, recent=6))
    with torch.no_grad():
        greedy = model.generate(**inputs, past_key_values=cache, do_sample=False, **common)
    kept = [[[layer.pos[b, h][layer.pos[b, h] >= 0].sort().values.tolist() for h in range(layer.pos.shape[1])]
             for b in range(layer.pos.shape[0])] for layer in cache.layers]  # fmt: skip
    torch.manual_seed(100 + rank())  # every process starts from a different random state ...
    seed = shared_seed()  # ... and shares rank 0's seed for sampling
    with torch.no_grad():
        sampled = model.generate(
            **inputs, past_key_values=h2o_kv.KVCache(h2o_kv.H2O(heavy=6, recent=6)), do_sample=True, **common
        )
    return {
        "greedy": greedy[:, inputs["input_ids"].shape[1] :].tolist(),
        "sampled": sampled[:, inputs["input_ids"].shape[1] :].tolist(),
        "seed": seed,
        "nbytes": cache.nbytes(),
        "kv_heads": cache.layers[0].keys.shape[1],
        "kept_positions": kept,  # [layer][sequence][KV head] sorted positions
    }


def run_cli(flags: list[str]) -> dict:
    """`h2o-kv generate FLAGS` in this process: its exit code and what it printed."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(flags)
    return {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


if __name__ == "__main__":
    result = run(sys.argv[1])
    if len(sys.argv) > 3:
        result["cli"] = run_cli(sys.argv[3:])
    Path(sys.argv[2], f"rank{rank()}.json").write_text(json.dumps(result))
