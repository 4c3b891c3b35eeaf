#!/usr/bin/env bash
# Session 47's device calls, from the repository root:
#   bash benchmarks/results/gpu-s47/run.sh verify   session 46's final form on a GPU (the snapshot, the capture-
#       boundary check, the strengthened deferral tests): the GPU kernel, op and latent tests; then flush_overlap.py's
#       probe of what the deferral costs a step where no tile completes: the deferral's variants (LAG 3, a flush stream
#       of high priority, the staging alone) beside none / inline / deferred at B8/8K, B32/8K, B128/2K (2 rounds),
#       and the kernels of one replay of none, staged-none, deferred-none, deferred and inline at B8/8K and B32/8K
#       (~9 min).
#   The deferral in vLLM: session 46's prepared cases (benchmarks/results/gpu-s46/run.sh vllm-defer-tests and
#   vllm-defer-burst), after carrying the vLLM 0.23 bundle.
# Each case ran at the commit benchmarks/NOTES.md (session 47) names. Results are packed into $OUT/results.tgz after
# each step.
source benchmarks/device_steps.sh
start_call "$0" "$1"  # sets repo and here
packed_results "$1"
case $1 in
verify)
    gpu_tests "$repo" 240 && pack
    bench_script flush_overlap.py 320 probe "$repo" --costs inline deferred deferred-none deferred-lag3 \
        deferred-none-lag3 deferred-hi deferred-none-hi staged-none --rounds 2 --shapes 8x8192,32x8192,128x2048 \
        --timeline none staged-none deferred-none deferred inline --timeline-shapes 8x8192,32x8192 && pack
    ;;
esac
date -u >> "$OUT/env-$1.txt"
pack
