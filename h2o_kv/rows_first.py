"""Weight-first linear layers: a faster model step on CPU at small batch (opt-in, every cache gains).

A decode step multiplies a few rows x (one per sequence) by every weight matrix W of the model, so its
time is the time to read the weights. `nn.Linear` computes x @ W^T; MKL's float32 GEMM reads W about half
as fast that way as when W is the left operand, (W @ x^T)^T, at 2-16 rows on the 2-core CPU this project
benchmarks on (`results/bench-static/probes/linear_order.txt`), and neither order reads W at the memory's
speed. h2o-kv's C++ kernel (`native.rows_linear`, `csrc/rows_linear.cpp`) streams each weight row once
(`results/bench-static/probes/rows_linear.txt`). The values are the same products summed in another order
(float rounding apart).

`use_rows_first(model)` swaps each plain `nn.Linear` under the decoder (`model.base_model`), and the
output projection, for a `RowsFirstLinear` holding the same parameters (and, with the C++ kernel, each stock
Llama decoder layer for fused_layer.py's, whose decode step runs the same products in its own C++ calls, and
the Llama model for fused_model.py's, whose steady decode step over a KVCache is one C++ call),
so the state dict, the weights'
memory, tied embeddings and the model's classes stay as they are. Its `compile_kernel` is `KVCache`'s
(`native.resolve`): None uses the C++ kernel where it can be built, else the weight-first torch product.
The swap is the standard module swap of PyTorch's quantization tools, not a patched class. It speeds up
the model for every cache alike, so `h2o-kv bench --rows-first` uses it for the stock baselines too.
"""

from __future__ import annotations

import torch
from torch import nn

from . import native
from .fused_layer import use_fused_layers
from .fused_model import use_fused_model
from .native import MAX_ROWS  # above it (a prefill, a large batch): the stock product

#: The `--rows-first` flag of generate, bench and serve.
CLI_HELP = (
    "on CPU, compute the linear layers weight-first at up to 64 rows, with h2o-kv's C++ kernel where it can be "
    "built, and on Llama models a decoder layer's small operations in C++ too (a faster decode step for every "
    "cache, and over a full KVCache the whole model's step in one C++ call; h2o_kv.rows_first, h2o_kv.fused_layer, "
    "h2o_kv.fused_model)"
)

#: The dtypes the C++ kernel multiplies (others take the torch product).
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


class RowsFirstLinear(nn.Linear):
    """`nn.Linear` that reads its weight first on CPU when x has at most `MAX_ROWS` rows: with h2o-kv's C++
    kernel when `kernel` is set (float32 or bfloat16), else as (W @ x^T)^T."""

    kernel: bool = False
    plain_product = True  # x @ W^T + b, as nn.Linear: fused_layer.py may compute it in its own kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if x.device.type != "cpu" or rows == 0 or rows > MAX_ROWS:
            return super().forward(x)
        flat = x.reshape(rows, -1)
        grad = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)  # the kernel has no backward
        if self.kernel and not grad and x.dtype == self.weight.dtype and x.dtype in KERNEL_DTYPES:
            out = native.rows_linear(flat, self.weight, self.bias)
        else:
            # contiguous: a transposed view would send attention (e.g. SDPA's flash kernel) to slower paths
            out = torch.mm(self.weight, flat.t()).t().contiguous()
            if self.bias is not None:
                out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def _plain_cpu_linear(module: nn.Module) -> bool:
    """Exactly `nn.Linear`, a plain CPU tensor weight (not sharded, not quantized), no hooks to keep."""
    return (
        type(module) is nn.Linear
        and type(module.weight.data) is torch.Tensor
        and module.weight.device.type == "cpu"
        and not (module._forward_hooks or module._forward_pre_hooks)
    )


def use_rows_first(model: nn.Module, *, compile_kernel: bool | None = None) -> int:
    """Swap the decoder's plain `nn.Linear` modules and the output projection for `RowsFirstLinear`;
    return how many were swapped. `compile_kernel` as in `KVCache` (None: the C++ kernel where it can be
    built, which happens here, once per machine; True: required; False: the torch product).

    Only modules of exactly `nn.Linear` with a plain CPU weight and no hooks are swapped (quantized,
    tensor-parallel, hooked or already swapped ones are left alone), so calling it twice swaps nothing the second time.
    """
    decoder = getattr(model, "base_model", model)  # transformers' decoder without the output head
    if decoder is model:
        raise ValueError(f"{type(model).__name__} has no decoder (transformers' base_model) to swap linear layers in")
    kernel = native.resolve(compile_kernel)
    slots = [(parent, name, child) for parent in decoder.modules() for name, child in parent.named_children()]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None:  # the last token's logits (generation.forward leaves a swapped head to the model)
        slots += [(model, name, child) for name, child in model.named_children() if child is head]
    swapped = 0
    for parent, name, child in slots:
        if not _plain_cpu_linear(child):
            continue
        new = RowsFirstLinear(child.in_features, child.out_features, bias=child.bias is not None, device="meta")
        new.weight, new.bias = child.weight, child.bias  # the same Parameters: no copy, ties kept
        new.kernel = kernel and child.weight.is_contiguous()  # the kernel would copy a strided weight per call
        new.train(child.training)
        setattr(parent, name, new)
        swapped += 1
    if swapped and kernel:
        native.load()  # build now, not in the first decode step (nothing to build for a GPU model)
        use_fused_layers(model)  # Llama layers: the small operations around the products in C++ too
        use_fused_model(model)  # and a steady decode step over a KVCache in one C++ call
    return swapped
