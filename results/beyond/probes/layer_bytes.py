"""KV bytes after a 1024-token prompt on Gemma 3 270M: uniform SnapKV against GlobalKV at 10 % and 20 %."""

import torch

import h2o_kv
from h2o_kv.generation import prefill
from h2o_kv.policies import build

torch.set_num_threads(1)
model, tokenizer = h2o_kv.load_model("gemma3-270m")
ids = torch.randint(1000, 20000, (1, 1024), generator=torch.Generator().manual_seed(0))
for budget in (0.1, 0.2):
    sizes = {}
    for name in ("snapkv", "globalkv"):
        cache = h2o_kv.KVCache(build(name, budget))
        with torch.inference_mode():
            prefill(model, cache, ids)
        sizes[name] = (cache.nbytes(), cache.kept_per_head().amax((1, 2)).tolist())
    print(f"budget {budget}: " + "; ".join(f"{n} {b} bytes, kept per layer {k}" for n, (b, k) in sizes.items()))
