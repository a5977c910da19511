// The C++ entry points one kernel file calls in another (model_step.cpp runs a whole decode step from them).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

namespace h2o_kv {

// rows_linear.cpp: a Llama decoder layer's decode step around the cache (fused_layer.py).
std::vector<at::Tensor> layer_in(const at::Tensor& x, const at::Tensor& norm, double eps, const at::Tensor& wq,
                                 const std::optional<at::Tensor>& bq, const at::Tensor& wk,
                                 const std::optional<at::Tensor>& bk, const at::Tensor& wv,
                                 const std::optional<at::Tensor>& bv, const at::Tensor& cos, const at::Tensor& sin,
                                 int64_t head_dim);
at::Tensor layer_out(const at::Tensor& x, const at::Tensor& attn_out, const at::Tensor& wo,
                     const std::optional<at::Tensor>& bo, const at::Tensor& norm, double eps, const at::Tensor& wg,
                     const std::optional<at::Tensor>& bg, const at::Tensor& wu, const std::optional<at::Tensor>& bu,
                     const at::Tensor& wd, const std::optional<at::Tensor>& bd);

// attend_one.cpp: a uniform layer's steady decode step over its cache (steady.py).
std::vector<at::Tensor> decode_step(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                    const std::optional<at::Tensor>& key_scale,
                                    const std::optional<at::Tensor>& value_scale, const at::Tensor& pos,
                                    const at::Tensor& score, const std::optional<at::Tensor>& last,
                                    const at::Tensor& slot, const at::Tensor& new_keys, const at::Tensor& new_values,
                                    const std::optional<at::Tensor>& new_key_scale,
                                    const std::optional<at::Tensor>& new_value_scale, const at::Tensor& qpos,
                                    const at::Tensor& recent, const at::Tensor& capacity, double scaling,
                                    double softcap);

}  // namespace h2o_kv
