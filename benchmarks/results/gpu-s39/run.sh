#!/usr/bin/env bash
# Session 39's device calls, from the repository root:
#   bash benchmarks/results/gpu-s39/run.sh overlap   benchmarks/flush_overlap.py (a 4-layer Qwen3-8B-shaped decode
#       step with one sequence completing a tile: its flush in line, or on a side stream beside the next layers'
#       matmuls) with the timelines of beside-2 and norm-1w-2, into $OUT/overlap
#   bash benchmarks/results/gpu-s39/run.sh regs      the flush's SM-time: decode_step.py of this checkout and of copies
#       with regs128.patch (the append kernel at maxnreg 128: two programs an SM), warps4.patch (4 warps: two programs
#       an SM) and patience2.patch (the normalisation ends after 2 iterations in a row that do not lower a tile's
#       imbalance) (~6 min)
#   bash benchmarks/results/gpu-s39/run.sh regs-overlap   flush_overlap.py of this checkout, regs128 and patience2 (in
#       line, beside, beside-2), then patience2's GPU tests (~5 min)
# The two regs calls pack their results into $OUT/results.tgz after each step.
source benchmarks/device_steps.sh
start_call "$0" "$1"  # sets repo and here
if [ "$1" != overlap ]; then
    packed_results "$1"
    for copy in regs128 warps4 patience2; do
        bash benchmarks/patched_repo.sh /tmp/$copy "$here/$copy.patch" || exit 1
    done
fi
case $1 in
overlap)
    flush_overlap overlap "$repo" --timeline beside-2 norm-1w-2
    ;;
regs)
    for run in now regs128 warps4 patience2; do
        dir=/tmp/$run; [ "$run" = now ] && dir=$repo
        decode_step "$run" "$dir" && pack
    done
    ;;
regs-overlap)
    for run in now regs128 patience2; do
        dir=/tmp/$run; [ "$run" = now ] && dir=$repo
        flush_overlap "overlap-$run" "$dir" --costs inline beside beside-2 && pack
    done
    gpu_tests /tmp/patience2 120 && cp "$OUT/tests.txt" "$OUT/tests-patience2.txt" && pack
    ;;
esac
date -u >> "$OUT/env-$1.txt"
if [ "$1" != overlap ]; then pack; fi
