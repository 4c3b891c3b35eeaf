#!/usr/bin/env bash
# Session 21's device calls (H200), after carrying the vLLM 0.23 bundle's p1..p3 (one a call, back to back):
#   pkg:     p4 installs vLLM; then bf16 vs kvarn (the package) on the staggered burst (prompts of 385-512
#            tokens: requests complete tiles in most decode steps) and the burst, side by side.
#   parts:   no vLLM: overlap_variants.py (fork orders of a decode step's append, beside its attention) and
#            flush_parts.py (the flush with fewer normalisation iterations / flip rounds).
#   overlap: with the bundle: the kvarn engine on a copy with next-append-overlap.patch, same workloads (not run).
#   fp8:     with the bundle (after p4 on a fresh machine, or pkg/overlap on this one): fp8 vs kvarn, the same
#            workloads (not run: no device time left; ~7 min, so a call of its own).
set -u
export PYTHONUNBUFFERED=1 VLLM_WORKER_MULTIPROC_METHOD=spawn
repo=$PWD
(date -u; nvidia-smi -L) > $OUT/env-$1.txt 2>&1
burst() {  # $1: out dir, $2: dtypes, $3: timeout
    (source benchmarks/device_vllm_env.sh && python3 -c "import torch, triton, vllm; print(torch.__version__, \
triton.__version__, vllm.__version__)" && cd benchmarks && timeout $3 python3 vllm_burst.py --out $1 --dtypes $2 \
        --output-len 2048 --max-num-seqs 256 --workloads staggered burst)
}
case $1 in
pkg)
    bash .device-carry/vllm023/p4/install.sh > $OUT/install.txt 2>&1
    burst $OUT/pkg "auto kvarn_k4v2_g128" ${2:-540} > $OUT/pkg.log 2>&1
    ;;
parts)
    (cd benchmarks && PYTHONPATH=$repo:$repo/benchmarks timeout 150 python3 ../benchmarks/results/h200-s21/overlap_variants.py \
        --out $OUT/variants) > $OUT/variants.log 2>&1
    (cd benchmarks && PYTHONPATH=$repo:$repo/benchmarks timeout 120 python3 ../benchmarks/results/h200-s21/flush_parts.py \
        --out $OUT/flush) > $OUT/flush.log 2>&1
    ;;
overlap)
    bash benchmarks/patched_repo.sh /tmp/repo-overlap benchmarks/results/h200-vllm-s20/next-append-overlap.patch
    (cd /tmp/repo-overlap && burst $OUT/overlap kvarn_k4v2_g128 ${2:-400}) > $OUT/overlap.log 2>&1
    ;;
fp8)
    [ -f /tmp/vllm023-site/.installed ] || bash .device-carry/vllm023/p4/install.sh > $OUT/install.txt 2>&1
    burst $OUT/fp8 "fp8 kvarn_k4v2_g128" ${2:-540} > $OUT/fp8.log 2>&1
    ;;
esac
date -u >> $OUT/env-$1.txt
