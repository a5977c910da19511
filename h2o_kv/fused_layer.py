"""A Llama decoder layer's decode step in two C++ calls around the cache (opt-in with rows-first, every cache gains).

Once the products read the weights near the memory's speed (rows_first.py), what is left of a small model's
decode step on a CPU is its many small operations: two RMSNorms, the rotary embedding, SiLU, the residual
adds, the reshapes and about a dozen module calls per layer, each a kernel launch and some Python (about
11 ms of a 44 ms step on SmolLM2-135M at 4 x 4096 tokens, `results/bench-static/README.md`). A
`FusedLlamaDecoderLayer` runs them in two calls of h2o-kv's C++ kernels (`csrc/rows_linear.cpp`):
`layer_in` (RMSNorm, the q/k/v products in one parallel region, the rotary embedding) and `layer_out`
(the output product, the residual, RMSNorm, the gate/up products, SiLU x up, the down product, the
residual). Between them the layer goes through the cache and the model's attention function exactly as
`LlamaAttention.forward` does (`past_key_values.update`, then the registered attention interface), so
a `KVCache`, a `StaticCache` or a `DynamicCache` each take their own path, unchanged.

`use_fused_layers(model)` swaps each `LlamaDecoderLayer` for this subclass holding the same submodules
(the same parameters, state dict and hooks' targets), the module swap `use_rows_first` does for linear
layers. Anything else takes `LlamaDecoderLayer.forward`: more than `MAX_ROWS` rows (a prompt), a GPU,
gradients, dtypes other than float32 and bfloat16, `output_attentions`, hooks on a submodule.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaMLP,
    LlamaRMSNorm,
    eager_attention_forward,
)

from . import native
from .native import MAX_ROWS

DTYPES = (torch.float32, torch.bfloat16)


class FusedLlamaDecoderLayer(LlamaDecoderLayer):
    """`LlamaDecoderLayer` whose decode step (at most `MAX_ROWS` rows on a CPU, float32 or bfloat16, no
    gradients) runs as two C++ calls around the model's own cache update and attention function."""

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False,
                position_embeddings=None, **kwargs):  # fmt: skip
        if not self._fused(hidden_states, position_embeddings, kwargs):
            return super().forward(hidden_states, attention_mask, position_ids, past_key_values, use_cache,
                                   position_embeddings, **kwargs)  # fmt: skip
        attn, mlp, norm_in, norm_post = self._children()
        (wq, bq), (wk, bk), (wv, bv) = (_linear(attn, name) for name in ("q_proj", "k_proj", "v_proj"))
        cos, sin = position_embeddings
        q, k, v = torch.ops.h2o_kv.layer_in(
            hidden_states, norm_in._parameters["weight"], norm_in.variance_epsilon, wq, bq, wk, bk, wv, bv,
            cos.contiguous(), sin.contiguous(), attn.head_dim,
        )  # fmt: skip
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, attn.layer_idx)
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, eager_attention_forward)
        out, _ = interface(attn, q, k, v, attention_mask, dropout=0.0, scaling=attn.scaling, position_ids=position_ids,
                           use_cache=use_cache, **kwargs)  # fmt: skip
        (wo, bo), (wg, bg), (wu, bu), (wd, bd) = (_linear(m, name) for m, name in (
            (attn, "o_proj"), (mlp, "gate_proj"), (mlp, "up_proj"), (mlp, "down_proj")))  # fmt: skip
        return torch.ops.h2o_kv.layer_out(hidden_states, out, wo, bo, norm_post._parameters["weight"],
                                          norm_post.variance_epsilon, wg, bg, wu, bu, wd, bd)  # fmt: skip

    def _children(self) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module]:
        """The attention, MLP and two norms, read from the module's own dict (nn.Module's `__getattr__`
        costs microseconds a name on a slow CPU, and a step reads about twenty)."""
        mods = self._modules
        return mods["self_attn"], mods["mlp"], mods["input_layernorm"], mods["post_attention_layernorm"]

    def _fused(self, hidden: torch.Tensor, position_embeddings, kwargs: dict) -> bool:
        """Whether this call takes the C++ step (else `LlamaDecoderLayer.forward`)."""
        rows = hidden.shape[0] * hidden.shape[1] if hidden.dim() == 3 else 0
        norm = self._modules["input_layernorm"]._parameters["weight"]
        return (
            0 < rows <= MAX_ROWS
            and hidden.device.type == "cpu"
            and hidden.dtype is norm.dtype
            and hidden.dtype in DTYPES
            and position_embeddings is not None
            and not self.training
            and not (torch.is_grad_enabled() and (hidden.requires_grad or norm.requires_grad))
            and not kwargs.get("output_attentions")
            and not any(m._forward_hooks or m._forward_pre_hooks for m in self._parts)
        )


def _linear(parent: nn.Module, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight and bias of `parent`'s linear layer `name`, from the modules' dicts (as `_children`)."""
    params = parent._modules[name]._parameters
    return params["weight"], params["bias"]


def _plain(module: nn.Module) -> bool:
    """A linear layer the kernel reads: `nn.Linear` or a subclass computing the same product (`plain_product`:
    rows_first's), a contiguous plain CPU weight (not sharded, not quantized)."""
    return (
        (type(module) is nn.Linear or getattr(type(module), "plain_product", False))
        and type(module.weight.data) is torch.Tensor
        and module.weight.device.type == "cpu"
        and module.weight.is_contiguous()
    )


def fusable(layer: nn.Module) -> bool:
    """A stock `LlamaDecoderLayer` (exactly, with its own attention, SiLU MLP and RMSNorms) on a CPU."""
    if type(layer) is not LlamaDecoderLayer:
        return False
    attn, mlp = layer.self_attn, layer.mlp
    return (
        type(attn) is LlamaAttention
        and type(mlp) is LlamaMLP
        and type(layer.input_layernorm) is LlamaRMSNorm
        and type(layer.post_attention_layernorm) is LlamaRMSNorm
        and getattr(mlp.config, "hidden_act", None) == "silu"
        and all(_plain(getattr(attn, name)) for name in ("q_proj", "k_proj", "v_proj", "o_proj"))
        and all(_plain(getattr(mlp, name)) for name in ("gate_proj", "up_proj", "down_proj"))
    )


def use_fused_layers(model: nn.Module) -> int:
    """Swap each stock `LlamaDecoderLayer` of `model` for a `FusedLlamaDecoderLayer` holding the same
    submodules; return how many were swapped (0 for other architectures, or when called again). Needs
    h2o-kv's C++ kernels (native.py; built here, once per machine). `use_rows_first` calls it after its own
    swap; a submodule swapped after this one is not among those whose hooks the layer checks."""
    slots = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()]
    swapped = 0
    for parent, name, child in slots:
        if not fusable(child):
            continue
        config = child.self_attn.config
        with torch.device("meta"):
            new = FusedLlamaDecoderLayer(config, child.self_attn.layer_idx)
        for part in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"):
            setattr(new, part, getattr(child, part))  # the same modules: the same parameters and state dict
        new._parts = [m for m in new.modules() if m is not new]  # plain list: not registered as submodules
        new.train(child.training)
        setattr(parent, name, new)
        swapped += 1
    if swapped:
        native.load()
    return swapped
