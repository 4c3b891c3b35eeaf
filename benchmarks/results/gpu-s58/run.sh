#!/usr/bin/env bash
# Session 58's device calls, from the repository root:
#   bash benchmarks/results/gpu-s58/run.sh h200   the op, backend and latent GPU tests (transformers' MLA cache's
#       row selection and crop new), whether Inductor's CUDA-graph trees skip the kvarn graphs for each way of holding
#       the buffers (cudagraph_skips.py), then on an H200 the README's decode table, cold, and the rows held in fitted
#       page tables, cold (session 57's `h200`, which no H200 took) (up to 9.5 min).
#   bash benchmarks/results/gpu-s58/run.sh tests   where no H200 is lent: h200's first two steps alone (up to 4 min).
# Results are packed into $OUT/results.tgz after each step.
source benchmarks/device_steps.sh
start_call "$0" "$1"  # sets repo and here
packed_results "$1"
case $1 in
h200 | tests)
    (source benchmarks/device_vllm_env.sh && gpu_tests "$repo" 170 tests/test_ops.py tests/test_backend.py \
        tests/test_latent.py tests/test_hf_latent.py) && pack
    (source benchmarks/device_vllm_env.sh && timeout 60 python3 "$here/cudagraph_skips.py") \
        > "$OUT/cudagraph_skips.txt" 2>&1
    grep -v '^[IWE][0-9]' "$OUT/cudagraph_skips.txt" | grep 'counters\|Error' | cut -c1-400
    pack
    [ "$1" = tests ] && { end_call "$1"; exit 0; }
    readme_table 220 && (cd "$OUT" && tar czf table.tgz table && rm -rf table) && pack
    time_op rows-fitted "$repo" 110 --shapes 1x2048,1x2112,1x2173,2x2112,8x8317 && pack
    ;;
*) unknown_case "$1" ;;
esac
end_call "$1"
