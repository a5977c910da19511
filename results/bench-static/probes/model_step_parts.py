"""Where a rows-first H2O decode step goes once the whole model's step is one C++ call (fused_model.py): SmolLM2-135M,
batch 4 after an argv[1]-token prompt (default 512), H2O at 20 %, in argv[3]'s dtype (default float32), torch's
default threads, argv[2] steps (default 100). The kernels are built a second time with timers around their parallel
regions (the products' and the cache step's) and around `model_step` and each layer's `decode_step` (text inserted
into a copy of `csrc/`, registered as `torch.ops.h2o_kv_parts`), and the Python around the call is timed by wrapping
its functions.
Medians per step, in ms: the step, `model_step` split into the products' regions, the cache step's region, the
decode_step calls' serial part and the rest of the call's serial work (norms, rotary, SiLU, residuals, tensors
made); then the output projection, the cache's bookkeeping and the model's other Python.
"""
import functools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

import h2o_kv.generation as g
from h2o_kv import cache as cache_module
from h2o_kv import fused_model, native
from h2o_kv.bench.config import new_cache, policy_for
from h2o_kv.models import load_model

n = int(sys.argv[1]) if len(sys.argv) > 1 else 512
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 100
dtype = sys.argv[3] if len(sys.argv) > 3 else "float32"
CLOCK = "std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count()"


def timed_sources(folder: Path) -> list[str]:
    """The kernels' sources with timers: region 0 the products, 1 the cache step, 2 model_step, 3 decode_step."""
    csrc = Path(native.__file__).parent / "csrc"
    header = (csrc / "kernels.h").read_text() + (
        "\n#include <chrono>\nnamespace h2o_kv { inline double parts[4] = {0, 0, 0, 0};\n"
        f"inline double clock_now() {{ return {CLOCK}; }} }}\n"
    )
    (folder / "kernels.h").write_text(header)
    edits = {
        "rows_linear.cpp": [
            ("  at::parallel_for(0, total, 64, [&](int64_t j0, int64_t j1) {",
             "  const double t0 = h2o_kv::clock_now();\n  at::parallel_for(0, total, 64, [&](int64_t j0, int64_t j1) {"),
            ("      prefetch_rows<T>(*next, first_column(next_total), std::max<int64_t>(1, NEXT_BYTES / row_bytes));\n"
             "    }\n  });\n",
             "      prefetch_rows<T>(*next, first_column(next_total), std::max<int64_t>(1, NEXT_BYTES / row_bytes));\n"
             "    }\n  });\n  h2o_kv::parts[0] += h2o_kv::clock_now() - t0;\n"),
        ],
        "attend_one.cpp": [
            ("    at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {\n      thread_local",
             "    const double t0 = h2o_kv::clock_now();\n    at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end)"
             " {\n      thread_local"),
            ("        vp[r] = victim;\n      }\n    });\n",
             "        vp[r] = victim;\n      }\n    });\n    h2o_kv::parts[1] += h2o_kv::clock_now() - t0;\n"),
        ],
        "model_step.cpp": [
            ("  std::vector<at::Tensor> out(L + 1);", "  const double t0 = h2o_kv::clock_now();\n  std::vector<at::Tensor> out(L + 1);"),
            ("    const std::vector<at::Tensor> step = h2o_kv::decode_step(",
             "    const double td = h2o_kv::clock_now();\n    const std::vector<at::Tensor> step = h2o_kv::decode_step("),
            ("    h = h2o_kv::layer_out(", "    h2o_kv::parts[3] += h2o_kv::clock_now() - td;\n    h = h2o_kv::layer_out("),
            ("  out[0] = h;\n  return out;", "  out[0] = h;\n  h2o_kv::parts[2] += h2o_kv::clock_now() - t0;\n  return out;"),
            ("TORCH_LIBRARY_FRAGMENT(h2o_kv, m) {",
             "std::vector<double> read_parts() {\n  std::vector<double> v(h2o_kv::parts, h2o_kv::parts + 4);\n"
             "  for (auto& x : h2o_kv::parts) x = 0;\n  return v;\n}\n"
             "TORCH_LIBRARY_FRAGMENT(h2o_kv, m) {\n  m.def(\"read_parts() -> float[]\", &read_parts);"),
        ],
    }
    paths = []
    for source in native.SOURCES:
        text = source.read_text()
        for old, new in edits.get(source.name, []):
            assert text.count(old) == 1, (source.name, old)
            text = text.replace(old, new)
        text = text.replace("TORCH_LIBRARY(h2o_kv,", "TORCH_LIBRARY(h2o_kv_parts,")
        text = text.replace("TORCH_LIBRARY_FRAGMENT(h2o_kv,", "TORCH_LIBRARY_FRAGMENT(h2o_kv_parts,")
        (folder / source.name).write_text(text)
        paths.append(str(folder / source.name))
    return paths


with tempfile.TemporaryDirectory() as folder:
    load(name="h2o_kv_parts", sources=timed_sources(Path(folder)), extra_cflags=native.flags(), is_python_module=False)
ops = torch.ops.h2o_kv_parts
python = {}


def wrapped(name, f):
    @functools.wraps(f)
    def run(*args, **kwargs):
        start = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            python[name] = python.get(name, 0.0) + time.perf_counter() - start

    return run


model = load_model("smollm2-135m", dtype=dtype, rows_first=True)[0]
fused_model.native.model_step = wrapped("model_step", functools.partial(native.model_step, ops=ops))  # the timed build
cache_module.KVCache.steady_plans = wrapped("steady_plans", cache_module.KVCache.steady_plans)
fused_model.FusedLlamaModel.forward = wrapped("model", fused_model.FusedLlamaModel.forward)
model.lm_head.forward = wrapped("lm_head", model.lm_head.forward)
prompt, token = torch.randint(100, 30000, (4, n)), torch.randint(100, 30000, (4, 1))
rows = []
with torch.inference_mode():
    cache = new_cache(model, "h2o", policy_for("h2o", 0.2, n), max_len=n + steps + 8)
    g.forward(model, cache, prompt)
    for i in range(3):
        g.forward(model, cache, token, positions=torch.full((4, 1), n + i))
    ops.read_parts()
    for i in range(steps):
        python.clear()
        start = time.perf_counter()
        g.forward(model, cache, token, positions=torch.full((4, 1), n + 3 + i))
        step = time.perf_counter() - start
        products, attend, call, decode = ops.read_parts()
        rows.append(dict(step=step, model_step=call, products=products, cache_step=attend,
                         decode_serial=decode - attend, other_serial=call - products - decode,
                         lm_head=python["lm_head"], bookkeeping=python["steady_plans"],
                         model_python=python["model"] - python["model_step"] - python["steady_plans"],
                         outside=step - python["model"] - python["lm_head"]))  # fmt: skip
print(f"# {n}-token prompt, batch 4, H2O 20 %, {dtype}, {torch.get_num_threads()} threads, {steps} steps: medians, ms")
for key in rows[0]:
    print(f"{key:14s} {1e3 * statistics.median(r[key] for r in rows):6.2f}")
