#!/usr/bin/env bash
# Session 56's device calls, from the repository root:
#   bash benchmarks/results/gpu-s56/run.sh side   flush_overlap.py with each step's own graph replayed (--graphs
#       a-step), 16 layers, B8/8K and B32/8K: the deferral as it is (deferred, deferred-none, staged-none) against a
#       graph of its own replayed on a side stream beside the next step's (side-tiny, side-wide, side-flush; the probe
#       of session 53's next step for the every-step cost), after the compile backend's GPU tests (session 56's
#       buffer checks; where no vLLM bundle can be carried) (up to 7.5 min).
#   bash benchmarks/results/gpu-s56/run.sh design   the same with the op's own FLUSH launches in the side graph
#       (side-deferred, side-deferred-none), after side's first results (up to 4 min).
#   bash benchmarks/results/gpu-s56/run.sh b32   which of design's side graphs stops B32/8K: side-deferred-none, then
#       side-deferred, each alone, one round (up to 2.5 min).
# Session 55's cases serve as they are: on an H200 `bash benchmarks/results/gpu-s55/run.sh tables`; after carrying
# the vLLM 0.23 bundle (its header says how) `bash benchmarks/results/gpu-s55/run.sh vllm`, whose full-vs-piecewise
# test since session 56 also checks that the full graphs were replayed, and whose backend tests check buffers.
# Results are packed into $OUT/results.tgz after each step.
source benchmarks/device_steps.sh
start_call "$0" "$1"  # sets repo and here
packed_results "$1"
case $1 in
side)
    (source benchmarks/device_vllm_env.sh && gpu_tests "$repo" 150 tests/test_backend.py) && pack
    bench_script flush_overlap.py 300 side "$repo" --graphs a-step --layers 16 --rounds 3 --shapes 8x8192,32x8192 \
        --costs deferred deferred-none staged-none side-tiny side-wide side-flush && pack
    ;;
design)
    bench_script flush_overlap.py 230 design "$repo" --graphs a-step --layers 16 --rounds 3 --shapes 8x8192,32x8192 \
        --costs deferred deferred-none side-tiny side-deferred side-deferred-none && pack
    ;;
b32)
    for cost in side-deferred-none side-deferred; do
        bench_script flush_overlap.py 75 "$cost" "$repo" --graphs a-step --layers 16 --rounds 1 --shapes 32x8192 \
            --costs "$cost" && pack
    done
    ;;
*) unknown_case "$1" ;;
esac
end_call "$1"
