#!/usr/bin/env bash
# Session 36's device call, from the repository root: `bash benchmarks/results/gpu-s36/run.sh append`.
#   append: benchmarks/decode_step.py (one layer's decode step with no, one or every sequence completing a tile) of
#           three copies in turn: before/ (before.patch: the append kernel of session 35, one flush-sized program
#           per sequence, KV head and keys or values), after/ (this checkout: the stage kernel, then the
#           quantize-and-store kernel over the completed tiles only) and one-wave/ (one-wave-old-grid.patch: the
#           old grid where it fits one wave of one program per SM, num_seqs x 2 x Hkv <= SMs); the GPU tests of the
#           kernels, ops and latent cache on this checkout (tests.txt) run before one-wave/; last the step's timeline (after).
# The device returns at most 8 files: results go to /tmp/results, packed into $OUT/results.tgz after each run.
source benchmarks/device_steps.sh
final_out=$OUT
OUT=/tmp/results && mkdir -p $OUT
pack() { tar czf "$final_out/results.tgz" -C "$OUT" .; }
start_call "$0" "$1"  # sets repo and here
step() {  # step NAME DIR: decode_step.py of the checkout at DIR into $OUT/NAME
    (cd "$2/benchmarks" && PYTHONPATH=$2 timeout 120 python3 decode_step.py --out "$OUT/$1") > "$OUT/$1.log" 2>&1
    grep '^| [0-9]' "$OUT/$1.log" | sed "s/^/$1 /"
    grep -i 'error\|Traceback' "$OUT/$1.log" | head -3
    pack
}
case $1 in
append)
    bash benchmarks/patched_repo.sh /tmp/before "$here/before.patch"
    bash benchmarks/patched_repo.sh /tmp/one-wave "$here/one-wave-old-grid.patch"
    step after "$repo"
    step before /tmp/before
    gpu_tests "$repo" 150
    pack
    step one-wave /tmp/one-wave
    (cd benchmarks && PYTHONPATH=$repo timeout 50 python3 decode_step.py --out $OUT/timeline --timeline) \
        > $OUT/timeline.log 2>&1
    grep -A12 "^B128\|^B256" $OUT/timeline/timeline.md
    ;;
esac
date -u >> $OUT/env-$1.txt
pack
