"""What one decode step costs by the number of rows it carries: why a study decodes its answers together.

    OMP_NUM_THREADS=1 python compare/decode_rows.py --model qwen2.5-coder-0.5b --cached 1024 --rows 1,4,16,32

Each row holds `--cached` tokens (a stock `DynamicCache` of random keys and values: the step's cost does not depend
on them); the step's time is the mean of `--steps` one-token calls after one warm call. Prints one line per row count.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import DynamicCache

from h2o_kv.runtime.models import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--cached", type=int, default=1024)
    parser.add_argument("--rows", default="1,4,16,32")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    model, _ = load_model(args.model, enable_h2o=False)
    print(f"{args.model}, {args.cached} cached tokens a row, float32, {torch.get_num_threads()} torch threads")
    config = model.config
    kv_heads, layers = config.num_key_value_heads, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    for rows in (int(r) for r in args.rows.split(",")):
        cache = DynamicCache()
        for layer in range(layers):  # random cached keys and values: the step's cost does not depend on them
            kv = torch.randn(2, rows, kv_heads, args.cached, head_dim)
            cache.update(kv[0], kv[1], layer)
        ids = torch.randint(0, 1000, (rows, args.steps + 1))
        with torch.no_grad():
            model(input_ids=ids[:, :1], past_key_values=cache, use_cache=True, logits_to_keep=1)
            start = time.perf_counter()
            for i in range(1, args.steps + 1):
                model(input_ids=ids[:, i : i + 1], past_key_values=cache, use_cache=True, logits_to_keep=1)
            step = (time.perf_counter() - start) / args.steps
        print(f"{rows:3d} rows: {step:.3f} s a step, {step / rows:.4f} s a row", flush=True)


if __name__ == "__main__":
    main()
