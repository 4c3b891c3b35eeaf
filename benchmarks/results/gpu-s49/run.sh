#!/usr/bin/env bash
# Session 49's device calls, from the repository root:
#   bash benchmarks/results/gpu-s49/run.sh verify   session 48's review fixes on a GPU (the flush stream waits for each
#       STAGE when a call is staged; the capture checks), then how many layers a FLUSH launch should serve:
#       flush_overlap.py with 16 layers, the package (GROUP 4) beside GROUP 1, 8 and 16 (deferred and deferred-none
#       each), in line and staged-none, at B8/8K, B32/8K, B128/2K; then 36 layers (Qwen3-8B's count) at B8/8K and
#       B32/8K, GROUP 4, 8 and 16 (~6 min).
#   bash benchmarks/results/gpu-s49/run.sh vllm-test   after carrying the vLLM 0.23 bundle (five parts: gpu-s47/run.sh
#       says how), vLLM's full CUDA graphs with deferred flushes against piecewise ones (session 48's review fixes
#       in vLLM; ~3 min); then, on the warm machine,
#   bash benchmarks/results/gpu-s49/run.sh vllm-burst   session 48's staggered pair again on another machine (Qwen3-8B
#       shape, 256 requests, 1,024 output tokens, KVARN_DEFER_FLUSH=0 then 1, an engine each; ~6 min).
#   bash benchmarks/results/gpu-s49/run.sh edge   the flush stream waiting for a group's first STAGE and at the launch
#       (the package now) against a wait for each staged call (per-call-wait.patch: the package before): the
#       deferral's GPU tests, then flush_overlap.py of both with 16 layers (deferred, deferred-none, staged-none at
#       B8/8K and B32/8K, 3 rounds) and 36 layers (deferred-none at B32/8K), one after the other (~5 min).
#   bash benchmarks/results/gpu-s49/run.sh timeline   where the deferral's every-step cost goes: flush_overlap.py's
#       timelines of none, staged-none, deferred-none (GROUP 4) and deferred-none-g16 at B32/8K, 16 layers, with the
#       costs of 2 rounds (~2 min).
# Results are packed into $OUT/results.tgz after each step.
source benchmarks/device_steps.sh
start_call "$0" "$1"  # sets repo and here
packed_results "$1"
case $1 in
verify)
    gpu_tests "$repo" 220 && pack
    bench_script flush_overlap.py 240 layers16 "$repo" --layers 16 --rounds 2 --shapes 8x8192,32x8192,128x2048 \
        --costs inline deferred deferred-none deferred-g1 deferred-none-g1 deferred-g8 deferred-none-g8 \
        deferred-g16 deferred-none-g16 staged-none && pack
    bench_script flush_overlap.py 200 layers36 "$repo" --layers 36 --rounds 2 --shapes 8x8192,32x8192 \
        --costs inline deferred deferred-none deferred-g8 deferred-none-g8 deferred-g16 deferred-none-g16 && pack
    ;;
edge)
    gpu_tests "$repo" 150 tests/test_ops.py -k "defer or flush" && pack
    bash benchmarks/patched_repo.sh /tmp/per-call "$here/per-call-wait.patch" || exit 1
    for round in 1 2; do
        for form in package per-call; do
            dir=$repo && [ $form = per-call ] && dir=/tmp/per-call
            bench_script flush_overlap.py 120 $form-16-$round "$dir" --layers 16 --rounds 2 \
                --shapes 8x8192,32x8192 --costs deferred deferred-none staged-none && pack
        done
    done
    for form in package per-call; do
        dir=$repo && [ $form = per-call ] && dir=/tmp/per-call
        bench_script flush_overlap.py 120 $form-36 "$dir" --layers 36 --rounds 2 --shapes 32x8192 \
            --costs deferred-none && pack
    done
    ;;
timeline)
    bench_script flush_overlap.py 200 layers16 "$repo" --layers 16 --rounds 2 --shapes 32x8192 \
        --costs deferred-none deferred-none-g16 staged-none \
        --timeline none staged-none deferred-none deferred-none-g16 --timeline-shapes 32x8192 && pack
    ;;
vllm-test | vllm-burst)
    export VLLM_WORKER_MULTIPROC_METHOD=spawn
    source benchmarks/device_vllm_env.sh
    if [ "$1" = vllm-test ]; then
        timeout 420 python3 -m pytest -q -rs -p no:cacheprovider tests/test_vllm_plugin.py \
            -k "full_cuda_graphs and tiny_llama" > "$OUT/tests-vllm.txt" 2>&1
        tail -n 5 "$OUT/tests-vllm.txt"
    else
        for defer in 0 1; do
            (cd benchmarks && KVARN_DEFER_FLUSH=$defer timeout 260 python3 vllm_burst.py \
                --out "$OUT/burst/defer$defer" --dtypes kvarn_k4v2_g128 --output-len 1024 --max-num-seqs 256 \
                --workloads staggered) > "$OUT/burst-defer$defer.log" 2>&1
            grep "^| kvarn" "$OUT/burst/defer$defer/results.md"; pack
        done
    fi
    ;;
esac
date -u >> "$OUT/env-$1.txt"
pack
