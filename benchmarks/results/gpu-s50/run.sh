#!/usr/bin/env bash
# Session 50's device calls, from the repository root:
#   bash benchmarks/results/gpu-s50/run.sh first   (1) the GPU kernel, op and latent tests with session 49's new ones (a
#       FLUSH launched from another stream than two of its calls' STAGEs; the flush stream skipping the caller's
#       stream in torch's pool), then the first on a copy without the flush stream's wait for each STAGE
#       (no-stage-wait.patch, the form before session 48's review fix), where it must fail; (2) where the deferral's
#       every-step cost comes from: flush_overlap.py with 16 layers at B8/8K and B32/8K (unrolled graphs, as the
#       other sessions' runs), deferred, deferred-none, staged-none, tiny-1 / tiny-4 / tiny-16 (a one-program kernel
#       forked after every N-th layer: the multi-stream graph without the FLUSH kernel) and deferred(-none)-r128 /
#       -r64 (FLUSH at most 128 / 64 registers a thread: its programs no longer fill an SM's register file); (3)
#       deferred, deferred-none, staged-none and tiny-4 with each step's own graph replayed in a row (a-step, as a
#       server replays it) (~8 min).
# Results are packed into $OUT/results.tgz after each step.
source benchmarks/device_steps.sh
start_call "$0" "$1"  # sets repo and here
packed_results "$1"
case $1 in
first)
    gpu_tests "$repo" 180 && pack
    bash benchmarks/patched_repo.sh /tmp/no-stage-wait "$here/no-stage-wait.patch" || exit 1
    (cd /tmp/no-stage-wait && timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_ops.py \
        -k another_stream) > "$OUT/tests-no-stage-wait.txt" 2>&1
    tail -n 3 "$OUT/tests-no-stage-wait.txt" && pack
    bench_script flush_overlap.py 150 unrolled "$repo" --layers 16 --rounds 3 --shapes 8x8192,32x8192 \
        --costs deferred deferred-none staged-none tiny-1 tiny-4 tiny-16 deferred-r128 deferred-none-r128 \
        deferred-r64 deferred-none-r64 && pack
    bench_script flush_overlap.py 100 a-step "$repo" --layers 16 --rounds 3 --shapes 8x8192,32x8192 \
        --costs deferred deferred-none staged-none tiny-4 --graphs a-step && pack
    ;;
esac
date -u >> "$OUT/env-$1.txt"
pack
