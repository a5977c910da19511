"""Why AdaKV's fused decode step costs more than H2O's: the C++ steps over the bench's sizes, outside the model.

30 layers of full caches at 4096 tokens x batch 4 and 20 % (820 slots per KV head, 3 KV heads, head size 64,
3 query heads per KV head): a uniform layer's `native.decode_step` (H2O, SnapKV) and a head-pooled layer's
`native.pooled_decode_step` (AdaKV: one row of 2,460 slots per sequence shared by the heads), each layer's
storage its own memory (5 MB of keys and values a layer, 150 MB in all, far beyond the caches), decoding in
turn. Then the pooled step's phases, timed inside a copy of `csrc/pooled_attend.cpp` built under another
name with timers between its phases, and a plain sum of the same keys and values (the memory's speed).

    python results/bench-static/probes/pooled_phases.py
"""

import re
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from h2o_kv import native

torch.manual_seed(0)
torch.set_num_threads(2)
B, H, G, D, C, L = 4, 3, 3, 64, 820, 30
S = H * C

# the timed copy: the same source, registered as torch.ops.h2o_probe, with a timer after each phase
source = (Path(native.__file__).parent / "csrc" / "pooled_attend.cpp").read_text()
source = source.replace("TORCH_LIBRARY_FRAGMENT(h2o_kv, m)", "TORCH_LIBRARY(h2o_probe, m)")
source = source.replace(
    "#include <vector>\n",
    "#include <vector>\n#include <chrono>\nstatic double T[5];\nstatic double now() { return std::chrono::duration"
    "<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count(); }\n",
    1,
)
marks = [("  // 1. logits", None), ("  // 2. softmax", 0), ("  // 3. the weighted values", 1), ("  // the chunks' outputs", 2)]
for i, (mark, slot) in enumerate(marks):
    timer = f"  double t{i} = now();" + ("" if slot is None else f" T[{slot}] += t{i} - t{i - 1};")
    assert mark in source, mark
    source = source.replace(mark, timer + "\n" + mark, 1)
source = source.replace("}  // namespace\n", "}  // namespace\nstd::vector<double> phase_times() "
                        "{ std::vector<double> r(T, T + 3); for (auto& t : T) t = 0; return r; }\n")  # fmt: skip
source = re.sub(r'(m\.def\("lowest_slots[^;]*;)', r'\1\n  m.def("phase_times() -> float[]", &phase_times);', source)
folder = Path(tempfile.mkdtemp())
(folder / "pooled_timed.cpp").write_text(source)
native.load()
load(name="h2o_probe_pooled_timed", sources=[str(folder / "pooled_timed.cpp")], extra_cflags=native.flags(),
     is_python_module=False, build_directory=str(folder))  # fmt: skip


def uniform_layer():
    keys, values = torch.randn(2, B, H, C, D)
    pos = torch.stack([torch.randperm(5000)[:C] for _ in range(B * H)]).view(B, H, C)
    vacant = torch.randint(0, C, (B, H, 1))
    pos.scatter_(2, vacant, -1)
    return dict(keys=keys, values=values, pos=pos, score=torch.rand(B, H, C).masked_fill(pos < 0, 0), vacant=vacant)


def pooled_layer():
    keys, values = torch.randn(2, B, 1, S, D)
    pos = torch.stack([torch.randperm(5000)[:S] for _ in range(B)]).view(B, 1, S)
    vacant = torch.stack([torch.randperm(S)[:H].sort().values for _ in range(B)]).view(B, 1, H)
    pos.scatter_(2, vacant, -1)
    head = torch.randint(0, H, (B, 1, S), dtype=torch.int8)
    score = torch.rand(B, 1, S).masked_fill(pos < 0, 0)
    return dict(keys=keys, values=values, pos=pos, score=score, vacant=vacant, head=head)


uniform, pooled = [uniform_layer() for _ in range(L)], [pooled_layer() for _ in range(L)]
q, (new_keys, new_values) = torch.randn(B, H * G, 1, D), torch.randn(2, B, H, 1, D)
capacity, recent = torch.full((B, 1), C - 1), torch.full((B, 1, 1), 410)
step = [6000]


def run_uniform():
    begin = time.perf_counter()
    for layer in uniform:
        qpos = torch.full((B, 1), step[0])
        _, layer["vacant"] = native.decode_step(
            q, layer["keys"], layer["values"], layer["pos"], layer["score"], None, layer["vacant"], new_keys,
            new_values, qpos, recent, capacity, scaling=D**-0.5,
        )  # fmt: skip
    return (time.perf_counter() - begin) / L * 1e6


def run_pooled(op=None):
    begin = time.perf_counter()
    for layer in pooled:
        qpos = torch.full((B, 1), step[0])
        args = (layer["keys"], layer["values"], layer["head"], layer["pos"], layer["score"], None, layer["vacant"],
                new_keys.view(B, 1, H, D), new_values.view(B, 1, H, D))  # fmt: skip
        if op is None:
            _, freed, tied = native.pooled_decode_step(q, *args, qpos, recent, scaling=D**-0.5)
        else:
            _, freed, tied = op((q * D**-0.5).view(B, H * G, D), *args, qpos.view(-1), recent.view(-1), H, 0.0)
        if not bool(tied):
            layer["vacant"] = freed
    step[0] += 1
    return (time.perf_counter() - begin) / L * 1e6


print(f"torch threads {torch.get_num_threads()}, {L} layers, B={B}, {H} KV heads x {C} slots (pooled rows of {S})")
for r in range(5):
    u = statistics.median(run_uniform() for _ in range(5))
    p = statistics.median(run_pooled() for _ in range(5))
    print(f"round {r}: decode_step {u:.0f} us a layer, pooled_decode_step {p:.0f} us a layer ({p / u:.2f}x)")
op = torch.ops.h2o_probe.pooled_decode_step
for r in range(3):
    torch.ops.h2o_probe.phase_times()
    total = statistics.mean(run_pooled(op) for _ in range(5))
    logits, softmax, weighted = (t / (5 * L) for t in torch.ops.h2o_probe.phase_times())
    print(f"pooled phases, round {r}: {total:.0f} us a layer: 1. logits {logits:.0f}, 2. softmax {softmax:.0f}, "
          f"3. values {weighted:.0f}, the rest (write, scores, eviction, calls) {total - logits - softmax - weighted:.0f}")  # fmt: skip
for r in range(3):
    begin = time.perf_counter()
    for layer in pooled:
        layer["keys"].sum()
    keys = (time.perf_counter() - begin) / L * 1e6
    begin = time.perf_counter()
    for layer in pooled:
        layer["values"].sum()
    values = (time.perf_counter() - begin) / L * 1e6
    print(f"a plain sum of one layer's keys: {keys:.0f} us, of its values: {values:.0f} us "
          f"({2 * B * S * D * 4 / (keys + values) / 1e3:.1f} GB/s)")  # fmt: skip
