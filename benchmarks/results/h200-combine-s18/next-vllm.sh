#!/usr/bin/env bash
# For a later device session (not run yet): session 18's decode changes (the two-pass combine, the exact split on a
# side stream) under vLLM 0.23 on the GPU. After carrying the bundle (.device-carry/vllm023/p1..p4, one a call):
#     bash benchmarks/results/h200-combine-s18/next-vllm.sh tests    # ~200 s: full vs piecewise CUDA graphs
#     bash benchmarks/results/h200-combine-s18/next-vllm.sh bf16     # ~280 s: the burst + short, bf16 vs kvarn
#     bash benchmarks/results/h200-combine-s18/next-vllm.sh fp8      # ~350 s: the same against fp8
# Predicted: the tests pass (the fork and join are captured as two graph branches, as in test_ops' CUDA-graph
# replays); the burst ~2-3% faster than session 17's (14,424 tok/s vs bf16): the kernels gained 4% at batch 256 /
# 1.5K, the attention is about half a decode step.
set -u
export PYTHONUNBUFFERED=1 VLLM_WORKER_MULTIPROC_METHOD=spawn
source benchmarks/device_vllm_env.sh
(date -u; nvidia-smi -L; python3 -c "import torch, triton, vllm; print(torch.__version__, triton.__version__, vllm.__version__)") \
    > $OUT/env-$1.txt 2>&1
case $1 in
tests) timeout 560 python3 -m pytest -q -rs tests/test_vllm_plugin.py -k "full_cuda_graphs" > $OUT/tests-vllm.txt 2>&1 ;;
bf16 | fp8)
    base=$([ "$1" = bf16 ] && echo auto || echo fp8)
    (cd benchmarks && timeout 580 python3 vllm_burst.py --out $OUT/$1-kvarn --dtypes $base kvarn_k4v2_g128 \
        --output-len 2048 --max-num-seqs 256 --workloads burst short) > $OUT/$1-kvarn.log 2>&1 ;;
esac
date -u >> $OUT/env-$1.txt
