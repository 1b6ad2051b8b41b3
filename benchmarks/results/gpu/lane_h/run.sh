#!/usr/bin/env bash
# GPU lane H (written in session 8, 2026-12-01, for the next lease; NOT YET RUN): on `nvidia-h200-x2`,
# the whole engine suite and the notebooks in one command (half A on GPU 0, half B and the notebooks
# on GPU 1), the tensor-parallel tests on both GPUs, and issue 9's benchmark with every case.
#   bash run.sh suite   halves A and B of lane G side by side, one per GPU, and the six notebooks on GPU 1
#                       (beside half B, the shorter: 190 s in lane G against A's 560+)
#   bash run.sh tp      STAGES="tp_vllm tp_isolated" TP=2: test_vllm, test_edits, test_stream and the
#                       isolated TP test at tensor-parallel size 2 (both GPUs)
#   bash run.sh bench   benchmarks/capture_gpu.py, every case: the Llama-1B shape (64 x 128) on GPU 0 beside
#                       the GPT-2-small shape (64 x 32) and then 1,024 x 128 streamed to disk on GPU 1
#                       (the cases of one shape run one after another, each alone on its GPU)
# Run from the repository root after `source /root/nnvllm-gpu.env && export PYTHONPATH=$PWD:$PYTHONPATH`
# (vllm-lens for the bench: `bash ../shared/gpu/bundle.sh .gpu vllm-lens==1.2.1` when staging).
set -u
R="${OUT:-benchmarks/results/gpu/lane_h}"
mkdir -p "$R"
export NNVLLM_NO_SETUP=1
A="tests/test_isolated_lifecycle.py tests/test_isolated.py tests/test_docs.py tests/test_families.py
   tests/test_widgets.py tests/test_stream.py tests/test_interrupt.py tests/test_analyses_llama.py tests/test_browser.py
   tests/test_capture.py tests/test_compat.py tests/test_packaging.py tests/test_pure.py"
B="tests/test_engines_list.py tests/test_bad_input.py tests/test_edits.py tests/test_engine.py tests/test_analyses.py
   tests/test_bad_input_more.py tests/test_capture_scheduling.py tests/test_gpu_exact.py tests/test_gpu_graphs.py
   tests/test_results_io.py tests/test_store.py tests/test_vllm.py"
suite_env() {  # test engines: a fixed 1 GiB KV cache each, so many share a GPU
  export NNVLLM_GPU_MEMORY_UTILIZATION=0.1 NNVLLM_KV_CACHE_MEMORY_BYTES=1073741824
}
start=$(date +%s)
case "${1:-suite}" in
  suite)
    suite_env
    ( CUDA_VISIBLE_DEVICES=0 OUT="$R/engine_a" STAGES=engine STAGE_TIMEOUT="${ENGINE_TIMEOUT:-560}" TESTS="$(echo $A)" \
        PYTEST_ARGS="--durations=40 -o faulthandler_timeout=500" bash scripts/test_gpu.sh > /dev/null 2>&1 ) &
    ( CUDA_VISIBLE_DEVICES=1 OUT="$R/engine_b" STAGES=engine STAGE_TIMEOUT="${ENGINE_TIMEOUT:-560}" TESTS="$(echo $B)" \
        PYTEST_ARGS="--durations=40 -o faulthandler_timeout=500" bash scripts/test_gpu.sh > /dev/null 2>&1 ) &
    ( CUDA_VISIBLE_DEVICES=1 OUT="$R/notebooks" STAGES=notebooks STAGE_TIMEOUT="${NB_TIMEOUT:-560}" \
        PYTEST_ARGS="--durations=10" bash scripts/test_gpu.sh > /dev/null 2>&1 ) &
    wait ;;
  tp)
    suite_env
    ( OUT="$R/tp" STAGES="tp_vllm tp_isolated" TP=2 STAGE_TIMEOUT="${TP_TIMEOUT:-280}" \
        PYTEST_ARGS="--durations=20" bash scripts/test_gpu.sh > /dev/null 2>&1 ) ;;
  bench)
    export VLLM_PLUGINS=""
    ( CUDA_VISIBLE_DEVICES=0 timeout -k 5 "${BENCH_TIMEOUT:-570}" python3 benchmarks/capture_gpu.py --shape llama1b \
        --prompts 64 --tokens 128 --timeout 150 --root /tmp/b0 --out "$R/llama1b.json" \
        --cases "${LLAMA_CASES:-bare_graphs,bare_eager,nv_graphs,nv_eager,nv_isolated,nv_isolated_eager,vllm_lens,hf_nnsight,nnsight_taps}" \
        > "$R/llama1b.log" 2>&1 ) &
    ( CUDA_VISIBLE_DEVICES=1 timeout -k 5 "${BENCH_TIMEOUT:-570}" bash -c "
        python3 benchmarks/capture_gpu.py --shape gpt2s --prompts 64 --tokens 32 --timeout 120 --root /tmp/b1 \
          --cases bare_graphs,bare_eager,nv_graphs,nv_eager,nv_isolated,nv_isolated_eager,hf_nnsight,nnsight_taps \
          --out $R/gpt2s.json > $R/gpt2s.log 2>&1
        python3 benchmarks/capture_gpu.py --shape llama1b --big 1024 --tokens 128 --timeout 200 --root /tmp/b1 \
          --budget 8GB --out $R/big.json > $R/big.log 2>&1" ) &
    wait ;;
esac
echo "wall $(( $(date +%s) - start )) s for '${1:-suite}'" > "$R/wall_${1:-suite}.txt"
