"""The GPU study's correctness cells: a captured decode step against eager steps, and `model.generate` with a
KVCache compiled as transformers compiles StaticCache's, against the same call uncompiled."""

from __future__ import annotations

import torch

from h2o_kv.studies.bench.gpu_models import BUDGET, clock, h2o_cache


def check_captured(model, context: int, batch: int, device) -> dict:
    """The captured step against eager steps from the same state: the same greedy tokens, logits close."""
    from h2o_kv.runtime.generation import forward
    from h2o_kv.runtime.graphs import CapturedStep

    budget = int(BUDGET * context)
    torch.manual_seed(1)
    eager, _, token = h2o_cache(model, "h2o", budget, budget, batch, device)
    torch.manual_seed(1)
    graphed, _, token2 = h2o_cache(model, "h2o", budget, budget, batch, device)
    step = CapturedStep(model, graphed)
    worst, same, position = 0.0, True, torch.full_like(token, budget)
    for _ in range(12):
        a = forward(model, eager, token.view(-1, 1), positions=position.view(-1, 1))
        b = step(token2, position)
        worst = max(worst, float((a - b).abs().max() / a.abs().max()))
        token, token2 = a.argmax(-1), b.argmax(-1)
        same = same and bool((token == token2).all())
        position = position + 1
    pos_equal = all(bool((x.pos == y.pos).all()) for x, y in zip(eager.layers, graphed.layers))
    return dict(graph=step.graph is not None, same_tokens=same, max_rel_logit_diff=worst, same_kept_positions=pos_equal,
                seen_equal=eager.layers[0].seen == graphed.layers[0].seen)  # fmt: skip


def generate_compiled(model, device, prompt_len: int = 512, batch: int = 2, new: int = 32) -> dict:
    """`model.generate` with a KVCache, as transformers compiles it on a GPU (the cache says it is compileable),
    against the same call with compilation off: the fraction of equal tokens and both times (the compiled one
    includes compiling)."""
    from transformers.generation.configuration_utils import CompileConfig

    from h2o_kv import H2O, KVCache, enable

    enable(model)
    ids = torch.randint(model.config.vocab_size, (batch, prompt_len), device=device)
    kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, attention_mask=torch.ones_like(ids))
    config = CompileConfig(fullgraph=True)
    config._compile_all_devices = True  # a CPU dry run compiles too
    out, seconds = {}, {}
    for name, extra in (("eager", dict(disable_compile=True)), ("compiled", dict(compile_config=config)),
                        ("compiled-again", dict(compile_config=config))):  # fmt: skip
        cache = KVCache(H2O(budget=prompt_len // 5))

        def run(name=name, cache=cache, extra=extra):
            out[name] = model.generate(ids, past_key_values=cache, **extra, **kwargs)

        seconds[name] = clock(device, run)
    same = float((out["eager"] == out["compiled-again"]).float().mean())
    return dict(same_tokens=same, **{f"{name}_s": round(t, 3) for name, t in seconds.items()})
