// A Llama model's whole steady decode step over h2o-kv's cache in one C++ call (h2o_kv/fused_model.py, built
// and called by h2o_kv/native.py): for each decoder layer in turn, layer_in (RMSNorm, q/k/v products, rotary
// embedding), the cache's decode_step (the new token into the slot the last step freed, attention, scores,
// eviction) and layer_out (output product, residual, RMSNorm, MLP, residual): the calls fused_layer.py and
// steady.py make per layer, in the same order on the same tensors, without the Python between them (about
// 15 % of a step on the 2-core CPU this project benchmarks on: results/bench-static/README.md).

#include <ATen/ATen.h>
#include <torch/library.h>

#include <limits>
#include <optional>
#include <vector>

#include "kernels.h"

namespace {

constexpr int64_t WEIGHTS = 9;  // per layer: input norm, q, k, v, o, post-attention norm, gate, up, down
constexpr int64_t BIASES = 7;   // per layer: q, k, v, o, gate, up, down (each may be none)

// quant.quantize's operations: int8 per vector of the last dim, with its float32 scales.
std::pair<at::Tensor, at::Tensor> quantize(const at::Tensor& x) {
  const at::Tensor f = x.to(at::kFloat);
  const at::Tensor scale =
      f.abs().amax({-1}, true).div_(127).clamp_min_(std::numeric_limits<float>::min());  // torch.finfo.tiny
  const at::Tensor q = f.div(scale).round_().clamp_(-127, 127).to(at::kChar);
  return {q, scale.squeeze(-1)};
}

// The decode step of every layer, in place on each layer's cache; see fused_model.py for the arguments, one
// list entry per layer (WEIGHTS weights and BIASES biases each). Returns the last layer's hidden states
// [B, 1, K] (before the model's final norm), then each layer's freed slots [B, H, 1].
std::vector<at::Tensor> model_step(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin,
                                   at::TensorList weights, const c10::List<std::optional<at::Tensor>>& biases,
                                   at::ArrayRef<double> eps, at::ArrayRef<double> scaling, int64_t head_dim,
                                   at::TensorList keys, at::TensorList values,
                                   const c10::List<std::optional<at::Tensor>>& key_scale,
                                   const c10::List<std::optional<at::Tensor>>& value_scale, at::TensorList pos,
                                   at::TensorList score, const c10::List<std::optional<at::Tensor>>& last,
                                   at::TensorList slots, at::TensorList qpos, at::TensorList recent,
                                   at::TensorList capacity) {
  const int64_t L = static_cast<int64_t>(keys.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == WEIGHTS * L
                  && static_cast<int64_t>(biases.size()) == BIASES * L
                  && static_cast<int64_t>(eps.size()) == 2 * L && static_cast<int64_t>(scaling.size()) == L,
              "model_step: 9 weights, 7 biases, 2 norm epsilons and a scaling per layer");
  for (size_t n : {values.size(), key_scale.size(), value_scale.size(), pos.size(), score.size(), last.size(),
                   slots.size(), qpos.size(), recent.size(), capacity.size()}) {
    TORCH_CHECK(static_cast<int64_t>(n) == L, "model_step: one cache entry per layer in each list");
  }
  std::vector<at::Tensor> out(L + 1);
  at::Tensor h = hidden;
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* w = weights.data() + WEIGHTS * l;
    std::optional<at::Tensor> b[BIASES];
    for (int64_t i = 0; i < BIASES; ++i) b[i] = biases.get(BIASES * l + i);
    const std::vector<at::Tensor> qkv =
        h2o_kv::layer_in(h, w[0], eps[2 * l], w[1], b[0], w[2], b[1], w[3], b[2], cos, sin, head_dim);
    at::Tensor new_keys = qkv[1], new_values = qkv[2];
    std::optional<at::Tensor> new_key_scale, new_value_scale;
    if (keys[l].scalar_type() == at::kChar) {  // int8 storage: quantized on the way in, as steady.py does
      auto [q, s] = quantize(at::stack({new_keys, new_values}));
      new_keys = q[0];
      new_values = q[1];
      new_key_scale = s[0];
      new_value_scale = s[1];
    }
    const std::vector<at::Tensor> step = h2o_kv::decode_step(
        qkv[0], keys[l], values[l], key_scale.get(l), value_scale.get(l), pos[l], score[l], last.get(l), slots[l],
        new_keys, new_values, new_key_scale, new_value_scale, qpos[l], recent[l], capacity[l], scaling[l], 0.0);
    h = h2o_kv::layer_out(h, step[0].to(h.scalar_type()), w[4], b[3], w[5], eps[2 * l + 1], w[6], b[4], w[7], b[5],
                          w[8], b[6]);
    out[l + 1] = step[1];
  }
  out[0] = h;
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(h2o_kv, m) {
  m.def("model_step(Tensor hidden, Tensor cos, Tensor sin, Tensor[] weights, Tensor?[] biases, float[] eps, "
        "float[] scaling, int head_dim, Tensor(a!)[] keys, Tensor(b!)[] values, Tensor(c!)?[] key_scale, "
        "Tensor(d!)?[] value_scale, Tensor(e!)[] pos, Tensor(f!)[] score, Tensor(g!)?[] last, Tensor[] slots, "
        "Tensor[] qpos, Tensor[] recent, Tensor[] capacity) -> Tensor[]",
        &model_step);
}
