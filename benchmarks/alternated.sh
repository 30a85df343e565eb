#!/usr/bin/env bash
# Alternated runs: this project and each peer in turn (ours, vLLM, ours, vLLM, ...), a fresh server each time,
# BENCH_ROUNDS rounds, on the embedded model (W1 W2 W5) and on a larger seeded shape (W1 W2). Shared machines drift
# 15-40% within an hour: the report's medians over alternated runs are what a comparison between servers can rest on.
#
#   OUT=results/bench/run-.../alternated benchmarks/alternated.sh   # = make bench BENCH_ROUNDS=3 (or make bench-rounds)
#
# Settings (environment): OUT (the folder for the result files, required), BENCH_ROUNDS (3), ALTERNATED_PEERS
# (vllm; naive where vLLM cannot run; ours@REV: this project at git revision REV, served from a worktree of it and
# measured by this checkout's load generator, for an A/B of two versions), BENCH_SHAPE (llama-371m,
# app/bench/shapes.py; empty: the embedded model only, as a revision that cannot serve the shape needs),
# PYTHON (.venv/bin/python).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

OUT="${OUT:?OUT: the folder for the result files}"
BENCH_ROUNDS="${BENCH_ROUNDS:-3}"
ALTERNATED_PEERS="${ALTERNATED_PEERS:-vllm}"
BENCH_SHAPE="${BENCH_SHAPE-llama-371m}"
PYTHON="$(cd "$(dirname "${PYTHON:-.venv/bin/python}")" && pwd)/$(basename "${PYTHON:-.venv/bin/python}")"
OURS_PORT=8100
NAIVE_PORT=8001
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
# One sitting per folder: the report takes the medians of every result file in it, and a second sitting's rounds
# would mix with the first's (another hour, or another machine)
if compgen -G "$OUT/*.json" > /dev/null; then
    echo "$OUT already holds a sitting's results: give OUT (or BENCH_RUN) a new folder" >&2
    exit 1
fi

# A worktree of revision $1 (made once, outside this checkout), printed.
worktree() {
    local sha dir
    sha="$(git rev-parse --short "$1^{commit}")"
    dir="${TMPDIR:-/tmp}/llm-serve-at-$sha"
    [ -d "$dir" ] || git worktree add --detach "$dir" "$sha" >&2
    echo "$dir"
}

# One server measured once: ours | vllm | naive, on the embedded model or the shape ($2: its directory).
measure() {
    local server=$1 shape_dir=$2 round=$3 tag workloads model_args=()
    tag=$([ -n "$shape_dir" ] && echo "$BENCH_SHAPE" || echo "embedded")
    workloads=$([ -n "$shape_dir" ] && echo "W1 W2" || echo "W1 W2 W5")
    [ -n "$shape_dir" ] && model_args=(--model "$BENCH_SHAPE" --model-source "$shape_dir")
    local out="$OUT/$server-$tag-$round.json" log="$OUT/$server-$tag-$round.log"
    echo "round $round: $server on the $tag model -> $out"
    case "$server" in
        ours|ours@*)
            local code_args=()
            [ "$server" != ours ] && code_args=(--code "$(worktree "${server#ours@}")")
            "$PYTHON" -m app.bench peer --launch ours --name "$server" "${code_args[@]}" --port "$OURS_PORT" --no-progress \
                --workloads $workloads "${model_args[@]}" --out "$out" >"$log" 2>&1 ;;
        naive)
            "$PYTHON" -m app.bench peer --launch naive --name naive --port "$NAIVE_PORT" --no-progress \
                --workloads $workloads "${model_args[@]}" --out "$out" >"$log" 2>&1 ;;
        vllm)
            # vLLM serves the shape's directory under the shape's name; the load generator asks for that name.
            local served=smollm2-135m checkpoint=""
            [ -n "$shape_dir" ] && served="$BENCH_SHAPE" checkpoint="$shape_dir"
            VLLM_SERVED_NAME="$served" VLLM_CHECKPOINT="$checkpoint" PYTHON="$PYTHON" LOG_DIR="$OUT" \
                PEER_ARGS="--workloads $workloads --no-progress --out $out" \
                "$ROOT/benchmarks/vllm_cpu.sh" bench >"$log" 2>&1 ;;
        *) echo "unknown server $server: ours, ours@REV, vllm or naive" >&2; exit 2 ;;
    esac
    grep -E "W[0-9]:" "$log" || true
}

shape_dir=""
if [ -n "$BENCH_SHAPE" ]; then
    shape_dir="$("$PYTHON" -c "import sys; from app.bench.shapes import build_shape; print(build_shape(sys.argv[1]))" "$BENCH_SHAPE")"
fi
# Odd rounds run ours first, even rounds last (ABBA): the machine's drift within a round favours neither side.
for round in $(seq "$BENCH_ROUNDS"); do
    order="ours $ALTERNATED_PEERS"
    [ $((round % 2)) -eq 0 ] && order="$(printf '%s\n' $order | tac | xargs)"
    for model_dir in "" ${shape_dir:+"$shape_dir"}; do
        for server in $order; do
            measure "$server" "$model_dir" "$round"
        done
    done
done
