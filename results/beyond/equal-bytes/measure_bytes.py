"""KV bytes (`KVCache.nbytes()`: keys, values, scales, each slot's position and score) after one prompt,
for the token budgets of the equal-bytes runs, float32 and int8 storage, on the bundled SmolLM2 (or, given
`gemma3-270m`, the streaming perplexity budgets of Gemma 3: int8 holds 3.9x the tokens of its 256-wide heads, and
its sliding layers keep no more than their window).

    python results/beyond/equal-bytes/measure_bytes.py > results/beyond/equal-bytes/bytes.txt
    python results/beyond/equal-bytes/measure_bytes.py gemma3-270m > results/beyond/equal-bytes/bytes-gemma3.txt
"""

import sys

import torch

import h2o_kv
from h2o_kv.generation import prefill
from h2o_kv.policies import build

torch.set_num_threads(1)
MODEL = sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m"
model, _ = h2o_kv.load_model(MODEL)
# (policy, KV storage, budget in tokens, prompt length, what it is compared with)
RUNS = [
    ("globalkv", None, 197, 1024, "kvpress 20 % at 1k: 9,160-9,166 KiB"),
    ("globalkv", None, 397, 2048, "kvpress 20 % at 2k: 18,358-18,362 KiB"),
    ("globalkv", "int8", 350, 1024, "kvpress 10 % at 1k: 4,570-4,576 KiB"),
    ("globalkv", "int8", 703, 1024, "kvpress 20 % at 1k: 9,160-9,166 KiB"),
    ("globalkv", "int8", 704, 2048, "kvpress 10 % at 2k: 9,171-9,173 KiB"),
    ("globalkv", "int8", 1410, 2048, "kvpress 20 % at 2k: 18,358-18,362 KiB"),
    ("h2o", "int8", 1410, 2048, "kvpress 20 % at 2k: 18,358-18,362 KiB"),
    ("h2o", None, 102, 1024, "streaming perplexity, H2O float32 at 10 % of 1024"),
    ("h2o", "int8", 363, 1024, "streaming perplexity, H2O int8 at float32 10 %'s bytes"),
    ("h2o", None, 204, 1024, "streaming perplexity, H2O float32 at 20 % of 1024"),
    ("h2o", "int8", 724, 1024, "streaming perplexity, H2O int8 at float32 20 %'s bytes"),
]
if MODEL == "gemma3-270m":
    RUNS = [
        ("h2o", None, 102, 1024, "streaming perplexity, H2O float32 at 10 % of 1024"),
        ("h2o", "int8", 397, 1024, "streaming perplexity, H2O int8 at float32 10 %'s bytes"),
        ("h2o", None, 204, 1024, "streaming perplexity, H2O float32 at 20 % of 1024"),
        ("h2o", "int8", 792, 1024, "H2O int8 at 792: a sliding layer keeps no more than its 512-token window"),
        ("h2o", "int8", 1024, 1024, "streaming perplexity, H2O int8 keeping every token, within float32 20 %'s bytes"),
    ]
ids = torch.randint(1000, 20000, (1, 2048), generator=torch.Generator().manual_seed(0))
print("policy    storage  budget  prompt  KiB        compared with")
for name, kv_dtype, budget, length, against in RUNS:
    cache = h2o_kv.KVCache(build(name, budget), kv_dtype=kv_dtype)
    with torch.inference_mode():
        prefill(model, cache, ids[:, :length])
    print(f"{name:9s} {kv_dtype or 'float32':8s} {budget:6d}  {length:6d}  {cache.nbytes() / 1024:9.1f}  {against}")
