"""bfloat16 products: one weight row at a time against a 4 x 4 tile of weight rows (probe).

The weights of SmolLM2-135M's 30 decoder layers (random, its seven shapes) times 4 rows (a decode step at batch 4),
each matrix in its own parallel region as the decode step runs them, in argv[1]'s dtype (default bfloat16),
torch's default threads, rounds interleaved (25), median and best per way. The three ways are built here and
called the same way (x widened beforehand), so only the loop over the weights differs:
- `weight row`: one weight row at a time, two sets of 4 accumulators (a copy of `weight_row` in
  h2o_kv/csrc/rows_linear.cpp, what bfloat16 takes now);
- `tile 4x4`: 4 weight rows at a time, 16 accumulators (what float32 takes, and bfloat16 took before);
- `plain sum`: the same bytes summed as int32 in the same parallel regions, nothing multiplied (a read's rate).
With argv[2] "cache", the first layer's weights stand for all 30 (7 MB in bfloat16, in the caches): the same calls
and multiply-adds with nothing read from memory, so a way as slow there as from memory is held up by its work.
"""

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from h2o_kv import native

SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <immintrin.h>
#include <torch/extension.h>
using Vec = at::vec::Vectorized<float>;
constexpr int V = Vec::size();
inline Vec load_float(const float* p) { return Vec::loadu(p); }
inline Vec load_float(const at::BFloat16* p) { Vec o; at::vec::load_to_float<at::BFloat16>(p, o); return o; }

template <typename T, int JB>
void tile(const float* x, const T* w, int64_t K, int64_t N, int64_t j0, T* out) {
  Vec acc[4][JB];
  for (int r = 0; r < 4; ++r) for (int b = 0; b < JB; ++b) acc[r][b] = Vec(0.f);
  const T* ahead[JB];
  for (int b = 0; b < JB; ++b) ahead[b] = w + std::min<int64_t>(j0 + b + 2 * JB, N - 1) * K;
  for (int64_t k = 0; k + V <= K; k += V) {
    Vec wk[JB];
    for (int b = 0; b < JB; ++b) { __builtin_prefetch(ahead[b] + k, 0, 0); wk[b] = load_float(w + (j0 + b) * K + k); }
    for (int r = 0; r < 4; ++r) {
      const Vec xk = Vec::loadu(x + r * K + k);
      for (int b = 0; b < JB; ++b) acc[r][b] = at::vec::fmadd(xk, wk[b], acc[r][b]);
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int b = 0; b < JB; ++b)
      out[r * N + j0 + b] = static_cast<T>(at::vec::vec_reduce_all<float>(
          [](Vec& a, Vec& c) { return a + c; }, acc[r][b]));
}

template <typename T>
void weight_row(const float* x, const T* w, int64_t K, int64_t N, int64_t j, T* out) {
  Vec even[4], odd[4];
  for (int r = 0; r < 4; ++r) even[r] = odd[r] = Vec(0.f);
  const T* wj = w + j * K;
  const T* ahead = w + std::min<int64_t>(j + 1, N - 1) * K;
  int64_t k = 0;
  for (; k + 2 * V <= K; k += 2 * V) {
    __builtin_prefetch(ahead + k, 0, 0);
    const Vec w0 = load_float(wj + k), w1 = load_float(wj + k + V);
    for (int r = 0; r < 4; ++r) {
      even[r] = at::vec::fmadd(Vec::loadu(x + r * K + k), w0, even[r]);
      odd[r] = at::vec::fmadd(Vec::loadu(x + r * K + k + V), w1, odd[r]);
    }
  }
  for (int r = 0; r < 4; ++r)
    out[r * N + j] = static_cast<T>(at::vec::vec_reduce_all<float>(
        [](Vec& a, Vec& c) { return a + c; }, even[r] + odd[r]));
}

template <typename T>
at::Tensor run(const at::Tensor& x, const at::Tensor& w, int64_t way) {
  const bool sum = way == 2;
  const int64_t K = w.size(1), N = w.size(0);
  at::Tensor out = at::zeros({4, N}, w.options());
  const float* xp = x.data_ptr<float>(); const T* wp = w.data_ptr<T>(); T* o = out.data_ptr<T>();
  at::parallel_for(0, N, 64, [&](int64_t j0, int64_t j1) {
    if (sum) {  // the rows j0 .. j1 - 1 as int32 lanes, four sums in flight
      const __m256i* p = reinterpret_cast<const __m256i*>(wp + j0 * K);
      const int64_t n = (j1 - j0) * K * static_cast<int64_t>(sizeof(T)) / 32;
      __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t i = 0; i + 4 <= n; i += 4) {
        a0 = _mm256_add_epi32(a0, _mm256_loadu_si256(p + i));
        a1 = _mm256_add_epi32(a1, _mm256_loadu_si256(p + i + 1));
        a2 = _mm256_add_epi32(a2, _mm256_loadu_si256(p + i + 2));
        a3 = _mm256_add_epi32(a3, _mm256_loadu_si256(p + i + 3));
      }
      a0 = _mm256_add_epi32(_mm256_add_epi32(a0, a1), _mm256_add_epi32(a2, a3));
      o[j0] = static_cast<T>(static_cast<float>(_mm256_extract_epi32(a0, 0)));
      return;
    }
    int64_t j = j0;
    if (way == 0) {
      for (; j < j1; ++j) weight_row<T>(xp, wp, K, N, j, o);
      return;
    }
    for (; j + 4 <= j1; j += 4) tile<T, 4>(xp, wp, K, N, j, o);
    for (; j < j1; ++j) tile<T, 1>(xp, wp, K, N, j, o);
  });
  return out;
}

at::Tensor product(const at::Tensor& x, const at::Tensor& w, int64_t way) {
  return w.scalar_type() == at::kFloat ? run<float>(x, w, way) : run<at::BFloat16>(x, w, way);
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("product", &product); }
"""

dtype = getattr(torch, sys.argv[1] if len(sys.argv) > 1 else "bfloat16")
native.load()
with tempfile.TemporaryDirectory() as folder:
    (Path(folder) / "tile.cpp").write_text(SOURCE)
    tile = load(name="bf16_rows_probe", sources=[str(Path(folder) / "tile.cpp")], extra_cflags=native.flags())
torch.manual_seed(0)
hidden, inter, layers = 576, 1536, 30
shapes = [(hidden, hidden), (192, hidden), (192, hidden), (hidden, hidden), (inter, hidden), (inter, hidden),
          (hidden, inter)]  # fmt: skip
in_cache = len(sys.argv) > 2 and sys.argv[2] == "cache"
weights = [torch.randn(n, k).to(dtype) for _ in range(1 if in_cache else layers) for n, k in shapes]
weights = weights * layers if in_cache else weights
xs = {k: torch.randn(4, k).to(dtype).float() for k in (hidden, inter)}
for w in weights[:7]:  # the two products agree with the kernel as built
    want = native.rows_linear(xs[w.shape[1]].to(dtype), w, None).float()
    for way in (0, 1):
        torch.testing.assert_close(tile.product(xs[w.shape[1]], w, way).float(), want, rtol=2e-2, atol=0.2)
ways = {"weight row": 0, "tile 4x4": 1, "plain sum": 2}
times = {name: [] for name in ways}
for _ in range(25):
    for name, way in ways.items():
        start = time.perf_counter()
        for w in weights:
            tile.product(xs[w.shape[1]], w, way)
        times[name].append(time.perf_counter() - start)
nbytes = sum(w.numel() * w.element_size() for w in weights)
where = "one layer's, 30 times (in cache)" if in_cache else "from memory"
print(f"# {dtype}, {nbytes / 1e6:.0f} MB of weights: {where}, 4 rows, {torch.get_num_threads()} threads, 25 rounds")
for name, t in times.items():
    median = statistics.median(t)
    fmas = 4 * nbytes / w.element_size() / 8 / median  # 4 rows, 8 float32 lanes (AVX2); the sum has none
    rate = "" if name == "plain sum" else f", {fmas / 1e9:4.1f} G vector multiply-adds/s"
    rate = f"{nbytes / median / 1e9:4.1f} GB/s{rate}"
    print(f"{name:12s} median {median * 1e3:6.2f} ms ({rate}), best {min(t) * 1e3:6.2f} ms")
