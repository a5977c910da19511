"""A compiled decode step against the eager one: stock StaticCache on the bundled SmolLM2 (probe).

torch.compile(model.forward) is transformers' documented fast path for StaticCache. Batch 4, a 512-token
prompt, float32, 2 torch threads; median of 20 steps each, after the compiled step's first (compiling) call.
"""

import time

import torch
from transformers import StaticCache

from h2o_kv.models import load_model

torch.set_num_threads(2)
model, _ = load_model("smollm2-135m", enable_h2o=False, rows_first=True)
model.set_attn_implementation("sdpa")
batch, prompt = 4, 512
ids = torch.randint(100, 30000, (batch, prompt), generator=torch.Generator().manual_seed(0))


def steps(forward, n=20):
    cache = StaticCache(config=model.config, max_cache_len=prompt + n + 1)
    with torch.inference_mode():
        token = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        seconds = []
        for i in range(n):
            begin = time.perf_counter()
            out = forward(input_ids=token, past_key_values=cache, cache_position=torch.tensor([prompt + i]))
            token = out.logits[:, -1:].argmax(-1)
            seconds.append(time.perf_counter() - begin)
    return sorted(seconds[1:])[len(seconds) // 2] * 1e3, seconds[0]


eager, _ = steps(model.forward)
compiled, first = steps(torch.compile(model.forward, dynamic=False))
print(f"eager StaticCache step     {eager:6.1f} ms")
print(f"compiled StaticCache step  {compiled:6.1f} ms  (first call, compiling: {first:.0f} s)")
