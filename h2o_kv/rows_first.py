"""Weight-first linear layers: a faster model step on CPU at small batch (opt-in, every cache gains).

A decode step multiplies a few rows x (one per sequence) by every weight matrix W of the model.
`nn.Linear` computes x @ W^T; MKL's float32 GEMM reads W about half as fast that way as when W is
the left operand, (W @ x^T)^T, at 2-16 rows (the same at 1) on the 2-core CPU this project benchmarks on
(`results/bench-static/probes/linear_order.txt`: one H2O decode step of SmolLM2 at batch 4, 158 ms
against 108 ms). The values are the same products summed in another order (float rounding apart).

`use_rows_first(model)` swaps each plain `nn.Linear` under the decoder (`model.base_model`) for a
`RowsFirstLinear` holding the same parameters, so the state dict, the weights' memory and the
model's classes stay as they are; the output projection is left alone (`generation.forward`
already computes the last token's logits weight-first). The swap is the standard module swap of
PyTorch's quantization tools, not a patched class. It speeds up the model for every cache alike, so
`h2o-kv bench --rows-first` uses it for the stock baselines too.
"""

from __future__ import annotations

import torch
from torch import nn

#: Above this many rows (a prefill, a large batch) the stock product is as fast or faster.
MAX_ROWS = 16


class RowsFirstLinear(nn.Linear):
    """`nn.Linear` that computes (W @ x^T)^T on CPU when x has at most `MAX_ROWS` rows."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if x.device.type != "cpu" or rows == 0 or rows > MAX_ROWS:
            return super().forward(x)
        # contiguous: a transposed view would send attention (e.g. SDPA's flash kernel) to slower paths
        out = torch.mm(self.weight, x.reshape(rows, -1).t()).t().contiguous()
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


def use_rows_first(model: nn.Module) -> int:
    """Swap the decoder's plain `nn.Linear` modules for `RowsFirstLinear`; return how many were swapped.

    Only modules of exactly `nn.Linear` with a plain CPU weight and no hooks are swapped (quantized,
    tensor-parallel, hooked or already swapped ones are left alone), so calling it twice swaps nothing the second time.
    """
    decoder = getattr(model, "base_model", model)  # transformers' decoder without the output head
    if decoder is model:
        raise ValueError(f"{type(model).__name__} has no decoder (transformers' base_model) to swap linear layers in")
    swapped = 0
    for parent in decoder.modules():
        for name, child in list(parent.named_children()):
            if not _plain_cpu_linear(child):
                continue
            new = RowsFirstLinear(child.in_features, child.out_features, bias=child.bias is not None, device="meta")
            new.weight, new.bias = child.weight, child.bias  # the same Parameters: no copy
            new.train(child.training)
            setattr(parent, name, new)
            swapped += 1
    return swapped
