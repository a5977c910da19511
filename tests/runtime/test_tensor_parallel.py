"""Tensor parallel across processes: two CPU processes (torchrun, gloo) against one.

Eviction is per KV head and transformers' tp_plan="auto" splits attention by heads, so each process
must keep exactly the single-process run's tokens for its own KV heads, hold half the KV bytes, and
generate the same tokens.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers as tf
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from tp_worker import run, run_cli

from h2o_kv.runtime.distributed import check_tp
from h2o_kv.runtime.models import load_model
from h2o_kv.runtime.ports import free_port

PROCESSES = 2
TIMEOUT_S = 180  # per torchrun launch; a healthy one takes ~15 s on a busy 2-core machine
WORKER = Path(__file__).with_name("tp_worker.py")
CHARS = [chr(c) for c in range(32, 127)]  # printable ASCII, one token each


def _tokenizer() -> tf.PreTrainedTokenizerFast:
    vocab = {"<eos>": 0, "<unk>": 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return tf.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")


def save_tiny_llama(path: Path, heads: int = 4, kv_heads: int = 2, weights: bool = True) -> Path:
    """A tiny random Llama (float32) with a character tokenizer, saved as a local model directory."""
    tokenizer = _tokenizer()
    config = tf.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=16, max_position_embeddings=512,
        bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    if not weights:  # only the config: loading any weight from here would fail
        config.save_pretrained(path)
        return path
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def torchrun(*args: str) -> subprocess.CompletedProcess:
    """Run `args` under `torchrun --nproc-per-node 2` on this machine's loopback only; fail with its stderr."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", PYTHONIOENCODING="utf-8")
    if Path("/sys/class/net/lo").exists():
        env["GLOO_SOCKET_IFNAME"] = "lo"
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(name, None)
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={PROCESSES}"]
    command += ["--master-addr=127.0.0.1", f"--master-port={free_port()}", *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, f"torchrun failed ({done.returncode}):\n{done.stderr[-4000:]}"
    return done


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


GENERATE = ["generate", "To be, or not to be", "--no-chat", "--heavy", "4", "--recent", "4", "--max-new-tokens", "16"]


def test_two_processes_generate_the_same_tokens_with_half_the_kv_each(model_dir, tmp_path, monkeypatch):
    for name in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    single = run(str(model_dir))
    single_cli = run_cli([*GENERATE, "--model", str(model_dir)])
    torchrun(str(WORKER), str(model_dir), str(tmp_path), *GENERATE, "--model", str(model_dir))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(PROCESSES)]

    assert single["kv_heads"] == 2
    for r, result in enumerate(ranks):
        assert result["kv_heads"] == 1, "each process holds one of the two KV heads"
        assert result["greedy"] == single["greedy"], f"rank {r} generated other tokens"
        assert result["nbytes"] * PROCESSES == single["nbytes"], f"rank {r} does not hold half the KV bytes"
        for layer, (mine, whole) in enumerate(zip(result["kept_positions"], single["kept_positions"])):
            for seq, (heads, all_heads) in enumerate(zip(mine, whole)):
                assert heads == [all_heads[r]], f"rank {r} kept other tokens (layer {layer}, sequence {seq})"
    assert len(single["kept_positions"][0][0][0]) == 12, "the budget must have evicted (6 heavy + 6 recent)"
    assert ranks[0]["seed"] == ranks[1]["seed"]
    assert ranks[0]["sampled"] == ranks[1]["sampled"], "sampling drew different tokens on the two processes"

    # `h2o-kv generate` under torchrun: rank 0 prints the single-process text and one stats line, rank 1 nothing
    main, other = ranks[0]["cli"], ranks[1]["cli"]
    assert single_cli["code"] == main["code"] == other["code"] == 0
    assert main["stdout"].strip() == single_cli["stdout"].strip() != ""
    assert other["stdout"] == other["stderr"] == ""
    assert "per process" in main["stderr"] and "per process" not in single_cli["stderr"]
    kv_mib = [float(re.search(r"KV cache ([0-9.]+) MiB", cli["stderr"])[1]) for cli in (main, single_cli)]
    assert kv_mib[0] == pytest.approx(kv_mib[1] / PROCESSES, abs=0.05)


def test_heads_that_do_not_divide_are_refused_before_loading(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"KV heads \(1\).*divide by 2"):
        check_tp(tf.LlamaConfig(num_attention_heads=4, num_key_value_heads=1), 2)
    with pytest.raises(ValueError, match=r"attention heads \(6\).*divide by 4"):
        check_tp(tf.LlamaConfig(hidden_size=96, num_attention_heads=6, num_key_value_heads=2), 4)
    with pytest.raises(ValueError, match="no tensor-parallel plan"):
        check_tp(tf.OPTConfig(num_attention_heads=4), 2)
    with pytest.raises(ValueError, match="processes must be a positive int"):
        check_tp(tf.LlamaConfig(), 0)
    check_tp(tf.LlamaConfig(num_attention_heads=4, num_key_value_heads=2), 2)  # fits: no error

    mqa = save_tiny_llama(tmp_path / "mqa", heads=4, kv_heads=1, weights=False)
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun would; refused before any process group starts
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match=r"KV heads \(1\).*--nproc-per-node in \[1\]"):
        load_model(str(mqa), tp_plan="auto")
    assert not torch.distributed.is_initialized()
    refused = run_cli(["generate", "hello", "--model", str(mqa), "--no-chat"])
    assert refused["code"] == 2 and refused["stderr"].startswith("h2o-kv: error: tensor parallel over 2 processes")
