#!/usr/bin/env bash
# Session 55's device calls, from the repository root:
#   bash benchmarks/results/gpu-s55/run.sh tables   the op's deferral GPU tests and the compile backend's (its entry
#       point registered as device_vllm_env.sh does: the checkout is not pip-installed there); the README's decode
#       table, cold; the rows held in fitted and 32K-wide page tables, cold (up to 9.5 min).
#   bash benchmarks/results/gpu-s55/run.sh flush   the deferral's cost at 16 layers (flush_overlap.py), B8/8K and
#       B32/8K, then B128/2K with one, two and three sequences completing a tile (the steps session 54's B128 sum
#       estimates), then 36 layers at B8/8K and B32/8K (up to 8 min).
#   bash benchmarks/results/gpu-s55/run.sh vllm   after carrying the vLLM 0.23 bundle (`../shared/device/vllm023/
#       make-bundle.sh`, its parts cut again into six of 32 MiB, since a call carries the working tree's ~27 MB too:
#       `cat p*/part.* > all.tar; split -b 32M -d -a 1 all.tar part.`, each with the same install.sh; carried as p1 ..
#       p6, the last call running this case): vLLM's full CUDA graphs against piecewise ones for the dense model, also
#       with deferred flushes (FLUSH's programs taking their call's tiles in turn and up to 4 tiles a call since
#       session 54; test_full_cuda_graphs_match_piecewise_ones[tiny_llama]); then the compile backend's GPU tests
#       (up to 7.5 min).
#   bash benchmarks/results/gpu-s55/run.sh h100   where no H200 is lent: the op's deferral GPU tests, then B128/2K
#       with one, two and three sequences completing a tile (up to 4.5 min).
# Results are packed into $OUT/results.tgz after each step.
source benchmarks/device_steps.sh
start_call "$0" "$1"  # sets repo and here
packed_results "$1"
case $1 in
tables)
    (source benchmarks/device_vllm_env.sh && gpu_tests "$repo" 150 tests/test_ops.py tests/test_backend.py \
        -k "defer or test_backend") && pack
    readme_table 220 && (cd "$OUT" && tar czf table.tgz table && rm -rf table) && pack
    time_op rows-fitted "$repo" 110 --shapes 1x2048,1x2112,1x2173,2x2112,8x8317 && pack
    time_op wide "$repo" 80 --table 32768 --shapes 1x2048,1x2112,2x2048 && pack
    ;;
flush)
    bench_script flush_overlap.py 130 layers16 "$repo" --layers 16 --rounds 3 --shapes 8x8192,32x8192 \
        --costs deferred deferred-none staged-none && pack
    bench_script flush_overlap.py 110 b128 "$repo" --layers 16 --rounds 2 --shapes 128x2048 \
        --costs deferred deferred-2 deferred-3 deferred-none && pack
    bench_script flush_overlap.py 170 layers36 "$repo" --layers 36 --rounds 3 --shapes 8x8192,32x8192 \
        --costs deferred deferred-none && pack
    ;;
vllm)
    export VLLM_WORKER_MULTIPROC_METHOD=spawn
    source benchmarks/device_vllm_env.sh
    timeout 300 python3 -m pytest -q -rs -p no:cacheprovider tests/test_vllm_plugin.py \
        -k "full_cuda_graphs and tiny_llama" > "$OUT/tests-vllm.txt" 2>&1
    tail -n 5 "$OUT/tests-vllm.txt" && pack
    gpu_tests "$repo" 150 tests/test_backend.py && pack
    ;;
h100)
    gpu_tests "$repo" 150 tests/test_ops.py -k defer && pack
    bench_script flush_overlap.py 110 b128 "$repo" --layers 16 --rounds 2 --shapes 128x2048 \
        --costs deferred deferred-2 deferred-3 deferred-none && pack
    ;;
*) unknown_case "$1" ;;
esac
end_call "$1"
