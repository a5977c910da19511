"""A Llama model's whole decode step in one C++ call over h2o-kv's cache (opt-in with rows-first).

With the products and each layer's small operations in C++ (rows_first.py, fused_layer.py), what is left of a
small model's decode step outside the kernels is Python: per layer, the decoder layer's and attention's module
calls, the cache's `update`, the attention function, the layer's bookkeeping, and the arguments of three C++
calls; about 15 % of a step at batch 4 on the 2-core CPU this project benchmarks on (py-spy,
`results/bench-static/probes/python_share.txt`). A `FusedLlamaModel`'s forward, on a `KVCache` whose every
layer is in its steady decode step (full, one token in and one out, `steady.Steady`) and a batch of new real
tokens, runs all the layers in one call (`native.model_step`): per layer the same `layer_in`, the cache's
`decode_step` and `layer_out` as the per-layer path, in the same order on the same tensors, so the logits and
the cache's state are the same to the bit. The cache's layers do the bookkeeping before and after the call
(`KVLayer.steady_plan`, `begin_steady`, `end_steady`). Anything else takes `LlamaModel.forward`: a prompt, a
cache still filling, another cache, output capture, hooks, gradients, a padded step.

`use_fused_model(model)` swaps the model's `LlamaModel` for this subclass holding the same submodules (the same
parameters and state dict), as `use_fused_layers` swaps the decoder layers; only when all of them are fused.
"""

from __future__ import annotations

import torch
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.models.llama.modeling_llama import LlamaModel

from . import native
from .attention import is_enabled
from .cache import KVCache
from .fused_layer import FusedLlamaDecoderLayer
from .native import MAX_ROWS

#: Keyword arguments a decode step may carry that the fused step honours (falsy output flags) or that the
#: Llama model does not read.
QUIET = frozenset({"return_dict", "output_attentions", "output_hidden_states", "cache_position"})


class FusedLlamaModel(LlamaModel):
    """`LlamaModel` whose steady decode steps over a `KVCache` run as one C++ call (`native.model_step`)."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, inputs_embeds=None,
                use_cache=None, **kwargs):  # fmt: skip
        if isinstance(past_key_values, KVCache):
            out = self._steady_step(input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, use_cache,
                                    kwargs)  # fmt: skip
            if out is not None:
                return out
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                               **kwargs)  # fmt: skip

    def _steady_step(self, input_ids, attention_mask, position_ids, cache: KVCache, inputs_embeds, use_cache,
                     kwargs: dict):  # fmt: skip
        """The step in one C++ call, or None when it cannot take it (then nothing has changed)."""
        config = self.config
        if (
            use_cache is False
            or kwargs.keys() - QUIET
            or any(
                kwargs.get(name, getattr(config, name, False)) for name in ("output_attentions", "output_hidden_states")
            )
            or (input_ids is None) == (inputs_embeds is None)
            or (input_ids if inputs_embeds is None else inputs_embeds).shape[1:2] != (1,)
            or not is_enabled(self)
        ):
            return None
        layers = list(self.layers._modules.values())[: config.num_hidden_layers]  # not a slice: a new ModuleList
        if not all(type(layer) is FusedLlamaDecoderLayer for layer in layers) or _hooked(layers):
            return None
        seen = cache.get_seq_length()
        if attention_mask is not None and not _last_column_real(attention_mask, seen + 1):
            return None  # padding, or a mask of another form: the per-layer path reads it
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        attn = layers[0]._modules["self_attn"]
        if not (
            0 < hidden.shape[0] <= MAX_ROWS
            and hidden.device.type == "cpu"
            and hidden.dtype is layers[0]._modules["input_layernorm"]._parameters["weight"].dtype
            and not self.training
            and not torch.is_grad_enabled()
        ):
            return None
        plans = cache.steady_plans(len(layers), hidden.shape[0], config.num_key_value_heads, attn.head_dim,
                                   hidden.dtype, hidden.device)  # fmt: skip
        if plans is None:
            return None
        if position_ids is None:
            position_ids = torch.full((1, 1), seen, device=hidden.device)
        cos, sin = self.rotary_emb(hidden, position_ids=position_ids)
        weights, biases, eps, scaling = _parameters(layers)
        steps = [layer.begin_steady(plan) for layer, plan in zip(cache.layers, plans)]
        hidden, freed = native.model_step(hidden, cos, sin, weights, biases, eps, scaling, attn.head_dim, cache.layers,
                                          steps)  # fmt: skip
        for layer, slots in zip(cache.layers, freed):
            layer.end_steady(slots)
        out = BaseModelOutputWithPast(last_hidden_state=self.norm(hidden), past_key_values=cache)
        return out.to_tuple() if kwargs.get("return_dict", getattr(config, "return_dict", True)) is False else out


def _hooked(layers) -> bool:
    """A forward hook on a decoder layer or one of its parts (they would not run inside the C++ call)."""
    for layer in layers:
        if layer._forward_hooks or layer._forward_pre_hooks:
            return True
        for m in layer._parts:
            if m._forward_hooks or m._forward_pre_hooks:
                return True
    return False


def _last_column_real(mask: torch.Tensor, columns: int) -> bool:
    """A [B, columns] mask whose last column is a real token in every row: what the per-layer path reads as no
    padding in a decode step (the new column's entry of the model's mask)."""
    return mask.dim() == 2 and mask.shape[1] == columns and bool(mask[:, -1].all())


def _parameters(layers) -> tuple[list, list, list[float], list[float]]:
    """The layers' weights (9 each), biases (7 each), norm epsilons (2 each) and attention scalings, in
    `native.model_step`'s order, read from the modules' dicts as `FusedLlamaDecoderLayer` reads them."""
    weights, biases, eps, scaling = [], [], [], []
    for layer in layers:
        attn, mlp, norm_in, norm_post = layer._children()
        a, m = attn._modules, mlp._modules
        q, k, v, o = (a[name]._parameters for name in ("q_proj", "k_proj", "v_proj", "o_proj"))
        gate, up, down = (m[name]._parameters for name in ("gate_proj", "up_proj", "down_proj"))
        weights += (norm_in._parameters["weight"], q["weight"], k["weight"], v["weight"], o["weight"],
                    norm_post._parameters["weight"], gate["weight"], up["weight"], down["weight"])  # fmt: skip
        biases += (q["bias"], k["bias"], v["bias"], o["bias"], gate["bias"], up["bias"], down["bias"])
        eps += (norm_in.variance_epsilon, norm_post.variance_epsilon)
        scaling.append(attn.scaling)
    return weights, biases, eps, scaling


def use_fused_model(model: torch.nn.Module) -> int:
    """Swap `model`'s `LlamaModel` (its `base_model`) for a `FusedLlamaModel` holding the same submodules when
    every decoder layer is a `FusedLlamaDecoderLayer` (`use_fused_layers`); return 1 if swapped, else 0 (other
    architectures, or when called again). `use_rows_first` calls it after the layers' swap."""
    decoder = getattr(model, "base_model", None)
    if type(decoder) is not LlamaModel or decoder is model or not decoder.layers:
        return 0
    if not all(type(layer) is FusedLlamaDecoderLayer for layer in decoder.layers):
        return 0
    if decoder._forward_hooks or decoder._forward_pre_hooks:
        return 0
    names = [name for name, child in model.named_children() if child is decoder]
    if len(names) != 1:
        return 0
    with torch.device("meta"):  # built once, so transformers registers the class (its output capture's table)
        new = FusedLlamaModel(decoder.config)
    new.__dict__.update(decoder.__dict__)  # then the same submodules, parameters, buffers, config and flags
    new._modules = dict(decoder._modules)
    setattr(model, names[0], new)
    native.load()
    return 1
