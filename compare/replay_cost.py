"""What a shared prefill's replay costs per (policy, fraction), alone and sharing its attention with the replays
before it (`h2o_kv.studies.eval.shared.SharedAttention`): one recorded prefill of a random prompt, one torch thread.
Then KVzip (`--kvzip`, default kvzip,kvzipwhole): its own pass (`h2o_kv.compress`) per (policy, fraction) against the
pass recorded once (`record_pass`) and replayed into each cache (`replay_pass`), alone and sharing one memo of the
pass's peak attention with the replays before it (as the eval does). `--policies ""` and `--no-own-pass` time only
the replays.

    OMP_NUM_THREADS=1 .venv/bin/python compare/replay_cost.py --model qwen2.5-coder-0.5b --tokens 4096
"""

from __future__ import annotations

import argparse
import time

import torch

from h2o_kv.cache.reconstruct import PassPeaks
from h2o_kv.runtime.compress import compress
from h2o_kv.runtime.models import load_model
from h2o_kv.studies.eval.decoding import new_cache
from h2o_kv.studies.eval.shared import SharedAttention, record_pass, record_prefill, replay, replay_pass
from h2o_kv.studies.report import commit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--policies", default="snapkv,h2o,tova,adakv,keydiff,streamingllm")
    parser.add_argument("--fractions", default="0.25,0.1")
    parser.add_argument("--kvzip", default="kvzip,kvzipwhole", help="KVzip's policies (empty: none)")
    parser.add_argument("--no-own-pass", action="store_true", help="skip KVzip's own pass (the slowest part)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_model(args.model)[:2]
    ids = torch.randint(100, 20000, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    print(f"commit {commit()}, {args.model}, {args.tokens} tokens, 1 thread")
    policies = [policy for policy in args.policies.split(",") if policy]
    if policies:
        start = time.perf_counter()
        _, calls = record_prefill(model, ids)
        print(f"recorded prefill {time.perf_counter() - start:.1f} s")
    shared = SharedAttention()
    for policy in policies:
        for fraction in map(float, args.fractions.split(",")):
            start = time.perf_counter()
            replay(new_cache(policy, fraction, args.tokens), calls)
            alone = time.perf_counter() - start
            start = time.perf_counter()
            replay(new_cache(policy, fraction, args.tokens), calls, shared)
            print(f"{policy} {fraction:g}: alone {alone:.1f} s, sharing {time.perf_counter() - start:.1f} s")
    if policies:
        print(f"attention calls computed while sharing: {shared.computed}")
    if not args.kvzip:
        return
    start = time.perf_counter()
    _, passed = record_pass(model, ids, tokenizer)
    print(f"KVzip's pass recorded once: {time.perf_counter() - start:.1f} s")
    peaks = PassPeaks()  # filled by the replays alone (the recording above was made without it)
    for policy in args.kvzip.split(","):
        for fraction in map(float, args.fractions.split(",")):
            own = "skipped"
            if not args.no_own_pass:
                start = time.perf_counter()
                cache = new_cache(policy, fraction, args.tokens)
                with torch.no_grad():
                    compress(model, torch.tensor([ids]), cache=cache, tokenizer=tokenizer)
                own = f"{time.perf_counter() - start:.1f} s"
            start = time.perf_counter()
            replay_pass(new_cache(policy, fraction, args.tokens), passed)
            alone = time.perf_counter() - start
            start = time.perf_counter()
            replay_pass(new_cache(policy, fraction, args.tokens), passed, peaks)
            print(f"{policy} {fraction:g}: its own pass {own}, replayed {alone:.1f} s, replayed sharing the peaks "
                  f"{time.perf_counter() - start:.1f} s")  # fmt: skip


if __name__ == "__main__":
    main()
