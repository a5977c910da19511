"""Widening int8 keys to float32 at the bench's decode sizes (3 KV heads x 820 kept x 64 per sequence, batch
4 / 20 / 64): a fresh tensor (`.to`, the allocation page-faults) against a copy into an existing buffer, a
broadcast multiply by per-token scales, and a float copy (probe)."""
import time, torch
def bench(f, n=20):
    f(); t = time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter() - t) / n * 1e3
for B in (4, 20, 64):
    x = torch.randint(-127, 127, (B * 3, 820, 64), dtype=torch.int8)
    s = torch.rand(B * 3, 820, 1)
    out = torch.empty(x.shape)
    print(B, "to float ms", round(bench(lambda: x.to(torch.float32)), 2),
          "copy_ into ms", round(bench(lambda: out.copy_(x)), 2),
          "mul scale ms", round(bench(lambda: x * s), 2),
          "float copy ms", round(bench(lambda: out.clone()), 2))
