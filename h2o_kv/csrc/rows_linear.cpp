// A linear layer for a few rows on a CPU (h2o_kv/rows_first.py, built and called by h2o_kv/native.py):
// out [R, N] = x [R, K] @ W^T [K, N] (+ bias [N]), for the R <= 64 rows of a decode step (native.MAX_ROWS).
//
// A decode step multiplies a handful of rows by every weight matrix of the model, so its time is the time
// to read the weights. MKL's products at 4 rows read them at about half the memory's speed on the 2-core
// CPU this project benchmarks on (results/bench-static/probes/rows_linear.txt). This kernel streams each
// weight row once: a tile of JB weight rows (float32; bfloat16 goes one row at a time, see weight_row) is loaded
// V lanes at a time, widened to float32 (bfloat16 weights), and multiplied into RB x JB float32 accumulators, one
// per (row, output), with the rows of x (widened once, up front) coming from the core's cache. Output columns run
// in parallel on torch's threads.
//
// Each output is one row of x against one row of W summed in a fixed order, whatever the other rows are:
// a sequence gets the same numbers alone as in any batch (the engine's solo == batched guarantee).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t NEXT_BYTES = 32 * 1024;  // what a product region asks for of the next one, per thread

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

// Output j of the row xr (float32, [K]): its accumulator's lanes added, then the products from k on one by one
// (the last K % V), then the bias, rounded to T.
template <typename T>
inline T output(const Vec& acc, const float* xr, const T* w, const T* bias, int64_t K, int64_t k, int64_t j) {
  float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& c) { return a + c; }, acc);
  for (; k < K; ++k) sum += xr[k] * static_cast<float>(w[j * K + k]);
  if (bias) sum += static_cast<float>(bias[j]);
  return static_cast<T>(sum);
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
    for (int b = 0; b < JB; ++b) out[r * N + j0 + b] = output(acc[r][b], x + r * K, w, bias, K, k, j0 + b);
}

// out[r * N + j] for the RB <= 4 rows of x and the one bfloat16 weight row j, read front to back: its blocks of V
// go in turn to two sets of RB accumulators (two multiply-adds in flight per row), added at the end. bfloat16's
// products are bound by their work, not their reads (half float32's bytes per multiply-add, and the widening): on
// the AVX2 CPU the bench runs on, this shape multiplies 20-35 % faster than a 4 x 4 tile with its operands in cache
// (results/bench-static/probes/tile_shapes.txt) and 2-8 % faster from memory (probes/bf16_rows.txt).
template <typename T, int RB>
inline void weight_row(const float* x, const T* w, const T* bias, int64_t K, int64_t N, int64_t j, T* out) {
  Vec even[RB], odd[RB];
  for (int r = 0; r < RB; ++r) even[r] = odd[r] = Vec(0.f);
  const T* wj = w + j * K;
  const T* ahead = w + std::min<int64_t>(j + 1, N - 1) * K;  // the next row, prefetched as we go
  int64_t k = 0;
  for (; k + 2 * V <= K; k += 2 * V) {
    __builtin_prefetch(ahead + k, 0, 0);
    const Vec w0 = load_float(wj + k), w1 = load_float(wj + k + V);
    for (int r = 0; r < RB; ++r) {
      even[r] = at::vec::fmadd(Vec::loadu(x + r * K + k), w0, even[r]);
      odd[r] = at::vec::fmadd(Vec::loadu(x + r * K + k + V), w1, odd[r]);
    }
  }
  if (k + V <= K) {
    const Vec w0 = load_float(wj + k);
    for (int r = 0; r < RB; ++r) even[r] = at::vec::fmadd(Vec::loadu(x + r * K + k), w0, even[r]);
    k += V;
  }
  for (int r = 0; r < RB; ++r) out[r * N + j] = output(even[r] + odd[r], x + r * K, w, bias, K, k, j);
}

// Outputs j0 .. j1 - 1 of RB rows. float32: JB weight rows at a time (4 for up to 4 rows, 2 above: RB x JB
// accumulators stay in registers), the last N % JB one by one. bfloat16: one weight row at a time, for the first
// 4 rows and then (RB > 4) the rest, the row read again from the core's cache.
template <typename T, int RB>
void columns(const float* x, const T* w, const T* bias, int64_t K, int64_t N, int64_t j0, int64_t j1, T* out) {
  if constexpr (std::is_same_v<T, float>) {
    constexpr int JB = RB <= 4 ? 4 : 2;
    int64_t j = j0;
    for (; j + JB <= j1; j += JB) tile<T, RB, JB>(x, w, bias, K, N, j, out);
    for (; j < j1; ++j) tile<T, RB, 1>(x, w, bias, K, N, j, out);
  } else {
    for (int64_t j = j0; j < j1; ++j) {
      weight_row<T, std::min(RB, 4)>(x, w, bias, K, N, j, out);
      if constexpr (RB > 4) weight_row<T, RB - 4>(x + 4 * K, w, bias, K, N, j, out + 4 * N);
    }
  }
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

// t as float32, contiguous (no copy when it already is).
at::Tensor widened(const at::Tensor& t) {
  return t.to(at::kFloat).contiguous();
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
  const at::Tensor xf = widened(x);  // rows widened once, reread from the cache
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

// ---- a Llama decoder layer's decode step (h2o_kv/fused_layer.py) ----------------------------------------------
// The same operations as transformers' LlamaDecoderLayer on R <= 64 rows, in two calls around the cache's attention:
// `layer_in` (RMSNorm, the q/k/v products, rotary embedding) and `layer_out` (output product, residual, RMSNorm, the
// gate/up products, SiLU x up, down product, residual). Elementwise steps round to the model's dtype where the
// model's own operations do (bfloat16), so they are its operations in one pass; the products are rows_columns'.

template <typename T>
inline float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// One weight of a product region: out [R, n] (+ bias) for weight [n, K].
struct Part {
  const at::Tensor* weight;
  const c10::optional<at::Tensor>* bias;
  at::Tensor out;
};

// Rows [from, from + count) of the weights of `parts` taken as one column range (as a product region splits
// them), asked for a cache line at a time: the start of what a thread reads in the region after this one,
// streamed in while the others finish this one and the region's threads meet.
template <typename T>
void prefetch_rows(const std::vector<Part>& parts, int64_t from, int64_t count) {
  int64_t base = 0;
  for (const auto& p : parts) {
    const int64_t n = p.weight->size(0), K = p.weight->size(1), a = std::max(from, base) - base;
    const int64_t b = std::min(from + count, base + n) - base;
    if (a < b) {
      const char* c = reinterpret_cast<const char*>(p.weight->data_ptr<T>() + a * K);
      for (int64_t i = 0; i < (b - a) * K * static_cast<int64_t>(sizeof(T)); i += 64) __builtin_prefetch(c + i, 0, 3);
    }
    base += n;
  }
}

// The first output column of this thread in a region of `total` columns split as at::parallel_for splits it
// (grain 64), or `total` when it gets none.
inline int64_t first_column(int64_t total) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (total + 63) / 64);
  const int64_t chunk = (total + threads - 1) / threads, start = at::get_thread_num() * chunk;
  return std::min(start, total);
}

// x (float32, [R, K]) times several weights in one parallel region over all their output columns; each thread
// then asks for the first rows it reads in the `next` region, when there is one.
template <typename T>
void products(const float* x, int64_t R, int64_t K, std::vector<Part>& parts, const std::vector<Part>* next = nullptr) {
  int64_t total = 0, next_total = 0;
  for (auto& p : parts) total += p.weight->size(0);
  if (next)
    for (auto& p : *next) next_total += p.weight->size(0);
  at::parallel_for(0, total, 64, [&](int64_t j0, int64_t j1) {
    int64_t base = 0;
    for (auto& p : parts) {
      const int64_t n = p.weight->size(0), a = std::max(j0, base) - base, b = std::min(j1, base + n) - base;
      if (a < b) {
        const T* bias = *p.bias ? (*p.bias)->data_ptr<T>() : nullptr;
        rows_columns<T>(x, p.weight->data_ptr<T>(), bias, R, K, n, a, b, p.out.data_ptr<T>());
      }
      base += n;
    }
    if (next && next_total) {
      const int64_t row_bytes = (*next)[0].weight->size(1) * static_cast<int64_t>(sizeof(T));
      prefetch_rows<T>(*next, first_column(next_total), std::max<int64_t>(1, NEXT_BYTES / row_bytes));
    }
  });
}

// LlamaRMSNorm of each row of h [R, K] into out (float32): x / sqrt(mean(x^2) + eps), rounded to T, times weight.
template <typename T>
void rms_norm(const float* h, const T* weight, double eps, int64_t R, int64_t K, float* out) {
  for (int64_t r = 0; r < R; ++r) {
    const float* x = h + r * K;
    float sum = 0.f;
    for (int64_t k = 0; k < K; ++k) sum += x[k] * x[k];
    const float inv = 1.f / std::sqrt(sum / K + static_cast<float>(eps));
    for (int64_t k = 0; k < K; ++k)
      out[r * K + k] = round_to<T>(static_cast<float>(weight[k]) * round_to<T>(x[k] * inv));
  }
}

constexpr int64_t MAX_ROWS = 64;  // native.MAX_ROWS

// The hidden states x [B, T, K] (float32 or bfloat16, at most MAX_ROWS rows) and a norm weight [K] of their dtype.
at::ScalarType check_hidden(const at::Tensor& x, const at::Tensor& norm) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "fused layer: float32 or bfloat16 hidden states");
  TORCH_CHECK(x.dim() == 3 && x.size(0) * x.size(1) <= MAX_ROWS, "fused layer: x [B, T, K] with at most ", MAX_ROWS,
              " rows");
  TORCH_CHECK(norm.scalar_type() == dtype && norm.numel() == x.size(2) && norm.is_contiguous(),
              "fused layer: norm weight [K]");
  return dtype;
}

void check_weight(const at::Tensor& w, const c10::optional<at::Tensor>& b, at::ScalarType dtype, int64_t K) {
  TORCH_CHECK(w.scalar_type() == dtype && w.dim() == 2 && w.size(1) == K && w.is_contiguous(),
              "fused layer: weights contiguous [N, K] in the hidden states' dtype");
  TORCH_CHECK(!b || (b->scalar_type() == dtype && b->dim() == 1 && b->size(0) == w.size(0) && b->is_contiguous()),
              "fused layer: bias [N] in the hidden states' dtype");
}

// x [B, T, K] -> q, k, v [B, heads, T, D] (views of [B, T, heads * D]) with the rotary embedding (cos, sin
// [B or 1, T, D]) on q and k.
template <typename T>
std::vector<at::Tensor> layer_in_impl(const at::Tensor& x, const at::Tensor& norm, double eps, std::vector<Part>& parts,
                                      const at::Tensor& cos, const at::Tensor& sin, int64_t D) {
  const int64_t B = x.size(0), S = x.size(1), K = x.size(2), R = B * S;
  const at::Tensor xf = widened(x);
  thread_local std::vector<float> xn;  // scratch, kept between calls
  xn.resize(R * K);
  rms_norm<T>(xf.data_ptr<float>(), norm.data_ptr<T>(), eps, R, K, xn.data());
  products<T>(xn.data(), R, K, parts);
  const T* c = cos.data_ptr<T>();
  const T* s = sin.data_ptr<T>();
  const int64_t half = D / 2;
  std::vector<float> row(D);
  for (int p = 0; p < 2; ++p) {  // q and k: x * cos + rotate_half(x) * sin, per head
    T* out = parts[p].out.data_ptr<T>();
    const int64_t N = parts[p].weight->size(0);
    for (int64_t r = 0; r < R; ++r) {
      const int64_t at_cs = ((cos.size(0) == 1 ? 0 : r / S) * S + r % S) * D;
      for (int64_t h = 0; h < N / D; ++h) {
        T* v = out + r * N + h * D;
        for (int64_t i = 0; i < D; ++i) row[i] = static_cast<float>(v[i]);
        for (int64_t i = 0; i < D; ++i) {
          const float rotated = i < half ? -row[i + half] : row[i - half];
          const float a = round_to<T>(row[i] * static_cast<float>(c[at_cs + i]));
          const float b = round_to<T>(rotated * static_cast<float>(s[at_cs + i]));
          v[i] = static_cast<T>(a + b);
        }
      }
    }
  }
  std::vector<at::Tensor> qkv;  // [B, heads, T, D] views, as the cache and the attention function take them
  for (auto& p : parts) qkv.push_back(p.out.view({B, S, -1, D}).transpose(1, 2));
  return qkv;
}

template <typename T>
at::Tensor layer_out_impl(const at::Tensor& x, const at::Tensor& attn, double eps, const at::Tensor& norm,
                          std::vector<Part>& o, std::vector<Part>& gate_up, std::vector<Part>& down) {
  const int64_t B = x.size(0), S = x.size(1), K = x.size(2), R = B * S, A = attn.size(2);  // attn [B, T, A]
  const int64_t I = gate_up[0].weight->size(0);
  const at::Tensor af = widened(attn);
  products<T>(af.data_ptr<float>(), R, A, o, &gate_up);  // o_proj
  const at::Tensor xc = x.contiguous();
  const T* xs = xc.data_ptr<T>();
  const T* os = o[0].out.data_ptr<T>();
  thread_local std::vector<float> h, hn, act;  // scratch, kept between calls
  h.resize(R * K);
  hn.resize(R * K);
  act.resize(R * I);
  for (int64_t i = 0; i < R * K; ++i) h[i] = round_to<T>(static_cast<float>(xs[i]) + static_cast<float>(os[i]));
  rms_norm<T>(h.data(), norm.data_ptr<T>(), eps, R, K, hn.data());
  products<T>(hn.data(), R, K, gate_up, &down);
  const T* g = gate_up[0].out.data_ptr<T>();
  const T* u = gate_up[1].out.data_ptr<T>();
  int64_t i = 0;
  if constexpr (std::is_same_v<T, float>) {  // V at a time, as torch's SiLU kernel computes it: x / (1 + exp(-x))
    for (; i + V <= R * I; i += V) {
      const Vec gv = Vec::loadu(g + i);
      (gv / (Vec(1.f) + gv.neg().exp()) * Vec::loadu(u + i)).store(act.data() + i);
    }
  } else {  // 2V at a time, rounded to bfloat16 where torch's SiLU and product kernels round (after each)
    using BVec = at::vec::Vectorized<T>;
    for (; i + 2 * V <= R * I; i += 2 * V) {
      auto [g0, g1] = at::vec::convert_to_float<T>(BVec::loadu(g + i));
      auto [u0, u1] = at::vec::convert_to_float<T>(BVec::loadu(u + i));
      auto [s0, s1] = at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(
          g0 / (Vec(1.f) + g0.neg().exp()), g1 / (Vec(1.f) + g1.neg().exp())));
      auto [a0, a1] = at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(s0 * u0, s1 * u1));
      a0.store(act.data() + i);
      a1.store(act.data() + i + V);
    }
  }
  for (; i < R * I; ++i) {  // the last R * I % V (2V in bfloat16), rounded where the model's operations round
    const float gi = static_cast<float>(g[i]);
    act[i] = round_to<T>(round_to<T>(gi / (1.f + std::exp(-gi))) * static_cast<float>(u[i]));
  }
  products<T>(act.data(), R, I, down);
  T* out = down[0].out.data_ptr<T>();
  for (int64_t i = 0; i < R * K; ++i) out[i] = static_cast<T>(h[i] + static_cast<float>(out[i]));
  return down[0].out.view({B, S, K});
}

}  // namespace

namespace h2o_kv {

std::vector<at::Tensor> layer_in(const at::Tensor& x, const at::Tensor& norm, double eps, const at::Tensor& wq,
                                 const c10::optional<at::Tensor>& bq, const at::Tensor& wk,
                                 const c10::optional<at::Tensor>& bk, const at::Tensor& wv,
                                 const c10::optional<at::Tensor>& bv, const at::Tensor& cos, const at::Tensor& sin,
                                 int64_t head_dim) {
  const auto dtype = check_hidden(x, norm);
  const int64_t K = x.size(2), R = x.size(0) * x.size(1);
  for (auto* w : {&wq, &wk, &wv}) TORCH_CHECK(w->size(0) % head_dim == 0 && head_dim % 2 == 0, "fused layer: heads");
  check_weight(wq, bq, dtype, K);
  check_weight(wk, bk, dtype, K);
  check_weight(wv, bv, dtype, K);
  TORCH_CHECK(cos.scalar_type() == dtype && sin.scalar_type() == dtype && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.sizes() == sin.sizes() && cos.dim() == 3 && (cos.size(0) == 1 || cos.size(0) == x.size(0)) &&
                  cos.size(1) == x.size(1) && cos.size(2) == head_dim,
              "fused layer: cos and sin [B or 1, T, head_dim] in the hidden states' dtype");
  std::vector<Part> parts{{&wq, &bq, at::empty({R, wq.size(0)}, x.options())},
                          {&wk, &bk, at::empty({R, wk.size(0)}, x.options())},
                          {&wv, &bv, at::empty({R, wv.size(0)}, x.options())}};
  if (dtype == at::kFloat) return layer_in_impl<float>(x, norm, eps, parts, cos, sin, head_dim);
  return layer_in_impl<at::BFloat16>(x, norm, eps, parts, cos, sin, head_dim);
}

at::Tensor layer_out(const at::Tensor& x, const at::Tensor& attn_out, const at::Tensor& wo,
                     const c10::optional<at::Tensor>& bo, const at::Tensor& norm, double eps, const at::Tensor& wg,
                     const c10::optional<at::Tensor>& bg, const at::Tensor& wu, const c10::optional<at::Tensor>& bu,
                     const at::Tensor& wd, const c10::optional<at::Tensor>& bd) {
  const auto dtype = check_hidden(x, norm);
  TORCH_CHECK(attn_out.scalar_type() == dtype && attn_out.dim() >= 3 && attn_out.size(0) == x.size(0)
                  && attn_out.size(1) == x.size(1),
              "fused layer: attention output [B, T, ...] in the hidden states' dtype");
  const at::Tensor attn = attn_out.reshape({x.size(0), x.size(1), -1});  // [B, T, heads, D] -> [B, T, A]
  const int64_t K = x.size(2), R = x.size(0) * x.size(1);
  check_weight(wo, bo, dtype, attn.size(2));
  TORCH_CHECK(wo.size(0) == K, "fused layer: o_proj [K, A]");
  check_weight(wg, bg, dtype, K);
  check_weight(wu, bu, dtype, K);
  TORCH_CHECK(wu.size(0) == wg.size(0), "fused layer: gate and up of one size");
  check_weight(wd, bd, dtype, wg.size(0));
  TORCH_CHECK(wd.size(0) == K, "fused layer: down_proj [K, I]");
  std::vector<Part> o{{&wo, &bo, at::empty({R, K}, x.options())}};
  std::vector<Part> gate_up{{&wg, &bg, at::empty({R, wg.size(0)}, x.options())},
                            {&wu, &bu, at::empty({R, wu.size(0)}, x.options())}};
  std::vector<Part> down{{&wd, &bd, at::empty({R, K}, x.options())}};
  if (dtype == at::kFloat) return layer_out_impl<float>(x, attn, eps, norm, o, gate_up, down);
  return layer_out_impl<at::BFloat16>(x, attn, eps, norm, o, gate_up, down);
}

}  // namespace h2o_kv

TORCH_LIBRARY_FRAGMENT(h2o_kv, m) {
  m.def("rows_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor", &rows_linear);
  m.def("layer_in(Tensor x, Tensor norm, float eps, Tensor wq, Tensor? bq, Tensor wk, Tensor? bk, Tensor wv, "
        "Tensor? bv, Tensor cos, Tensor sin, int head_dim) -> Tensor[]",
        &h2o_kv::layer_in);
  m.def("layer_out(Tensor x, Tensor attn, Tensor wo, Tensor? bo, Tensor norm, float eps, Tensor wg, Tensor? bg, "
        "Tensor wu, Tensor? bu, Tensor wd, Tensor? bd) -> Tensor",
        &h2o_kv::layer_out);
}
