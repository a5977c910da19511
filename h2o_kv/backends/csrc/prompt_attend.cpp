// A prompt's (or a chunk's) attention with the attention each slot received, on a CPU (built and called by
// h2o_kv/backends/native.py; cache/routes.py's attend takes it for in-order new tokens without window or softcap).
//
// H2O's scores need every query's attention probabilities summed per slot, which torch's fused attention
// (SDPA) never materialises; cache/routes.py's attend's blocked path computes them with three batched products over
// blocks of a few queries across the whole batch, and the products at those shapes run slower than SDPA's
// do. This kernel works per (sequence, KV
// head) on a tile of queries (the group's query heads of QT consecutive queries, R rows) at a time, inside the
// core's cache: the logits against the slots the tile sees (one MKL product), then per row the mask, maximum,
// exp and sum in one pass, the output (a second product) and the probabilities added into the slots' scores.
// Query i sees slots 0 .. new_from + i (the new tokens sit in slots new_from .. in order) except empty old
// slots (pos < 0); in a padded batch, of those, the slots holding positions 0 .. qpos[i] (a padding query, at
// -1, sees none and gives zeros).
//
// Each (sequence, KV head) is split into PARTS runs of consecutive tiles of about equal work (the tiles' widths
// grow with the causal triangle), each a task on torch's threads with its own score row; the parts' rows are
// added in order at the end. The split depends only on the prompt's shape, so a sequence gets the same numbers
// alone as in any batch.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/mm_cpu_dispatch.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels.h"

namespace {

constexpr int64_t PARTS = 4;                // tasks per (sequence, KV head)
constexpr int64_t TILE_FLOATS = 1 << 17;    // a tile's logits: 512 KiB, half the core's L2 cache
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// Queries per tile: the tile's logits (group x QT rows by up to `width` slots) fit TILE_FLOATS, 4 to 64.
int64_t tile_queries(int64_t group, int64_t width) {
  return std::clamp<int64_t>(TILE_FLOATS / std::max<int64_t>(1, group * width), 4, 64);
}

// The first tile of each part (PARTS + 1 bounds): consecutive tiles, about equal total width each.
std::vector<int64_t> part_bounds(int64_t tiles, int64_t qt, int64_t n, int64_t new_from) {
  std::vector<int64_t> bounds(PARTS + 1, tiles);
  bounds[0] = 0;
  double total = 0;
  for (int64_t t = 0; t < tiles; ++t) total += static_cast<double>(new_from + std::min(n, (t + 1) * qt));
  double done = 0;
  int64_t part = 1;
  for (int64_t t = 0; t < tiles && part < PARTS; ++t) {
    done += static_cast<double>(new_from + std::min(n, (t + 1) * qt));
    while (part < PARTS && done >= total * static_cast<double>(part) / PARTS) bounds[part++] = t + 1;
  }
  return bounds;
}

// Row r of p [0, lim): masked (holes; with `pos`, every slot outside 0 .. t) -> exp(x - max) in place, zeros in
// [lim, width); returns 1 / sum (the row's normaliser; a row with nothing visible stays zeros). The vector exp is
// torch's exp_u20 (within 2 ulp), the one SDPA's CPU kernel uses: Sleef's 1-ulp exp made this kernel 1.2x SDPA.
float softmax_row(float* p, int64_t lim, int64_t width, const std::vector<int64_t>& holes, const int64_t* pos,
                  int64_t t) {
  if (pos) {
    for (int64_t j = 0; j < lim; ++j) p[j] = (pos[j] < 0 || pos[j] > t) ? NEG_INF : p[j];
  } else {
    for (int64_t j : holes) {
      if (j >= lim) break;
      p[j] = NEG_INF;
    }
  }
  Vec vmax(NEG_INF);
  int64_t j = 0;
  for (; j + V <= lim; j += V) vmax = at::vec::maximum(vmax, Vec::loadu(p + j));
  float row_max = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, vmax);
  for (; j < lim; ++j) row_max = std::max(row_max, p[j]);
  if (row_max == NEG_INF) row_max = 0.f;  // nothing visible: every exp is 0, as cache/routes.py's attend's nan_to_num
  const Vec shift(row_max);
  Vec vsum(0.f);
  j = 0;
  for (; j + V <= lim; j += V) {
    const Vec e = (Vec::loadu(p + j) - shift).exp_u20();
    e.store(p + j);
    vsum = vsum + e;
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, vsum);
  for (; j < lim; ++j) {
    p[j] = std::exp(p[j] - row_max);
    sum += p[j];
  }
  std::fill(p + lim, p + width, 0.f);
  return 1.f / std::max(sum, 1e-30f);
}

// dst[0, len) += w * src[0, len)
inline void add_scaled(float* dst, const float* src, float w, int64_t len) {
  const Vec vw(w);
  int64_t j = 0;
  for (; j + V <= len; j += V) at::vec::fmadd(Vec::loadu(src + j), vw, Vec::loadu(dst + j)).store(dst + j);
  for (; j < len; ++j) dst[j] += w * src[j];
}

// dst[0, width) += sum over rows r of w[r] * p[r * width + j], four vectors of slots at a time, each slot's sum
// in registers across the rows (a row's entries past its last visible slot are zeros).
void column_sums(float* dst, const float* p, int64_t width, const float* w, const std::vector<int64_t>& rows) {
  int64_t j = 0;
  for (; j + 4 * V <= width; j += 4 * V) {
    Vec a0(0.f), a1(0.f), a2(0.f), a3(0.f);
    for (int64_t r : rows) {
      const float* row = p + r * width + j;
      const Vec wr(w[r]);
      a0 = at::vec::fmadd(Vec::loadu(row), wr, a0);
      a1 = at::vec::fmadd(Vec::loadu(row + V), wr, a1);
      a2 = at::vec::fmadd(Vec::loadu(row + 2 * V), wr, a2);
      a3 = at::vec::fmadd(Vec::loadu(row + 3 * V), wr, a3);
    }
    (Vec::loadu(dst + j) + a0).store(dst + j);
    (Vec::loadu(dst + j + V) + a1).store(dst + j + V);
    (Vec::loadu(dst + j + 2 * V) + a2).store(dst + j + 2 * V);
    (Vec::loadu(dst + j + 3 * V) + a3).store(dst + j + 3 * V);
  }
  for (; j < width; ++j) {
    float a = 0.f;
    for (int64_t r : rows) a += w[r] * p[r * width + j];
    dst[j] += a;
  }
}

// q [B, Hq, n, D], keys/values [B, H, S, D] float32, pos [B, H, S], qpos [B, n] (read with padding); see
// native.prompt_attend.
std::vector<at::Tensor> prompt_attend(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                      const at::Tensor& pos, const at::Tensor& qpos, bool padding, int64_t new_from,
                                      double scaling, bool want_scores, int64_t score_from, bool want_last) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat
                  && values.scalar_type() == at::kFloat,
              "prompt_attend: float32 queries, keys and values");
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.sizes() == keys.sizes() && pos.dim() == 3,
              "prompt_attend: q [B, Hq, n, D], keys/values [B, H, S, D], pos [B, H, S]");
  const int64_t B = q.size(0), Hq = q.size(1), n = q.size(2), D = q.size(3);
  const int64_t H = keys.size(1), S = keys.size(2);
  TORCH_CHECK(keys.size(0) == B && keys.size(3) == D && Hq % H == 0, "prompt_attend: shapes do not match");
  TORCH_CHECK(pos.size(0) == B && pos.size(1) == H && pos.size(2) == S, "prompt_attend: pos [B, H, S]");
  TORCH_CHECK(new_from >= 0 && new_from + n <= S, "prompt_attend: the new tokens sit in slots new_from ..");
  TORCH_CHECK(!padding || (qpos.dim() == 2 && qpos.size(0) == B && qpos.size(1) == n), "prompt_attend: qpos [B, n]");
  const int64_t G = Hq / H, width_all = new_from + n;
  const at::Tensor qc = q.contiguous(), kc = keys.contiguous(), vc = values.contiguous();
  const at::Tensor all_pos = pos.narrow(2, 0, width_all).to(at::kLong).contiguous();  // [B, H, new_from + n]
  const at::Tensor query_pos = padding ? qpos.to(at::kLong).contiguous() : at::Tensor();
  at::Tensor out = at::empty({B, n, Hq, D}, q.options());
  at::Tensor scores = want_scores ? at::zeros({B, H, S}, q.options()) : at::empty({0}, q.options());
  at::Tensor last = want_last ? at::zeros({B, H, S}, q.options()) : at::empty({0}, q.options());
  if (B == 0 || n == 0 || H == 0) return {out, scores, last};
  const int64_t qt = tile_queries(G, width_all), tiles = (n + qt - 1) / qt, R = G * qt;
  const std::vector<int64_t> bounds = part_bounds(tiles, qt, n, new_from);
  at::Tensor parts = want_scores ? at::zeros({B * H, PARTS, width_all}, q.options()) : at::Tensor();
  const float* qp = qc.data_ptr<float>();
  const float* kp = kc.data_ptr<float>();
  const float* vp = vc.data_ptr<float>();
  const int64_t* pp = all_pos.data_ptr<int64_t>();
  const int64_t* qq = padding ? query_pos.data_ptr<int64_t>() : nullptr;
  float* op = out.data_ptr<float>();
  float* partp = want_scores ? parts.data_ptr<float>() : nullptr;
  float* lastp = want_last ? last.data_ptr<float>() : nullptr;
  const float scale = static_cast<float>(scaling);
  const auto f32 = at::TensorOptions().dtype(at::kFloat);

  at::parallel_for(0, B * H * PARTS, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> qtile(R * D), logits(R * width_all), otile(R * D), inv(R);
    std::vector<int64_t> holes, scoring;
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t bh = task / PARTS, part = task % PARTS, b = bh / H, h = bh % H;
      const float* krow = kp + bh * S * D;
      const float* vrow = vp + bh * S * D;
      holes.clear();
      const int64_t* row_pos = pp + bh * width_all;
      for (int64_t j = 0; j < new_from && !qq; ++j)  // a padded batch's rows read every slot's position instead
        if (row_pos[j] < 0) holes.push_back(j);
      for (int64_t tile = bounds[part]; tile < bounds[part + 1]; ++tile) {
        const int64_t i0 = tile * qt, m = std::min(qt, n - i0), rows = G * m, width = new_from + i0 + m;
        for (int64_t g = 0; g < G; ++g)  // rows g * m + qi: query head h * G + g, query i0 + qi, scaled
          for (int64_t qi = 0; qi < m; ++qi) {
            const float* src = qp + (((b * Hq + h * G + g) * n) + i0 + qi) * D;
            float* dst = qtile.data() + (g * m + qi) * D;
            for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * scale;
          }
        // logits [rows, width] = qtile [rows, D] @ keys[:width]^T, on torch's CPU product (MKL), one thread here
        at::Tensor lt = at::from_blob(logits.data(), {rows, width}, f32);
        at::cpu::mm_out(lt, at::from_blob(qtile.data(), {rows, D}, f32),
                        at::from_blob(const_cast<float*>(krow), {width, D}, f32).t());
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t i = i0 + r % m;
          inv[r] = softmax_row(logits.data() + r * width, new_from + i + 1, width, holes, qq ? row_pos : nullptr,
                               qq ? qq[b * n + i] : 0);
        }
        // otile [rows, D] = probabilities [rows, width] @ values[:width]
        at::Tensor ot = at::from_blob(otile.data(), {rows, D}, f32);
        at::cpu::mm_out(ot, lt, at::from_blob(const_cast<float*>(vrow), {width, D}, f32));
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t g = r / m, i = i0 + r % m;
          const float* src = otile.data() + r * D;
          float* dst = op + ((b * n + i) * Hq + h * G + g) * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * inv[r];
          if (lastp && i == n - 1)
            add_scaled(lastp + bh * S, logits.data() + r * width, inv[r] / static_cast<float>(G), new_from + i + 1);
        }
        if (partp && i0 + m > score_from) {  // the scoring rows' probabilities, summed per slot into the part's row
          const int64_t skip = std::clamp<int64_t>(score_from - i0, 0, m);
          scoring.clear();
          for (int64_t r = 0; r < rows; ++r)
            if (r % m >= skip) scoring.push_back(r);
          column_sums(partp + (bh * PARTS + part) * width_all, logits.data(), width, inv.data(), scoring);
        }
      }
    }
  });
  if (want_scores) {  // the parts' rows added in order, whatever the batch
    float* sp = scores.data_ptr<float>();
    at::parallel_for(0, B * H, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t bh = r0; bh < r1; ++bh)
        for (int64_t part = 0; part < PARTS; ++part)
          add_scaled(sp + bh * S, partp + (bh * PARTS + part) * width_all, 1.f, width_all);
    });
  }
  return {out, scores, last};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(h2o_kv, m) {
  m.def("prompt_attend(Tensor q, Tensor keys, Tensor values, Tensor pos, Tensor qpos, bool padding, int new_from, "
        "float scaling, bool want_scores, int score_from, bool want_last) -> Tensor[]",
        &prompt_attend);
}
