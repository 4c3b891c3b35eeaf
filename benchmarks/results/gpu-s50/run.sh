#!/usr/bin/env bash
# Session 50's device calls, from the repository root:
#   bash benchmarks/results/gpu-s50/run.sh first   (1) the GPU kernel, op and latent tests with session 49's new ones (a
#       FLUSH launched from another stream than two of its calls' STAGEs; the flush stream skipping the caller's
#       stream in torch's pool), then the first on a copy without the flush stream's wait for each STAGE
#       (no-stage-wait.patch, the form before session 48's review fix), where it must fail; (2) where the deferral's
#       every-step cost comes from: flush_overlap.py with 16 layers at B8/8K and B32/8K, deferred, deferred-none,
#       staged-none and tiny-1 / tiny-4 / tiny-16 (a one-program kernel forked after every N-th layer: the
#       multi-stream graph without the FLUSH kernel), timed with each step's own graph replayed in a row (a-step, as
#       a server replays it), then with the unrolled graphs of the other sessions' runs (~5 min).
# Results are packed into $OUT/results.tgz after each step.
source benchmarks/device_steps.sh
start_call "$0" "$1"  # sets repo and here
packed_results "$1"
case $1 in
first)
    gpu_tests "$repo" 200 && pack
    bash benchmarks/patched_repo.sh /tmp/no-stage-wait "$here/no-stage-wait.patch" || exit 1
    (cd /tmp/no-stage-wait && timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_ops.py \
        -k another_stream) > "$OUT/tests-no-stage-wait.txt" 2>&1
    tail -n 3 "$OUT/tests-no-stage-wait.txt" && pack
    for graphs in a-step unrolled; do
        bench_script flush_overlap.py 120 $graphs "$repo" --layers 16 --rounds 3 --shapes 8x8192,32x8192 \
            --costs deferred deferred-none staged-none tiny-1 tiny-4 tiny-16 --graphs $graphs && pack
    done
    ;;
esac
date -u >> "$OUT/env-$1.txt"
pack
