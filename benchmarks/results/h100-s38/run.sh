#!/usr/bin/env bash
# Session 38's device call (its patches apply to the commit that adds this file), from the repository root:
#   bash benchmarks/results/h100-s38/run.sh append   (call 1; `exit`: call 2, below)
# benchmarks/decode_step.py (one layer's decode step with no, one or every sequence completing a tile) of four
# copies in turn, side by side on one machine:
#   now/       this checkout: the work list's rounds alternate a program's keys and values; decode calls of no
#              more tile halves than SMs keep one program per tile half (no stage kernel)
#   s35/       s35.patch: session 35's append (one flush-sized program per sequence, KV head and keys or values)
#   s36/       s36.patch: session 36's (the stage kernel and the work list, for every decode-sized call; a program's
#              items all keys or all values)
#   balanced/  balanced-only.patch: now, with the work list for every decode-sized call (as s36)
# then the step's timeline (now) with every sequence completing a tile and with none, and the GPU tests of the
# kernels, ops and latent cache (now). Results go to /tmp/results, packed into $OUT/results.tgz after each step.
source benchmarks/device_steps.sh
final_out=$OUT
OUT=/tmp/results && mkdir -p $OUT
pack() { tar czf "$final_out/results.tgz" -C "$OUT" .; }
start_call "$0" "$1"  # sets repo and here
step() { decode_step "$@" && pack; }  # step NAME DIR [decode_step.py arguments]
case $1 in
append)
    for copy in s35 s36 balanced-only; do
        bash benchmarks/patched_repo.sh /tmp/$copy "$here/$copy.patch" || exit 1
    done
    step now "$repo"
    step s35 /tmp/s35
    step s36 /tmp/s36
    step balanced /tmp/balanced-only
    step timeline-all "$repo" --timeline all
    step timeline-none "$repo" --timeline none
    gpu_tests "$repo" 170
    ;;
exit)  # call 2: the same step with the completing sequence first or last ("one", "last"): now, s35 and exit-grid
    # (exit-grid.patch: after the stage kernel, one program per tile half as s35's grid; a program whose sequence
    # completes no tile exits at once, instead of the work list's loop over a scan's finds), then exit-grid's tests
    for copy in s35 exit-grid; do
        bash benchmarks/patched_repo.sh /tmp/$copy "$here/$copy.patch" || exit 1
    done
    step now "$repo"
    step s35 /tmp/s35
    step exit-grid /tmp/exit-grid
    gpu_tests /tmp/exit-grid 170
    ;;
esac
date -u >> $OUT/env-$1.txt
pack
