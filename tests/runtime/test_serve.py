"""`h2o-kv serve` through the real `openai` client: completions, chat, streaming, usage, stop strings,
every refused input, client disconnects and metrics. One tiny random Llama (the bundled tokenizer's
vocabulary) served on 127.0.0.1 at an ephemeral port."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

import httpx  # noqa: E402
import torch  # noqa: E402

from h2o_kv import policies  # noqa: E402
from h2o_kv.cache.kvcache import KVCache  # noqa: E402
from h2o_kv.errors import BadBudget, ContextTooLong, InputError, KVMemoryExceeded, UnknownPolicy  # noqa: E402
from h2o_kv.runtime.generation import encode, greedy_ids  # noqa: E402
from h2o_kv.runtime.serve.requests import refusal  # noqa: E402

from serve_helpers import CONTEXT, MODEL, client, metric, running_server, wait_for  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog because"


@pytest.fixture(scope="module")
def server(model, tokenizer):
    """(engine, url): default policy h2o at 20 %; KV memory for one full-cache request of 600 tokens."""
    from h2o_kv.runtime.engine import Engine

    kv_memory = Engine(model, tokenizer).kv_bytes_for(584, 16, policies.Full())
    with running_server(model, tokenizer, kv_memory=kv_memory, max_batch=16, prefill_chunk=32) as served:
        yield served


@pytest.fixture(scope="module")
def api(server):
    return client(server[1])


def _greedy(api, **kw):
    kw = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, **kw}
    return api.completions.create(**kw)


def test_models_health_and_metrics_endpoints(server, api) -> None:
    engine, url = server
    assert [m.id for m in api.models.list().data] == [MODEL]
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    assert metric(url, "h2o_kv_kv_bytes_allowed") == engine.kv_memory
    with pytest.raises(openai.NotFoundError):
        api.models.retrieve("gpt-4")


def test_the_server_answers_while_a_step_holds_the_engine(server) -> None:
    """A scrape and a new request wait for the step in flight off the event loop: /health still answers, and the
    request queues (the queue limit reads the queue alone)."""
    from concurrent.futures import ThreadPoolExecutor

    engine, url = server
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    with ThreadPoolExecutor(2) as pool:
        with engine._state:  # the lock a step holds
            scrape = pool.submit(httpx.get, f"{url}/metrics", timeout=60)
            completion = pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=60)
            wait_for(lambda: engine.waiting() == 1, what="the request to queue")
            assert httpx.get(f"{url}/health", timeout=10).json()["status"] == "ok"
            assert not scrape.done() and not completion.done()
        assert scrape.result().status_code == 200 and completion.result().status_code == 200


def test_completion_matches_the_model_loop_and_counts_usage(server, api, model, tokenizer) -> None:
    ids = encode(tokenizer, PROMPT, chat=False)
    want = greedy_ids(model, KVCache(policies.Full()), ids, 8)
    out = _greedy(api, extra_body={"kv_policy": "full"})
    assert out.choices[0].text == tokenizer.decode(want, skip_special_tokens=True)
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (len(ids), 8, len(ids) + 8)
    by_ids = _greedy(api, prompt=ids, extra_body={"kv_policy": "full"})  # a prompt of token ids
    assert by_ids.choices[0].text == out.choices[0].text


def test_bounded_policy_override_differs_from_full_on_a_long_prompt(api, model, tokenizer) -> None:
    ids = encode(tokenizer, PROMPT * 12, chat=False)
    cache = KVCache(policies.build("h2o", 16), prompt_len=len(ids))
    want = tokenizer.decode(greedy_ids(model, cache, ids, 16), skip_special_tokens=True)
    got = _greedy(api, prompt=ids, max_tokens=16, extra_body={"kv_policy": "h2o", "kv_budget": 16}).choices[0].text
    assert got == want
    full = _greedy(api, prompt=ids, max_tokens=16, extra_body={"kv_policy": "full"}).choices[0].text
    assert got != full  # 16 of ~130 tokens: the override really bounded the cache
    assert (
        _greedy(api, prompt=ids, max_tokens=16, extra_body={"kv_budget": "100%"}).choices[0].text == full
    )  # h2o keeping all


def test_chat_applies_the_template_and_max_completion_tokens(api, tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    n_prompt = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    out = api.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=50, max_completion_tokens=5
    )
    assert out.choices[0].message.role == "assistant"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (n_prompt, 5)


def test_streams_carry_the_same_text_and_usage(server, api) -> None:
    whole = _greedy(api, max_tokens=12).choices[0].text
    chunks = list(_greedy(api, max_tokens=12, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])

    messages = [{"role": "user", "content": "Hello"}]
    chat = api.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=6)
    parts = list(api.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=6, stream=True))
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == chat.choices[0].message.content
    assert parts[-1].choices[0].finish_reason == "length" and all(p.usage is None for p in parts)

    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{server[1]}/v1/completions", json=body, timeout=30) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)


def test_stop_strings_cut_the_text_and_finish_with_stop(api) -> None:
    text = _greedy(api, max_tokens=24).choices[0].text
    start = next(i for i in range(4, len(text) - 3) if text.find(text[i : i + 3]) == i)
    stop = text[start : start + 3]
    out = _greedy(api, max_tokens=24, stop=["\u2603never", stop]).choices[0]
    assert (out.text, out.finish_reason) == (text[:start], "stop")
    streamed = list(_greedy(api, max_tokens=24, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == text[:start]
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(api) -> None:
    def sampled(seed):
        return _greedy(api, temperature=1.0, top_p=0.9, seed=seed, max_tokens=10).choices[0].text

    assert sampled(7) == sampled(7)
    assert sampled(7) != sampled(8)


BAD = [  # (request fields, status, param, code)
    ({"max_tokens": -1}, 400, "max_tokens", None),
    ({"max_tokens": 0}, 400, "max_tokens", None),
    ({"max_tokens": 10**9}, 400, "max_tokens", None),
    ({"n": 2}, 400, "n", None),
    ({"model": "gpt-4"}, 404, "model", "model_not_found"),
    ({"temperature": "hot"}, 400, "temperature", None),
    ({"temperature": 3}, 400, "temperature", None),
    ({"top_p": 0}, 400, "top_p", None),
    ({"prompt": 12}, 400, "prompt", None),
    ({"prompt": ""}, 400, "prompt", None),
    ({"prompt": ["a", "b"]}, 400, "prompt", None),
    ({"prompt": [1, 10**8]}, 400, "prompt", None),
    ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop", None),
    ({"logprobs": 2}, 400, "logprobs", None),
    ({"stream": "yes"}, 400, "stream", None),
    ({"kv_budget": "1.5"}, 400, "kv_budget", None),
    ({"kv_budget": 0}, 400, "kv_budget", None),
    ({"kv_budget": "nan"}, 400, "kv_budget", None),
    ({"kv_policy": "lru"}, 400, "kv_policy", None),
    ({"kv_policy": "full", "kv_budget": 64}, 400, "kv_budget", None),
    ({"prompt": list(range(5, 5 + CONTEXT)), "kv_policy": "full"}, 400, "prompt", "context_length_exceeded"),
    ({"prompt": list(range(5, 905)), "kv_policy": "full", "max_tokens": 16}, 400, "prompt", "kv_memory_exceeded"),
]


@pytest.mark.parametrize("fields,status,param,code", BAD, ids=[str(sorted(b[0]))[:40] for b in BAD])
def test_bad_input_gets_an_openai_error_and_the_server_goes_on(server, api, fields, status, param, code) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **fields}
    response = httpx.post(f"{server[1]}/v1/completions", json=body, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    assert _greedy(api, max_tokens=2).usage.completion_tokens == 2


REFUSALS = [  # (the library's error, param, code, message): by type, whatever the text says
    (UnknownPolicy("lru", policies.NAMES), "kv_policy", None, "kv_policy: unknown policy 'lru'; choose from h2o"),
    (BadBudget("policy 'full' keeps every token and takes no budget"), "kv_budget", None, "kv_budget: policy 'full'"),
    (ContextTooLong("9 + 4 tokens past 8", prompt_tokens=9, max_tokens=4, context=8), "messages",
     "context_length_exceeded", "messages: 9 + 4 tokens past 8"),
    (KVMemoryExceeded("needs 10 bytes, 5 allowed", needed=10, allowed=5), "messages", "kv_memory_exceeded",
     "needs 10 bytes, 5 allowed"),
    (InputError("the prompt is empty", param="prompt"), "messages", None, "the prompt is empty"),
    (InputError("stop must be non-empty strings", param="stop"), "stop", None, "stop must be non-empty strings"),
    (ValueError("past the context: more KV cache than allowed"), None, None, "past the context: more KV cache"),
]  # fmt: skip


@pytest.mark.parametrize("err,param,code,message", REFUSALS, ids=[type(r[0]).__name__ for r in REFUSALS])
def test_the_library_s_refusals_map_to_http_errors_by_type(err, param, code, message) -> None:
    refused = refusal(err, prompt_param="messages")
    assert (refused.status, refused.param, refused.code) == (400, param, code)
    assert refused.message.startswith(message)


def test_the_policy_is_built_once_and_submitted_built(server, monkeypatch) -> None:
    """The server builds the request's policy (checking it) and hands the engine that Policy, not its name again."""
    engine, url = server
    submitted = []
    submit = engine.submit

    def spy(ids, **kwargs):
        submitted.append(kwargs)
        return submit(ids, **kwargs)

    monkeypatch.setattr(engine, "submit", spy)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "kv_policy": "h2o", "kv_budget": 16}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
    (kwargs,) = submitted
    assert kwargs["policy"] == policies.build("h2o", 16) and kwargs.get("budget") is None


def test_malformed_bodies_and_the_openai_client_errors(server, api) -> None:
    url = f"{server[1]}/v1/chat/completions"
    for raw in (b"{not json", b"[1, 2]", b""):
        response = httpx.post(url, content=raw, headers={"content-type": "application/json"})
        assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    bad_chat = [
        {"messages": []},
        {"messages": [{"role": "wizard", "content": "hi"}]},
        {"messages": "hi"},
        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -5},
        {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
    ]
    for fields in bad_chat:
        response = httpx.post(url, json={"model": MODEL, **fields})
        assert response.status_code == 400, fields
        assert response.json()["error"]["param"] == next(iter(k for k in fields if k != "messages"), "messages")
    with pytest.raises(openai.BadRequestError) as err:
        api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=-3)
    assert err.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError):
        api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=3)


def test_a_prompt_past_the_context_is_refused_whatever_the_policy(api) -> None:
    """A bounded cache bounds memory, not positions: past the model's context every policy is refused, naming both
    numbers; the same prompt cut to fit is served by the default bounded policy."""
    ids = list(range(5, 5 + CONTEXT + 100))
    for extra in ({"kv_policy": "full"}, {}):  # {}: the server's default, a bounded policy
        with pytest.raises(openai.BadRequestError) as refused:
            _greedy(api, prompt=ids, extra_body=extra)
        error = refused.value.body
        assert error["code"] == "context_length_exceeded" and error["param"] == "prompt", error
        assert f"prompt ({len(ids)} tokens)" in error["message"] and f"context of {CONTEXT} tokens" in error["message"]
    out = _greedy(api, prompt=ids[: CONTEXT - 3], max_tokens=3)
    assert out.usage.prompt_tokens == CONTEXT - 3 and out.usage.completion_tokens == 3


def test_client_disconnect_cancels_and_frees_the_kv(server, api) -> None:
    engine, url = server
    cancelled = metric(url, "h2o_kv_requests_total", {"finish_reason": "cancelled"})
    before = engine.stats()["generated_tokens"]
    stream = _greedy(api, max_tokens=900, stream=True)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    assert metric(url, "h2o_kv_kv_bytes_in_use") > 0
    assert metric(url, "h2o_kv_kv_bytes_peak") >= metric(url, "h2o_kv_kv_bytes_in_use")
    stream.close()
    wait_for(lambda: metric(url, "h2o_kv_kv_bytes_in_use") == 0, what="KV bytes to return to zero")
    wait_for(lambda: metric(url, "h2o_kv_requests_total", {"finish_reason": "cancelled"}) == cancelled + 1)
    assert engine.stats()["running"] == 0
    assert engine.stats()["generated_tokens"] - before < 900

    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 900}  # a client that stops waiting for a whole answer
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=body, timeout=0.5)
    wait_for(lambda: metric(url, "h2o_kv_requests_total", {"finish_reason": "cancelled"}) == cancelled + 2)
    assert metric(url, "h2o_kv_kv_bytes_in_use") == 0 and engine.stats()["generated_tokens"] - before < 1800
    assert metric(url, "h2o_kv_kv_bytes_peak") > 0 and metric(url, "h2o_kv_requests_running_peak") >= 1
    assert httpx.post(f"{url}/reset_peaks").status_code == 204
    assert metric(url, "h2o_kv_kv_bytes_peak") == metric(url, "h2o_kv_requests_running_peak") == 0


def test_metrics_count_tokens_requests_and_first_token_times(server, api) -> None:
    url = server[1]
    tokens, done = (
        metric(url, "h2o_kv_generated_tokens_total"),
        metric(url, "h2o_kv_requests_total", {"finish_reason": "length"}),
    )
    ttft = metric(url, "h2o_kv_time_to_first_token_seconds_count")
    usage = [_greedy(api, max_tokens=n).usage.completion_tokens for n in (3, 5)]
    assert metric(url, "h2o_kv_generated_tokens_total") - tokens == sum(usage) == 8
    assert metric(url, "h2o_kv_requests_total", {"finish_reason": "length"}) - done == 2
    assert metric(url, "h2o_kv_time_to_first_token_seconds_count") - ttft == 2
    assert metric(url, "h2o_kv_requests_running") == 0 and metric(url, "h2o_kv_requests_waiting") == 0


def test_a_fraction_that_keeps_few_tokens_is_said_in_the_response(server) -> None:
    """kv_budget "0.2" of a short prompt keeps a handful of tokens: the reply carries `kv_warning` and the
    X-KV-Warning header (streamed replies: the header); a token budget carries neither."""
    url = server[1]
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "kv_policy": "h2o", "kv_budget": "0.2"}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200
    assert reply.json()["kv_warning"] == reply.headers["X-KV-Warning"]
    assert "H2O(budget=0.2) keeps 2 tokens per (sequence, KV head)" in reply.headers["X-KV-Warning"]
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as streamed:
        assert "keeps 2 tokens" in streamed.headers["X-KV-Warning"]
        streamed.read()
    tokens = httpx.post(f"{url}/v1/completions", json={**body, "kv_budget": 64}, timeout=60)
    assert "kv_warning" not in tokens.json() and "X-KV-Warning" not in tokens.headers


def test_kv_inspect_returns_the_kept_map_with_the_answer(server, api, model, tokenizer) -> None:
    """`kv_inspect: true` adds the cache's kept map over the prompt (`KeptMap.summary`): the same map the model loop's
    own cache reports after the same prompt and tokens; absent by default, and refused with a stream."""
    from h2o_kv.runtime.generation import greedy_continue, prefill

    messages = [{"role": "user", "content": " ".join([PROMPT] * 6)}]
    ask = {"model": MODEL, "messages": messages, "max_tokens": 5, "temperature": 0}
    extra = {"kv_policy": "h2o", "kv_budget": 24, "ignore_eos": True}
    plain = api.chat.completions.create(**ask, extra_body=extra)
    assert "kv_inspect" not in (plain.model_extra or {})
    reply = api.chat.completions.create(**ask, extra_body={**extra, "kv_inspect": True})
    got = reply.model_extra["kv_inspect"]
    assert reply.choices[0].message.content == plain.choices[0].message.content
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    assert got["prompt_tokens"] == reply.usage.prompt_tokens == len(ids) and got["seen_tokens"] == len(ids) + 4
    cache = KVCache(policies.build("h2o", 24), prompt_len=len(ids))
    logits = prefill(model, cache, torch.tensor([ids]), chunk=32)  # the server's prefill_chunk
    greedy_continue(model, cache, logits, len(ids), 5)
    assert got == cache.kept_map().summary(len(ids))
    assert got["kept_tokens"] == 24 and len(got["position_kept_fraction"]) == len(ids) and got["layers"] == 2
    streamed = httpx.post(f"{server[1]}/v1/chat/completions", json={**ask, **extra, "kv_inspect": True,
                                                                      "stream": True}, timeout=60)  # fmt: skip
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "kv_inspect"
