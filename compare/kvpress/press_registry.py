"""The kvpress presses run_kvpress.py runs (kvpress 0.5.5, its own venv), by name, and one h2o-kv-style variant."""

from __future__ import annotations

from kvpress import (
    AdaKVPress,
    ExpectedAttentionPress,
    KeyDiffPress,
    KVzipPress,
    ObservedAttentionPress,
    SnapKVPress,
    StreamingLLMPress,
    TOVAPress,
)
from torch.nn import functional as F


class KVzipKeepingScores(KVzipPress):
    """kvpress's KVzip, unchanged, keeping a copy of its pass's scores (`scores`) when it compresses: nothing in the
    pass depends on the ratio (it scores, then masks the lowest), so the same context's other ratios are masked from
    those scores (`kvzip_masks`) without running the pass again, as h2o-kv's study replays one pass per sample."""

    def compress_post(self, model):
        self.scores = self.score_val.clone()  # before compress_post lifts the sinks' scores in place
        super().compress_post(model)


def kvzip_masks(model, scores, ratio: float) -> list:
    """The masks kvpress's KVzip at `ratio` leaves on `model`'s attention modules after a pass that gave `scores`
    (its own `compress_post`, on a copy of them)."""
    press = KVzipPress(compression_ratio=ratio)
    press.score_val = scores.clone()
    press.compress_post(model)
    return [layer.self_attn.masked_key_indices for layer in model.model.layers]


class TOVAPerKVHead(TOVAPress):
    """kvpress's TOVA with one setting of h2o-kv's: each KV head ranks tokens by its own query group's attention
    (h2o-kv's TOVA), not by the mean over all of the layer's heads (kvpress's, every head keeping the same tokens).
    """

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        if attentions is not None:
            weights = attentions[..., -1:, :-1]
        else:
            embeddings = kwargs["position_embeddings"]
            weights = SnapKVPress.compute_window_attention(module, hidden_states, keys, 1, embeddings)
        batch, kv_heads = keys.shape[:2]
        scores = weights.reshape(batch, kv_heads, -1, weights.shape[-1]).mean(2)  # [B, kv heads, tokens - 1]
        return F.pad(scores, (0, 1), value=scores.max().item() + 1)  # the last token kept, as TOVAPress does


PRESSES = {
    "snapkv": lambda r: SnapKVPress(compression_ratio=r),
    "expected_attention": lambda r: ExpectedAttentionPress(compression_ratio=r),
    "tova": lambda r: TOVAPress(compression_ratio=r),
    "streamingllm": lambda r: StreamingLLMPress(compression_ratio=r),
    "observed_attention": lambda r: ObservedAttentionPress(compression_ratio=r),
    "adakv_snapkv": lambda r: AdaKVPress(SnapKVPress(compression_ratio=r)),
    # SnapKV with h2o-kv's settings, one at a time (why the two SnapKVs disagree; not in the default --presses):
    # h2o-kv observes the last 32 queries (kvpress 64) and pools over 31 tokens (kvpress 5; h2o-kv's pool is a max)
    "snapkv_window32": lambda r: SnapKVPress(compression_ratio=r, window_size=32),
    "snapkv_kernel31": lambda r: SnapKVPress(compression_ratio=r, kernel_size=31),
    "snapkv_window32_kernel31": lambda r: SnapKVPress(compression_ratio=r, window_size=32, kernel_size=31),
    "tova_per_kv_head": lambda r: TOVAPerKVHead(compression_ratio=r),
    # issue 50's query-agnostic candidates: KVzip ranks the context by having the model repeat it (its own passes),
    # KeyDiff by each key's cosine distance from the mean key
    "kvzip": lambda r: KVzipKeepingScores(compression_ratio=r),
    "keydiff": lambda r: KeyDiffPress(compression_ratio=r),
}
DEFAULT_PRESSES = ("snapkv", "expected_attention", "tova", "streamingllm", "observed_attention", "adakv_snapkv")
# issue 50, compress once and answer many (run with --ratios 0.75,0.9: 25 % and 10 % kept)
COMPRESS_ONCE_PRESSES = ("kvzip", "expected_attention", "snapkv", "tova", "keydiff", "adakv_snapkv", "streamingllm",
                         "observed_attention")  # fmt: skip
EAGER = {"observed_attention"}
OWN_PASS = {"kvzip"}  # presses that run forward passes of their own: never from the shared prefill
