"""What the bench's test files share: a tiny random Llama's bench run and the stand-ins it needs."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from h2o_kv.studies import bench

from conftest import VOCAB, make_model

PROMPT_LENS, BATCHES, GEN, BUDGET = [40, 80], [1, 2], 4, 0.2
TEXT = "To be, or not to be, that is the question. " * 20
READ_BYTES = 1 << 20  # the floor's reads: small, for speed (the bench reads 512 MB)


@contextmanager
def one_thread():
    """Tiny ops on a busy CPU: one thread is steadier. torch's thread count is restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class CharTokenizer:
    """Stands in for a real tokenizer: one id per character."""

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [3 + ord(c) % (VOCAB - 3) for c in text]}


def tiny_run() -> tuple[torch.nn.Module, list[dict]]:
    """The bench on a tiny random Llama at every policy, PROMPT_LENS x BATCHES: (model, rows)."""
    with one_thread():
        model = make_model("llama")
        rows = bench.run_bench(
            model,
            CharTokenizer(),
            budget=BUDGET,
            prompt_lens=PROMPT_LENS,
            gen_len=GEN,
            batch_sizes=BATCHES,
            repeats=1,
            warmup=0,
            threads=[1],
            progress=False,
            text=TEXT,
            read_bytes=READ_BYTES,
        )
    return model, rows


def sweep(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["section"] == "sweep"]
