#!/usr/bin/env bash
# Session 56's device calls, from the repository root:
#   bash benchmarks/results/gpu-s56/run.sh vllm   after carrying the vLLM 0.23 bundle (as gpu-s55/run.sh's header
#       says: six parts of 32 MiB, carried as p1 .. p6, the last call running this case): vLLM's full CUDA graphs
#       against piecewise ones for the dense model, also with deferred flushes, the stricter mode check of session
#       55 and session 56's check that full graphs replayed (test_full_cuda_graphs_match_piecewise_ones[tiny_llama]);
#       then the compile backend's GPU tests, with session 56's buffer checks (assert_served) (up to 7.5 min).
#   bash benchmarks/results/gpu-s56/run.sh side   flush_overlap.py with each step's own graph replayed (--graphs
#       a-step), 16 layers, B8/8K and B32/8K: the deferral as it is (deferred, deferred-none, staged-none) against a
#       graph of its own replayed on a side stream beside the next step's (side-tiny, side-wide, side-flush; the probe
#       of session 53's next step for the every-step cost), after the compile backend's GPU tests (session 56's
#       buffer checks; where no vLLM bundle can be carried) (up to 7.5 min).
# On an H200, the tables are session 55's case: bash benchmarks/results/gpu-s55/run.sh tables.
# Results are packed into $OUT/results.tgz after each step.
source benchmarks/device_steps.sh
start_call "$0" "$1"  # sets repo and here
packed_results "$1"
case $1 in
vllm)
    export VLLM_WORKER_MULTIPROC_METHOD=spawn
    source benchmarks/device_vllm_env.sh
    timeout 300 python3 -m pytest -q -rs -p no:cacheprovider tests/test_vllm_plugin.py \
        -k "full_cuda_graphs and tiny_llama" > "$OUT/tests-vllm.txt" 2>&1
    tail -n 5 "$OUT/tests-vllm.txt" && pack
    gpu_tests "$repo" 150 tests/test_backend.py && pack
    ;;
side)
    (source benchmarks/device_vllm_env.sh && gpu_tests "$repo" 150 tests/test_backend.py) && pack
    bench_script flush_overlap.py 300 side "$repo" --graphs a-step --layers 16 --rounds 3 --shapes 8x8192,32x8192 \
        --costs deferred deferred-none staged-none side-tiny side-wide side-flush && pack
    ;;
*) unknown_case "$1" ;;
esac
end_call "$1"
