// h2o-kv's decode-step attention on a CPU (built and called by h2o_kv/native.py): the same operations as
// kernel.attend_one for one query per sequence, where torch's products do more work.
//
// - attend_one: one row per (sequence, KV head), its G query heads' logits, mask, softmax, output and
//   scores in one pass while the row is in the core's cache (torch's eager path runs a handful of small
//   batched products and reductions over the layer, each reading it again). Int8 keys and values (quant.py)
//   are widened in registers as they are read: torch has no int8 x float product on a CPU, so the eager
//   path writes and reads a 4x larger float copy of the layer.
//
// Rows run in parallel on torch's threads (at::parallel_for); the vectors are torch's own (at::vec) at the
// width native.py compiles for.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int V = Vec::size();

// V lanes as float32: float32 as they are, int8 widened in registers (exact).
inline Vec load_float(const float* p) { return Vec::loadu(p); }
inline Vec load_float(const int8_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(CPU_CAPABILITY_AVX2)
  return Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else
  alignas(64) float wide[V];
  for (int i = 0; i < V; ++i) wide[i] = static_cast<float>(p[i]);
  return Vec::loadu(wide);
#endif
}

// logits[j] = q . k_j for S keys [S, D]: V slots at a time, one
// accumulator per slot (V independent chains over D), then one transpose turns the V partial vectors into
// V dot products.
template <typename T>
void dots(const float* q, const T* keys, int64_t S, int64_t D, float* logits) {
  alignas(64) float partial[V * V], columns[V * V];
  int64_t s0 = 0;
  if (D % V == 0) {
    for (; s0 + V <= S; s0 += V) {
      Vec acc[V];
      const T* k[V];
      for (int j = 0; j < V; ++j) {
        acc[j] = Vec(0.f);
        k[j] = keys + (s0 + j) * D;
      }
      for (int64_t d = 0; d < D; d += V) {
        const Vec qd = Vec::loadu(q + d);
        for (int j = 0; j < V; ++j) acc[j] = at::vec::fmadd(qd, load_float(k[j] + d), acc[j]);
      }
      for (int j = 0; j < V; ++j) acc[j].store(partial + j * V);
      at::vec::transpose_mxn<float, V, V>(partial, V, columns, V);
      Vec sum = Vec::loadu(columns);
      for (int i = 1; i < V; ++i) sum = sum + Vec::loadu(columns + i * V);
      sum.store(logits + s0);
    }
  }
  for (; s0 < S; ++s0) {  // the last S % V slots (all of them when D is not a multiple of V)
    const T* k = keys + s0 * D;
    float sum = 0.f;
    for (int64_t d = 0; d < D; ++d) sum += q[d] * static_cast<float>(k[d]);
    logits[s0] = sum;
  }
}

// out = sum_s p_s * values_s over S values [S, D], V lanes of the output at a time.
template <typename T>
void weighted_sum(const float* p, const T* values, int64_t S, int64_t D, float* out) {
  int64_t d0 = 0;
  for (; d0 + 4 * V <= D; d0 += 4 * V) {  // four independent accumulators in registers
    Vec o0(0.f), o1(0.f), o2(0.f), o3(0.f);
    for (int64_t s = 0; s < S; ++s) {
      const Vec w(p[s]);
      const T* v = values + s * D + d0;
      o0 = at::vec::fmadd(w, load_float(v), o0);
      o1 = at::vec::fmadd(w, load_float(v + V), o1);
      o2 = at::vec::fmadd(w, load_float(v + 2 * V), o2);
      o3 = at::vec::fmadd(w, load_float(v + 3 * V), o3);
    }
    o0.store(out + d0);
    o1.store(out + d0 + V);
    o2.store(out + d0 + 2 * V);
    o3.store(out + d0 + 3 * V);
  }
  for (; d0 < D; ++d0) {
    float sum = 0.f;
    for (int64_t s = 0; s < S; ++s) sum += p[s] * static_cast<float>(values[s * D + d0]);
    out[d0] = sum;
  }
}

void softmax(float* x, int64_t n) {
  if (n == 0) return;
  const float top = at::vec::reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, x, n);
  at::vec::map([top](Vec a) { return (a - Vec(top)).exp(); }, x, x, n);
  const float inv = 1.f / at::vec::reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, x, n);
  at::vec::map([inv](Vec a) { return a * Vec(inv); }, x, x, n);
}

// One (sequence, KV head) row per task: the G query heads' logits, softmax, output, and the slots' summed
// (scores) and averaged (last) probabilities. KV is float32, or int8 widened in registers as it is read, with
// its per-slot scales applied to the logits (q . k8_j * s_j) and folded into the output's weights (p_j t_j).
template <typename KV>
void attend_rows(const float* qp, const KV* kp, const KV* vp, const float* ksp, const float* vsp, const int64_t* pp,
                 int64_t B, int64_t H, int64_t S, int64_t D, int64_t G, float cap, float* op, float* sp, float* lp) {
  const float hidden = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> probs(G * S), weights(vsp ? S : 0);  // one row's probabilities (and scaled ones)
    for (int64_t r = begin; r < end; ++r) {
      const KV* keys = kp + r * S * D;
      const KV* values = vp + r * S * D;
      const float* ks = ksp ? ksp + r * S : nullptr;
      const float* vs = vsp ? vsp + r * S : nullptr;
      const int64_t* slot_pos = pp ? pp + r * S : nullptr;
      for (int64_t g = 0; g < G; ++g) {
        float* p = probs.data() + g * S;
        dots(qp + (r * G + g) * D, keys, S, D, p);
        for (int64_t s = 0; s < S; ++s) {
          float x = ks ? p[s] * ks[s] : p[s];
          if (cap > 0.f) x = std::tanh(x / cap) * cap;
          p[s] = slot_pos && slot_pos[s] < 0 ? hidden : x;
        }
        softmax(p, S);
        const float* w = p;
        if (vs) {
          for (int64_t s = 0; s < S; ++s) weights[s] = p[s] * vs[s];
          w = weights.data();
        }
        weighted_sum(w, values, S, D, op + (r * G + g) * D);
      }
      for (int64_t s = 0; s < S; ++s) {
        float total = 0.f;
        for (int64_t g = 0; g < G; ++g) total += probs[g * S + s];
        sp[r * S + s] = total;
        lp[r * S + s] = total / static_cast<float>(G);
      }
    }
  });
}

// A decode step (one query per sequence) over rows of KV heads: q [B, Hq, D] float32, already scaled; keys,
// values [B, H, S, D], int8 with their key_scale, value_scale [B, H, S] float32, or float32 without scales;
// pos [B, H, S] int64 (-1: an empty slot), or none when every slot holds a token (nothing masked); softcap > 0
// applies tanh(x / c) * c. Returns out [B, Hq, D], scores and last [B, H, S].
std::vector<at::Tensor> attend_one(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                   const std::optional<at::Tensor>& key_scale,
                                   const std::optional<at::Tensor>& value_scale, const std::optional<at::Tensor>& pos,
                                   double softcap) {
  const bool int8 = keys.scalar_type() == at::kChar;
  TORCH_CHECK(q.scalar_type() == at::kFloat && keys.scalar_type() == values.scalar_type()
              && (int8 || keys.scalar_type() == at::kFloat) && (!pos || pos->scalar_type() == at::kLong),
              "attend_one: float32 q, int8 or float32 keys/values, int64 pos");
  TORCH_CHECK(int8 == (key_scale.has_value() && value_scale.has_value())
              && (!int8 || (key_scale->scalar_type() == at::kFloat && value_scale->scalar_type() == at::kFloat)),
              "attend_one: int8 keys/values come with float32 scales, float32 ones without");
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 4 && keys.sizes() == values.sizes() && keys.size(0) == q.size(0)
              && keys.size(3) == q.size(2) && q.size(1) % keys.size(1) == 0, "attend_one: shapes do not match");
  const int64_t B = keys.size(0), H = keys.size(1), S = keys.size(2), D = keys.size(3), G = q.size(1) / H;
  const at::Tensor qc = q.contiguous(), kc = keys.contiguous(), vc = values.contiguous();
  const at::Tensor ksc = int8 ? key_scale->contiguous() : at::Tensor();
  const at::Tensor vsc = int8 ? value_scale->contiguous() : at::Tensor();
  const at::Tensor pc = pos ? pos->contiguous() : at::Tensor();
  at::Tensor out = at::empty({B, G * H, D}, q.options());
  at::Tensor scores = at::empty({B, H, S}, q.options());
  at::Tensor last = at::empty({B, H, S}, q.options());
  const int64_t* pp = pos ? pc.data_ptr<int64_t>() : nullptr;
  const float cap = static_cast<float>(softcap);
  if (int8) {
    attend_rows<int8_t>(qc.data_ptr<float>(), kc.data_ptr<int8_t>(), vc.data_ptr<int8_t>(), ksc.data_ptr<float>(),
                        vsc.data_ptr<float>(), pp, B, H, S, D, G, cap, out.data_ptr<float>(), scores.data_ptr<float>(),
                        last.data_ptr<float>());
  } else {
    attend_rows<float>(qc.data_ptr<float>(), kc.data_ptr<float>(), vc.data_ptr<float>(), nullptr, nullptr, pp, B, H,
                       S, D, G, cap, out.data_ptr<float>(), scores.data_ptr<float>(), last.data_ptr<float>());
  }
  return {out, scores, last};
}

}  // namespace

TORCH_LIBRARY(h2o_kv, m) {
  m.def("attend_one(Tensor q, Tensor keys, Tensor values, Tensor? key_scale, Tensor? value_scale, Tensor? pos, "
        "float softcap) -> Tensor[]",
        &attend_one);
}
