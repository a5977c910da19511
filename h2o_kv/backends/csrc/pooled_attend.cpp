// A head-pooled row's decode-step attention on a CPU (h2o_kv/cache/pooled.py, AdaKV; built and called by
// h2o_kv/backends/native.py): the same operations as cache/attend.py's attend_one with `slot_head`, where the eager path computes
// every query head against every slot of the row and masks the other heads' slots.
//
// The row's heads' slots are interleaved (a token's heads take neighbouring slots, and a decode step refills
// whichever slots the last eviction freed). Reading one head's slots at a time, as attend_one reads a uniform
// layer's rows, jumps through memory and ran at its latency (a fifth slower than attend_one over the same
// bytes); this kernel reads the row once in slot order, in chunks that run in parallel on torch's threads.
// Also here: lowest_slots, the slots a full head-pooled row frees at each decode step.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels.h"

namespace {

constexpr int64_t CHUNK = 256;  // slots per task in the passes over the row

// Scratch memory that outlives a call (one per calling thread): a fresh buffer of this size is memory the OS
// maps page by page at every layer's call.
float* scratch(std::vector<float>& buffer, int64_t size) {
  if (static_cast<int64_t>(buffer.size()) < size) buffer.resize(size);
  return buffer.data();
}

// acc [N, D] += w [N, s0:s1] @ values [s0:s1, D] for N rows of weights (row stride S): the values read in slot
// order, 2 V lanes of D at a time into N x 2 accumulators held in registers (N <= 12).
template <int N>
void weigh(const float* w, int64_t S, const float* values, int64_t D, int64_t s0, int64_t s1, float* acc) {
  int64_t d0 = 0;
  for (; d0 + 2 * V <= D; d0 += 2 * V) {
    Vec a[N][2];
    for (int n = 0; n < N; ++n) {
      a[n][0] = Vec::loadu(acc + n * D + d0);
      a[n][1] = Vec::loadu(acc + n * D + d0 + V);
    }
    for (int64_t s = s0; s < s1; ++s) {
      const Vec v0 = Vec::loadu(values + s * D + d0), v1 = Vec::loadu(values + s * D + d0 + V);
      for (int n = 0; n < N; ++n) {
        const Vec x(w[n * S + s]);
        a[n][0] = at::vec::fmadd(x, v0, a[n][0]);
        a[n][1] = at::vec::fmadd(x, v1, a[n][1]);
      }
    }
    for (int n = 0; n < N; ++n) {
      a[n][0].store(acc + n * D + d0);
      a[n][1].store(acc + n * D + d0 + V);
    }
  }
  for (; d0 + V <= D; d0 += V) {
    Vec a[N];
    for (int n = 0; n < N; ++n) a[n] = Vec::loadu(acc + n * D + d0);
    for (int64_t s = s0; s < s1; ++s) {
      const Vec v0 = Vec::loadu(values + s * D + d0);
      for (int n = 0; n < N; ++n) a[n] = at::vec::fmadd(Vec(w[n * S + s]), v0, a[n]);
    }
    for (int n = 0; n < N; ++n) a[n].store(acc + n * D + d0);
  }
  for (; d0 < D; ++d0)
    for (int64_t s = s0; s < s1; ++s)
      for (int n = 0; n < N; ++n) acc[n * D + d0] += w[n * S + s] * values[s * D + d0];
}

// weigh for any number of rows, 12 at a time.
void weigh_rows(const float* w, int64_t rows, int64_t S, const float* values, int64_t D, int64_t s0, int64_t s1,
                float* acc) {
  for (int64_t r = 0; r < rows; r += 12) {
    const float* wr = w + r * S;
    float* ar = acc + r * D;
    switch (std::min<int64_t>(rows - r, 12)) {
      case 1: weigh<1>(wr, S, values, D, s0, s1, ar); break;
      case 2: weigh<2>(wr, S, values, D, s0, s1, ar); break;
      case 3: weigh<3>(wr, S, values, D, s0, s1, ar); break;
      case 4: weigh<4>(wr, S, values, D, s0, s1, ar); break;
      case 5: weigh<5>(wr, S, values, D, s0, s1, ar); break;
      case 6: weigh<6>(wr, S, values, D, s0, s1, ar); break;
      case 7: weigh<7>(wr, S, values, D, s0, s1, ar); break;
      case 8: weigh<8>(wr, S, values, D, s0, s1, ar); break;
      case 9: weigh<9>(wr, S, values, D, s0, s1, ar); break;
      case 10: weigh<10>(wr, S, values, D, s0, s1, ar); break;
      case 11: weigh<11>(wr, S, values, D, s0, s1, ar); break;
      default: weigh<12>(wr, S, values, D, s0, s1, ar); break;
    }
  }
}

// A head-pooled row's decode-step attention (h2o_kv/cache/pooled.py, AdaKV): q [B, Hq, D] float32, already scaled;
// keys, values [B, S, D] float32 shared by the KV heads, head [B, S] int8 each slot's KV head, pos [B, S] int64
// (-1: empty). Query head i belongs to KV head i / G (G = Hq / heads) and attends over that head's kept slots
// only. The row is read in slot order, the way it lies in memory (a head's slots are scattered through it, and
// reading them head by head runs at the memory's latency, not its bandwidth):
//   1. each slot's G logits, its own head's queries against its key (chunks of the row in parallel);
//   2. per (sequence, query head): the max, exp and sum over that head's slots (small, in cache);
//   3. the values weighted into every query head's output by that head's probabilities, 0 on another head's
//      slots (`masked`, written by 2): a dense product read once in slot order (chunks in parallel, then
//      summed in chunk order); picking each head's slots out of the row instead ran at the memory's latency.
// Writes out [B, Hq, D], each slot's probabilities summed over its own head's queries into sp [B, S] (0 on empty
// slots), and their mean into lp [B, S] unless it is null.
void pooled_attend(const float* qp, const float* kp, const float* vp, const int8_t* hp, const int64_t* pp, int64_t B,
                   int64_t S, int64_t D, int64_t Hq, int64_t heads, float cap, float* op, float* sp, float* lp) {
  const int64_t G = Hq / heads;
  const int64_t chunks = std::max<int64_t>(1, (S + CHUNK - 1) / CHUNK);
  thread_local std::vector<float> probs_buffer, which_buffer, partial_buffer, masked_buffer;
  float* P = scratch(probs_buffer, B * G * S);  // logits, then probabilities: [b][g][s]
  float* masked = scratch(masked_buffer, B * Hq * S);  // probabilities per query head, 0 on other heads' slots
  float* which = scratch(which_buffer, B * S);  // a slot's head as a float, `heads` if empty
  float* part = scratch(partial_buffer, B * chunks * Hq * D);
  const float hidden = -std::numeric_limits<float>::infinity();
  // 1. logits, slot order
  at::parallel_for(0, B * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / chunks, s_begin = (task % chunks) * CHUNK, s_end = std::min(S, s_begin + CHUNK);
      const float* keys_b = kp + b * S * D;
      const float* q_b = qp + b * Hq * D;
      float* P_b = P + b * G * S;
      float* which_b = which + b * S;
      for (int64_t s = s_begin; s < s_end; ++s) {  // a slot's head, `heads` for an empty slot (or a tag out of range)
        const int64_t h = hp[b * S + s];
        which_b[s] = static_cast<float>(pp[b * S + s] >= 0 && h >= 0 && h < heads ? h : heads);
      }
      // a slot's queries (an empty slot's are head 0's: masked below)
      auto queries = [&](int64_t s) { return q_b + (which_b[s] < heads ? static_cast<int64_t>(which_b[s]) : 0) * G * D; };
      int64_t s0 = s_begin;
      if (D % V == 0) {  // V slots at a time, each against its own head's query g: V independent sums over D
        alignas(64) float partial_dots[V * V], columns[V * V];
        for (; s0 + V <= s_end; s0 += V) {
          const float *k[V], *qh[V];
          for (int j = 0; j < V; ++j) {
            k[j] = keys_b + (s0 + j) * D;
            qh[j] = queries(s0 + j);
          }
          for (int64_t g = 0; g < G; ++g) {
            Vec acc[V];
            for (int j = 0; j < V; ++j) acc[j] = Vec(0.f);
            for (int64_t d = 0; d < D; d += V)
              for (int j = 0; j < V; ++j)
                acc[j] = at::vec::fmadd(Vec::loadu(qh[j] + g * D + d), Vec::loadu(k[j] + d), acc[j]);
            for (int j = 0; j < V; ++j) acc[j].store(partial_dots + j * V);
            at::vec::transpose_mxn<float, V, V>(partial_dots, V, columns, V);
            Vec sum = Vec::loadu(columns);
            for (int i = 1; i < V; ++i) sum = sum + Vec::loadu(columns + i * V);
            sum.store(P_b + g * S + s0);
          }
        }
      }
      for (; s0 < s_end; ++s0) {  // the last slots of the chunk (all of them when D is not a multiple of V)
        const float* k = keys_b + s0 * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = queries(s0) + g * D;
          float sum = 0.f;
          for (int64_t d = 0; d < D; ++d) sum += qg[d] * k[d];
          P_b[g * S + s0] = sum;
        }
      }
      for (int64_t s = s_begin; s < s_end; ++s) {
        for (int64_t g = 0; g < G; ++g) {
          float& x = P_b[g * S + s];
          if (cap > 0.f) x = std::tanh(x / cap) * cap;
          if (which_b[s] == heads) x = hidden;
        }
      }
    }
  });
  // 2. softmax per (sequence, query head) over its head's slots, V slots at a time: each head's lanes picked
  // by comparing the slots' heads (`which`), the empty slots' logits are -inf (probabilities 0).
  at::parallel_for(0, B * G, 1, [&](int64_t begin, int64_t end) {
    std::vector<Vec> top(heads), total(heads);
    std::vector<float> top_of(heads + 1, 0.f), scale_of(heads + 1, 0.f);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / G, g = task % G;
      float* row = P + (b * G + g) * S;
      const float* w = which + b * S;
      const int64_t vectorized = S - S % V;
      // the row's lanes that hold head h's slots as a factor per head (index `heads`: the empty slots, 0)
      auto per_head = [&](const float* table, int64_t s0) {
        const Vec wv = Vec::loadu(w + s0);
        Vec out(table[heads]);
        for (int64_t h = 0; h < heads; ++h)
          out = Vec::blendv(out, Vec(table[h]), wv == Vec(static_cast<float>(h)));
        return out;
      };
      std::fill(top.begin(), top.end(), Vec(hidden));
      for (int64_t s0 = 0; s0 < vectorized; s0 += V) {
        const Vec x = Vec::loadu(row + s0), wv = Vec::loadu(w + s0);
        for (int64_t h = 0; h < heads; ++h)
          top[h] = at::vec::maximum(top[h], Vec::blendv(Vec(hidden), x, wv == Vec(static_cast<float>(h))));
      }
      for (int64_t h = 0; h < heads; ++h) {
        alignas(64) float lanes[V];
        top[h].store(lanes);
        top_of[h] = *std::max_element(lanes, lanes + V);
      }
      for (int64_t s = vectorized; s < S; ++s)
        if (w[s] < heads) top_of[static_cast<int64_t>(w[s])] = std::max(top_of[static_cast<int64_t>(w[s])], row[s]);
      for (int64_t h = 0; h < heads; ++h) top_of[h] = top_of[h] == hidden ? 0.f : top_of[h];  // no kept slot
      top_of[heads] = 0.f;
      std::fill(total.begin(), total.end(), Vec(0.f));
      for (int64_t s0 = 0; s0 < vectorized; s0 += V) {
        const Vec p = (Vec::loadu(row + s0) - per_head(top_of.data(), s0)).exp(), wv = Vec::loadu(w + s0);
        p.store(row + s0);
        for (int64_t h = 0; h < heads; ++h)
          total[h] = total[h] + Vec::blendv(Vec(0.f), p, wv == Vec(static_cast<float>(h)));
      }
      for (int64_t h = 0; h < heads; ++h) scale_of[h] = at::vec::vec_reduce_all<float>(
          [](Vec& a, Vec& c) { return a + c; }, total[h]);
      for (int64_t s = vectorized; s < S; ++s) {
        const int64_t h = static_cast<int64_t>(w[s]);
        row[s] = std::exp(row[s] - top_of[h]);
        if (h < heads) scale_of[h] += row[s];
      }
      for (int64_t h = 0; h < heads; ++h) scale_of[h] = scale_of[h] > 0.f ? 1.f / scale_of[h] : 0.f;
      scale_of[heads] = 0.f;
      float* masked_bg = masked + b * Hq * S + g * S;  // query head h * G + g: [b][h * G + g][s]
      for (int64_t s0 = 0; s0 < vectorized; s0 += V) {
        const Vec p = Vec::loadu(row + s0) * per_head(scale_of.data(), s0), wv = Vec::loadu(w + s0);
        p.store(row + s0);
        for (int64_t h = 0; h < heads; ++h)
          Vec::blendv(Vec(0.f), p, wv == Vec(static_cast<float>(h))).store(masked_bg + h * G * S + s0);
      }
      for (int64_t s = vectorized; s < S; ++s) {
        row[s] *= scale_of[static_cast<int64_t>(w[s])];
        for (int64_t h = 0; h < heads; ++h) masked_bg[h * G * S + s] = w[s] == h ? row[s] : 0.f;
      }
    }
  });
  // 3. the weighted values, slot order, into each chunk's outputs [Hq, D]
  at::parallel_for(0, B * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / chunks, s_begin = (task % chunks) * CHUNK, s_end = std::min(S, s_begin + CHUNK);
      float* acc = part + task * Hq * D;
      std::fill(acc, acc + Hq * D, 0.f);
      const float* P_b = P + b * G * S;
      float* score = sp + b * S + s_begin;  // a slot's probabilities summed over its head's queries, and their mean
      const int64_t width = s_end - s_begin;
      std::copy(P_b + s_begin, P_b + s_end, score);
      for (int64_t g = 1; g < G; ++g)
        at::vec::map2([](Vec a, Vec c) { return a + c; }, score, score, P_b + g * S + s_begin, width);
      const float inverse = 1.f / static_cast<float>(G);
      if (lp) at::vec::map([inverse](Vec a) { return a * Vec(inverse); }, lp + b * S + s_begin, score, width);
      weigh_rows(masked + b * Hq * S, Hq, S, vp + b * S * D, D, s_begin, s_end, acc);
    }
  });
  // the chunks' outputs summed in chunk order
  for (int64_t b = 0; b < B; ++b) {
    float* o = op + b * Hq * D;
    std::copy(part + b * chunks * Hq * D, part + (b * chunks + 1) * Hq * D, o);
    for (int64_t c = 1; c < chunks; ++c)
      at::vec::map2([](Vec a, Vec x) { return a + x; }, o, o, part + (b * chunks + c) * Hq * D, Hq * D);
  }
}

// pooled_attend as an op: keys, values [B, 1, S, D], head, pos [B, 1, S]; returns out [B, Hq, D], scores and
// last [B, 1, S].
std::vector<at::Tensor> pooled_attend_one(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                          const at::Tensor& head, const at::Tensor& pos, int64_t heads,
                                          double softcap) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat && values.scalar_type() == at::kFloat
              && head.scalar_type() == at::kChar && pos.scalar_type() == at::kLong,
              "pooled_attend_one: float32 q, keys and values, int8 head tags, int64 pos");
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 4 && keys.size(1) == 1 && keys.sizes() == values.sizes()
              && keys.size(0) == q.size(0) && keys.size(3) == q.size(2) && heads > 0 && q.size(1) % heads == 0,
              "pooled_attend_one: shapes do not match");
  const int64_t B = keys.size(0), S = keys.size(2), D = keys.size(3), Hq = q.size(1);
  const at::Tensor qc = q.contiguous(), kc = keys.contiguous(), vc = values.contiguous();
  const at::Tensor hc = head.contiguous(), pc = pos.contiguous();
  at::Tensor out = at::empty({B, Hq, D}, q.options());
  at::Tensor scores = at::empty({B, 1, S}, q.options());
  at::Tensor last = at::empty({B, 1, S}, q.options());
  pooled_attend(qc.data_ptr<float>(), kc.data_ptr<float>(), vc.data_ptr<float>(), hc.data_ptr<int8_t>(),
                pc.data_ptr<int64_t>(), B, S, D, Hq, heads, static_cast<float>(softcap), out.data_ptr<float>(),
                scores.data_ptr<float>(), last.data_ptr<float>());
  return {out, scores, last};
}

// One row's `k` lowest of `priority` [S] as slot indices in ascending slot order (into `slots` [k]), in one pass
// keeping the k + 1 lowest (`value`, `index`: [k + 1] scratch); returns whether the k-th and (k+1)-th lowest
// are equal (an infinite k-th lowest is equal to the next too, or stands for slots never seen: tied either way).
bool row_lowest(const float* priority, int64_t S, int64_t k, float* value, int64_t* index, int64_t* slots) {
  std::fill(value, value + k + 1, std::numeric_limits<float>::infinity());
  std::fill(index, index + k + 1, -1);
  for (int64_t s = 0; s < S; ++s) {
    const float x = priority[s];
    if (!(x < value[k])) continue;  // not among the k + 1 lowest so far (or nan)
    int64_t i = k;
    for (; i > 0 && x < value[i - 1]; --i) {
      value[i] = value[i - 1];
      index[i] = index[i - 1];
    }
    value[i] = x;
    index[i] = s;
  }
  std::sort(index, index + k);
  std::copy(index, index + k, slots);
  return value[k - 1] == value[k];
}

// A decode step's eviction over head-pooled rows (pooled.py `_evict_row`): priority [B, 1, S] float32, each
// row's `k` lowest priorities (the slots it frees), as slot indices [B, 1, k] in ascending slot order, and
// whether any row's k-th and (k+1)-th lowest are equal (then which slot goes is the exact order's to say, and
// the caller takes it). One pass per row keeping the k + 1 lowest (torch's topk, sort and compare: four ops).
std::vector<at::Tensor> lowest_slots(const at::Tensor& priority, int64_t k) {
  TORCH_CHECK(priority.scalar_type() == at::kFloat && priority.dim() == 3 && priority.size(1) == 1 && k > 0
              && priority.size(2) > k, "lowest_slots: float32 priority [B, 1, S] with S > k > 0");
  const int64_t B = priority.size(0), S = priority.size(2);
  const at::Tensor pc = priority.contiguous();
  at::Tensor slots = at::empty({B, 1, k}, priority.options().dtype(at::kLong));
  at::Tensor tied = at::zeros({B}, priority.options().dtype(at::kBool));
  const float* pp = pc.data_ptr<float>();
  int64_t* sp = slots.data_ptr<int64_t>();
  bool* tp = tied.data_ptr<bool>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> value(k + 1);
    std::vector<int64_t> index(k + 1);
    for (int64_t b = begin; b < end; ++b) tp[b] = row_lowest(pp + b * S, S, k, value.data(), index.data(), sp + b * k);
  });
  return {slots, tied.any()};
}

// A head-pooled layer's steady decode step (pooled.py `_decode_full`), in place, in the eager path's order: the
// new token's `heads` keys and values (new_keys, new_values [B, 1, heads, D]) go into the row's vacant slots
// `slot` [B, 1, heads] (ascending: head i into the i-th) at position qpos [B]; the query heads attend
// (pooled_attend_one); each slot's score gains what its head's queries paid (`last` gets their mean, when
// given); then every row's `heads` lowest priorities are freed, where a kept token's priority is its score, or
// +inf for the `recent` [B] newest positions and below `sinks` [B] when given, and an empty slot's +inf. If any
// row's heads-th and next lowest tie, nothing is freed (the caller takes the exact order). Returns out [B, Hq, D], the freed slots
// [B, 1, heads] and the tie flag.
std::vector<at::Tensor> pooled_decode_step(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                           const at::Tensor& head, const at::Tensor& pos, const at::Tensor& score,
                                           const std::optional<at::Tensor>& last, const at::Tensor& slot,
                                           const at::Tensor& new_keys, const at::Tensor& new_values,
                                           const at::Tensor& qpos, const at::Tensor& recent, int64_t heads,
                                           double softcap, const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 4 && keys.size(1) == 1 && keys.sizes() == values.sizes() && heads > 0
              && q.size(0) == keys.size(0) && q.size(2) == keys.size(3) && q.size(1) % heads == 0 && pos.dim() == 3 && pos.sizes() == score.sizes() && pos.sizes() == head.sizes()
              && pos.size(0) == keys.size(0) && pos.size(2) == keys.size(2) && slot.numel() == keys.size(0) * heads
              && new_keys.numel() == slot.numel() * keys.size(3) && new_values.sizes() == new_keys.sizes()
              && qpos.numel() == keys.size(0) && recent.numel() == keys.size(0),
              "pooled_decode_step: shapes do not match");
  TORCH_CHECK(q.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat && values.scalar_type() == at::kFloat
              && score.scalar_type() == at::kFloat
              && new_keys.scalar_type() == at::kFloat && new_values.scalar_type() == at::kFloat
              && head.scalar_type() == at::kChar && pos.scalar_type() == at::kLong && slot.scalar_type() == at::kLong
              && qpos.scalar_type() == at::kLong && recent.scalar_type() == at::kLong,
              "pooled_decode_step: float32 storage and new tokens, int8 head tags, int64 pos, slots and positions");
  for (const at::Tensor* t : {&keys, &values, &head, &pos, &score})
    TORCH_CHECK(t->is_contiguous(), "pooled_decode_step: the layer's storage must be contiguous (written in place)");
  if (last) TORCH_CHECK(last->sizes() == score.sizes() && last->is_contiguous() && last->scalar_type() == at::kFloat,
                        "pooled_decode_step: last like score");
  const int64_t B = keys.size(0), S = keys.size(2), D = keys.size(3);
  const at::Tensor sc = slot.contiguous(), nk = new_keys.contiguous(), nv = new_values.contiguous();
  const at::Tensor qposc = qpos.contiguous(), rc = recent.contiguous();
  TORCH_CHECK(!sinks || (sinks->numel() == B && sinks->scalar_type() == at::kLong), "pooled_decode_step: B int64 sinks");
  const at::Tensor kc = sinks ? sinks->contiguous() : at::Tensor();
  const int64_t* sinkp = sinks ? kc.data_ptr<int64_t>() : nullptr;  // none: no position below 0 to keep
  const int64_t* slots = sc.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * heads; ++i) TORCH_CHECK(slots[i] >= 0 && slots[i] < S, "pooled_decode_step: a slot out of range");
  float* kp = keys.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  int8_t* hp = head.data_ptr<int8_t>();
  int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t* qposp = qposc.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < heads; ++i) {
      const int64_t s = slots[b * heads + i], from = (b * heads + i) * D;
      std::copy(nk.data_ptr<float>() + from, nk.data_ptr<float>() + from + D, kp + (b * S + s) * D);
      std::copy(nv.data_ptr<float>() + from, nv.data_ptr<float>() + from + D, vp + (b * S + s) * D);
      hp[b * S + s] = static_cast<int8_t>(i);
      pp[b * S + s] = qposp[b];
    }
  }
  const at::Tensor qc = q.contiguous();
  at::Tensor out = at::empty({B, q.size(1), D}, q.options());
  thread_local std::vector<float> added_buffer, mean_buffer;
  float* added = scratch(added_buffer, B * S);
  float* mean = last ? scratch(mean_buffer, B * S) : nullptr;
  pooled_attend(qc.data_ptr<float>(), kp, vp, hp, pp, B, S, D, q.size(1), heads, static_cast<float>(softcap),
                out.data_ptr<float>(), added, mean);
  float* scp = score.data_ptr<float>();
  float* lp = last ? last->data_ptr<float>() : nullptr;
  const int64_t* rp = rc.data_ptr<int64_t>();
  at::Tensor freed = at::empty({B, 1, heads}, slot.options());
  int64_t* fp = freed.data_ptr<int64_t>();
  std::vector<char> tied(B);
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> priority(S), value(heads + 1);
    std::vector<int64_t> index(heads + 1);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t newest = qposp[b] + 1 - rp[b];  // next_pos - recent: kept whatever their score, as the sinks
      for (int64_t s = 0; s < S; ++s) {
        const int64_t at = b * S + s;
        scp[at] += added[at];
        if (lp) lp[at] = mean[at];
        const bool kept_anyway = pp[at] < 0 || pp[at] >= newest || (sinkp && pp[at] < sinkp[b]);
        priority[s] = kept_anyway ? std::numeric_limits<float>::infinity() : scp[at];
      }
      tied[b] = row_lowest(priority.data(), S, heads, value.data(), index.data(), fp + b * heads);
    }
  });
  const bool any_tie = std::any_of(tied.begin(), tied.end(), [](char t) { return t != 0; });
  if (!any_tie) {
    for (int64_t i = 0; i < B * heads; ++i) {
      const int64_t at = (i / heads) * S + fp[i];
      pp[at] = -1;
      scp[at] = 0.f;
      if (lp) lp[at] = 0.f;
    }
  }
  return {out, freed, at::scalar_tensor(any_tie, at::TensorOptions().dtype(at::kBool))};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(h2o_kv, m) {
  m.def("pooled_attend_one(Tensor q, Tensor keys, Tensor values, Tensor head, Tensor pos, int heads, "
        "float softcap) -> Tensor[]",
        &pooled_attend_one);
  m.def("lowest_slots(Tensor priority, int k) -> Tensor[]", &lowest_slots);
  m.def("pooled_decode_step(Tensor q, Tensor(a!) keys, Tensor(b!) values, Tensor(c!) head, Tensor(d!) pos, "
        "Tensor(e!) score, Tensor(f!)? last, Tensor slot, Tensor new_keys, Tensor new_values, Tensor qpos, "
        "Tensor recent, int heads, float softcap, Tensor? sinks=None) -> Tensor[]",
        &pooled_decode_step);
}
