#!/usr/bin/env bash
# Session 39's device calls, from the repository root:
#   bash benchmarks/results/gpu-s39/run.sh overlap   benchmarks/flush_overlap.py (a 4-layer Qwen3-8B-shaped decode
#       step with one sequence completing a tile: its flush in line, or on a side stream beside the next layers'
#       matmuls) with the timelines of beside-2 and norm-1w-2, into $OUT/overlap
#   bash benchmarks/results/gpu-s39/run.sh regs      the append kernel in two programs an SM: decode_step.py of this
#       checkout and of copies with regs128.patch (maxnreg 128) and warps4.patch (4 warps), then flush_overlap.py of the three
#       (no norm variants); results packed into $OUT/results.tgz after each step
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
    for copy in regs128 warps4; do
        bash benchmarks/patched_repo.sh /tmp/$copy "$here/$copy.patch" || exit 1
    done
    decode_step now "$repo" && pack
    decode_step regs128 /tmp/regs128 && pack
    decode_step warps4 /tmp/warps4 && pack
    flush_overlap overlap-now "$repo" --costs inline beside beside-2 && pack
    flush_overlap overlap-regs128 /tmp/regs128 --costs inline beside beside-2 && pack
    flush_overlap overlap-warps4 /tmp/warps4 --costs inline beside beside-2 && pack
    cp "$final_out"/env-*.txt "$OUT"/
    ;;
esac
date -u >> "$OUT/env-$1.txt"
[ "$1" = regs ] && pack
