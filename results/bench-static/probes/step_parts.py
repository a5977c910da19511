"""Where an h2o-kv decode step's time goes: the cache layer's share (attention over the kept slots, eviction,
insertion, score update) against the rest of the model's step, at 4096 tokens x batch B, 20 %, rows-first.
The cache layer's methods are wrapped with timers in this process only (probe).

    python results/bench-static/probes/step_parts.py POLICY BATCH   # e.g. h2o 4, h2o-int8 64, adakv 4
"""
import statistics
import sys
import time

import torch

import h2o_kv.layer as layer_mod
import h2o_kv.pooled as pooled_mod
from h2o_kv.bench.config import new_cache, policy_for
from h2o_kv.bench.sweep import load_text, prompt_ids
from h2o_kv.bench.timing import decode_steps, prefill
from h2o_kv.models import load_model

L, name, B, STEPS = 4096, sys.argv[1], int(sys.argv[2]), 10
model, tok = load_model("smollm2-135m", rows_first=True)
ids = tok(load_text(), add_special_tokens=False)["input_ids"]
cache = new_cache(model, name, policy_for(name, 0.2, L), max_len=L + 40)
parts = {"cache layer": 0.0, "attention": 0.0, "eviction": 0.0, "insertion": 0.0, "scores": 0.0}


running = dict.fromkeys(parts, 0)  # a part's timers running now: a method inside another of its part adds nothing


def timed(cls, method, part):
    inner = getattr(cls, method)

    def run(*args, **kwargs):
        running[part] += 1
        begin = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            running[part] -= 1
            if not running[part]:
                parts[part] += time.perf_counter() - begin

    setattr(cls, method, run)


layer_class = pooled_mod.PooledKVLayer if name.startswith("adakv") else layer_mod.KVLayer
# the steady decode path (KVLayer._decode_full) writes with `_write`, evicts with `_evict_one` and adds its
# scores inline (counted in the cache layer only); the general path reaches them through `_insert` / `_evict`
for method, part in (("forward_attention", "cache layer"), ("_attend", "attention"), ("_evict", "eviction"),
                     ("_evict_one", "eviction"), ("_insert", "insertion"), ("_write", "insertion"),
                     ("_add_scores", "scores")):
    timed(layer_class, method, part)
with torch.inference_mode():
    token, _ = prefill(model, cache, prompt_ids(ids, L, 1))
    cache.batch_repeat_interleave(B)
    token = token.repeat_interleave(B, dim=0)
    decode_steps(model, cache, token, L, 3)
    parts.update((part, 0.0) for part in parts)
    steps = decode_steps(model, cache, token, L + 3, STEPS)
print(f"{name} batch {B}: step {1000 * statistics.mean(steps):.1f} ms, of which "
      + ", ".join(f"{part} {1000 * seconds / STEPS:.1f}" for part, seconds in parts.items())
      + f" ms (torch threads {torch.get_num_threads()})")
