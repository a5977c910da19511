// The C++ entry points h2o-kv's kernel files declare for one another.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cpu/vec/vec.h>

#include <optional>
#include <vector>

namespace {

// The vector every kernel file computes in: torch's float lanes at the width this build targets (AVX-512 or AVX2).
using Vec = at::vec::Vectorized<float>;
constexpr int V = Vec::size();

}  // namespace

namespace h2o_kv {

// attend_one.cpp: a uniform layer's steady decode step over its cache (steady.py).
std::vector<at::Tensor> decode_step(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                    const std::optional<at::Tensor>& key_scale,
                                    const std::optional<at::Tensor>& value_scale, const at::Tensor& pos,
                                    const at::Tensor& score, const std::optional<at::Tensor>& last,
                                    const at::Tensor& slot, const at::Tensor& new_keys, const at::Tensor& new_values,
                                    const std::optional<at::Tensor>& new_key_scale,
                                    const std::optional<at::Tensor>& new_value_scale, const at::Tensor& qpos,
                                    const at::Tensor& recent, const at::Tensor& capacity, double scaling,
                                    double softcap, const std::optional<at::Tensor>& sinks);

}  // namespace h2o_kv
