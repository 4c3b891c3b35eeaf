#!/usr/bin/env bash
# Session 39's device calls, from the repository root:
#   bash benchmarks/results/gpu-s39/run.sh overlap   benchmarks/flush_overlap.py (a 4-layer Qwen3-8B-shaped decode
#       step with one sequence completing a tile: its flush in line, or on a side stream beside the next layers'
#       matmuls) with the timelines of beside-2 and norm-1w-2, into $OUT/overlap
#   bash benchmarks/results/gpu-s39/run.sh regs      the flush's SM-time: decode_step.py of this checkout and of copies
#       with regs128.patch (the append kernel at maxnreg 128: two programs an SM), warps4.patch (4 warps: two programs
#       an SM) and patience2.patch (the normalisation ends after 2 iterations in a row that do not lower a tile's
#       imbalance), then flush_overlap.py of this checkout, regs128 and patience2 (in line, beside, beside-2), then
#       patience2's GPU tests; results packed into $OUT/results.tgz after each step (~9 min: split it if need be)
source benchmarks/device_steps.sh
start_call "$0" "$1"  # sets repo and here
case $1 in
overlap)
    flush_overlap overlap "$repo" --timeline beside-2 norm-1w-2
    ;;
regs)
    final_out=$OUT
    OUT=/tmp/results && mkdir -p $OUT
    pack() { tar czf "$final_out/results.tgz" -C "$OUT" .; }
    for copy in regs128 warps4 patience2; do
        bash benchmarks/patched_repo.sh /tmp/$copy "$here/$copy.patch" || exit 1
    done
    decode_step now "$repo" && pack
    decode_step regs128 /tmp/regs128 && pack
    decode_step warps4 /tmp/warps4 && pack
    decode_step patience2 /tmp/patience2 && pack
    flush_overlap overlap-now "$repo" --costs inline beside beside-2 && pack
    flush_overlap overlap-regs128 /tmp/regs128 --costs inline beside beside-2 && pack
    flush_overlap overlap-patience2 /tmp/patience2 --costs inline beside beside-2 && pack
    gpu_tests /tmp/patience2 120 && cp "$OUT/tests.txt" "$OUT/tests-patience2.txt" && pack
    cp "$final_out"/env-*.txt "$OUT"/
    ;;
esac
date -u >> "$OUT/env-$1.txt"
[ "$1" = regs ] && pack
