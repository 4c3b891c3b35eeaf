#!/usr/bin/env bash
# Session 47's device calls, from the repository root:
#   bash benchmarks/results/gpu-s47/run.sh verify   session 46's final form and the conditional flush on a GPU: the
#       GPU kernel, op and latent tests (the deferral's op test, replayed in a CUDA graph, now runs its flushes in
#       conditional nodes); then flush_overlap.py of the package (a CUDA graph's FLUSH launch in a conditional node
#       that runs only where STAGE found a tile): inline, deferred, deferred-none, staged-none (the staging alone),
#       deferred-hi / deferred-none-hi (a flush stream of high priority) at B8/8K, B32/8K, B128/2K, 2 rounds, and the
#       kernels of one replay of none, deferred-none, deferred at B8/8K and B32/8K; then of the package without the
#       conditional node (undo-cond.patch: session 46's form): deferred, deferred-none (~6 min).
#   The deferral in vLLM: session 46's prepared cases (benchmarks/results/gpu-s46/run.sh vllm-defer-tests and
#   vllm-defer-burst), after carrying the vLLM 0.23 bundle.
# Each case ran at the commit benchmarks/NOTES.md (session 47) names. Results are packed into $OUT/results.tgz after
# each step.
source benchmarks/device_steps.sh
start_call "$0" "$1"  # sets repo and here
packed_results "$1"
case $1 in
verify)
    gpu_tests "$repo" 220 && pack
    bench_script flush_overlap.py 220 conditional "$repo" --costs inline deferred deferred-none staged-none \
        deferred-hi deferred-none-hi --rounds 2 --shapes 8x8192,32x8192,128x2048 \
        --timeline none deferred-none deferred --timeline-shapes 8x8192,32x8192 && pack
    bash benchmarks/patched_repo.sh /tmp/before "$here/undo-cond.patch" || exit 1
    bench_script flush_overlap.py 130 unconditional /tmp/before --costs deferred deferred-none --rounds 2 \
        --shapes 8x8192,32x8192,128x2048 && pack
    ;;
esac
date -u >> "$OUT/env-$1.txt"
pack
