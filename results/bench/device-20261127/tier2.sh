python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD LLM_SERVE_CACHE=/tmp/cache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
sed -i 's/^_CUDA_FREE_FRACTION = 0.8/_CUDA_FREE_FRACTION = 0.03/' app/engine/runner.py
mkdir -p /tmp/cache/smollm2-135m-instruct && cp .dev/smollm2/* /tmp/cache/smollm2-135m-instruct/
python3 .dev/random_smollm.py /tmp/cache/smollm2-135m-instruct 2>&1 | tail -1
date -u +%T
timeout 40 python3 -m pytest tests/model/test_bf16_products.py::test_auto_and_bfloat16_load_the_bf16_kernel_path -q -p no:cacheprovider 2>&1 | tail -2
date -u +%T
LLM_SERVE_TEST_DEVICE=cuda timeout 170 python3 -m pytest tests/model --ignore=tests/model/test_quantized_models.py --deselect tests/model/test_greedy_parity.py::test_chat_answers_capital_question -q -rfEs -p no:cacheprovider --timeout 40 > $OUT/gpu-tests.log 2>&1; echo rc=$?; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/gpu-tests.log | tail -20; grep -c "^SKIPPED" $OUT/gpu-tests.log
