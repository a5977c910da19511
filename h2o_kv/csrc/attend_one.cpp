// h2o-kv's decode-step attention on a CPU (built and called by h2o_kv/native.py): the same operations as
// kernel.attend_one for one query per sequence, where torch's products do more work.
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

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int V = Vec::size();

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

// logits[g * S + j] = q_g . k_j for the G query heads q [G, D] of one KV head and its S keys [S, D]: V slots at a
// time, read from memory once and multiplied by each query head in turn while they are in the core's L1 (one
// accumulator per slot, V independent chains over D, then one transpose turns the V partial vectors into V dot
// products).
template <typename T>
void dots(const float* q, int64_t G, const T* keys, int64_t S, int64_t D, float* logits) {
  alignas(64) float partial[V * V], columns[V * V];
  int64_t s0 = 0;
  if (D % V == 0) {
    for (; s0 + V <= S; s0 += V) {
      const T* k[V];
      for (int j = 0; j < V; ++j) k[j] = keys + (s0 + j) * D;
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = q + g * D;
        Vec acc[V];
        for (int j = 0; j < V; ++j) acc[j] = Vec(0.f);
        for (int64_t d = 0; d < D; d += V) {
          const Vec qd = Vec::loadu(qg + d);
          for (int j = 0; j < V; ++j) acc[j] = at::vec::fmadd(qd, load_float(k[j] + d), acc[j]);
        }
        for (int j = 0; j < V; ++j) acc[j].store(partial + j * V);
        at::vec::transpose_mxn<float, V, V>(partial, V, columns, V);
        Vec sum = Vec::loadu(columns);
        for (int i = 1; i < V; ++i) sum = sum + Vec::loadu(columns + i * V);
        sum.store(logits + g * S + s0);
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

// out[g] = sum_s p[g * S + s] * values_s for the G query heads and S values [S, D]: blocks of SB slots, read from
// memory once and weighed by each head in turn while they are in L1, V lanes of the output at a time (each
// output lane summed over the slots in order, as one pass per head would).
template <typename T>
void weighted_sums(const float* p, int64_t G, const T* values, int64_t S, int64_t D, float* out) {
  constexpr int64_t SB = 32;
  std::fill(out, out + G * D, 0.f);
  for (int64_t b0 = 0; b0 < S; b0 += SB) {
    const int64_t b1 = std::min(S, b0 + SB);
    for (int64_t g = 0; g < G; ++g) {
      const float* pg = p + g * S;
      float* og = out + g * D;
      int64_t d0 = 0;
      for (; d0 + 4 * V <= D; d0 += 4 * V) {  // four independent accumulators in registers
        Vec o0 = Vec::loadu(og + d0), o1 = Vec::loadu(og + d0 + V), o2 = Vec::loadu(og + d0 + 2 * V),
            o3 = Vec::loadu(og + d0 + 3 * V);
        for (int64_t s = b0; s < b1; ++s) {
          const Vec w(pg[s]);
          const T* v = values + s * D + d0;
          o0 = at::vec::fmadd(w, load_float(v), o0);
          o1 = at::vec::fmadd(w, load_float(v + V), o1);
          o2 = at::vec::fmadd(w, load_float(v + 2 * V), o2);
          o3 = at::vec::fmadd(w, load_float(v + 3 * V), o3);
        }
        o0.store(og + d0);
        o1.store(og + d0 + V);
        o2.store(og + d0 + 2 * V);
        o3.store(og + d0 + 3 * V);
      }
      for (; d0 < D; ++d0) {
        float sum = og[d0];
        for (int64_t s = b0; s < b1; ++s) sum += pg[s] * static_cast<float>(values[s * D + d0]);
        og[d0] = sum;
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
                float* weights) {
  const float hidden = -std::numeric_limits<float>::infinity();
  dots(q, G, keys, S, D, probs);
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
  weighted_sums(vs ? weights : probs, G, values, S, D, out);
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

// A uniform layer's steady decode step (steady.Steady._decode_fused), in place, one (sequence, KV head) row per
// task, each row's work in the order of the eager path's operations: the new token (new_keys, new_values
// [B, H, 1, D] in the storage's dtype: float32, bfloat16, or int8 with their scales) goes into the row's vacant
// slot `slot` [B, H, 1] at position qpos [B]; the G query heads attend (attend_row, empty slots masked); each slot's score
// gains the probability its query heads paid (and `last` gets their mean, when given); then the row frees the
// oldest of its lowest priorities, where a kept token's priority is its score, or +inf for the `recent` [B]
// newest positions (H2O's and SnapKV's ranking, policies' `protected_recent`), and an empty slot ranks -inf
// in a row within its capacity [B] (it is "freed" instead) and +inf in a row over it. Returns the output
// [B, Hq, D] and the freed slots [B, H, 1] (where the next step writes).
std::vector<at::Tensor> decode_step(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                    const std::optional<at::Tensor>& key_scale,
                                    const std::optional<at::Tensor>& value_scale, const at::Tensor& pos, const at::Tensor& score,
                                    const std::optional<at::Tensor>& last, const at::Tensor& slot,
                                    const at::Tensor& new_keys, const at::Tensor& new_values,
                                    const std::optional<at::Tensor>& new_key_scale,
                                    const std::optional<at::Tensor>& new_value_scale, const at::Tensor& qpos,
                                    const at::Tensor& recent, const at::Tensor& capacity, double softcap) {
  const bool int8 = keys.scalar_type() == at::kChar, bf16 = keys.scalar_type() == at::kBFloat16;
  TORCH_CHECK(q.scalar_type() == at::kFloat && keys.scalar_type() == values.scalar_type()
              && (int8 || bf16 || keys.scalar_type() == at::kFloat) && new_keys.scalar_type() == keys.scalar_type()
              && new_values.scalar_type() == keys.scalar_type(),
              "decode_step: float32 q, int8, bfloat16 or float32 keys/values and new ones alike");
  TORCH_CHECK(int8 == (key_scale && value_scale && new_key_scale && new_value_scale),
              "decode_step: int8 storage comes with its scales and the new tokens' scales, float32 and bfloat16 "
              "without");
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 4 && keys.sizes() == values.sizes() && keys.size(0) == q.size(0)
              && keys.size(3) == q.size(2) && q.size(1) % keys.size(1) == 0, "decode_step: shapes do not match");
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
  if (int8) TORCH_CHECK(key_scale->is_contiguous() && value_scale->is_contiguous() && key_scale->sizes() == pos.sizes()
                        && value_scale->sizes() == pos.sizes(), "decode_step: scales like pos, contiguous");
  const at::Tensor qc = q.contiguous(), sc = slot.contiguous(), qposc = qpos.contiguous();
  const at::Tensor rc = recent.contiguous(), cc = capacity.contiguous();
  const at::Tensor nk = new_keys.contiguous(), nv = new_values.contiguous();
  const at::Tensor nks = int8 ? new_key_scale->contiguous() : at::Tensor();
  const at::Tensor nvs = int8 ? new_value_scale->contiguous() : at::Tensor();
  const int64_t* slots = sc.data_ptr<int64_t>();
  for (int64_t r = 0; r < B * H; ++r) TORCH_CHECK(slots[r] >= 0 && slots[r] < S, "decode_step: a slot out of range");
  at::Tensor out = at::empty({B, G * H, D}, q.options());
  at::Tensor victims = at::empty({B, H, 1}, slot.options());
  const float* qp = qc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  int64_t* pp = pos.data_ptr<int64_t>();
  float* scp = score.data_ptr<float>();
  float* lp = last ? last->data_ptr<float>() : nullptr;
  float* ksp = int8 ? key_scale->data_ptr<float>() : nullptr;
  float* vsp = int8 ? value_scale->data_ptr<float>() : nullptr;
  const int64_t *qposp = qposc.data_ptr<int64_t>(), *rp = rc.data_ptr<int64_t>(), *cp = cc.data_ptr<int64_t>();
  int64_t* vp = victims.data_ptr<int64_t>();
  const float cap = static_cast<float>(softcap);
  auto run = [&](auto* kp, auto* valp, const auto* nkp, const auto* nvp) {
    at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> probs(G * S), weights(int8 ? G * S : 0);
      for (int64_t r = begin; r < end; ++r) {
        const int64_t b = r / H, s0 = slots[r];
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
        attend_row(qp + r * G * D, kp + r * S * D, valp + r * S * D, ksp ? ksp + r * S : nullptr,
                   vsp ? vsp + r * S : nullptr, rpos, S, D, G, cap, op + r * G * D, probs.data(), weights.data());
        int64_t kept = 0;
        for (int64_t s = 0; s < S; ++s) {
          float total = 0.f;
          for (int64_t g = 0; g < G; ++g) total += probs[g * S + s];
          rscore[s] += total;
          if (rlast) rlast[s] = total / static_cast<float>(G);
          kept += rpos[s] >= 0;
        }
        const float empty = kept > cp[b] ? std::numeric_limits<float>::infinity()
                                         : -std::numeric_limits<float>::infinity();
        const int64_t newest = qposp[b] + 1 - rp[b];  // next_pos - recent: kept whatever their score
        int64_t victim = 0;
        float best = 0.f;
        for (int64_t s = 0; s < S; ++s) {  // the lowest priority, the oldest (then the first slot) among equals
          const float pr = rpos[s] < 0 ? empty : rpos[s] >= newest ? std::numeric_limits<float>::infinity() : rscore[s];
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

}  // namespace

TORCH_LIBRARY(h2o_kv, m) {
  m.def("attend_one(Tensor q, Tensor keys, Tensor values, Tensor? key_scale, Tensor? value_scale, Tensor? pos, "
        "float softcap) -> Tensor[]",
        &attend_one);
  m.def("decode_step(Tensor q, Tensor(a!) keys, Tensor(b!) values, Tensor(c!)? key_scale, Tensor(d!)? value_scale, "
        "Tensor(e!) pos, Tensor(f!) score, Tensor(g!)? last, Tensor slot, Tensor new_keys, Tensor new_values, "
        "Tensor? new_key_scale, Tensor? new_value_scale, Tensor qpos, Tensor recent, Tensor capacity, "
        "float softcap) -> Tensor[]",
        &decode_step);
}
