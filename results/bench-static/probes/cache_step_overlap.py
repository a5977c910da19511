"""Why the cache step reads its bytes slower than a plain sum does (probe).

H2O's steady step over SmolLM2-135M's shapes at batch 4 (3 KV heads of 64, 3 query heads each, 820 kept slots: H2O
at 20 % of 4096 tokens), float32, `csrc/attend_one.cpp`'s `decode_step`, all rounds in turn (40 rounds, medians):

- the step over 30 distinct layers (151 MB, read from memory, as in the model);
- the same over one layer 30 times (5 MB, in the core's caches): the kernel's own work without the memory's wait;
- plain sums of the same 151 MB in the kernel's order (each thread its rows, a row's keys then its values);
- variants of the kernel, built from text edits of `csrc/attend_one.cpp`: no software prefetch; rows handed out to
  the threads one at a time (an atomic counter, not torch's static split); the row's work in chunks of 64 slots
  (each chunk's logits, softmax and values together: the numbers are wrong, the work and the reads are the same;
  timing only), to see whether the two passes over a row (keys, then values) cost the overlap.

Each variant's outputs are checked against the kernel's (equal, except the chunked one).
"""

import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load, load_inline

from h2o_kv import native

B, H, G, D, S, LAYERS, ROUNDS = 4, 3, 3, 64, 820, 30, 40
source = open("h2o_kv/csrc/attend_one.cpp").read()

PREFETCH = "  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 3);"
STATIC_ROWS = """    at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
      thread_local std::vector<float> query, probs, weights;  // scratch, kept between calls
      query.resize(G * D);
      probs.resize(G * S);
      weights.resize(int8 ? G * S : 0);
      for (int64_t r = begin; r < end; ++r) {"""
DYNAMIC_ROWS = """    std::atomic<int64_t> next_row{0};
    at::parallel_for(0, std::min<int64_t>(B * H, at::get_num_threads()), 1, [&](int64_t, int64_t) {
      thread_local std::vector<float> query, probs, weights;  // scratch, kept between calls
      query.resize(G * D);
      probs.resize(G * S);
      weights.resize(int8 ? G * S : 0);
      const int64_t end = B * H;
      for (int64_t r; (r = next_row.fetch_add(1)) < end;) {"""
TWO_PASSES = """  const float hidden = -std::numeric_limits<float>::infinity();
  dots(q, G, keys, S, D, probs, values);"""
CHUNKS = """  const float hidden = -std::numeric_limits<float>::infinity();
  if (G * 64 <= 3 * 64 && D <= 64) {  // timing only: each 64-slot chunk's logits, softmax and values together
    std::fill(out, out + G * D, 0.f);
    for (int64_t c0 = 0; c0 < S; c0 += 64) {
      const int64_t n = std::min<int64_t>(64, S - c0);
      float chunk[3 * 64], part[3 * 64];
      dots(q, G, keys + c0 * D, n, D, chunk);
      for (int64_t g = 0; g < G; ++g) softmax(chunk + g * n, n);
      weighted_sums(chunk, G, values + c0 * D, n, D, part);
      for (int64_t i = 0; i < G * D; ++i) out[i] += part[i];
      for (int64_t g = 0; g < G; ++g) std::copy(chunk + g * n, chunk + (g + 1) * n, probs + g * S + c0);
    }
    return;
  }
  dots(q, G, keys, S, D, probs, values);"""
for text in (PREFETCH, STATIC_ROWS, TWO_PASSES):
    assert text in source, "csrc/attend_one.cpp changed: update the probe's edits"
variants = {
    "kernel": source,
    "no software prefetch": source.replace(PREFETCH, "  (void)c;\n  (void)bytes;"),
    "rows handed out one at a time": source.replace(STATIC_ROWS, DYNAMIC_ROWS).replace(
        "#include <vector>\n", "#include <vector>\n#include <atomic>\n", 1
    ),
    "chunks of 64 slots (timing only)": source.replace(TWO_PASSES, CHUNKS),
}
ops = {}
for i, (name, text) in enumerate(variants.items()):
    path = f"/tmp/h2o_kv_overlap{i}.cpp"
    with open(path, "w") as f:
        f.write(text.replace("TORCH_LIBRARY(h2o_kv,", f"TORCH_LIBRARY(h2o_kv_overlap{i},"))
    load(name=f"h2o_kv_overlap{i}_{abs(hash(text)) % 10**8}", sources=[path], is_python_module=False,
         extra_cflags=native.flags() + [f"-I{Path('h2o_kv/csrc').resolve()}"])  # fmt: skip
    ops[name] = getattr(torch.ops, f"h2o_kv_overlap{i}").decode_step

SUMS = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
using Vec = at::vec::Vectorized<float>;
static float row_sum(const float* p, int64_t n) {
  Vec s[4] = {Vec(0.f), Vec(0.f), Vec(0.f), Vec(0.f)};
  for (int64_t i = 0; i + 4 * Vec::size() <= n; i += 4 * Vec::size())
    for (int j = 0; j < 4; ++j) s[j] = s[j] + Vec::loadu(p + i + j * Vec::size());
  float lane[Vec::size()];
  (s[0] + s[1] + s[2] + s[3]).store(lane);
  return lane[0];
}
// per layer, each thread its rows (torch's static split), a row's keys then its values
double rows_sum(std::vector<at::Tensor> keys, std::vector<at::Tensor> values, int64_t rows) {
  double total = 0;
  for (size_t l = 0; l < keys.size(); ++l) {
    const float* k = keys[l].data_ptr<float>();
    const float* v = values[l].data_ptr<float>();
    const int64_t n = keys[l].numel() / rows;
    std::vector<float> part(64 * 16, 0.f);  // one per thread, a cache line apart
    at::parallel_for(0, rows, 1, [&](int64_t a, int64_t b) {
      for (int64_t r = a; r < b; ++r) part[at::get_thread_num() * 16] += row_sum(k + r * n, n) + row_sum(v + r * n, n);
    });
    total += part[0];
  }
  return total;
}
"""
sums = load_inline("h2o_kv_overlap_sums", cpp_sources=SUMS, functions=["rows_sum"], extra_cflags=native.flags())


def layer():
    pos = torch.arange(S).expand(B, H, S).contiguous()
    return torch.randn(B, H, S, D), torch.randn(B, H, S, D), pos, torch.rand(B, H, S), torch.zeros(B, H, S)


q = torch.randn(B, H * G, 1, D)
new_keys, new_values = torch.randn(B, H, 1, D), torch.randn(B, H, 1, D)
slot = torch.zeros(B, H, 1, dtype=torch.long)
qpos, recent, capacity = torch.full((B,), S + 5), torch.full((B,), 8), torch.full((B,), S - 1)


def step(op, layers):
    for keys, values, pos, score, last in layers:
        op(q, keys, values, None, None, pos, score, last, slot, new_keys, new_values, None, None, qpos, recent,
           capacity, 0.125, 0.0)  # fmt: skip


base, reference = layer(), None
for name, op in ops.items():  # the same inputs through each variant
    keys, values, pos, score, last = (t.clone() for t in base)
    out, freed = op(q, keys, values, None, None, pos, score, last, slot, new_keys, new_values, None, None, qpos,
                    recent, capacity, 0.125, 0.0)  # fmt: skip
    if reference is None:
        reference = out, freed, score
    else:
        same = all(torch.equal(a, b) for a, b in zip((out, freed, score), reference))
        print(f"# {name}: outputs, freed slots and scores {'equal' if same else 'differ'} to the kernel's")

memory = {name: [layer() for _ in range(LAYERS)] for name in ops}
cached = [layer()] * LAYERS
plain = [layer() for _ in range(LAYERS)]
paths = {f"{name}, from memory": (lambda op=op, n=name: step(op, memory[n])) for name, op in ops.items()}
paths["kernel, one layer 30 times (in cache)"] = lambda: step(ops["kernel"], cached)
paths["plain sums, the kernel's order"] = lambda: sums.rows_sum([p[0] for p in plain], [p[1] for p in plain], B * H)
times = {name: [] for name in paths}
for round_ in range(ROUNDS):
    for name in paths if round_ % 2 else reversed(list(paths)):
        start = time.perf_counter()
        paths[name]()
        times[name].append(time.perf_counter() - start)
kv = LAYERS * 2 * B * H * S * D * 4
print(f"# {torch.get_num_threads()} threads, {LAYERS} layers, KV {kv / 1e6:.0f} MB, {ROUNDS} rounds in turn, medians "
      f"(the first 4 rounds left out); {sys.argv[0]}")  # fmt: skip
for name, ts in times.items():
    median = statistics.median(ts[4:])
    print(f"{name:45s} {median * 1e3:6.2f} ms ({kv / median / 1e9:5.1f} GB/s), best {min(ts) * 1e3:.2f}")
