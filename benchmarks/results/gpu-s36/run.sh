#!/usr/bin/env bash
# Session 36's device call (its patches apply to 1ebf115), from the repository root: `bash benchmarks/results/gpu-s36/run.sh append`.
# Ran in session 38 (H100): results in benchmarks/results/h100-s38/call0/ (the design it measures was then reverted).
#   append: benchmarks/decode_step.py (one layer's decode step with no, one or every sequence completing a tile) of
#           three copies in turn: before/ (before.patch: the append kernel of session 35, one flush-sized program
#           per sequence, KV head and keys or values), after/ (this checkout: the stage kernel, then the
#           quantize-and-store kernel over the completed tiles only) and one-wave/ (one-wave-old-grid.patch: the
#           old grid where it fits one wave of one program per SM, num_seqs x 2 x Hkv <= SMs); the GPU tests of the
#           kernels, ops and latent cache on this checkout (tests.txt) run before one-wave/; last the step's timeline (after).
#   timing: the same without the GPU tests.
# The device returns at most 8 files: results go to /tmp/results, packed into $OUT/results.tgz after each run.
source benchmarks/device_steps.sh
final_out=$OUT
OUT=/tmp/results && mkdir -p $OUT
pack() { tar czf "$final_out/results.tgz" -C "$OUT" .; }
start_call "$0" "$1"  # sets repo and here
step() { decode_step "$@" && pack; }  # step NAME DIR
case $1 in
append | timing)  # timing: the same without the GPU tests
    bash benchmarks/patched_repo.sh /tmp/before "$here/before.patch" || exit 1
    bash benchmarks/patched_repo.sh /tmp/one-wave "$here/one-wave-old-grid.patch" || exit 1
    step after "$repo"
    step before /tmp/before
    [ "$1" = timing ] || gpu_tests "$repo" 150
    pack
    step one-wave /tmp/one-wave
    decode_step timeline "$repo" --timeline
    ;;
esac
date -u >> $OUT/env-$1.txt
pack
