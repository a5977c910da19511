"""The cache step of two revisions of `csrc/attend_one.cpp` (argv[1], argv[2]: git revisions, default the commit
before the prefetching one and that commit), each built under its own op namespace and run in turn, one
30-layer pass each: `decode_step` over SmolLM2-135M's shapes at batch 4 (3 KV heads of 64, 3 query heads each),
820 kept slots (H2O at 20 % of 4096 tokens), each layer's storage distinct (read from memory, as in the model).
"""
import subprocess
import sys
import time

import torch
from torch.utils.cpp_extension import load

from h2o_kv import native

revs = sys.argv[1:3] if len(sys.argv) > 2 else ["c9d6964^", "c9d6964"]
B, H, G, D, S, LAYERS = 4, 3, 3, 64, 820, 30
ops = []
for i, rev in enumerate(revs):
    text = subprocess.run(["git", "show", f"{rev}:h2o_kv/csrc/attend_one.cpp"], capture_output=True, text=True,
                          check=True).stdout.replace("TORCH_LIBRARY(h2o_kv,", f"TORCH_LIBRARY(h2o_kv_ab{i},")  # fmt: skip
    path = f"/tmp/h2o_kv_ab{i}.cpp"
    with open(path, "w") as f:
        f.write(text)
    load(name=f"h2o_kv_ab{i}_{abs(hash(text)) % 10**8}", sources=[path], extra_cflags=native.flags(),
         is_python_module=False)  # fmt: skip
    ops.append(getattr(torch.ops, f"h2o_kv_ab{i}").decode_step)


def storage():
    pos = torch.arange(S).expand(B, H, S).contiguous()
    return [(torch.randn(B, H, S, D), torch.randn(B, H, S, D), pos.clone(), torch.rand(B, H, S), torch.rand(B, H, S))
            for _ in range(LAYERS)]  # fmt: skip


layers = [storage() for _ in ops]
q = torch.randn(B, H * G, 1, D)
new_keys, new_values = torch.randn(B, H, 1, D), torch.randn(B, H, 1, D)
slot = torch.zeros(B, H, 1, dtype=torch.long)
qpos, recent, capacity = torch.full((B,), S + 5), torch.full((B,), 8), torch.full((B,), S - 1)


def step(i):
    op = ops[i]
    for keys, values, pos, score, last in layers[i]:
        args = (keys, values, None, None, pos, score, last, slot, new_keys, new_values, None, None, qpos, recent, capacity)
        if "scaling" in str(op.default._schema):  # the later signature takes the query unscaled, [B, Hq, 1, D]
            op(q, *args, 0.125, 0.0)
        else:
            op((q * 0.125).view(B, H * G, D), *args, 0.0)


times = [[], []]
for i in (0, 1):
    step(i)
for r in range(60):
    for i in (0, 1) if r % 2 else (1, 0):
        start = time.perf_counter()
        step(i)
        times[i].append(time.perf_counter() - start)
kv = LAYERS * 2 * B * H * S * D * 4
print(f"# {torch.get_num_threads()} threads, {LAYERS} layers, KV {kv / 1e6:.0f} MB, 60 passes each, alternating")
for rev, ts in zip(revs, times):
    ts.sort()
    print(f"{rev}: best {ts[0] * 1e3:.2f} ms, median {ts[30] * 1e3:.2f} ms per pass ({kv / ts[30] / 1e9:.1f} GB/s)")
