#!/usr/bin/env bash
# Session 41's device calls, from the repository root:
#   bash benchmarks/results/gpu-s41/run.sh flips   the flip rounds of the value flush: decode_step.py of this checkout
#       (one move a round, the moved code's step gathered through shared memory) and of copies with moves.patch (4
#       moves a round, found in one reduction of 4-tuples, each step read back from the record), it with moves1.patch
#       (1 a round) and with moves2.patch (2); then moves.patch's GPU kernel, op and latent tests (~7 min)
#   (its `parts` case, prepared and not run for want of a machine, is session 42's: gpu-s42/run.sh)
# Results are packed into $OUT/results.tgz after each step.
source benchmarks/device_steps.sh
start_call "$0" "$1"  # sets repo and here
packed_results "$1"
case $1 in
flips)
    bash benchmarks/patched_repo.sh /tmp/moves4 "$here/moves.patch" || exit 1
    for moves in 1 2; do
        bash benchmarks/patched_repo.sh /tmp/moves$moves "$here/moves.patch" "$here/moves$moves.patch" || exit 1
    done
    for run in head moves1 moves2 moves4; do
        dir=/tmp/$run; [ "$run" = head ] && dir=$repo
        decode_step "$run" "$dir" && pack
    done
    gpu_tests /tmp/moves4 200 && pack
    ;;
esac
date -u >> "$OUT/env-$1.txt"
pack
