"""One H2O decode step with the decoder linear layers computed as (W @ x^T)^T instead of F.linear (probe)."""
import torch, time, statistics
from h2o_kv.models import load_model
import h2o_kv.generation as g
from h2o_kv.cache import KVCache
from h2o_kv.policies import build
from transformers import StaticCache
class RowsLinear(torch.nn.Linear):
    def forward(self, x):
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] > 16: return super().forward(x)
        out = torch.mm(self.weight, rows.t()).t()
        return out.view(*x.shape[:-1], -1)
model, tok = load_model("smollm2-135m")
ids = torch.randint(100, 30000, (4, 64))
def step_times(n=10):
    with torch.inference_mode():
        c = KVCache(build("h2o", 819)); g.forward(model, c, torch.randint(100, 30000, (4, 1024)))
        tok = ids[:, -1]; ts = []
        for i in range(n):
            s = time.perf_counter(); g.forward(model, c, tok[:, None]); ts.append(time.perf_counter() - s)
    return 1000*statistics.median(ts[1:])
a = step_times()
for layer in model.model.layers:
    for parent in (layer.self_attn, layer.mlp):
        for name, mod in list(parent.named_children()):
            if type(mod) is torch.nn.Linear:
                new = RowsLinear(mod.in_features, mod.out_features, bias=mod.bias is not None)
                new.weight = mod.weight; new.bias = mod.bias
                setattr(parent, name, new)
b = step_times()
print(f"stock linear {a:.1f} ms, rows-first {b:.1f} ms")
