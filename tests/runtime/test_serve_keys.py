"""`h2o-kv serve --api-key`: every route but /health needs `Authorization: Bearer KEY` with one of the keys; a
missing or wrong key gets a 401 with an OpenAI-shaped error, through the real `openai` client and raw HTTP."""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

import httpx  # noqa: E402

from h2o_kv.runtime.serve.main import api_keys  # noqa: E402

from serve_helpers import MODEL, client, running_server  # noqa: E402

KEYS = ("first-key-0123", "second-key-4567")


@pytest.fixture(scope="module")
def url(model, tokenizer):
    with running_server(model, tokenizer, api_keys=KEYS, max_batch=2) as (_, served):
        yield served


def _complete(api):
    return api.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)


def test_each_key_opens_the_api(url):
    for key in KEYS:
        api = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
        assert _complete(api).usage.completion_tokens == 2


def test_a_wrong_or_missing_key_gets_an_openai_shaped_401(url):
    wrong = openai.OpenAI(base_url=f"{url}/v1", api_key="first-key-0124", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as raised:
        _complete(wrong)
    assert raised.value.status_code == 401 and raised.value.code == "invalid_api_key"
    for headers in ({}, {"Authorization": "first-key-0123"}, {"Authorization": "Basic first-key-0123"}):
        for path in ("/v1/models", "/metrics"):
            reply = httpx.get(f"{url}{path}", headers=headers, timeout=30)
            assert reply.status_code == 401, (path, headers)
            assert reply.json()["error"]["code"] == "invalid_api_key"
            assert "first-key" not in reply.text  # a key never comes back


def test_health_needs_no_key(url):
    assert httpx.get(f"{url}/health", timeout=30).json()["status"] == "ok"


def test_no_keys_means_an_open_server(model, tokenizer):
    with running_server(model, tokenizer, max_batch=2) as (_, served):
        assert _complete(client(served)).usage.completion_tokens == 2


def test_keys_come_from_the_flag_and_the_environment(monkeypatch):
    monkeypatch.setenv("H2O_KV_API_KEY", "env-one,env-two")
    assert api_keys(argparse.Namespace(api_key=["flag"])) == ["flag", "env-one", "env-two"]
    monkeypatch.delenv("H2O_KV_API_KEY")
    assert api_keys(argparse.Namespace(api_key=None)) == []
    with pytest.raises(ValueError, match="non-empty"):
        api_keys(argparse.Namespace(api_key=[" padded"]))
