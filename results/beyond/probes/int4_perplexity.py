"""Does 4-bit KV storage pay on the bundled model? Streaming perplexity (token by token, 4 windows of 1024
tokens of the plays, as `h2o-kv eval --tasks perplexity`) of H2O when every kept key and value is rounded
the way a 4-bit store would keep it (probe).

Storage stays float here and `KVLayer._write` rounds what it stores, in this process only: the library's
int8 store gives exactly the outputs of a float layer fed its rounded values (tests/test_quantized.py), so
this measures a 4-bit store's accuracy without building one. Rounding schemes:
  int8          the library's: symmetric, one scale per token and head (levels -127..127)
  int4          the same with levels -7..7
  int4-had      int4 after a fixed randomized Hadamard rotation of the head dimension (QuaRot, arXiv
                2404.00456; queries rotate alike, so q.k and p@v are unchanged and only the rounding differs)
  int4-had-g32  ... with one scale per 32 channels (two per token and head); int4-had-g16: per 16
  k8v4          keys int8, values int4 (per token)
Bytes per kept token, per layer and KV head (keys + values + scales, + 12 bytes of position and score):
float32 524, int8 148, int4 and int4-had 84, int4-had-g32 92, int4-had-g16 108, k8v4 116.

    python results/beyond/probes/int4_perplexity.py > results/beyond/probes/int4_perplexity.txt
"""

import math
import time

import torch

import h2o_kv
import h2o_kv.layer as layer_mod
from h2o_kv import H2O, KVCache
from h2o_kv.eval.perplexity import text_windows

torch.set_num_threads(1)
model, tok = h2o_kv.load_model("smollm2-135m")
windows = text_windows(tok, None, n=4, length=1024, seed=0)
DIM = 64
generator = torch.Generator().manual_seed(0)
hadamard = torch.ones(1, 1)
while hadamard.shape[0] < DIM:
    hadamard = torch.cat((torch.cat((hadamard, hadamard), 1), torch.cat((hadamard, -hadamard), 1)), 0)
TURN = hadamard / math.sqrt(DIM) * torch.where(torch.rand(DIM, generator=generator) < 0.5, -1.0, 1.0)


def rounding(levels: int | None, turn: torch.Tensor | None = None, group: int = DIM):
    def keep(x: torch.Tensor) -> torch.Tensor:
        if levels is None:
            return x
        y = x.float() if turn is None else x.float() @ turn
        y = y.unflatten(-1, (DIM // group, group))
        scale = y.abs().amax(-1, keepdim=True).div(levels).clamp_min(torch.finfo(torch.float32).tiny)
        y = (y / scale).round().clamp(-levels, levels).mul(scale).flatten(-2)
        return (y if turn is None else y @ turn.T).to(x.dtype)

    return keep


SCHEMES = {
    "float32": (rounding(None), rounding(None)),
    "int8": (rounding(127), rounding(127)),
    "int4": (rounding(7), rounding(7)),
    "int4-had": (rounding(7, TURN), rounding(7, TURN)),
    "int4-had-g32": (rounding(7, TURN, 32), rounding(7, TURN, 32)),
    "int4-had-g16": (rounding(7, TURN, 16), rounding(7, TURN, 16)),
    "k8v4": (rounding(127), rounding(7)),
}
write = layer_mod.KVLayer._write


def perplexity(scheme: str, budget: int) -> float:
    keys_kept, values_kept = SCHEMES[scheme]
    layer_mod.KVLayer._write = lambda self, slots, k, v, positions: write(
        self, slots, keys_kept(k), values_kept(v), positions
    )
    nll = []
    with torch.no_grad():
        for window in windows:
            ids = window.view(1, -1)
            cache = KVCache(H2O(budget=budget), prefill_chunk=1)
            logits = model(ids, past_key_values=cache, use_cache=True).logits[0, :-1].float()
            nll.append(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none"))
    return math.exp(torch.cat(nll).mean())


RUNS = [  # (scheme, H2O budget in tokens, what the row is)
    *((scheme, 204, "20 % of 1024 tokens") for scheme in SCHEMES),
    ("int8", 363, "float32 H2O's bytes at 10 % (4,744 KiB)"),
    ("int4-had", 641, "float32 H2O's bytes at 10 %"),
    ("int4-had", 1024, "everything kept: the rounding alone (fits float32 H2O's bytes at 20 %)"),
    ("float32", 1024, "everything kept: Full"),
]
print("scheme        budget  perplexity  row")
for scheme, budget, what in RUNS:
    begin = time.time()
    print(f"{scheme:13s} {budget:6d}  {perplexity(scheme, budget):10.3f}  {what} ({time.time() - begin:.0f} s)", flush=True)
