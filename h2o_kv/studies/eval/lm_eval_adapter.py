"""lm-evaluation-harness adapter: run any lm-eval task on a model whose KV cache is an h2o-kv cache.

Registers the model type ``h2o_kv`` (a subclass of lm-eval's HFLM). lm-eval does not discover
plugins, so run its CLI through this module, which registers the model first:

    python -m h2o_kv.studies.eval.lm_eval_adapter --model h2o_kv \\
        --model_args pretrained=smollm2-135m,policy=h2o,budget=0.2 --tasks hellaswag --device cpu

or from Python: ``import h2o_kv.studies.eval.lm_eval_adapter`` then ``lm_eval.simple_evaluate(model="h2o_kv", ...)``.

model_args: ``pretrained`` (bundled name, local dir, .gguf or hub id, or a model instance with
``tokenizer=``), ``policy`` (h2o, local, streamingllm, tova, full), ``budget`` (a fraction of each
request's length, e.g. 0.2, or a token count, e.g. 128), ``mode`` (drop or mask), ``prefill_chunk``
(tokens between evictions inside a request; 1, the default, is the paper's token-by-token simulation).

Every request gets a fresh cache. A loglikelihood request scores its continuation from one forward
over context + continuation, with eviction inside that forward every ``prefill_chunk`` tokens, so
each token is predicted from the bounded cache; with ``prefill_chunk=None`` eviction would only
happen after the forward and the scores would equal Full's. Generation prefills the same way and
decodes under the cache. Requests run one at a time (batch size 1), so budgets never see padding.
"""

from __future__ import annotations

import sys
from typing import Any

import lm_eval.models  # noqa: F401  (fills lm-eval's model registry before ours is added)
import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from h2o_kv.cache.attention import enable
from h2o_kv.cache.kvcache import KVCache
from h2o_kv.policies import Budget, budget_tokens, build, parse_budget
from h2o_kv.runtime.generation import forward


@register_model("h2o_kv", "h2o-kv")
class H2OKVLM(HFLM):
    """HFLM whose forward passes and generations run with an h2o-kv `KVCache` (one per request)."""

    def __init__(
        self,
        pretrained: Any = "smollm2-135m",
        policy: str = "h2o",
        budget: Budget = 0.2,
        mode: str = "drop",
        prefill_chunk: int | None = 1,
        device: str = "cpu",
        dtype: str | None = None,
        tokenizer: Any = None,
        batch_size: int | str | None = 1,
        **kwargs: Any,
    ) -> None:
        if str(batch_size) != "1":
            print(f"h2o_kv adapter: batch_size={batch_size} ignored; requests run one at a time", file=sys.stderr)
        if str(device).startswith("cuda") and not torch.cuda.is_available():  # lm-eval's CLI defaults to cuda
            print("h2o_kv adapter: CUDA is not available; running on the CPU", file=sys.stderr)
            device = "cpu"
        if isinstance(pretrained, str):
            from h2o_kv.runtime.models import load_model

            model, loaded_tokenizer = load_model(pretrained, device=device, dtype=None if dtype == "auto" else dtype)
            tokenizer = tokenizer or loaded_tokenizer
        else:
            model = enable(pretrained)
        self.policy_name = str(policy)
        self.budget = None if self.policy_name.lower() == "full" else _budget(budget)
        self.kv_mode = mode
        self.prefill_chunk = prefill_chunk
        build(self.policy_name, budget_tokens(self.budget, 100))  # fail early on a bad policy or budget
        super().__init__(pretrained=model, tokenizer=tokenizer, batch_size=1, device=device, **kwargs)

    def new_cache(self, length: int) -> KVCache:
        """A fresh cache sized for a request of `length` tokens."""
        policy = build(self.policy_name, budget_tokens(self.budget, length))
        return KVCache(policy, mode=self.kv_mode, prefill_chunk=self.prefill_chunk)

    def _model_call(self, inps: torch.Tensor, attn_mask: torch.Tensor | None = None, labels: Any = None):
        if attn_mask is not None or labels is not None:  # encoder-decoder models: not supported by h2o-kv
            return super()._model_call(inps, attn_mask, labels)
        with torch.no_grad():
            return forward(self.model, self.new_cache(inps.shape[1]), inps, all_logits=True)

    def _model_generate(self, context: torch.Tensor, max_length: int, stop: list[str], **generation_kwargs: Any):
        generation_kwargs["past_key_values"] = self.new_cache(context.shape[1])
        return super()._model_generate(context, max_length, stop, **generation_kwargs)


def _budget(value: Budget | str) -> Budget:
    """model_args arrive as text from lm-eval's CLI ("0.2", "128") and as numbers from Python."""
    return parse_budget(value) if isinstance(value, str) else value


def main() -> None:
    """lm-eval's command line with the `h2o_kv` model registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
