"""How many vector multiply-adds a core of this machine does per second, against what a decode step needs.

A C++ loop of 12 independent fused multiply-add chains at the vector width native.py compiles for (torch's
at::vec, 8 float32 lanes on AVX2), one thread, then the same on every torch thread at once; and the step's count:
SmolLM2-135M's products at batch 4 (each weight times 4 rows, V lanes at a time) and H2O's cache step at 20 % of
4096 tokens (3 query heads x 64 dims per kept slot, keys and values, 30 layers x 4 sequences x 3 KV heads). The
bandwidth floor assumes the arithmetic is free; this says how much of it is not.

The loop is a function of its own, called by each thread. Until 2026-11-26 it was written inside the parallel
lambda, and then each of two threads ran it 3x slower than one thread alone (a property of that code, not of the
machine: the same loop as a function runs at one thread's rate on both at once), so this probe reported 3.6-3.9 G
vector FMAs/s for two threads together and the step's arithmetic as 21-22 ms; both were wrong.
"""
import torch
from torch.utils.cpp_extension import load_inline

from h2o_kv import native

source = r"""
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <chrono>
#include <vector>
using Vec = at::vec::Vectorized<float>;
__attribute__((noinline)) float chains(int64_t iterations) {  // 12 independent multiply-add chains
  Vec acc[12];
  for (int j = 0; j < 12; ++j) acc[j] = Vec(static_cast<float>(j));
  const Vec a(0.5f), b(0.25f);  // the values stay finite
  for (int64_t i = 0; i < iterations; ++i)
    for (int j = 0; j < 12; ++j) acc[j] = at::vec::fmadd(acc[j], a, b);
  Vec sum = acc[0];
  for (int j = 1; j < 12; ++j) sum = sum + acc[j];
  float lane[Vec::size()];
  sum.store(lane);
  return lane[0];
}
double fma_seconds(int64_t iterations, int64_t threads) {
  std::vector<float> sink(threads * 16);  // each thread's result used, a cache line apart
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t) { sink[begin * 16] = chains(iterations); });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  static volatile float kept;
  kept = sink[0];
  return seconds;
}
int64_t lanes() { return Vec::size(); }
"""
module = load_inline("h2o_kv_fma_rate", cpp_sources=source, functions=["fma_seconds", "lanes"],
                     extra_cflags=native.flags())  # fmt: skip
V, threads, iterations = module.lanes(), torch.get_num_threads(), 20_000_000
print(f"# {V} float32 lanes, 12 chains, {iterations:,} iterations per thread, best of 5")
rates = {}
for t in (1, threads):
    best = min(module.fma_seconds(iterations, t) for _ in range(5))
    rates[t] = 12 * iterations * t / best
    print(f"{t} thread(s): {rates[t] / 1e9:.2f} G vector FMAs/s ({rates[t] / t / 1e9:.2f} per core)")
K, I, L, VOCAB, B = 576, 1536, 30, 49152, 4
weights = L * (2 * K * K + 2 * 192 * K + 3 * K * I) + VOCAB * K
products = weights * B / V
cache = L * B * 3 * 820 * (3 * 64 * 2) / V
for name, count in (("products (batch 4)", products), ("cache step (820 slots)", cache)):
    print(f"{name}: {count / 1e6:.1f} M vector FMAs = {1e3 * count / rates[threads]:.1f} ms on {threads} threads")
print(f"bytes the floor reads: {(weights * 4 + L * 2 * B * 3 * 820 * 64 * 4) / 1e6:.0f} MB")
