#!/usr/bin/env bash
# Session 49's device calls, from the repository root:
#   bash benchmarks/results/gpu-s49/run.sh verify   session 48's review fixes on a GPU (the flush stream waits for each
#       STAGE when a call is staged; the capture checks), then how many layers a FLUSH launch should serve:
#       flush_overlap.py with 16 layers, the package (GROUP 4) beside GROUP 1, 8 and 16 (deferred and deferred-none
#       each), in line and staged-none, at B8/8K, B32/8K, B128/2K; then 36 layers (Qwen3-8B's count) at B8/8K and
#       B32/8K, GROUP 4, 8 and 16 (~6 min).
#   bash benchmarks/results/gpu-s49/run.sh vllm   after carrying the vLLM 0.23 bundle (five parts: gpu-s47/run.sh
#       says how), session 48's `vllm-group` again on another machine: the full-graph test with deferred flushes,
#       then the staggered workload (Qwen3-8B shape, 256 requests, 1,024 output tokens) in line and deferred (~8 min).
# Results are packed into $OUT/results.tgz after each step.
[ "$1" = vllm ] && exec bash benchmarks/results/gpu-s48/run.sh vllm-group
source benchmarks/device_steps.sh
start_call "$0" "$1"  # sets repo and here
packed_results "$1"
case $1 in
verify)
    gpu_tests "$repo" 220 && pack
    bench_script flush_overlap.py 240 layers16 "$repo" --layers 16 --rounds 2 --shapes 8x8192,32x8192,128x2048 \
        --costs inline deferred deferred-none deferred-g1 deferred-none-g1 deferred-g8 deferred-none-g8 \
        deferred-g16 deferred-none-g16 staged-none && pack
    bench_script flush_overlap.py 200 layers36 "$repo" --layers 36 --rounds 2 --shapes 8x8192,32x8192 \
        --costs inline deferred deferred-none deferred-g8 deferred-none-g8 deferred-g16 deferred-none-g16 && pack
    ;;
esac
date -u >> "$OUT/env-$1.txt"
pack
