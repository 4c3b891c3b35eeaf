#!/usr/bin/env bash
# Session 47's device calls, from the repository root:
#   bash benchmarks/results/gpu-s47/run.sh verify   session 46's final form and the conditional flush on a GPU: the
#       GPU kernel, op and latent tests (the deferral's op test, replayed in a CUDA graph, now runs its flushes in
#       conditional nodes); then flush_overlap.py of the package (a CUDA graph's FLUSH launch in a conditional node
#       that runs only where STAGE found a tile): inline, deferred, deferred-none, staged-none (the staging alone),
#       deferred-hi / deferred-none-hi (a flush stream of high priority) at B8/8K, B32/8K, B128/2K, 2 rounds, and the
#       kernels of one replay of none, deferred-none, deferred at B8/8K and B32/8K; then of the package without the
#       conditional node (undo-cond.patch: session 46's form): deferred, deferred-none (~6 min). RAN at 7aa3204
#       (h100-verify/): torch 2.11's CUDAGraph has no get_currently_capturing_graph, so both runs launched FLUSH in
#       every step; the conditional node was reverted (6c1e7b9).
#   bash benchmarks/results/gpu-s47/run.sh probe2   what torch 2.11 offers for conditional nodes (the CUDAGraph API,
#       cuda-python); then flush_overlap.py (deferred, deferred-none; B8/8K, B32/8K, 2 rounds) of the package (also
#       LAG 3), of session 46's form before the snapshot (s46-defer3.patch: the package at 4e87c01, whose deferred-none
#       measured +5.7 / +15.0 us where h100-verify's +18.7 / +14.5) and of DEFERRED_MOST 1 (most1.patch: 16 FLUSH
#       programs, not 32), one after another (~3 min). RAN at fd6e597 with the vLLM bundle's first part
#       (h100-probe2/).
#   bash benchmarks/results/gpu-s47/run.sh vllm-defer   the deferral in vLLM 0.23, after carrying its bundle: the
#       dense model's full CUDA graphs, also with KVARN_DEFER_FLUSH=1, against piecewise ones
#       (test_full_cuda_graphs_match_piecewise_ones[tiny_llama]; ~3 min). RAN at fd6e597 (h100-vllm/tests-vllm.txt).
#       The bundle with this repository's results no longer fits a call's 64 MiB in four parts: its parts were cut
#       again into five of 36 MiB (`cat p*/part.* > all.tar; split -b 36M -d -a 1 all.tar part.`, each with the same
#       install.sh), carried as p1 (with probe2), p2, p3, p4, then p5 with this case.
#   Then, on the same warm machine, the staggered workload with 1,024 output tokens (not 2,048: the device
#   time left), KVARN_DEFER_FLUSH=0 then 1, an engine each (h100-vllm/burst/):
#       (cd benchmarks && KVARN_DEFER_FLUSH=$defer python3 vllm_burst.py --out DIR --dtypes kvarn_k4v2_g128 \
#           --output-len 1024 --max-num-seqs 256 --workloads staggered)
#   bash benchmarks/results/gpu-s47/run.sh conditional   RAN in session 48 at 59407fb (gpu-s48/h100-conditional/):
#       conditional-node.patch (kvarn_compile.graph_conditional: a CUDA graph's IF node built with cuda-python, since torch 2.11 cannot capture
#       one; STAGE writes whether its FLUSH has a tile; deferred_flush captures FLUSH into the node) on a copy: its GPU
#       tests (the node's own, the kernels', the ops' with the deferral's graph test now asserting IF nodes, the
#       latent ones), then flush_overlap.py of the copy (inline, deferred, deferred-none, staged-none; B8/8K, B32/8K,
#       B128/2K; 2 rounds; a timeline of none and deferred-none at B8/8K) and of the package (deferred,
#       deferred-none) (~4 min). Expected: deferred-none from ~15 us to ~2 (staged-none's); measured: the node cost
#       more than the launch it skips (B8/8K deferred-none +21.7 us against the package's +5.7): dropped.
#   bash benchmarks/results/gpu-s47/run.sh vllm-conditional   NOT RUN (the node was dropped): after the vLLM bundle,
#       the copy's full-graph test with KVARN_DEFER_FLUSH=1 (its flushes in IF nodes inside vLLM's captures; ~3 min).
# Each case ran at the commit benchmarks/NOTES.md (sessions 47-48) names. Results are packed into $OUT/results.tgz after
# each step.
source benchmarks/device_steps.sh
start_call "$0" "$1"  # sets repo and here
packed_results "$1"
case $1 in
verify)
    gpu_tests "$repo" 220 && pack
    bench_script flush_overlap.py 220 conditional "$repo" --costs inline deferred deferred-none staged-none \
        deferred-hi deferred-none-hi --rounds 2 --shapes 8x8192,32x8192,128x2048 \
        --timeline none deferred-none deferred --timeline-shapes 8x8192,32x8192 && pack
    bash benchmarks/patched_repo.sh /tmp/before "$here/undo-cond.patch" || exit 1
    bench_script flush_overlap.py 130 unconditional /tmp/before --costs deferred deferred-none --rounds 2 \
        --shapes 8x8192,32x8192,128x2048 && pack
    ;;
probe2)
    python3 -c "import torch; print(torch.__version__, [a for a in dir(torch.cuda.CUDAGraph) if a[0] != '_'])" \
        > "$OUT/cudagraph-api.txt" 2>&1
    python3 -c "import cuda.bindings; print('cuda.bindings', cuda.bindings.__version__)" >> "$OUT/cudagraph-api.txt" 2>&1
    cat "$OUT/cudagraph-api.txt" && pack
    bash benchmarks/patched_repo.sh /tmp/s46 "$here/s46-defer3.patch" || exit 1
    bash benchmarks/patched_repo.sh /tmp/most1 "$here/most1.patch" || exit 1
    for run in package s46 most1; do
        dir=/tmp/$run; [ "$run" = package ] && dir=$repo
        costs="deferred deferred-none"; [ "$run" = package ] && costs="$costs deferred-lag3 deferred-none-lag3"
        bench_script flush_overlap.py 110 "$run" "$dir" --costs $costs --rounds 2 --shapes 8x8192,32x8192 && pack
    done
    ;;
conditional)
    bash benchmarks/patched_repo.sh /tmp/cond "$here/conditional-node.patch" || exit 1
    gpu_tests /tmp/cond 200 tests/test_graph_conditional.py tests/test_kernels.py tests/test_ops.py tests/test_latent.py \
        && pack
    bench_script flush_overlap.py 160 conditional /tmp/cond --costs inline deferred deferred-none staged-none \
        --rounds 2 --shapes 8x8192,32x8192,128x2048 --timeline none deferred-none && pack
    bench_script flush_overlap.py 120 package "$repo" --costs deferred deferred-none --rounds 2 \
        --shapes 8x8192,32x8192,128x2048 && pack
    ;;
vllm-conditional)
    bash benchmarks/patched_repo.sh /tmp/cond "$here/conditional-node.patch" || exit 1
    cd /tmp/cond
    export VLLM_WORKER_MULTIPROC_METHOD=spawn
    source benchmarks/device_vllm_env.sh
    timeout 480 python3 -m pytest -q -rs -p no:cacheprovider tests/test_vllm_plugin.py \
        -k "full_cuda_graphs and tiny_llama" > "$OUT/tests-vllm-conditional.txt" 2>&1
    tail -n 5 "$OUT/tests-vllm-conditional.txt" && pack
    ;;
vllm-defer)
    export VLLM_WORKER_MULTIPROC_METHOD=spawn
    source benchmarks/device_vllm_env.sh
    python3 -c "import vllm; print('vllm', vllm.__version__)" >> "$OUT/env-$1.txt" 2>&1
    timeout 480 python3 -m pytest -q -rs -p no:cacheprovider tests/test_vllm_plugin.py \
        -k "full_cuda_graphs and tiny_llama" > "$OUT/tests-vllm.txt" 2>&1
    tail -n 5 "$OUT/tests-vllm.txt" && pack
    ;;
esac
date -u >> "$OUT/env-$1.txt"
pack
