#!/usr/bin/env bash
# Session 57's device calls, from the repository root:
#   bash benchmarks/results/gpu-s57/run.sh vllm   after carrying the vLLM 0.23 bundle (gpu-s55/run.sh's header says
#       how): vLLM's full CUDA graphs against piecewise ones for the dense model (since session 56 also checking that
#       the full graphs were replayed), then the compile backend's GPU tests (since session 57 one graph over two
#       layers' buffers in Inductor's CUDA graphs) (up to 7.5 min).
#   bash benchmarks/results/gpu-s57/run.sh flush   flush_overlap.py with each step's own graph (--graphs a-step), 16
#       layers, B8/8K and B32/8K, 4 rounds: the deferral as it is (deferred, deferred-none) against the op's FLUSH in a
#       graph of its own on a side stream (side-deferred, side-deferred-none), the figures session 56 left unsettled
#       (up to 5.5 min).
#   bash benchmarks/results/gpu-s57/run.sh h200   on an H200: the op, backend and latent GPU tests at this session's
#       last code (the ops' new checks, the backend's re-analysis), then the README's decode table, cold, and the rows
#       held in fitted page tables, cold (session 55's `tables` less its 32K-wide tables) (up to 9 min).
#   bash benchmarks/results/gpu-s57/run.sh tests   where no H200 is lent: h200's first step alone (up to 3 min).
# Results are packed into $OUT/results.tgz after each step.
source benchmarks/device_steps.sh
start_call "$0" "$1"  # sets repo and here
packed_results "$1"
case $1 in
vllm)
    (
        export VLLM_WORKER_MULTIPROC_METHOD=spawn
        source benchmarks/device_vllm_env.sh
        timeout 300 python3 -m pytest -q -rs -p no:cacheprovider tests/test_vllm_plugin.py \
            -k "full_cuda_graphs and tiny_llama" > "$OUT/tests-vllm.txt" 2>&1
        tail -n 5 "$OUT/tests-vllm.txt"
    ) && pack
    (source benchmarks/device_vllm_env.sh && gpu_tests "$repo" 150 tests/test_backend.py) && pack
    ;;
flush)
    bench_script flush_overlap.py 320 side "$repo" --graphs a-step --layers 16 --rounds 4 --shapes 8x8192,32x8192 \
        --costs deferred deferred-none side-deferred side-deferred-none && pack
    ;;
h200 | tests)
    (source benchmarks/device_vllm_env.sh && gpu_tests "$repo" 170 tests/test_ops.py tests/test_backend.py \
        tests/test_latent.py) && pack
    [ "$1" = tests ] && { end_call "$1"; exit 0; }
    readme_table 220 && (cd "$OUT" && tar czf table.tgz table && rm -rf table) && pack
    time_op rows-fitted "$repo" 110 --shapes 1x2048,1x2112,1x2173,2x2112,8x8317 && pack
    ;;
*) unknown_case "$1" ;;
esac
end_call "$1"
