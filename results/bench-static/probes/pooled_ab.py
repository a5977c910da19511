"""AdaKV's decode step in the model with two versions of the head-pooled kernel, alternating (probe).

The bench's size (4096-token prompts, batch 4, 20 %, float32, 2 threads, rows-first model), one AdaKV cache
prefilled, then rounds of 6 decode steps alternating between h2o-kv's `csrc/pooled_attend.cpp` (as built) and
another version of that file (`OTHER`, registered as torch.ops.h2o_other), with SnapKV's step (H2O's fused
step) just before each as the yardstick; each round's median step, and the median over rounds of
AdaKV's step over SnapKV's. The other version is read as given, e.g. the
last commit's: `git show HEAD:h2o_kv/csrc/pooled_attend.cpp > /tmp/pooled_old.cpp` (this session: commit 3c1f095).

    python results/bench-static/probes/pooled_ab.py /tmp/pooled_old.cpp
"""

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from h2o_kv import native
from h2o_kv.bench.config import new_cache, policy_for
from h2o_kv.generation import decode_step, prefill
from h2o_kv.models import load_model

folder = Path(tempfile.mkdtemp())
other = Path(sys.argv[1]).read_text().replace("TORCH_LIBRARY_FRAGMENT(h2o_kv, m)", "TORCH_LIBRARY(h2o_other, m)")
(folder / "other.cpp").write_text(other)
native.load()
load(name="h2o_other_pooled", sources=[str(folder / "other.cpp")], extra_cflags=native.flags(), is_python_module=False,
     build_directory=str(folder))  # fmt: skip
mine = torch.ops.h2o_kv.pooled_decode_step

torch.set_num_threads(2)
model, _ = load_model("smollm2-135m", rows_first=True)
batch, n = 4, 4096
prompt = torch.randint(100, 30000, (batch, n), generator=torch.Generator().manual_seed(0))
names = ("snapkv", "adakv")
caches, tokens, position = {}, {}, {}
with torch.inference_mode():
    for name in names:
        caches[name] = new_cache(model, name, policy_for(name, 0.2, n), max_len=n + 200)
        tokens[name] = prefill(model, caches[name], prompt).argmax(-1)
        position[name] = n

    def run(name, steps):
        times = []
        for _ in range(steps):
            begin = time.perf_counter()
            step = torch.full((batch,), position[name])
            tokens[name] = decode_step(model, caches[name], tokens[name], step).argmax(-1)
            position[name] += 1
            times.append(time.perf_counter() - begin)
        return statistics.median(times) * 1e3

    rows = {"snapkv": [], "built": [], "other": []}
    for r in range(6):
        line = []
        for label in ("built", "other"):
            torch.ops.h2o_kv.pooled_decode_step = mine if label == "built" else torch.ops.h2o_other.pooled_decode_step
            rows["snapkv"].append(run("snapkv", 6))
            rows[label].append(run("adakv", 6))
            line.append(f"snapkv {rows['snapkv'][-1]:.1f} ms, adakv ({label}) {rows[label][-1]:.1f} ms")
        print(f"round {r}: " + "; ".join(line), flush=True)
    for i, label in enumerate(("built", "other")):  # each round's adakv step over the snapkv step just before it
        ratios = [a / s for a, s in zip(rows[label], rows["snapkv"][i::2])]
        print(f"adakv ({label}): median step {statistics.median(rows[label]):.1f} ms, "
              f"{statistics.median(ratios):.3f}x snapkv's step in its round (median over rounds)")  # fmt: skip
