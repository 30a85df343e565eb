#!/bin/bash
# One device run: the AMX CPU (2 cores pinned), engine alone, this code against the code before the burst-in-chunks
# rule (alternated), W1 first-token times; then the GPU path (engine bench, model tier on the GPU).
T0=$(date +%s); L=$OUT/all.log
log() { echo "== $(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s $*" | tee -a $L; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD LLM_SERVE_CACHE=/tmp/cache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -c "import transformers, llguidance, app.engine, app.api" || exit 1
sed -i 's/^_CUDA_FREE_FRACTION = 0.8/_CUDA_FREE_FRACTION = 0.03/' app/engine/runner.py
mkdir -p /tmp/cache/smollm2-135m-instruct && cp .dev/smollm2/* /tmp/cache/smollm2-135m-instruct/
log setup; { nvidia-smi -L; lscpu | grep -E "Model name|^CPU family|^Model:"; lscpu | grep -o 'amx_tile\|avx512_bf16\|avx2' | sort -u | tr '\n' ' '; echo; python3 -c "import torch,transformers;print(torch.__version__,transformers.__version__)"; } 2>&1 | tee -a $L
python3 .dev/random_smollm.py /tmp/cache/smollm2-135m-instruct 2>&1 | tail -1 | tee -a $L
( python3 -c "from app.cpu.build import build_library; print(build_library())" 2>&1 | tail -1 ) | tee -a $L
timeout 60 python3 -m app.bench shape --shape llama-371m 2>&1 | tail -1 | tee -a $L
mkdir -p /tmp/runs; pack() { tar czf $OUT/runs.tgz -C /tmp runs 2>/dev/null; }
PIN="env CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=2 taskset -c 0,1"
eng() { # $1 label, $2 code dir, rest: args
  local lab=$1 dir=$2; shift 2
  ( cd $dir && PYTHONPATH=/tmp/site:$PWD timeout 90 $PIN python3 -m app.bench engine --modes continuous --out /tmp/runs/$lab.json "$@" > /tmp/runs/$lab.log 2>&1 )
  python3 -c "import json,sys;d=json.load(open(sys.argv[1]))['modes']['continuous'];print(sys.argv[2],d['W1_output_tok_per_s'],d['W1_ttft_p50_s'],d['W1_ttft_max_s'],d['W1_mean_step_ms'],d['single_stream_tok_per_s'],d['long_prompt_ttft_s'])" /tmp/runs/$lab.json $lab 2>&1 | tee -a $L; pack
}
M371="--model-source /tmp/cache/bench-llama-371m-seed0"
log "engine alone, AMX: label W1tok/s W1ttft_p50 W1ttft_max W1step_ms one_stream long_ttft"
eng new1 $PWD; eng old1 $PWD/.dev/old; eng old2 $PWD/.dev/old; eng new2 $PWD
eng new371 $PWD $M371; eng old371 $PWD/.dev/old $M371
cp /tmp/cache/kernel-choices.json /tmp/runs/ 2>/dev/null
log gpu engine
( timeout 80 python3 -m app.bench engine --modes continuous --device cuda --dtype bfloat16 --out /tmp/runs/gpu-new.json > /tmp/runs/gpu-new.log 2>&1 )
python3 -c "import json,sys;d=json.load(open(sys.argv[1]))['modes']['continuous'];print('gpu-new',d)" /tmp/runs/gpu-new.json 2>&1 | tail -1 | tee -a $L; pack
LEFT=$(( 500 - ($(date +%s) - T0) )); log "gpu model tier, ${LEFT}s left"
LLM_SERVE_TEST_DEVICE=cuda timeout $LEFT python3 -m pytest tests/model --ignore=tests/model/test_quantized_models.py -q -rfE -p no:cacheprovider --timeout 40 > $OUT/gpu-tests.log 2>&1; log "rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/gpu-tests.log | tail -12 | tee -a $L
log done
