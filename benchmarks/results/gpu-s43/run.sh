#!/usr/bin/env bash
# Session 43's device calls, from the repository root:
#   bash benchmarks/results/gpu-s43/run.sh spread   the current tile's rows over programs (paged_attention's exact
#       part, exact_parts_for): attention.py --sweep-exact (the op over 1-9 exact programs at contexts 0, 64 and 125
#       rows past a tile boundary); the kernel, op and latent tests; then attention.py past tile boundaries, the
#       package before this session (old.patch undoes its kernels) and now, one after the other (~8 min).
#   bash benchmarks/results/gpu-s43/run.sh final    the kernel, op and latent tests, then attention.py past tile
#       boundaries, before this session and now (~5 min).
# Results are packed into $OUT/results.tgz after each step.
source benchmarks/device_steps.sh
start_call "$0" "$1"  # sets repo and here
packed_results "$1"
shapes=1x2048,1x2112,1x2173,1x8317,8x8192,8x8317,32x8317,128x2173
case $1 in
final)
    gpu_tests "$repo" 200 tests/test_kernels.py tests/test_ops.py tests/test_latent.py && pack
    bash benchmarks/patched_repo.sh /tmp/old "$here/old.patch" || exit 1
    for run in old new; do
        dir=/tmp/old; [ "$run" = new ] && dir=$repo
        time_op "$run" "$dir" 100 --shapes 1x2048,1x2112,1x2173,1x8192,1x8317,8x8192,8x8256,8x8317,32x8317 && pack
    done
    ;;
spread)
    time_op sweep "$repo" 150 --sweep-exact && pack
    gpu_tests "$repo" 240 tests/test_kernels.py tests/test_ops.py tests/test_latent.py && pack
    bash benchmarks/patched_repo.sh /tmp/old "$here/old.patch" || exit 1
    for run in old new; do
        dir=/tmp/old; [ "$run" = new ] && dir=$repo
        time_op "$run" "$dir" 100 --shapes $shapes && pack
    done
    ;;
esac
date -u >> "$OUT/env-$1.txt"
pack
