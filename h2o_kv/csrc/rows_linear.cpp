// A linear layer for a few rows on a CPU (h2o_kv/rows_first.py, built and called by h2o_kv/native.py):
// out [R, N] = x [R, K] @ W^T [K, N] (+ bias [N]), for the R <= 16 rows of a decode step.
//
// A decode step multiplies a handful of rows by every weight matrix of the model, so its time is the time
// to read the weights. MKL's products at 4 rows read them at about half the memory's speed on the 2-core
// CPU this project benchmarks on (results/bench-static/probes/rows_linear.txt). This kernel streams each
// weight row once: a tile of JB weight rows is loaded V lanes at a time, widened to float32 (bfloat16
// weights), and multiplied into RB x JB float32 accumulators, one per (row, output), with the rows of x
// (widened once, up front) coming from the core's cache. Output columns run in parallel on torch's threads.
//
// Each output is one row of x against one row of W summed in a fixed order, whatever the other rows are:
// a sequence gets the same numbers alone as in any batch (the engine's solo == batched guarantee).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int V = Vec::size();

template <typename T>
inline Vec load_float(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p);
  } else {
    Vec out;
    at::vec::load_to_float<T>(p, out);
    return out;
  }
}

// out[r * N + j] for the RB rows of x (float32, [RB, K]) and the JB weight rows j0 .. j0 + JB - 1.
template <typename T, int RB, int JB>
inline void tile(const float* x, const T* w, const T* bias, int64_t K, int64_t N, int64_t j0, T* out) {
  Vec acc[RB][JB];
  for (int r = 0; r < RB; ++r)
    for (int b = 0; b < JB; ++b) acc[r][b] = Vec(0.f);
  const T* ahead[JB];  // the weight rows two tiles ahead (the last row near the end), prefetched as we go
  for (int b = 0; b < JB; ++b) ahead[b] = w + std::min<int64_t>(j0 + b + 2 * JB, N - 1) * K;
  int64_t k = 0;
  for (; k + V <= K; k += V) {
    Vec wk[JB];
    for (int b = 0; b < JB; ++b) {
      __builtin_prefetch(ahead[b] + k, 0, 0);
      wk[b] = load_float(w + (j0 + b) * K + k);
    }
    for (int r = 0; r < RB; ++r) {
      const Vec xk = Vec::loadu(x + r * K + k);
      for (int b = 0; b < JB; ++b) acc[r][b] = at::vec::fmadd(xk, wk[b], acc[r][b]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int b = 0; b < JB; ++b) {
      float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& c) { return a + c; }, acc[r][b]);
      for (int64_t kk = k; kk < K; ++kk) sum += x[r * K + kk] * static_cast<float>(w[(j0 + b) * K + kk]);
      if (bias) sum += static_cast<float>(bias[j0 + b]);
      out[r * N + j0 + b] = static_cast<T>(sum);
    }
}

// Outputs j0 .. j1 - 1 of RB rows: JB weight rows at a time (4 for up to 4 rows, 2 above: RB x JB
// accumulators stay in registers), the last N % JB one by one.
template <typename T, int RB>
void columns(const float* x, const T* w, const T* bias, int64_t K, int64_t N, int64_t j0, int64_t j1, T* out) {
  constexpr int JB = RB <= 4 ? 4 : 2;
  int64_t j = j0;
  for (; j + JB <= j1; j += JB) tile<T, RB, JB>(x, w, bias, K, N, j, out);
  for (; j < j1; ++j) tile<T, RB, 1>(x, w, bias, K, N, j, out);
}

// Outputs j0 .. j1 - 1 of all R rows: panels of 16 weight rows, each read from memory once and multiplied
// by the rows 8 at a time (8 x 2 accumulators); a second pass (R > 8) rereads the panel from the cache.
template <typename T>
void rows_columns(const float* x, const T* w, const T* bias, int64_t R, int64_t K, int64_t N, int64_t j0,
                  int64_t j1, T* out) {
  for (int64_t p0 = j0; p0 < j1; p0 += 16) {
    const int64_t p1 = std::min<int64_t>(p0 + 16, j1);
    for (int64_t r = 0; r < R; r += 8) {
      const float* xr = x + r * K;
      T* o = out + r * N;
      switch (std::min<int64_t>(R - r, 8)) {
        case 1: columns<T, 1>(xr, w, bias, K, N, p0, p1, o); break;
        case 2: columns<T, 2>(xr, w, bias, K, N, p0, p1, o); break;
        case 3: columns<T, 3>(xr, w, bias, K, N, p0, p1, o); break;
        case 4: columns<T, 4>(xr, w, bias, K, N, p0, p1, o); break;
        case 5: columns<T, 5>(xr, w, bias, K, N, p0, p1, o); break;
        case 6: columns<T, 6>(xr, w, bias, K, N, p0, p1, o); break;
        case 7: columns<T, 7>(xr, w, bias, K, N, p0, p1, o); break;
        default: columns<T, 8>(xr, w, bias, K, N, p0, p1, o); break;
      }
    }
  }
}

// x [R, K], weight [N, K], bias [N] or none, all float32 or all bfloat16; returns [R, N] in that dtype.
at::Tensor rows_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "rows_linear: float32 or bfloat16 weights");
  TORCH_CHECK(x.scalar_type() == dtype && (!bias || bias->scalar_type() == dtype),
              "rows_linear: x, weight and bias of one dtype");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "rows_linear: x [R, K], weight [N, K]");
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == weight.size(0)), "rows_linear: bias [N]");
  const int64_t R = x.size(0), K = x.size(1), N = weight.size(0);
  const at::Tensor xf = x.to(at::kFloat).contiguous();  // rows widened once, reread from the cache
  const at::Tensor wc = weight.contiguous();
  const at::Tensor bc = bias ? bias->contiguous() : at::Tensor();
  at::Tensor out = at::empty({R, N}, x.options());
  if (R == 0 || N == 0) return out;
  // columns in chunks of 64: enough per task to amortize the split, enough tasks for every thread
  at::parallel_for(0, N, 64, [&](int64_t j0, int64_t j1) {
    if (dtype == at::kFloat) {
      rows_columns<float>(xf.data_ptr<float>(), wc.data_ptr<float>(), bias ? bc.data_ptr<float>() : nullptr, R, K,
                          N, j0, j1, out.data_ptr<float>());
    } else {
      using B = at::BFloat16;
      rows_columns<B>(xf.data_ptr<float>(), wc.data_ptr<B>(), bias ? bc.data_ptr<B>() : nullptr, R, K, N, j0, j1,
                      out.data_ptr<B>());
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(h2o_kv, m) {
  m.def("rows_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor", &rows_linear);
}
