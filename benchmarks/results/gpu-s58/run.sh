#!/usr/bin/env bash
# Session 58's device calls, from the repository root:
#   bash benchmarks/results/gpu-s58/run.sh h200   the op, backend and latent GPU tests (transformers' MLA cache's
#       row selection and crop new), whether Inductor's CUDA-graph trees skip the kvarn graphs for each way of holding
#       the buffers (cudagraph_skips.py), then on an H200 the README's decode table, cold, and the rows held in fitted
#       page tables, cold (session 57's `h200`, which no H200 took) (up to 9.5 min).
#   bash benchmarks/results/gpu-s58/run.sh tests   where no H200 is lent: h200's first two steps alone (up to 4 min).
#   bash benchmarks/results/gpu-s58/run.sh vllm   after carrying the vLLM 0.23 bundle in six parts (gpu-s55/run.sh's
#       header says how): prefix-cache hits on blocks written in the same step (new) and vLLM's full CUDA graphs
#       against piecewise ones; then the backend's CUDA-graph tests (plain-input buffers marked static: new), and
#       the plain-input test again with that marking removed, which must fail, and cudagraph_skips.py (up to 10 min).
#   bash benchmarks/results/gpu-s58/run.sh backend   the vllm case's steps after its vLLM tests (up to 6.5 min).
# Results are packed into $OUT/results.tgz after each step.
source benchmarks/device_steps.sh
start_call "$0" "$1"  # sets repo and here
packed_results "$1"
# The backend's CUDA-graph tests (plain-input buffers marked static: new), then the plain-input test again with that
# marking removed, which must fail, then the cudagraph-skips probe at this code.
backend_cuda_graphs() {
    (source benchmarks/device_vllm_env.sh && gpu_tests "$repo" 120 tests/test_backend.py -k "cuda") && pack
    cp kvarn_compile/backend.py /tmp/backend.py.orig
    sed -i 's/^\( *\)node.meta\["tensor_dict"\] = {\*\*node.meta.get.*unguarded"}$/\1pass  # mutation/' \
        kvarn_compile/backend.py
    grep -c 'pass  # mutation' kvarn_compile/backend.py
    (source benchmarks/device_vllm_env.sh && timeout 100 python3 -m pytest -q -p no:cacheprovider \
        tests/test_backend.py -k plain_inputs > "$OUT/tests-mutation.txt" 2>&1; tail -n 2 "$OUT/tests-mutation.txt")
    cp /tmp/backend.py.orig kvarn_compile/backend.py && pack
    (source benchmarks/device_vllm_env.sh && timeout 150 python3 "$here/cudagraph_skips.py") \
        > "$OUT/cudagraph_skips.txt" 2>&1
    grep -v '^[IWE][0-9]' "$OUT/cudagraph_skips.txt" | grep 'counters\|Error' | cut -c1-400
    pack
}

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
vllm)
    (
        export VLLM_WORKER_MULTIPROC_METHOD=spawn
        source benchmarks/device_vllm_env.sh
        timeout 330 python3 -m pytest -q -rs -p no:cacheprovider tests/test_vllm_plugin.py \
            -k "same_step or (full_cuda_graphs and tiny_llama)" > "$OUT/tests-vllm.txt" 2>&1
        tail -n 5 "$OUT/tests-vllm.txt"
    ) && pack
    backend_cuda_graphs
    ;;
backend) backend_cuda_graphs ;;
*) unknown_case "$1" ;;
esac
end_call "$1"
