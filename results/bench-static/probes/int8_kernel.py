"""int8 KV's decode step with h2o-kv's C++ kernel (native.attend_one, the default where it builds), with
the eager path (`compile_kernel=False`: widen to float, then MKL's products), and float32 storage with
the same kernel (the default) and without it, on the stock model.

H2O keeping 820 of 1024 tokens (the bench's 819 kept at 4096 x 20 %: the decode step reads the kept tokens
only), batch 4, 2 threads, SmolLM2-135M float32. The three caches decode in turn, one step each
(`decode_in_turn`, as `h2o-kv bench --interleave`), 16 steps per round, four rounds, so the machine's drift
hits them alike; medians per round.

    python results/bench-static/probes/int8_kernel.py
"""

import statistics

import torch

from h2o_kv import H2O, KVCache
from h2o_kv.bench.config import use_path
from h2o_kv.bench.timing import decode_in_turn, prefill
from h2o_kv.models import load_model

torch.set_num_threads(2)
torch.manual_seed(0)
model, _ = load_model("smollm2-135m")
use_path(model, "h2o")
B, P, KEPT = 4, 1024, 820
ids = torch.randint(0, 1000, (B, P))
caches = {
    "float32": KVCache(H2O(budget=KEPT)),
    "float32 eager": KVCache(H2O(budget=KEPT), compile_kernel=False),
    "int8 eager": KVCache(H2O(budget=KEPT), kv_dtype="int8", compile_kernel=False),
    "int8 kernel": KVCache(H2O(budget=KEPT), kv_dtype="int8"),
}
with torch.inference_mode():
    live = {name: [cache, prefill(model, cache, ids)[0]] for name, cache in caches.items()}
    decode_in_turn(model, live, P, 2)
    start = P + 2
    for r in range(4):
        seconds = decode_in_turn(model, live, start, 16)
        start += 16
        base = statistics.median(seconds["float32"])
        print(f"round {r}: " + ", ".join(f"{n} {statistics.median(s) * 1e3:.1f} ms ({base / statistics.median(s):.2f}x)"
                                         for n, s in seconds.items()), flush=True)  # fmt: skip
    kv = {n: c.nbytes() / 2**20 for n, c in caches.items()}
    print("KV MiB: " + ", ".join(f"{n} {v:.1f}" for n, v in kv.items()) + f" (torch threads {torch.get_num_threads()})")
