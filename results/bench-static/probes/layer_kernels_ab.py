"""The layer kernels (`layer_in` + `layer_out`) of two revisions of `csrc/rows_linear.cpp` (argv[1], argv[2]: git
revisions, default the commit before the next-region prefetch and that commit), each built under its own op
namespace, over 30 SmolLM2-135M layers of random weights at 4 rows, in argv[3]'s dtype (default float32), one pass
each in turn (40 each)."""
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from h2o_kv import native

revs = sys.argv[1:3] if len(sys.argv) > 2 else ["c9d6964^", "c9d6964"]
dtype = getattr(torch, sys.argv[3] if len(sys.argv) > 3 else "float32")
libs = []
for i, rev in enumerate(revs):
    text = subprocess.run(["git", "show", f"{rev}:h2o_kv/csrc/rows_linear.cpp"], capture_output=True, text=True,
                          check=True).stdout.replace("TORCH_LIBRARY_FRAGMENT(h2o_kv,", f"TORCH_LIBRARY(h2o_kv_l{i},")
    path = f"/tmp/h2o_kv_l{i}.cpp"  # kernels.h beside it
    (Path("/tmp") / "kernels.h").write_text((Path(native.__file__).parent / "csrc" / "kernels.h").read_text())
    with open(path, "w") as f:
        f.write(text)
    load(name=f"h2o_kv_l{i}_{abs(hash(text)) % 10**8}", sources=[path], extra_cflags=native.flags(),
         is_python_module=False)
    libs.append(getattr(torch.ops, f"h2o_kv_l{i}"))
K, I, D = 576, 1536, 64


def layer():
    shapes = dict(q=(576, K), k=(192, K), v=(192, K), o=(K, 576), g=(I, K), u=(I, K), d=(K, I))
    weights = {name: torch.randn(*shape) * 0.05 for name, shape in shapes.items()}
    weights |= dict(n1=torch.ones(K), n2=torch.ones(K))
    return {name: w.to(dtype) for name, w in weights.items()}


sets = [[layer() for _ in range(30)] for _ in libs]
x, attn = torch.randn(4, 1, K).to(dtype), torch.randn(4, 1, 576).to(dtype)
cos, sin = torch.randn(1, 1, D).to(dtype), torch.randn(1, 1, D).to(dtype)


def run(i):
    lib = libs[i]
    for w in sets[i]:
        lib.layer_in(x, w["n1"], 1e-5, w["q"], None, w["k"], None, w["v"], None, cos, sin, D)
        lib.layer_out(x, attn, w["o"], None, w["n2"], 1e-5, w["g"], None, w["u"], None, w["d"], None)


nbytes = sum(t.numel() * t.element_size() for w in sets[0] for t in w.values())
times = [[], []]
for r in range(40):
    for i in (0, 1) if r % 2 else (1, 0):
        start = time.perf_counter()
        run(i)
        times[i].append(time.perf_counter() - start)
print(f"# {dtype}, {torch.get_num_threads()} threads, 30 layers, {nbytes / 1e6:.0f} MB of weights, 40 passes each, "
      "alternating")
for rev, ts in zip(revs, times):
    ts.sort()
    print(f"{rev}: best {ts[0] * 1e3:.1f} ms, median {ts[20] * 1e3:.1f} ms ({nbytes / ts[20] / 1e9:.1f} GB/s)")
