"""Fixtures: tiny randomly initialised models, one per supported architecture (no downloads)."""

from __future__ import annotations

import copy
import os

# Triton reads this when it is first imported: without a GPU its kernels run interpreted on CPU tensors
# (tests/backends/test_triton.py). Only h2o-kv's Triton kernels are affected (torch.compile on a CPU emits C++).
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Under pytest-xdist the workers share the cores: each worker (and each process a test starts) gets its share of
# OpenMP threads, since two busy processes each running a thread per core slow each other many times over.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT") and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers as tf  # noqa: E402
from hypothesis import settings  # noqa: E402

import h2o_kv  # noqa: E402

# Hypothesis draws the same examples on every run (`make test`, CI: a test that passes once passes again) and keeps
# no database of failures across runs; `HYPOTHESIS_PROFILE=explore make test` draws new ones each run, to hunt.
settings.register_profile("fixed", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fixed"))

VOCAB = 128
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
# fmt: off
OPT = dict(COMMON, ffn_dim=128, word_embed_proj_dim=64, max_position_embeddings=2048)
GEMMA3 = dict(COMMON, intermediate_size=128, num_hidden_layers=3, num_key_value_heads=1, head_dim=16, sliding_window=6,
              max_position_embeddings=2048, layer_types=["sliding_attention", "sliding_attention", "full_attention"])
# fmt: on


def _llama_like(config_cls, model_cls, **extra):
    cfg = config_cls(**COMMON, intermediate_size=128, num_key_value_heads=2, max_position_embeddings=2048, **extra)
    return model_cls(cfg)


TINY_MODELS = {
    "llama": lambda: _llama_like(tf.LlamaConfig, tf.LlamaForCausalLM),
    "mistral": lambda: _llama_like(tf.MistralConfig, tf.MistralForCausalLM, sliding_window=None),
    "qwen2": lambda: _llama_like(tf.Qwen2Config, tf.Qwen2ForCausalLM),
    "qwen3": lambda: _llama_like(tf.Qwen3Config, tf.Qwen3ForCausalLM, head_dim=16),
    "opt": lambda: tf.OPTForCausalLM(tf.OPTConfig(**OPT)),
    "gpt_neox": lambda: tf.GPTNeoXForCausalLM(
        tf.GPTNeoXConfig(**COMMON, intermediate_size=128, max_position_embeddings=2048, rotary_pct=0.25)
    ),
    "gemma3": lambda: tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**GEMMA3)),
}


def make_model(arch: str, seed: int = 0, enable: bool = True) -> torch.nn.Module:
    """A tiny model with float32 random weights; `enable` switches it to h2o-kv attention."""
    torch.manual_seed(seed)
    model = TINY_MODELS[arch]().eval()
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    model.generation_config.pad_token_id = 0
    return h2o_kv.enable(model) if enable else model


def biased_llama(layers: int = 2) -> torch.nn.Module:
    """A tiny Llama with biases on every product (attention_bias, mlp_bias), h2o-kv attention enabled."""
    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, attention_bias=True, mlp_bias=True,
    )  # fmt: skip
    return h2o_kv.enable(tf.LlamaForCausalLM(config).eval())


@pytest.fixture(params=sorted(TINY_MODELS))
def arch(request) -> str:
    return request.param


@pytest.fixture
def llama() -> torch.nn.Module:
    return make_model("llama")


def make_tokenizer():
    """A character-level fast tokenizer with one id per model token (VOCAB) and a chat template: no downloads."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = [chr(c) for c in range(32, 127)] + ["\n"] + [chr(c) for c in range(192, 192 + VOCAB - 99)]
    vocab = {"<unk>": 0, "<eos>": 1, "<pad>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = tf.PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    return tokenizer


@pytest.fixture
def tiny_tokenizer():
    return make_tokenizer()


def random_ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=gen)


@pytest.fixture(scope="module")
def tokenizer():
    """The bundled model's tokenizer, padding on the left (skips where `make setup` has not run)."""
    from serve_helpers import bundled_tokenizer

    return bundled_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    """A tiny random Llama with the bundled tokenizer's vocabulary (serve_helpers.tiny_model)."""
    from serve_helpers import tiny_model

    return tiny_model(tokenizer)


@pytest.fixture(scope="session")
def _bench_once() -> tuple[torch.nn.Module, list[dict]]:
    from bench_helpers import tiny_run

    return tiny_run()


@pytest.fixture
def bench_run(_bench_once) -> tuple[torch.nn.Module, list[dict]]:
    """The bench on a tiny random Llama (bench_helpers.tiny_run), run once per process: its model and a copy of its
    rows for each test. The bench's test files are one xdist group, so `make test` runs it once."""
    model, rows = _bench_once
    return model, copy.deepcopy(rows)
