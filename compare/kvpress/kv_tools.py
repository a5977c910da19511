"""What run_kvpress.py and questions.py share (kvpress's venv): RULER's scoring, the cache's size, AdaKV's masks, and
the two ways a press compresses a prompt (one prefill shared by every press, or the documented one per press)."""

from __future__ import annotations

import re
from contextlib import contextmanager

import torch
from kvpress.attention_patch import attention_patch
from kvpress.presses.base_press import is_prefilling
from transformers import AttentionInterface, AttentionMaskInterface, DynamicCache
from transformers.masking_utils import sdpa_mask

# ----------------------------------------------------------------------------------------- scoring
# h2o_kv.studies.eval.ruler.score, copied (RULER's postprocess + string_match_all / string_match_part);
# export_samples.py --check re-scores every cached prediction with the original to prove they agree.


def score(prediction: str, answers: list[str], metric: str) -> float:
    p = re.sub(r"[\x00-\x08\x0b-\x1f]", "\n", prediction).strip().lower()
    if metric == "string_match_all":
        return sum(1.0 for a in answers if a.lower() in p) / len(answers)
    if metric == "string_match_part":
        return 1.0 if any(a.lower() in p for a in answers) else 0.0
    raise ValueError(f"unknown metric {metric!r}")


def complete(decode, golds: list[str], metric: str):
    """A stopping test for greedy tokens: their text (`decode`) holds every gold, so RULER's string match is 1 and
    more text cannot lower it (h2o-kv's study answers stop on the same test)."""
    return lambda tokens: score(decode(tokens), golds, metric) == 1.0


# ---------------------------------------------------------------------------------------- caching


def kv_stats(cache: DynamicCache, masked: list | None) -> dict:
    """Bytes of the cache's key/value tensors and tokens per (layer, KV head), actual and effective."""
    nbytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    lengths = [layer.keys.shape[2] for layer in cache.layers]
    heads = cache.layers[0].keys.shape[1]
    effective = [n - (0 if m is None else len(m[0]) / heads) for n, m in zip(lengths, masked or [None] * len(lengths))]
    return {
        "kv_bytes": int(nbytes),
        "kv_tokens": sum(lengths) / len(lengths),
        "kv_tokens_effective": sum(effective) / len(effective),
    }


def new_cache(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    cache = DynamicCache()
    for i, (k, v) in enumerate(layers):
        cache.update(k, v, i)
    return cache


def attn_modules(model) -> list:
    return [layer.self_attn for layer in model.model.layers]


def set_masks(model, masks: list | None) -> None:
    """AdaKV's per-layer masked indices (kvpress's attention patch reads module.masked_key_indices)."""
    for i, module in enumerate(attn_modules(model)):
        module.masked_key_indices = None if masks is None else masks[i]


@torch.no_grad()
def shared_prefill(model, ids: torch.Tensor, presses: dict) -> tuple[torch.Tensor, dict]:
    """One prefill; each press compresses the same layer inputs into its own cache.

    Returns the last logits and {name: (cache, adakv masks or None)}; name "full" is the uncompressed cache.
    """
    for press in presses.values():
        press.post_init_from_model(model)
    kept: dict[str, list] = {name: [] for name in presses}
    masks: dict[str, list] = {name: [] for name in presses}

    def hook(module, args, kwargs, output):
        if not is_prefilling(kwargs["cache_position"], kwargs["hidden_states"].shape[1]):
            return output
        layer = kwargs["past_key_values"].layers[module.layer_idx]
        for name, press in presses.items():
            module.masked_key_indices = None
            k, v = press.compress(module, kwargs["hidden_states"], layer.keys, layer.values, output[1], kwargs)
            kept[name].append((k.clone(), v.clone()))
            masks[name].append(getattr(module, "masked_key_indices", None))
        module.masked_key_indices = None
        return output

    hooks = []
    for layer in model.model.layers:
        layer.self_attn.rotary_emb = model.model.rotary_emb  # what BasePress.__call__ sets up
        hooks.append(layer.self_attn.register_forward_hook(hook, with_kwargs=True))
    try:
        base = DynamicCache()
        logits = model(input_ids=ids, past_key_values=base, logits_to_keep=1).logits[0, -1]
    finally:
        for h in hooks:
            h.remove()
    out = {name: (new_cache(kept[name]), masks[name] if any(m is not None for m in masks[name]) else None)
           for name in presses}  # fmt: skip
    out["full"] = (base, None)
    return logits, out


@torch.no_grad()
def standard_prefill(model, ids: torch.Tensor, press) -> tuple[torch.Tensor, DynamicCache, list | None]:
    """The documented kvpress way: the press's hooks active during one forward call."""
    cache = DynamicCache()
    if press is None:
        logits = model(input_ids=ids, past_key_values=cache, logits_to_keep=1).logits[0, -1]
        return logits, cache, None
    with press(model):
        logits = model(input_ids=ids, past_key_values=cache, logits_to_keep=1).logits[0, -1]
    masks = [getattr(m, "masked_key_indices", None) for m in attn_modules(model)]
    return logits, cache, masks if any(m is not None for m in masks) else None


# ------------------------------------------------------------------------------------------ decoding


def one_length(cache: DynamicCache) -> int | None:
    """The cache's kept length if every layer holds as many, else None."""
    lengths = {layer.keys.shape[2] for layer in cache.layers}
    return lengths.pop() if len(lengths) == 1 else None


def stack(caches: list[DynamicCache], slots: int | None = None) -> DynamicCache:
    """One cache whose row r is `caches[r]`'s one sequence, copied, so that one batched call steps them all: every
    layer as long in each (`together` groups them so), or, with `slots`, each right-padded with zeros to that many
    (their `answer_together` mask keeps the pad slots out of attention)."""

    def row(t: torch.Tensor) -> torch.Tensor:
        return t if slots is None else torch.nn.functional.pad(t, (0, 0, 0, slots - t.shape[2]))

    layers = zip(*([(layer.keys, layer.values) for layer in cache.layers] for cache in caches), strict=True)
    return new_cache([(torch.cat([row(k) for k, _ in rows]), torch.cat([row(v) for _, v in rows])) for rows in layers])


def together(configs: list, caches: dict) -> list[list]:
    """`configs` in groups that decode in one batch: the compressed caches without masks (AdaKV's and KVzip's are set
    on the model's modules, one per call) whose layers all hold one length (any: `answer_together` pads them to the
    longest), and those whose layers differ, by their lengths; a masked cache is a group of its own, and so is Full
    (padding every compressed cache to the whole prompt would cost the memory compression saves)."""
    groups: dict = {}
    for cfg in configs:
        cache, masks = caches[cfg]
        if masks is not None or cfg[0] == "full":
            key = cfg
        else:
            key = (
                "one length" if one_length(cache) is not None else tuple(layer.keys.shape[2] for layer in cache.layers)
            )
        groups.setdefault(key, []).append(cfg)
    return list(groups.values())


def _sdpa_gqa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
              is_causal: bool | None = None, **kwargs):  # fmt: skip
    """transformers' "sdpa" attention with the KV heads given to SDPA as they are (`enable_gqa`) also under a mask.
    Stock takes GQA in SDPA only without a mask and otherwise copies every KV head to its query heads (`repeat_kv`),
    which dominated a padded batch's decoding (docs/accuracy.md). SDPA computes the same numbers either way on the
    CPU; `--validate` checks the answers."""
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = query.shape[2] > 1 and attention_mask is None and is_causal
    sdpa = torch.nn.functional.scaled_dot_product_attention
    out = sdpa(query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=is_causal,
               enable_gqa=True)  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


# kvpress wraps every attention function registered when it is imported (its head masks); this one too
AttentionInterface.register("sdpa_gqa", attention_patch(_sdpa_gqa))
AttentionMaskInterface.register("sdpa_gqa", sdpa_mask)


@contextmanager
def gqa_decoding(model):
    """An "sdpa" model decodes with `_sdpa_gqa` inside; any other (eager) as it is."""
    stock = model.config._attn_implementation
    if stock != "sdpa":
        yield
        return
    model.set_attn_implementation("sdpa_gqa")
    try:
        yield
    finally:
        model.set_attn_implementation(stock)


@torch.no_grad()
def greedy_together(model, cache: DynamicCache, first_logits: torch.Tensor, starts: list[int], max_new: int,
                    eos: set[int], dones: list, mask: torch.Tensor | None = None) -> list[list[int]]:  # fmt: skip
    """Greedy tokens for each row of a stacked cache (`stack`) from its first logits [B, V], row r's fed tokens at
    positions from `starts[r]` on, one batched call a step over the rows still going (a finished row leaves the
    batch); `mask` [B, slots] (None: every slot) marks the cache slots each row attends to, and grows with the fed
    tokens. A row stops as run_kvpress's `decode` and questions' `answer` stop, after the token that is EOS, its
    `max_new`-th, or makes `dones[r](tokens)` true (None: never); its tokens are returned with that EOS. A row's
    logits may differ from its solo call's by a batched matrix product's rounding (`--validate` checks the answers)."""
    outs = [[int(t)] for t in first_logits.argmax(-1).tolist()]

    def going(r: int) -> bool:
        out = outs[r]
        return not (len(out) >= max_new or out[-1] in eos or (dones[r] is not None and dones[r](out)))

    rows = list(range(len(outs)))
    while True:
        keep = [i for i, r in enumerate(rows) if going(r)]
        if not keep:
            return outs
        if len(keep) < len(rows):
            cache.batch_select_indices(torch.tensor(keep))
            rows = [rows[i] for i in keep]
            mask = None if mask is None else mask[keep]
        fed = torch.tensor([[outs[r][-1]] for r in rows])
        where = torch.tensor([[starts[r] + len(outs[r]) - 1] for r in rows])
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=1)
        logits = model(input_ids=fed, past_key_values=cache, position_ids=where, attention_mask=mask).logits[:, -1]
        for r, token in zip(rows, logits.argmax(-1).tolist(), strict=True):
            outs[r].append(int(token))


@torch.no_grad()
def answer_together(model, caches: list[DynamicCache], n: int, questions: list[torch.Tensor] | None,
                    first_logits: torch.Tensor | None, max_new: int, eos: set[int],
                    dones: list) -> list[list[list[int]]]:  # fmt: skip
    """Each cache's greedy answer to each question (`greedy_together`'s tokens), all decoded in one batch over a
    stack of the caches, one row per (question, cache) (the caches stay as they are); returns [question][cache].
    A question [1, q] is fed at the positions after the `n` context tokens, as the pipeline numbers it. Caches of
    different lengths are right-padded to the longest and questions of different lengths left-padded, every pad slot
    masked out of its row's attention. With `questions` None (query-aware) every row starts from the prompt's own
    last logits `first_logits` [V]. `dones[j](tokens)` stops question j's rows (None: never)."""
    asked = [None] if questions is None else questions
    kept = [one_length(c) for c in caches]
    widths = [0 if q is None else q.shape[1] for q in asked]
    if None in kept and len(set(widths)) > 1:  # one mask serves every layer: pads need one length in each
        return [answer_together(model, caches, n, [q], None, max_new, eos, [d])[0] for q, d in zip(asked, dones)]
    per, width = len(caches), max(widths)
    padded = None not in kept and len(set(kept)) * len(set(widths)) > 1
    cache = stack([c for _ in asked for c in caches], max(kept) if padded else None)
    mask = None
    if padded:  # row j * per + i: cache i's own slots, then question j's tokens without its pads
        own = torch.arange(max(kept))[None] < torch.tensor(kept)[:, None]
        fed = torch.arange(width)[None] >= torch.tensor([width - w for w in widths])[:, None]
        mask = torch.cat([own.repeat(len(asked), 1), fed.repeat_interleave(per, 0)], 1).long()
    with gqa_decoding(model):
        if questions is None:
            logits = first_logits.expand(per, -1)
        else:
            ids = torch.cat([torch.nn.functional.pad(q, (width - q.shape[1], 0)) for q in questions])
            positions = torch.cat([torch.arange(n + q.shape[1] - width, n + q.shape[1])[None] for q in questions])
            positions = positions.clamp_min(n)  # a pad's position: any, it is masked
            logits = model(input_ids=ids.repeat_interleave(per, 0), past_key_values=cache, attention_mask=mask,
                           position_ids=positions.repeat_interleave(per, 0), logits_to_keep=1)  # fmt: skip
            logits = logits.logits[:, -1]
        starts = [n + w for w in widths for _ in caches]
        outs = greedy_together(model, cache, logits, starts, max_new, eos, [d for d in dones for _ in caches], mask)
    return [outs[j * per : (j + 1) * per] for j in range(len(asked))]
