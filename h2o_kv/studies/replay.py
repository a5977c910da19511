"""A served conversation replayed in this process with one `KVCache`: what automatic prefix reuse must give.

The server keeps a finished turn's cache and starts the next turn from it when the new prompt extends what the
cache has seen (the prompt and the answer but its last token). The library's own run of the same conversation is
one cache fed the first prompt (in prefill chunks), its greedy answer, then each next turn's new tokens: the
server's answers with reuse must be that run's. Where the conversation as the client sends it back would not extend
the answer's tokens (an answer that tokenizes differently, a chat template that rewrites earlier turns), the server
keeps the cache as it was when the prompt was through (`requests.chat_resend`, scheduler.py's `keep`), and so does
the replay: the next turn goes on from a copy of it. A turn that extends neither starts a new cache.
"""

from __future__ import annotations

import argparse


def check_answers(args: argparse.Namespace, convs: list) -> dict:
    """Replay `convs` (their messages hold the server's answers) with the server's model, policy and chunk."""
    import torch

    from h2o_kv import KVCache, policies
    from h2o_kv.cli import build_parser
    from h2o_kv.runtime.generation import eos_ids, greedy_continue, prefill
    from h2o_kv.runtime.models import load_model
    from h2o_kv.runtime.serve.main import engine_settings
    from h2o_kv.runtime.serve.requests import chat_resend

    flags = ["serve", *(["--policy", args.policy] if args.policy else [])]
    flags += ["--budget", args.budget] if args.budget else []
    settings = engine_settings(build_parser().parse_args(flags))
    policy = policies.build(settings["policy"], settings["budget"], sinks=settings["sinks"])
    model, tokenizer = load_model(args.model)
    eos, details, matching = eos_ids(model, tokenizer), [], 0
    for conv in convs:
        cache, seen = None, []
        asked = [i for i, message in enumerate(conv.messages) if message["role"] == "user"]
        for turn, at in zip(conv.turns, asked):
            history = conv.messages[: at + 1]  # the conversation up to this turn's question
            text = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
            ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            reused = cache is not None and len(seen) < len(ids) and ids[: len(seen)] == seen
            if not reused:
                cache, seen = KVCache(policy, prompt_len=len(ids)), []
            start = len(seen)
            with torch.no_grad():
                logits = prefill(model, cache, torch.tensor([ids[start:]]), chunk=args.prefill_chunk, start=start)
                at_prompt = cache.fork()  # the server's copy when the prompt is through
                answer = greedy_continue(model, cache, logits, len(ids), args.max_tokens, eos)
            seen = ids + answer[:-1]
            text = tokenizer.decode(answer, skip_special_tokens=True)
            resent = chat_resend(tokenizer, history)(text)  # what the next turn starts with: the cache it extends
            if resent[: len(seen)] != seen:  # the server keeps the prompt's copy; the next turn may extend it
                cache, seen = at_prompt, ids
            same = text == turn.answer
            matching += same
            details.append(dict(reused=start, server_cached=turn.cached_tokens, same=same, answer=text,
                                served=turn.answer))  # fmt: skip
    return dict(matching=matching, compared=len(details), turns=details)
