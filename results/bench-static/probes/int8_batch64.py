"""Decode steps of H2O float32 at batch 20 and H2O int8 at batch B (the same-memory batches), 4096 tokens,
20 %, stock model, decoding in turn (probe). usage: int8_batch64.py B STEPS"""
import sys, statistics, torch
from h2o_kv.models import load_model
from h2o_kv.bench.config import new_cache, policy_for
from h2o_kv.bench.sweep import prompt_ids, load_text
from h2o_kv.bench.timing import decode_in_turn, prefill
L = 4096; B8 = int(sys.argv[1]); steps = int(sys.argv[2])
model, tok = load_model("smollm2-135m")
ids = tok(load_text(), add_special_tokens=False)["input_ids"]
live = {}
for name, batch in (("h2o", 20), ("h2o-int8", B8)):
    cache = new_cache(model, name, policy_for(name, 0.2, L), max_len=L + steps + 4)
    with torch.inference_mode():
        token, _ = prefill(model, cache, prompt_ids(ids, L, 1))
    cache.batch_repeat_interleave(batch); token = token.repeat_interleave(batch, dim=0)
    live[name] = [cache, token]
    print(name, batch, "nbytes MB", cache.nbytes() / 1e6, flush=True)
with torch.inference_mode():
    s = decode_in_turn(model, live, L, steps)
for (name, v), batch in zip(s.items(), (20, B8)):
    print(name, batch, "median step ms", round(1000 * statistics.median(v[1:]), 1), "tok/s", round(batch / statistics.median(v[1:]), 1))
