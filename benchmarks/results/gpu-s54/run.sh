#!/usr/bin/env bash
# Session 54's device calls, from the repository root:
#   bash benchmarks/results/gpu-s54/run.sh in-line   whether the deferral's FLUSH launch could run in line, on the
#       stream that defers, instead of on a side stream (flush_overlap.py's in-line-* variants, NOTES session 54): 16
#       layers at B8/8K and B32/8K beside the package's deferral and the in-line op, then 36 layers at B8/8K (a
#       FLUSH launch of 16 layers then runs three times a step); then the cold rows-held step that session 53's
#       `run.sh rows` could not finish (up to 9 min).
#   bash benchmarks/results/gpu-s54/run.sh loop   flush-loop.patch (FLUSH's program for a KV head and keys / values
#       quantizes its call's completed tiles in turn: a launch of half the programs, each holding an SM) beside the
#       package: its kernel and deferral GPU tests, then flush_overlap.py at 16 layers, package and patch in turn, twice
#       (up to 10 min).
#   bash benchmarks/results/gpu-s54/run.sh h200   for an H200: the README's decode table, cold; the deferral's cost
#       at 16 layers (flush_overlap.py), also with two and three sequences completing a tile at B128/2K (the steps
#       session 54's B128 sum estimates); the rows held in fitted and 32K-wide tables, cold (up to 10 min).
#   bash benchmarks/results/gpu-s54/run.sh verify   the package's GPU kernel, op and latent tests (FLUSH's programs
#       taking their call's tiles in turn, e4c2fd4), then the deferral at Qwen3-8B's 36 layers, B8/8K and B32/8K
#       (up to 6 min).
#   bash benchmarks/results/gpu-s54/run.sh most   most4.patch (DEFERRED_MOST 4: a call's 3-4 completed tiles deferred,
#       not quantized in line as a burst) beside the package: its kernel and deferral GPU tests, then flush_overlap.py
#       at 16 layers, B128/2K and B32/8K, with three sequences completing a tile (deferred-3) (up to 7 min).
# Results are packed into $OUT/results.tgz after each step.
source benchmarks/device_steps.sh
start_call "$0" "$1"  # sets repo and here
packed_results "$1"
case $1 in
in-line)
    bench_script flush_overlap.py 200 layers16 "$repo" --layers 16 --rounds 3 --shapes 8x8192,32x8192 \
        --costs deferred deferred-none in-line-g4 in-line-none-g4 in-line-g16 in-line-none-g16 inline staged-none \
        && pack
    bench_script flush_overlap.py 150 layers36 "$repo" --layers 36 --rounds 3 --shapes 8x8192 \
        --costs deferred deferred-none in-line-g16 in-line-none-g16 inline && pack
    time_op rows-fitted "$repo" 200 --shapes 1x2048,1x2112,1x2173,2x2112,8x8317 && pack
    ;;
loop)
    bash benchmarks/patched_repo.sh /tmp/flush-loop "$here/flush-loop.patch" || exit 1
    gpu_tests /tmp/flush-loop 150 tests/test_kernels.py tests/test_ops.py -k "defer or flush or staged" && pack
    for round in 1 2; do
        shapes=8x8192,32x8192
        [ "$round" = 1 ] || shapes=8x8192
        for copy in package flush-loop; do
            dir=$repo
            [ "$copy" = package ] || dir=/tmp/flush-loop
            bench_script flush_overlap.py 110 "$copy-$round" "$dir" --layers 16 --rounds 2 --shapes "$shapes" \
                --costs deferred deferred-none in-line-g16 in-line-none-g16 staged-none && pack
        done
    done
    ;;
h200)
    readme_table 200 && (cd "$OUT" && tar czf table.tgz table && rm -rf table) && pack
    bench_script flush_overlap.py 130 layers16 "$repo" --layers 16 --rounds 3 --shapes 8x8192,32x8192 \
        --costs deferred deferred-none staged-none && pack
    bench_script flush_overlap.py 100 b128 "$repo" --layers 16 --rounds 2 --shapes 128x2048 \
        --costs deferred deferred-2 deferred-3 deferred-none && pack
    time_op rows-fitted "$repo" 120 --shapes 1x2048,1x2112,1x2173,2x2112,8x8317 && pack
    time_op wide "$repo" 100 --table 32768 --shapes 1x2048,1x2112,2x2048 && pack
    ;;
verify)
    gpu_tests "$repo" 200 && pack
    bench_script flush_overlap.py 150 layers36 "$repo" --layers 36 --rounds 3 --shapes 8x8192,32x8192 \
        --costs deferred deferred-none && pack
    ;;
most)
    bash benchmarks/patched_repo.sh /tmp/most4 "$here/most4.patch" || exit 1
    gpu_tests /tmp/most4 150 tests/test_kernels.py tests/test_ops.py -k "defer or flush or staged" && pack
    for copy in package most4; do
        dir=$repo
        [ "$copy" = package ] || dir=/tmp/most4
        bench_script flush_overlap.py 120 "$copy" "$dir" --layers 16 --rounds 2 --shapes 128x2048,32x8192 \
            --costs deferred deferred-3 deferred-none && pack
    done
    ;;
*) unknown_case "$1" ;;
esac
end_call "$1"
