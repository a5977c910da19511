"""One layer's decode-step attention over float32 storage: the eager path (`kernel.attend_one`, torch's
batched products) against h2o-kv's C++ kernel (`native.attend_one`) (probe).

SmolLM2's shape (3 KV heads, 9 query heads, head size 64), batch 4, the slots H2O keeps at 20 % of 4,096
tokens, with the empty-slot mask (pos) and without (a packed layer); median of 200 calls, the two in turn.
"""

import statistics
import time

import torch

from h2o_kv import native
from h2o_kv.kernel import attend_one

native.load()
torch.manual_seed(0)
batch, heads, group, dim = 4, 3, 3, 64
print(f"# {torch.get_num_threads()} threads, batch {batch}, {heads} KV heads x {group}, head size {dim}")
for slots in (820, 1640):
    q = torch.randn(batch, heads * group, 1, dim)
    keys, values = torch.randn(batch, heads, slots, dim), torch.randn(batch, heads, slots, dim)
    for pos in (torch.arange(slots).repeat(batch, heads, 1), None):
        paths = {
            "eager": lambda: attend_one(q, keys, values, pos, scaling=0.125, want_scores=True, want_last=True),
            "C++ kernel": lambda: native.attend_one(q, keys, values, pos, scaling=0.125),
        }
        times = {name: [] for name in paths}
        for _ in range(200):
            for name, path in paths.items():
                start = time.perf_counter()
                path()
                times[name].append(time.perf_counter() - start)
        cells = [f"{name} {1e6 * statistics.median(t):6.1f} us" for name, t in times.items()]
        print(f"{slots} slots, {'pos' if pos is not None else 'packed'}:", " | ".join(cells))
