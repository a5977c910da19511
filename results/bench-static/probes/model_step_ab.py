"""Two revisions of the kernels (argv[1], argv[2]: git revisions) in the whole rows-first decode step, alternating step
by step on one cache: SmolLM2-135M, batch 4 after an argv[3]-token prompt (default 1024), H2O at 20 %, in argv[4]'s
dtype (default bfloat16), torch's default threads, argv[5] steps of each (default 60). Each revision's `csrc/` is
built under its own op namespace and `native.model_step` and `native.rows_linear` (the output projection) call the
revision whose turn it is; everything else is the working tree's. Medians and quartiles of the whole step, in ms.
"""

import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

import h2o_kv.generation as g
from h2o_kv import native
from h2o_kv.bench.config import new_cache, policy_for
from h2o_kv.models import load_model

revs = sys.argv[1:3]
n = int(sys.argv[3]) if len(sys.argv) > 3 else 1024
dtype = sys.argv[4] if len(sys.argv) > 4 else "bfloat16"
steps = int(sys.argv[5]) if len(sys.argv) > 5 else 60
libs = []
for i, rev in enumerate(revs):
    folder = Path(f"/tmp/model_step_ab_{i}")
    folder.mkdir(exist_ok=True)
    paths = []
    for path in [*native.SOURCES, *native.HEADERS]:
        text = subprocess.run(["git", "show", f"{rev}:h2o_kv/csrc/{path.name}"], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip
        text = text.replace("TORCH_LIBRARY(h2o_kv,", f"TORCH_LIBRARY(h2o_kv_ab{i},")
        text = text.replace("TORCH_LIBRARY_FRAGMENT(h2o_kv,", f"TORCH_LIBRARY_FRAGMENT(h2o_kv_ab{i},")
        (folder / path.name).write_text(text)
        if path.suffix == ".cpp":
            paths.append(str(folder / path.name))
    load(name=f"h2o_kv_ab{i}_{abs(hash(rev)) % 10**8}", sources=paths, extra_cflags=native.flags(),
         is_python_module=False)  # fmt: skip
    libs.append(getattr(torch.ops, f"h2o_kv_ab{i}"))
turn = [0]  # the revision whose turn it is
step_of_tree = native.model_step
native.load()
native.model_step = lambda *args: step_of_tree(*args, ops=libs[turn[0]])
native.rows_linear = lambda x, weight, bias: libs[turn[0]].rows_linear(x, weight, bias)
model = load_model("smollm2-135m", dtype=dtype, rows_first=True)[0]
prompt, token = torch.randint(100, 30000, (4, n)), torch.randint(100, 30000, (4, 1))
times = [[], []]
with torch.inference_mode():
    cache = new_cache(model, "h2o", policy_for("h2o", 0.2, n), max_len=n + 2 * steps + 16)
    g.forward(model, cache, prompt)
    for i in range(2 * steps + 8):
        turn[0] = i % 2
        start = time.perf_counter()
        g.forward(model, cache, token, positions=torch.full((4, 1), n + i))
        if i >= 8:
            times[turn[0]].append(time.perf_counter() - start)
print(f"# {n}-token prompt, batch 4, H2O 20 %, {dtype}, {torch.get_num_threads()} threads, {steps} steps each, "
      "alternating")  # fmt: skip
for rev, t in zip(revs, times):
    q = statistics.quantiles(t, n=4)
    print(f"{rev}: median {1e3 * q[1]:.2f} ms, quartiles {1e3 * q[0]:.2f}-{1e3 * q[2]:.2f} ms")
