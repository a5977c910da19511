// h2o-kv's decode-step attention on a CPU (built and called by h2o_kv/backends/native.py): the same operations as
// cache/attend.py's attend_one for one query per sequence, where torch's products do more work.
//
// - attend_one: one row per (sequence, KV head), its G query heads' logits, mask, softmax, output and
//   scores in one pass while the row is in the core's cache (torch's eager path runs a handful of small
//   batched products and reductions over the layer, each reading it again). Int8 keys and values (quant.py)
//   are widened in registers as they are read: torch has no int8 x float product on a CPU, so the eager
//   path writes and reads a 4x larger float copy of the layer. bfloat16 keys and values are widened the
//   same way and multiplied in float32 (the eager path multiplies in bfloat16 where the CPU can, or widens a
//   float32 copy of the layer where it cannot).
//
// Rows run in parallel on torch's threads (at::parallel_for); the vectors are torch's own (at::vec) at the
// width native.py compiles for.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

// V lanes as float32: float32 as they are, int8 and bfloat16 widened in registers (exact).
inline Vec load_float(const float* p) { return Vec::loadu(p); }
inline Vec load_float(const at::BFloat16* p) {
  Vec out;
  at::vec::load_to_float<at::BFloat16>(p, out);
  return out;
}
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

// Asks for `bytes` from p on, a cache line at a time (nothing when p is null): the memory keeps streaming the
// row's next data while the core computes on what it has.
inline void prefetch(const void* p, int64_t bytes) {
  if (!p) return;
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 3);
}

// The V lane totals of V vectors (acc[j]'s lanes summed into lane j). AVX2: a tree of horizontal adds in
// registers; wider vectors: a transpose through memory, then the columns summed.
inline Vec lane_totals(const Vec* acc) {
#if defined(CPU_CAPABILITY_AVX2)
  const __m256 a = _mm256_hadd_ps(acc[0], acc[1]), b = _mm256_hadd_ps(acc[2], acc[3]);
  const __m256 c = _mm256_hadd_ps(acc[4], acc[5]), d = _mm256_hadd_ps(acc[6], acc[7]);
  const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);  // [0..3 low halves | 0..3 high], [4..7 ...]
  return Vec(_mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31)));
#else
  alignas(64) float partial[V * V], columns[V * V];
  for (int j = 0; j < V; ++j) acc[j].store(partial + j * V);
  at::vec::transpose_mxn<float, V, V>(partial, V, columns, V);
  Vec sum = Vec::loadu(columns);
  for (int i = 1; i < V; ++i) sum = sum + Vec::loadu(columns + i * V);
  return sum;
#endif
}

// logits[g * S + j] = q_g . k_j for the G query heads q [G, D] of one KV head and its S keys [S, D]: V slots at a
// time, read from memory once and multiplied by each query head in turn while they are in the core's L1 (one
// accumulator per slot, V independent chains over D, then lane_totals turns the V partial vectors into V dot
// products).
template <typename T>
void dots(const float* q, int64_t G, const T* keys, int64_t S, int64_t D, float* logits, const T* then = nullptr) {
  int64_t s0 = 0;
  if (D % V == 0) {
    for (; s0 + V <= S; s0 += V) {
      const T* k = keys + s0 * D;
      prefetch(k + 16 * V * D, V * D * sizeof(T));  // the keys 16 blocks ahead
      if (then) prefetch(then + s0 * D, V * D * sizeof(T));  // and what comes next (the row's values)
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = q + g * D;
        Vec acc[V];
        for (int j = 0; j < V; ++j) acc[j] = Vec(0.f);
        for (int64_t d = 0; d < D; d += V) {
          const Vec qd = Vec::loadu(qg + d);
          for (int j = 0; j < V; ++j) acc[j] = at::vec::fmadd(qd, load_float(k + j * D + d), acc[j]);
        }
        lane_totals(acc).store(logits + g * S + s0);
      }
    }
  }
  for (; s0 < S; ++s0) {  // the last S % V slots (all of them when D is not a multiple of V)
    const T* k = keys + s0 * D;
    for (int64_t g = 0; g < G; ++g) {
      float sum = 0.f;
      for (int64_t d = 0; d < D; ++d) sum += q[g * D + d] * static_cast<float>(k[d]);
      logits[g * S + s0] = sum;
    }
  }
}

// out[g * D + d0 ..] += sum over slots b0 .. b1 - 1 of p[g * S + s] * values_s, for NG query heads at once and W
// vectors of the output (NG x W accumulators in registers: independent chains, each value vector read once
// per head from L1), each lane summed over the slots in order.
template <typename T, int NG, int W>
inline void weigh(const float* p, int64_t S, const T* values, int64_t D, int64_t b0, int64_t b1, int64_t d0,
                  float* out) {
  Vec o[NG][W];
  for (int g = 0; g < NG; ++g)
    for (int w = 0; w < W; ++w) o[g][w] = Vec::loadu(out + g * D + d0 + w * V);
  for (int64_t s = b0; s < b1; ++s) {
    const T* v = values + s * D + d0;
    for (int g = 0; g < NG; ++g) {
      const Vec pw(p[g * S + s]);
      for (int w = 0; w < W; ++w) o[g][w] = at::vec::fmadd(pw, load_float(v + w * V), o[g][w]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int w = 0; w < W; ++w) o[g][w].store(out + g * D + d0 + w * V);
}

// out[g] = sum_s p[g * S + s] * values_s for the G query heads and S values [S, D]: blocks of SB slots, read from
// memory once and weighed by the heads (three at a time, weigh) while they are in L1, 4 V lanes of the output
// at a time (each output lane summed over the slots in order, as one pass per head would).
template <typename T>
void weighted_sums(const float* p, int64_t G, const T* values, int64_t S, int64_t D, float* out,
                   const T* then = nullptr) {
  constexpr int64_t SB = 32;
  std::fill(out, out + G * D, 0.f);
  for (int64_t b0 = 0; b0 < S; b0 += SB) {
    const int64_t b1 = std::min(S, b0 + SB);
    if (then) prefetch(then + b0 * D, (b1 - b0) * D * sizeof(T));  // the next row's keys
    for (int64_t g = 0; g < G; g += 3) {
      const float* pg = p + g * S;
      float* og = out + g * D;
      const int64_t heads = std::min<int64_t>(3, G - g);
      int64_t d0 = 0;
      for (; d0 + 4 * V <= D; d0 += 4 * V) {
        if (heads == 3) weigh<T, 3, 4>(pg, S, values, D, b0, b1, d0, og);
        else if (heads == 2) weigh<T, 2, 4>(pg, S, values, D, b0, b1, d0, og);
        else weigh<T, 1, 4>(pg, S, values, D, b0, b1, d0, og);
      }
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t d = d0; d < D; ++d) {  // the last D % 4V lanes
          float sum = og[h * D + d];
          for (int64_t s = b0; s < b1; ++s) sum += pg[h * S + s] * static_cast<float>(values[s * D + d]);
          og[h * D + d] = sum;
        }
    }
  }
}

void softmax(float* x, int64_t n) {
  if (n == 0) return;
  const float top = at::vec::reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, x, n);
  at::vec::map([top](Vec a) { return (a - Vec(top)).exp(); }, x, x, n);
  const float inv = 1.f / at::vec::reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, x, n);
  at::vec::map([inv](Vec a) { return a * Vec(inv); }, x, x, n);
}

// One (sequence, KV head) row: its G query heads' logits, softmax (into probs [G, S]) and outputs (out [G, D]).
// KV is float32, or int8 widened in registers as it is read, with its per-slot scales applied to the logits
// (q . k8_j * s_j) and folded into the output's weights (p_j t_j, in `weights` [G, S]). slot_pos masks empty slots.
template <typename KV>
void attend_row(const float* q, const KV* keys, const KV* values, const float* ks, const float* vs,
                const int64_t* slot_pos, int64_t S, int64_t D, int64_t G, float cap, float* out, float* probs,
                float* weights, const KV* next_keys = nullptr) {
  const float hidden = -std::numeric_limits<float>::infinity();
  dots(q, G, keys, S, D, probs, values);
  for (int64_t g = 0; g < G; ++g) {
    float* p = probs + g * S;
    for (int64_t s = 0; s < S; ++s) {
      float x = ks ? p[s] * ks[s] : p[s];
      if (cap > 0.f) x = std::tanh(x / cap) * cap;
      p[s] = slot_pos && slot_pos[s] < 0 ? hidden : x;
    }
    softmax(p, S);
    if (vs)
      for (int64_t s = 0; s < S; ++s) weights[g * S + s] = p[s] * vs[s];
  }
  weighted_sums(vs ? weights : probs, G, values, S, D, out, next_keys);
}

// score[s] += the probability slot s got from the G query heads (probs [G, S]), summed over the heads in order, and
// last[s] = their mean when `last` is given; V slots at a time.
inline void add_scores(const float* probs, int64_t G, int64_t S, float* score, float* last) {
  const Vec heads(static_cast<float>(G));
  int64_t s = 0;
  for (; s + V <= S; s += V) {
    Vec total = Vec::loadu(probs + s);
    for (int64_t g = 1; g < G; ++g) total = total + Vec::loadu(probs + g * S + s);
    (Vec::loadu(score + s) + total).store(score + s);
    if (last) (total / heads).store(last + s);
  }
  for (; s < S; ++s) {
    float total = probs[s];
    for (int64_t g = 1; g < G; ++g) total += probs[g * S + s];
    score[s] += total;
    if (last) last[s] = total / static_cast<float>(G);
  }
}

// One row per task (attend_row), the slots' summed (scores) and averaged (last) probabilities written out.
template <typename KV>
void attend_rows(const float* qp, const KV* kp, const KV* vp, const float* ksp, const float* vsp, const int64_t* pp,
                 int64_t B, int64_t H, int64_t S, int64_t D, int64_t G, float cap, float* op, float* sp, float* lp) {
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> probs(G * S), weights(vsp ? G * S : 0);  // one row's probabilities (and scaled ones)
    for (int64_t r = begin; r < end; ++r) {
      attend_row(qp + r * G * D, kp + r * S * D, vp + r * S * D, ksp ? ksp + r * S : nullptr,
                 vsp ? vsp + r * S : nullptr, pp ? pp + r * S : nullptr, S, D, G, cap, op + r * G * D, probs.data(),
                 weights.data());
      std::fill(sp + r * S, sp + (r + 1) * S, 0.f);
      add_scores(probs.data(), G, S, sp + r * S, lp + r * S);
    }
  });
}

// A decode step (one query per sequence) over rows of KV heads: q [B, Hq, D] float32, already scaled; keys,
// values [B, H, S, D], int8 with their key_scale, value_scale [B, H, S] float32, or float32 or bfloat16 without;
// pos [B, H, S] int64 (-1: an empty slot), or none when every slot holds a token (nothing masked); softcap > 0
// applies tanh(x / c) * c. Returns out [B, Hq, D], scores and last [B, H, S].
std::vector<at::Tensor> attend_one(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                   const std::optional<at::Tensor>& key_scale,
                                   const std::optional<at::Tensor>& value_scale, const std::optional<at::Tensor>& pos,
                                   double softcap) {
  const bool int8 = keys.scalar_type() == at::kChar, bf16 = keys.scalar_type() == at::kBFloat16;
  TORCH_CHECK(q.scalar_type() == at::kFloat && keys.scalar_type() == values.scalar_type()
              && (int8 || bf16 || keys.scalar_type() == at::kFloat) && (!pos || pos->scalar_type() == at::kLong),
              "attend_one: float32 q, int8, bfloat16 or float32 keys/values, int64 pos");
  TORCH_CHECK(int8 == (key_scale.has_value() && value_scale.has_value())
              && (!int8 || (key_scale->scalar_type() == at::kFloat && value_scale->scalar_type() == at::kFloat)),
              "attend_one: int8 keys/values come with float32 scales, float32 and bfloat16 ones without");
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
  } else if (bf16) {
    attend_rows<at::BFloat16>(qc.data_ptr<float>(), kc.data_ptr<at::BFloat16>(), vc.data_ptr<at::BFloat16>(), nullptr,
                              nullptr, pp, B, H, S, D, G, cap, out.data_ptr<float>(), scores.data_ptr<float>(),
                              last.data_ptr<float>());
  } else {
    attend_rows<float>(qc.data_ptr<float>(), kc.data_ptr<float>(), vc.data_ptr<float>(), nullptr, nullptr, pp, B, H,
                       S, D, G, cap, out.data_ptr<float>(), scores.data_ptr<float>(), last.data_ptr<float>());
  }
  return {out, scores, last};
}

}  // namespace

namespace h2o_kv {

// A uniform layer's steady decode step (steady.Steady._decode_fused), in place, one (sequence, KV head) row per
// task, each row's work in the order of the eager path's operations: the new token (new_keys, new_values
// [B, H, 1, D] in the storage's dtype: float32, bfloat16, or int8 with their scales) goes into the row's vacant
// slot `slot` [B, H, 1] at position qpos [B]; the G query heads (q [B, Hq, 1, D] float32 or bfloat16, times
// `scaling` in float32 as torch's q.float() * scaling) attend (attend_row, empty slots masked); each slot's score
// gains the probability its query heads paid (and `last` gets their mean, when given); then the row frees the
// oldest of its lowest priorities, where a kept token's priority is its score, or +inf for the `recent` [B]
// newest positions (H2O's and SnapKV's ranking, policies' `protected_recent`) and for positions below `sinks` [B]
// when given (`protected_sinks`), and an empty slot ranks -inf
// in a row within its capacity [B] (it is "freed" instead) and +inf in a row over it. qpos, recent and
// capacity may come in any shape of B numbers. Returns the output [B, 1, Hq, D] float32 and the freed slots
// [B, H, 1] (where the next step writes).
std::vector<at::Tensor> decode_step(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                    const std::optional<at::Tensor>& key_scale,
                                    const std::optional<at::Tensor>& value_scale, const at::Tensor& pos, const at::Tensor& score,
                                    const std::optional<at::Tensor>& last, const at::Tensor& slot,
                                    const at::Tensor& new_keys, const at::Tensor& new_values,
                                    const std::optional<at::Tensor>& new_key_scale,
                                    const std::optional<at::Tensor>& new_value_scale, const at::Tensor& qpos,
                                    const at::Tensor& recent, const at::Tensor& capacity, double scaling,
                                    double softcap, const std::optional<at::Tensor>& sinks) {
  const bool int8 = keys.scalar_type() == at::kChar, bf16 = keys.scalar_type() == at::kBFloat16;
  TORCH_CHECK((q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16)
              && keys.scalar_type() == values.scalar_type() && (int8 || bf16 || keys.scalar_type() == at::kFloat)
              && new_keys.scalar_type() == keys.scalar_type() && new_values.scalar_type() == keys.scalar_type(),
              "decode_step: float32 or bfloat16 q, int8, bfloat16 or float32 keys/values and new ones alike");
  TORCH_CHECK(int8 == (key_scale && value_scale && new_key_scale && new_value_scale),
              "decode_step: int8 storage comes with its scales and the new tokens' scales, float32 and bfloat16 "
              "without");
  TORCH_CHECK(q.dim() == 4 && q.size(2) == 1 && keys.dim() == 4 && keys.sizes() == values.sizes()
              && keys.size(0) == q.size(0) && keys.size(3) == q.size(3) && q.size(1) % keys.size(1) == 0,
              "decode_step: shapes do not match");
  const int64_t B = keys.size(0), H = keys.size(1), S = keys.size(2), D = keys.size(3), G = q.size(1) / H;
  TORCH_CHECK(new_keys.numel() == B * H * D && new_values.numel() == B * H * D && slot.numel() == B * H
              && pos.sizes() == score.sizes() && pos.size(0) == B && pos.size(1) == H && pos.size(2) == S
              && qpos.numel() == B && recent.numel() == B && capacity.numel() == B,
              "decode_step: shapes do not match");
  for (const at::Tensor* t : {&keys, &values, &pos, &score}) {
    TORCH_CHECK(t->is_contiguous(), "decode_step: the layer's storage must be contiguous (it is written in place)");
  }
  TORCH_CHECK(pos.scalar_type() == at::kLong && score.scalar_type() == at::kFloat && slot.scalar_type() == at::kLong
              && qpos.scalar_type() == at::kLong && recent.scalar_type() == at::kLong
              && capacity.scalar_type() == at::kLong, "decode_step: int64 pos, slots and positions, float32 score");
  if (last) TORCH_CHECK(last->sizes() == score.sizes() && last->is_contiguous() && last->scalar_type() == at::kFloat,
                        "decode_step: last like score");
  if (sinks) TORCH_CHECK(sinks->numel() == B && sinks->scalar_type() == at::kLong, "decode_step: B int64 sinks");
  if (int8) TORCH_CHECK(key_scale->is_contiguous() && value_scale->is_contiguous() && key_scale->sizes() == pos.sizes()
                        && value_scale->sizes() == pos.sizes(), "decode_step: scales like pos, contiguous");
  const at::Tensor qc = q.to(at::kFloat).contiguous();  // [B, Hq, 1, D], scaled per row below (as q.float() * scaling)
  const float scale = static_cast<float>(scaling);
  const at::Tensor sc = slot.contiguous(), qposc = qpos.contiguous();
  const at::Tensor rc = recent.contiguous(), cc = capacity.contiguous();
  const at::Tensor kc = sinks ? sinks->contiguous() : at::Tensor();
  const at::Tensor nk = new_keys.contiguous(), nv = new_values.contiguous();
  const at::Tensor nks = int8 ? new_key_scale->contiguous() : at::Tensor();
  const at::Tensor nvs = int8 ? new_value_scale->contiguous() : at::Tensor();
  const int64_t* slots = sc.data_ptr<int64_t>();
  for (int64_t r = 0; r < B * H; ++r) TORCH_CHECK(slots[r] >= 0 && slots[r] < S, "decode_step: a slot out of range");
  at::Tensor out = at::empty({B, 1, G * H, D}, qc.options());
  at::Tensor victims = at::empty({B, H, 1}, slot.options());
  const float* qp = qc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  int64_t* pp = pos.data_ptr<int64_t>();
  float* scp = score.data_ptr<float>();
  float* lp = last ? last->data_ptr<float>() : nullptr;
  float* ksp = int8 ? key_scale->data_ptr<float>() : nullptr;
  float* vsp = int8 ? value_scale->data_ptr<float>() : nullptr;
  const int64_t *qposp = qposc.data_ptr<int64_t>(), *rp = rc.data_ptr<int64_t>(), *cp = cc.data_ptr<int64_t>();
  const int64_t* sinkp = sinks ? kc.data_ptr<int64_t>() : nullptr;  // none: no position below 0 to keep
  int64_t* vp = victims.data_ptr<int64_t>();
  const float cap = static_cast<float>(softcap);
  auto run = [&](auto* kp, auto* valp, const auto* nkp, const auto* nvp) {
    at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
      thread_local std::vector<float> query, probs, weights;  // scratch, kept between calls
      query.resize(G * D);
      probs.resize(G * S);
      weights.resize(int8 ? G * S : 0);
      for (int64_t r = begin; r < end; ++r) {
        const int64_t b = r / H, s0 = slots[r];
        for (int64_t i = 0; i < G * D; ++i) query[i] = qp[r * G * D + i] * scale;
        int64_t* rpos = pp + r * S;
        float* rscore = scp + r * S;
        float* rlast = lp ? lp + r * S : nullptr;
        std::copy(nkp + r * D, nkp + (r + 1) * D, kp + (r * S + s0) * D);
        std::copy(nvp + r * D, nvp + (r + 1) * D, valp + (r * S + s0) * D);
        if (int8) {
          ksp[r * S + s0] = nks.data_ptr<float>()[r];
          vsp[r * S + s0] = nvs.data_ptr<float>()[r];
        }
        rpos[s0] = qposp[b];
        attend_row(query.data(), kp + r * S * D, valp + r * S * D, ksp ? ksp + r * S : nullptr,
                   vsp ? vsp + r * S : nullptr, rpos, S, D, G, cap, op + r * G * D, probs.data(), weights.data(),
                   r + 1 < end ? kp + (r + 1) * S * D : nullptr);
        add_scores(probs.data(), G, S, rscore, rlast);
        int64_t kept = 0;
        for (int64_t s = 0; s < S; ++s) kept += rpos[s] >= 0;
        const float empty = kept > cp[b] ? std::numeric_limits<float>::infinity()
                                         : -std::numeric_limits<float>::infinity();
        const int64_t newest = qposp[b] + 1 - rp[b];  // next_pos - recent: kept whatever their score
        const int64_t first = sinkp ? sinkp[b] : 0;    // and the sinks, below it
        int64_t victim = 0;
        float best = 0.f;
        for (int64_t s = 0; s < S; ++s) {  // the lowest priority, the oldest (then the first slot) among equals
          const bool kept_anyway = rpos[s] >= newest || rpos[s] < first;
          const float pr = rpos[s] < 0 ? empty : kept_anyway ? std::numeric_limits<float>::infinity() : rscore[s];
          if (s == 0 || pr < best || (pr == best && rpos[s] < rpos[victim])) {
            best = pr;
            victim = s;
          }
        }
        rpos[victim] = -1;
        rscore[victim] = 0.f;
        if (rlast) rlast[victim] = 0.f;
        vp[r] = victim;
      }
    });
  };
  if (int8) {
    run(keys.data_ptr<int8_t>(), values.data_ptr<int8_t>(), nk.data_ptr<int8_t>(), nv.data_ptr<int8_t>());
  } else if (bf16) {
    run(keys.data_ptr<at::BFloat16>(), values.data_ptr<at::BFloat16>(), nk.data_ptr<at::BFloat16>(),
        nv.data_ptr<at::BFloat16>());
  } else {
    run(keys.data_ptr<float>(), values.data_ptr<float>(), nk.data_ptr<float>(), nv.data_ptr<float>());
  }
  return {out, victims};
}

}  // namespace h2o_kv

TORCH_LIBRARY(h2o_kv, m) {
  m.def("attend_one(Tensor q, Tensor keys, Tensor values, Tensor? key_scale, Tensor? value_scale, Tensor? pos, "
        "float softcap) -> Tensor[]",
        &attend_one);
  m.def("decode_step(Tensor q, Tensor(a!) keys, Tensor(b!) values, Tensor(c!)? key_scale, Tensor(d!)? value_scale, "
        "Tensor(e!) pos, Tensor(f!) score, Tensor(g!)? last, Tensor slot, Tensor new_keys, Tensor new_values, "
        "Tensor? new_key_scale, Tensor? new_value_scale, Tensor qpos, Tensor recent, Tensor capacity, "
        "float scaling, float softcap, Tensor? sinks=None) -> Tensor[]",
        &h2o_kv::decode_step);
}
