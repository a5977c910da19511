"""One budget meaning everywhere: the same flag gives the same kept tokens in `h2o-kv generate`,
`h2o-kv eval` and `h2o-kv bench` (an int is tokens, a float in (0, 1] a fraction of the prompt)."""

from __future__ import annotations

import pytest
import torch

from h2o_kv import cli
from h2o_kv.policies import budget_tokens, parse_budget
from h2o_kv.studies import bench
from h2o_kv.studies.eval.decoding import new_cache

from conftest import make_model, random_ids

PROMPT = 60


def policies_from_flag(policy: str, flag: str, length: int) -> dict[str, object]:
    """The policy each command builds from `--policy policy --budget flag` for a `length`-token prompt."""
    parser = cli.build_parser()
    generate = parser.parse_args(["generate", "x", "--policy", policy, "--budget", flag])
    bench_args = parser.parse_args(["bench", "--policies", policy, "--budget", flag])
    eval_args = parser.parse_args(["eval", "--policies", policy, "--budgets", flag])
    return {
        "generate": cli.policy_from_args(generate),
        "bench": bench.policy_for(policy, bench_args.budget, length),
        "eval": new_cache(policy, eval_args.budgets[0], length).policy,
    }


@pytest.mark.parametrize("policy", ["h2o", "local", "streamingllm", "tova"])
@pytest.mark.parametrize("flag", ["1", "3", "12", "0.2", "20%", "1.0"])
def test_same_flag_same_capacity_and_split(policy: str, flag: str) -> None:
    expected = budget_tokens(parse_budget(flag), PROMPT)
    at = torch.tensor([PROMPT])
    built = policies_from_flag(policy, flag, PROMPT)
    assert {path: int(p.capacity(at)[0]) for path, p in built.items()} == dict.fromkeys(built, expected)
    if policy == "h2o":
        assert len({tuple(int(t) for t in p.split(at)) for p in built.values()}) == 1
    if policy == "streamingllm":
        assert len({int(p._sinks(at)[0]) for p in built.values()}) == 1


@pytest.mark.parametrize("flag", ["1", "12", "0.2", "1.0"])
def test_same_flag_same_kept_tokens_on_a_model(flag: str) -> None:
    """The caches really keep the same tokens: kept counts after a prompt and a few decode steps."""
    from h2o_kv.cache.kvcache import KVCache
    from h2o_kv.runtime.generation import decode_step, prefill

    model, ids = make_model("llama"), random_ids(1, PROMPT)
    kept = {}
    for path, policy in policies_from_flag("h2o", flag, PROMPT).items():
        cache = KVCache(policy)
        with torch.no_grad():
            token = prefill(model, cache, ids).argmax(-1)
            for step in range(3):
                token = decode_step(model, cache, token, torch.tensor([PROMPT + step])).argmax(-1)
        kept[path] = cache.kept_tokens
    assert kept == dict.fromkeys(kept, budget_tokens(parse_budget(flag), PROMPT))
