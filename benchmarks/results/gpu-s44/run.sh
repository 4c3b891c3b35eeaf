#!/usr/bin/env bash
# Session 44's device calls, from the repository root:
#   bash benchmarks/results/gpu-s44/run.sh tail    attention.py past tile boundaries of the package before the
#       session (base.patch undoes the merge's tail), now (a step and a short tail at once), and now with the kept rows
#       32 a block (kept32.patch), one after the other (~6 min).
#   bash benchmarks/results/gpu-s44/run.sh diag    with the kept rows 32 a block in the package (kept32.patch applied,
#       commit b9ee50c): attention.py at batch 1 past tile boundaries of the package without it (undo-kept32.patch),
#       with it, and two copies for timing only, whose results are wrong: the exact part's runs not counted, the
#       merging program the fresh token's, which does not wait for them (nocount.patch), and runs that attend no rows
#       (norows.patch): where the batch-1 step's time goes once rows are held (~5 min).
#   bash benchmarks/results/gpu-s44/run.sh stamps  stamps.py of a copy with stamps.patch (timing only): when each
#       exact program of a batch-1 step reaches each phase, at 0 / 64 / 125 rows held (~2 min).
#   bash benchmarks/results/gpu-s44/run.sh timeline  stamps.py of the package: its kernels' timeline only (~1 min).
#   bash benchmarks/results/gpu-s44/run.sh fitted  attention.py past tile boundaries with page tables as wide as
#       each step needs (filled_cache's capacity since this session), then with page tables 32K tokens wide (--table:
#       a server's max_model_len), then the kernel, op and latent tests (~7 min).
#   bash benchmarks/results/gpu-s44/run.sh shared  splits that share each sequence's own tiles (tile_math.quantized_tiles):
#       the kernel, op and latent tests, then attention.py of the package before (undo-shared.patch) and now, with
#       page tables as wide as each step needs, 32K tokens wide and 128K wide (~9 min).
#   bash benchmarks/results/gpu-s44/run.sh sweep   attention.py --sweep-only at batch 1: the op over its number of
#       splits with page tables 32K tokens wide (2K, 8K) and 128K wide (32K), and as wide as each step needs (2K, 32K,
#       128K) (~3 min; run as three calls, h100-sweep/: the first asked for 1x32768 in a 32K table, which has no room
#       for its step, and stopped there).
#   bash benchmarks/results/gpu-s44/run.sh live    PREPARED, NOT RUN (no device time left; for the next session; the
#       patches apply at f430abd): a merging decode step reads only the partials of splits that have tiles
#       (live.patch: tile_math.live_splits; interpreter tests and the sm_90 compile test pass on it), alone (A: at most
#       64 splits, as the package) and with 128 splits and merges of up to 160 partials in the exact part
#       (live128.patch on top: B); the GPU tests of A, then attention.py of the package, A and B with page tables 32K
#       tokens wide and as wide as each step needs (~8 min).
#   bash benchmarks/results/gpu-s44/run.sh tests [PATCH]   the kernel, op and latent tests of the package (with PATCH).
# Each case ran at the commit benchmarks/NOTES.md (session 44) names, where its patches apply. Results are packed
# into $OUT/results.tgz after each step.
source benchmarks/device_steps.sh
start_call "$0" "$1"  # sets repo and here
packed_results "$1"
shapes=1x2048,1x2112,1x2173,1x8192,1x8317,8x8192,8x8317,32x8317
case $1 in
tail)
    bash benchmarks/patched_repo.sh /tmp/base "$here/base.patch" || exit 1
    bash benchmarks/patched_repo.sh /tmp/kept32 "$here/kept32.patch" || exit 1
    for run in base new kept32; do
        dir=/tmp/$run; [ "$run" = new ] && dir=$repo
        time_op "$run" "$dir" 150 --shapes $shapes && pack
    done
    ;;
diag)
    for run in undo-kept32 nocount norows; do
        bash benchmarks/patched_repo.sh /tmp/$run "$here/$run.patch" || exit 1
    done
    for run in undo-kept32 kept32 nocount norows; do
        dir=/tmp/$run; [ "$run" = kept32 ] && dir=$repo
        time_op "$run" "$dir" 150 --shapes 1x2048,1x2112,1x2173,1x8317,8x8317,32x8317 && pack
    done
    ;;
stamps)
    bash benchmarks/patched_repo.sh /tmp/stamps "$here/stamps.patch" || exit 1
    cp "$here/stamps.py" /tmp/stamps/benchmarks/
    bench_script stamps.py 200 stamps /tmp/stamps && pack
    cat "$OUT/stamps/stamps.md"
    ;;
timeline)
    cp "$here/stamps.py" benchmarks/
    bench_script stamps.py 200 timeline "$repo" && pack
    cat "$OUT/timeline/timeline.md"
    ;;
fitted)
    time_op fitted "$repo" 150 --shapes 1x2048,1x2112,1x2173,1x8192,1x8317,8x8192,8x8317,32x8317 && pack
    time_op table32k "$repo" 150 --table 32768 --shapes 1x2048,1x2112,1x2173,1x8192,8x8192,8x8317 && pack
    gpu_tests "$repo" 280 && pack
    ;;
shared)
    gpu_tests "$repo" 200 && pack
    bash benchmarks/patched_repo.sh /tmp/before "$here/undo-shared.patch" || exit 1
    for run in before now; do
        dir=/tmp/before; [ "$run" = now ] && dir=$repo
        time_op "$run-fitted" "$dir" 100 --shapes 1x2048,1x2112,8x8192,8x32768 && pack
        time_op "$run-table32k" "$dir" 100 --table 32768 --shapes 1x2048,1x2112,8x8192,8x8317 && pack
        time_op "$run-table128k" "$dir" 100 --table 131072 --shapes 8x32768,32x32768 && pack
    done
    ;;
sweep)
    time_op sweep-table32k "$repo" 150 --sweep-only --table 32768 --shapes 1x2048,1x8192 && pack
    time_op sweep-fitted "$repo" 120 --sweep-only --shapes 1x2048,1x32768 && pack
    time_op sweep-fitted128k "$repo" 120 --sweep-only --shapes 1x131072 && pack
    time_op sweep-table128k "$repo" 100 --sweep-only --table 131072 --shapes 1x32768 && pack
    ;;
live)
    bash benchmarks/patched_repo.sh /tmp/liveA "$here/live.patch" || exit 1
    bash benchmarks/patched_repo.sh /tmp/liveB "$here/live.patch" "$here/live128.patch" || exit 1
    gpu_tests /tmp/liveA 200 && pack
    for run in package liveA liveB; do
        dir=/tmp/$run; [ "$run" = package ] && dir=$repo
        time_op "$run-table32k" "$dir" 100 --table 32768 --shapes 1x2048,1x2112,1x8192,8x8192 && pack
        time_op "$run-fitted" "$dir" 100 --shapes 1x2048,1x32768,1x131072,8x32768 && pack
    done
    ;;
tests)
    dir=$repo
    if [ $# -gt 1 ]; then bash benchmarks/patched_repo.sh /tmp/patched "$here/$2" || exit 1; dir=/tmp/patched; fi
    gpu_tests "$dir" 300 tests/test_kernels.py tests/test_ops.py tests/test_latent.py && pack
    ;;
esac
date -u >> "$OUT/env-$1.txt"
pack
