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
#       It ran at bf74bec (flush-registers.patch: the registers' knob, in the package then).
#   bash benchmarks/results/gpu-s50/run.sh table   (run as `h200`, asking for the issue's device; an H100 came) the
#       README's decode table (attention.py --profile), the op past tile boundaries at batch 1-2 (rows of the current
#       tile held), then the deferral's step costs with in line beside them: flush_overlap.py with 16 layers (B8/8K,
#       B32/8K, B128/2K) and 36 (Qwen3-8B's depth; B8/8K, B32/8K) (~5 min).
#   bash benchmarks/results/gpu-s50/run.sh depth   the deferral's step costs with in line beside them, 16 and 36
#       layers at B8/8K and B32/8K (the first call's card had no in-line column; ~4 min).
#   bash benchmarks/results/gpu-s50/run.sh forks   the first call's tiny-N and registers' variants on the card at hand
#       (16 layers, B8/8K and B32/8K; the registers' on a copy with flush-registers.patch; ~2 min).
#   bash benchmarks/results/gpu-s50/run.sh nodes   whether the cost of a tiny fork after every 16th layer (tiny-16)
#       follows the step's length: 4 and 36 layers at B8/8K (one fork and three; ~1.5 min).
#   (the `span` case prepared here moved to benchmarks/results/gpu-s51/run.sh; not run in session 51 either)
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
table)
    readme_table 200 && (cd "$OUT" && tar czf table.tgz table && rm -rf table) && pack
    time_op rows-fitted "$repo" 60 --shapes 1x2048,1x2112,1x2173,2x2112,8x8317 && pack
    bench_script flush_overlap.py 120 layers16 "$repo" --layers 16 --rounds 2 --shapes 8x8192,32x8192,128x2048 \
        --costs inline deferred deferred-none staged-none && pack
    bench_script flush_overlap.py 120 layers36 "$repo" --layers 36 --rounds 2 --shapes 8x8192,32x8192 \
        --costs inline deferred deferred-none && pack
    ;;
depth)
    for layers in 16 36; do
        bench_script flush_overlap.py 150 layers$layers "$repo" --layers $layers --rounds 2 --shapes 8x8192,32x8192 \
            --costs inline deferred deferred-none && pack
    done
    ;;
forks)
    bench_script flush_overlap.py 100 forks "$repo" --layers 16 --rounds 2 --shapes 8x8192,32x8192 \
        --costs deferred-none staged-none tiny-1 tiny-4 tiny-16 && pack
    bash benchmarks/patched_repo.sh /tmp/registers "$here/flush-registers.patch" || exit 1
    bench_script flush_overlap.py 100 registers /tmp/registers --layers 16 --rounds 2 --shapes 8x8192,32x8192 \
        --costs deferred-none deferred-none-r128 deferred-none-r64 && pack
    ;;
nodes)
    for layers in 4 36; do
        bench_script flush_overlap.py 80 layers$layers "$repo" --layers $layers --rounds 2 --shapes 8x8192 \
            --costs staged-none tiny-16 && pack
    done
    ;;
esac
date -u >> "$OUT/env-$1.txt"
pack
