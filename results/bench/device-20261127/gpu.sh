#!/bin/bash
# One device run: the GPU path (model tier, engine bench), then the AMX CPU pinned to 2 cores (engine bench).
L=$OUT/all.log
log() { echo "== $(date -u +%H:%M:%S) $*" | tee -a $L; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD LLM_SERVE_CACHE=/tmp/cache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
sed -i 's/^_CUDA_FREE_FRACTION = 0.8/_CUDA_FREE_FRACTION = 0.03/' app/engine/runner.py
mkdir -p /tmp/cache/smollm2-135m-instruct && cp .dev/smollm2/* /tmp/cache/smollm2-135m-instruct/
log setup; { nvidia-smi -L; lscpu | grep -o 'amx_tile\|avx512_bf16\|avx2' | sort -u | tr '\n' ' '; echo; python3 -c "import torch,transformers;print(torch.__version__,transformers.__version__)"; gcc --version | head -1; } 2>&1 | tee -a $L
python3 .dev/random_smollm.py /tmp/cache/smollm2-135m-instruct 2>&1 | tail -2 | tee -a $L
( python3 -c "from app.cpu.build import build_library; print(build_library())" 2>&1 | tail -2 ) | tee -a $L
( timeout 60 python3 -m app.bench shape --shape llama-371m 2>&1 | tail -1 ) | tee -a $L &
log gpu engine bench
timeout 90 python3 -m app.bench engine --modes continuous --device cuda --dtype bfloat16 --out $OUT/gpu-engine.json 2>&1 | grep -E "tok/s|W1|single|long|Error|error" | tail -8 | tee -a $L
wait
log gpu model tier
timeout 180 python3 -m pytest tests/model -q -rfE -p no:cacheprovider --timeout 60 > $OUT/gpu-tests.log 2>&1; log "model tier rc=$?"; tail -3 $OUT/gpu-tests.log | tee -a $L
PIN="env CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=2 taskset -c 0,1"
log amx on; timeout 75 $PIN python3 -m app.bench engine --modes continuous --out $OUT/amx-on.json 2>&1 | grep -iE "linear:|attention:|chose|decision" | head -8 | tee -a $L
log amx off; ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 timeout 75 $PIN python3 -m app.bench engine --modes continuous --out $OUT/amx-off.json 2>&1 | tail -1 | tee -a $L
log 371m amx on; timeout 90 $PIN python3 -m app.bench engine --modes continuous --model-source /tmp/cache/bench-llama-371m-seed0 --out $OUT/amx-371m.json 2>&1 | tail -1 | tee -a $L
cp /tmp/cache/kernel-choices.json $OUT/ 2>/dev/null
for f in $OUT/*.json; do python3 -c "import json,sys;d=json.load(open(sys.argv[1]));print(sys.argv[1].split('/')[-1],d.get('modes'))" $f 2>/dev/null; done | tee -a $L
log done
