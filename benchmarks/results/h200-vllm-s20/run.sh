#!/usr/bin/env bash
# Session 20's device calls (H200, vLLM 0.23 bundle carried first), one mode a call:
#   burst-bf16: bf16 vs kvarn on the burst; the first GPU run of the start-up kernel warm-up
#               (compat.warm_up_kernels): expected no kvarn kernel in vLLM's JIT monitor after start-up and
#               the two warm-up requests ~1 s instead of ~14 s.
#   burst-fp8:  fp8 vs kvarn vs kvarn with the --compilation-config hook (not run: no device time left).
set -u
export PYTHONUNBUFFERED=1 VLLM_WORKER_MULTIPROC_METHOD=spawn
source benchmarks/device_vllm_env.sh
(date -u; nvidia-smi -L; python3 -c "import torch, triton, vllm; print(torch.__version__, triton.__version__, vllm.__version__)") \
    > $OUT/env-$1.txt 2>&1
case $1 in
burst-bf16) dtypes="auto kvarn_k4v2_g128" ;;
burst-fp8) dtypes="fp8 kvarn_k4v2_g128 kvarn_k4v2_g128+hook" ;;
esac
(cd benchmarks && timeout ${2:-560} python3 vllm_burst.py --out $OUT/$1 --dtypes $dtypes \
    --output-len 2048 --max-num-seqs 256 --workloads burst) > $OUT/$1.log 2>&1
date -u >> $OUT/env-$1.txt
