#!/usr/bin/env bash
# Session 48's own device calls, from the repository root (its first two ran earlier sessions' scripts: README.md):
#   bash benchmarks/results/gpu-s48/run.sh group   one FLUSH launch for GROUP (4) deferring layers' calls
#       (deferred_flush.GROUP) instead of one a layer: the GPU kernel, op and latent tests (the deferral's op test with
#       groups of 1 and 4), then flush_overlap.py with 8 layers (two groups a step) and 4: inline, deferred,
#       deferred-none, deferred-g1 and deferred-none-g1 (GROUP 1: the package before), staged-none, at B8/8K, B32/8K,
#       B128/2K, 2 rounds; a timeline of deferred-none and deferred-none-g1 at B8/8K (~6 min).
#   bash benchmarks/results/gpu-s48/run.sh vllm-group   after carrying the vLLM 0.23 bundle (five parts: gpu-s47/run.sh
#       says how), the dense model's full CUDA graphs with KVARN_DEFER_FLUSH=1 against piecewise ones
#       (test_full_cuda_graphs_match_piecewise_ones[tiny_llama]; ~3 min); then session 47's staggered workload
#       (Qwen3-8B shape, 256 requests, 1,024 output tokens) with KVARN_DEFER_FLUSH=0 then 1, an engine each (~5 min).
#   bash benchmarks/results/gpu-s48/run.sh verify   PREPARED, NOT RUN (no device time left): the review's fixes
#       (6eb6803: the flush stream waits for each STAGE when the call is staged; the capture checks) on a GPU: the
#       kernel, op and latent tests, then flush_overlap.py with 8 layers, deferred and deferred-none against GROUP 1,
#       B8/8K and B32/8K (expected: as h100-group/, the extra waits being graph edges) (~4 min). Then repeat
#       `vllm-group` (after the bundle) for a second pair of staggered runs on another machine.
# Results are packed into $OUT/results.tgz after each step.
source benchmarks/device_steps.sh
start_call "$0" "$1"  # sets repo and here
packed_results "$1"
case $1 in
group)
    gpu_tests "$repo" 200 && pack
    costs="inline deferred deferred-none deferred-g1 deferred-none-g1 staged-none"
    bench_script flush_overlap.py 170 layers8 "$repo" --layers 8 --costs $costs --rounds 2 \
        --shapes 8x8192,32x8192,128x2048 --timeline deferred-none deferred-none-g1 --timeline-shapes 8x8192 && pack
    bench_script flush_overlap.py 120 layers4 "$repo" --costs $costs --rounds 2 --shapes 8x8192,32x8192,128x2048 \
        && pack
    ;;
verify)
    gpu_tests "$repo" 200 && pack
    bench_script flush_overlap.py 120 layers8 "$repo" --layers 8 --costs deferred deferred-none deferred-g1 \
        deferred-none-g1 --rounds 2 --shapes 8x8192,32x8192 && pack
    ;;
vllm-group)
    export VLLM_WORKER_MULTIPROC_METHOD=spawn
    source benchmarks/device_vllm_env.sh
    timeout 480 python3 -m pytest -q -rs -p no:cacheprovider tests/test_vllm_plugin.py \
        -k "full_cuda_graphs and tiny_llama" > "$OUT/tests-vllm.txt" 2>&1
    tail -n 5 "$OUT/tests-vllm.txt" && pack
    for defer in 0 1; do
        (cd benchmarks && KVARN_DEFER_FLUSH=$defer timeout 200 python3 vllm_burst.py --out "$OUT/burst/defer$defer" \
            --dtypes kvarn_k4v2_g128 --output-len 1024 --max-num-seqs 256 --workloads staggered) \
            > "$OUT/burst-defer$defer.log" 2>&1
        grep "^| kvarn" "$OUT/burst/defer$defer/results.md"; pack
    done
    ;;
esac
date -u >> "$OUT/env-$1.txt"
pack
