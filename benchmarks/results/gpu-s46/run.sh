#!/usr/bin/env bash
# Session 46's device calls, from the repository root:
#   (Session 45's prepared comparison of batch 1 past tile boundaries, not run in session 46 either:
#   `bash benchmarks/results/gpu-s45/run.sh tail`; its patches apply at session 47's last commit. Session 46's
#   package tests, which this script ran before it, ran in session 47: gpu-s47/h100-verify.)
#   bash benchmarks/results/gpu-s46/run.sh defer   decode steps' tile quantizations deferred to a side stream
#       (kvarn_compile.deferred_flush): the GPU kernel, op and latent tests (the deferral's own among them), then
#       flush_overlap.py (4 Qwen3-8B-shaped layers and the lm_head) of the package: none, inline, deferred,
#       deferred-none, beside-2; then of the package before (undo-defer.patch: the commit before the deferral, its
#       benchmarks too): none and inline, to see what the append kernel's loop over sequences costs the in-line
#       path (~8 min).
#   bash benchmarks/results/gpu-s46/run.sh defer2  after `defer` (h100-defer/): FLUSH launches DEFERRED_MOST programs a
#       KV head (program j: the j-th completed tile), STAGE quantizes bursts in line, and the append kernel has no
#       loop over sequences again: the GPU tests, flush_overlap.py of the package (inline, deferred, deferred-none),
#       of the package before the deferral (inline), and of flush4w.patch (FLUSH in 4 warps: two programs an SM;
#       deferred, deferred-none) (~9 min).
#   bash benchmarks/results/gpu-s46/run.sh defer3  after `defer2` (h100-defer2/, whose tests were cut by their limit):
#       STAGE counts the completed tiles only in programs whose own tile completes, FLUSH programs with nothing to do
#       exit at once, calls of fewer than deferred_flush.SMALLEST_BATCH sequences quantize in line: the GPU tests of
#       the append and of the deferral (the device time left allowed no more), then flush_overlap.py of the package
#       (inline, deferred, deferred-none; B8/8K, B32/8K, B128/2K, 2 rounds) (~3 min).
#   The deferral in vLLM, PREPARED, NOT RUN (no device time left), after carrying the vLLM 0.23 bundle
#   (../shared/device/vllm023/make-bundle.sh: .device-carry/vllm023/p1 .. p3 one a call, then with p4
#   `bash .device-carry/vllm023/p4/install.sh && bash benchmarks/results/gpu-s46/run.sh CASE`):
#   bash benchmarks/results/gpu-s46/run.sh vllm-defer-tests  vLLM's full CUDA graphs against piecewise ones, the dense
#       model also with KVARN_DEFER_FLUSH=1 (test_full_cuda_graphs_match_piecewise_ones; ~5 min)
#   bash benchmarks/results/gpu-s46/run.sh vllm-defer-burst  the staggered workload (prompts of 385-512 tokens,
#       2,048 output tokens, 256 at once) with KVARN_DEFER_FLUSH=0 then 1, an engine each (~7 min)
# Each case ran at the commit benchmarks/NOTES.md (session 46) names. Results are packed into $OUT/results.tgz after
# each step.
source benchmarks/device_steps.sh
start_call "$0" "$1"  # sets repo and here
packed_results "$1"
case $1 in
defer)
    gpu_tests "$repo" 150 && pack
    bench_script flush_overlap.py 240 deferred "$repo" --costs inline deferred deferred-none beside-2 && pack
    bash benchmarks/patched_repo.sh /tmp/before "$here/undo-defer.patch" || exit 1
    bench_script flush_overlap.py 150 before /tmp/before --costs inline && pack
    ;;
defer2)
    gpu_tests "$repo" 150 && pack
    bench_script flush_overlap.py 170 deferred "$repo" --costs inline deferred deferred-none && pack
    bash benchmarks/patched_repo.sh /tmp/before "$here/undo-defer.patch" || exit 1
    bench_script flush_overlap.py 110 before /tmp/before --costs inline && pack
    bash benchmarks/patched_repo.sh /tmp/w4 "$here/flush4w.patch" || exit 1
    bench_script flush_overlap.py 130 flush4w /tmp/w4 --costs deferred deferred-none && pack
    ;;
defer3)
    gpu_tests "$repo" 70 tests/test_kernels.py tests/test_ops.py -k "append or staged or decode_sized or deferred \
        or cuda_graph or attend" && pack
    bench_script flush_overlap.py 120 deferred "$repo" --costs inline deferred deferred-none --rounds 2 \
        --shapes 8x8192,32x8192,128x2048 && pack
    ;;
vllm-defer-tests | vllm-defer-burst)
    export VLLM_WORKER_MULTIPROC_METHOD=spawn
    source benchmarks/device_vllm_env.sh
    python3 -c "import vllm; print('vllm', vllm.__version__)" >> "$OUT/env-$1.txt" 2>&1
    if [ "$1" = vllm-defer-tests ]; then
        timeout 540 python3 -m pytest -q -rs -p no:cacheprovider tests/test_vllm_plugin.py -k full_cuda_graphs \
            > "$OUT/tests-vllm.txt" 2>&1
        tail -n 5 "$OUT/tests-vllm.txt" && pack
    else
        for defer in 0 1; do
            (cd benchmarks && KVARN_DEFER_FLUSH=$defer timeout 280 python3 vllm_burst.py --out "$OUT/defer$defer" \
                --dtypes kvarn_k4v2_g128 --output-len 2048 --max-num-seqs 256 --workloads staggered) \
                > "$OUT/defer$defer.log" 2>&1
            grep -i "tokens/s\|error" "$OUT/defer$defer.log" | tail -3 && pack
        done
    fi
    ;;
esac
date -u >> "$OUT/env-$1.txt"
pack
