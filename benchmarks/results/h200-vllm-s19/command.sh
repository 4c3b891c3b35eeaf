#!/usr/bin/env bash
# Session 19's device calls (NVIDIA H200, torch 2.11, triton 3.6, vLLM 0.23 from ../../../../shared/device/vllm023;
# each after carrying .device-carry/vllm023/p1..p4, one a call).
#
# 1. (tests-vllm.txt, env-tests.txt; code 133c3d0) full vs piecewise CUDA graphs with the side-stream decode:
#        bash benchmarks/results/h200-combine-s18/next-vllm.sh tests          -> 2 passed (425 s)
# 2. (before-warm-up/; code 133c3d0) the burst and the short run, bf16 vs kvarn, one process:
#        bash benchmarks/results/h200-combine-s18/next-vllm.sh bf16
#    -> burst 7,490 vs 14,429 tok/s (1.93x), short 10,043 vs 9,759 (0.97x). The side stream moved nothing
#    (session 17: 14,424). vLLM's JIT monitor (log.txt) saw _paged_attention_kernel and _quantize_store_kernel
#    finish compiling 8 s and 13 s after the kvarn engine was up, in the benchmark's two untimed warm-up requests
#    (their prefill variants: vLLM's warm-up runs attention in decode batches only); the engine's timeline
#    (up 09:36:20, burst of 36.3 s, short run, shut down 09:37:18) puts ~14 s in those two requests. Before it,
#    `pytest tests/test_ops.py -k bad_positions` (the latent cases changed in session 18) was cut off by its
#    100 s timeout after 8 passing cases (tests-bad-cut-off.txt).
# 3. (warm-up-cut-off/; code 8caa6bb: the plugin's warm-up, compat.warm_up_kernels) the kvarn burst alone, on a
#    fresh machine with the last 300 s of the session's device time. Cut off by its timeout (265 s) before any
#    request: with cold compile caches the engine took 3 min to reach vLLM's kernel warm-up (10:04:55; CUDA-graph
#    memory profiling alone 105 s, where the decode kernels compile), and the log ends inside it. So the warm-up
#    has not run on a GPU yet; the CPU test (test_kernel_warm_up_runs_decode_rows_and_a_prefill_in_the_scratch_slot)
#    runs its batches through the same ops. The command (after the four carries):
set -u
export PYTHONUNBUFFERED=1 VLLM_WORKER_MULTIPROC_METHOD=spawn
source benchmarks/device_vllm_env.sh
(date -u; nvidia-smi -L) > $OUT/env.txt
(cd benchmarks && timeout 265 python3 vllm_burst.py --out $OUT/after-warm-up --dtypes kvarn_k4v2_g128 \
    --output-len 2048 --max-num-seqs 256 --workloads burst) > $OUT/log.txt 2>&1
date -u >> $OUT/env.txt
# Next session (not run): the same with --dtypes kvarn_k4v2_g128 kvarn_k4v2_g128+hook auto and timeout 560, after
# `next-vllm.sh tests` (which starts engines with the warm-up: the first GPU check of it); expected: no
# "JIT compilation during inference" line for a kvarn kernel, the 2 warm-up requests ~1 s instead of ~14 s.
