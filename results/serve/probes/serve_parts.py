"""Where a serve engine step goes (probe): a 2048-token prompt in 256-token chunks, then a decode step at
batch B, for H2O at 20 % (batch 24, what 512 MiB admits) and the full cache (batch 4). One torch thread."""
import time, torch
import h2o_kv
from h2o_kv import KVCache, H2O
from h2o_kv.policies import Full
torch.set_num_threads(1)
model, tok = h2o_kv.load_model("smollm2-135m")
L, C = 2048, 256
ids = torch.randint(100, 30000, (1, L), generator=torch.Generator().manual_seed(0))
def chunk_times(policy):
    cache = KVCache(policy, prompt_len=L)
    times = []
    with torch.inference_mode():
        for s in range(0, L, C):
            t = time.perf_counter(); model(ids[:, s:s+C], past_key_values=cache, use_cache=True); times.append(time.perf_counter() - t)
    return cache, times
for name, pol, B in (("h2o", H2O(budget=0.2), 24), ("full", Full(), 4)):
    cache, times = chunk_times(pol)
    print(name, "chunk s", [round(x, 2) for x in times], flush=True)
    cache.batch_repeat_interleave(B)
    tokn = torch.full((B, 1), 500)
    st = []
    with torch.inference_mode():
        for i in range(5):
            t = time.perf_counter(); model(tokn, past_key_values=cache, use_cache=True); st.append(time.perf_counter() - t)
    print(name, f"decode batch {B} s", [round(x, 3) for x in st], flush=True)
