#!/usr/bin/env bash
# Session 22's device calls (H200, device tool), from the repository root:
#   flush: no vLLM; ran on 6401a7b (before.patch applies to that commit only). The append kernel's flush there
#          (normalisation from one pass of centred sums per axis, fast logs, int32 search keys in the flip
#          rounds) against a copy with the kernels of 75afa8f (before.patch), alternating package / before /
#          package: attention.py --append-only (append and flush at 8K, batch 1/8/32/128; CUDA-graph medians). Then session 21's flush_parts.py on the package
#          (the flush with iterations / flip rounds varied: compare with h200-s21/parts/flush), then the GPU
#          tests of the kernels and ops.
#   pkg:   after carrying the vLLM 0.23 bundle's p1..p3: bf16 vs kvarn on the staggered burst and the burst.
#   fp8:   the same with fp8 vs kvarn.
#   next:  prepared for the next session (not run in session 22), no vLLM, ~3 min: the flush clock probe
#          (next-flush-clock.patch + flush_clock.py) and next_flush_warps.py (8 vs 16 warps with 0, 2 or all
#          sequences completing a tile; the 4 / 8 knobs).
set -u
export PYTHONUNBUFFERED=1 VLLM_WORKER_MULTIPROC_METHOD=spawn
repo=$PWD
here=benchmarks/results/h200-s22
(date -u; nvidia-smi -L; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)") \
    > $OUT/env-$1.txt 2>&1
burst() {  # $1: out dir, $2: dtypes, $3: timeout
    (source benchmarks/device_vllm_env.sh && python3 -c "import torch, triton, vllm; print(torch.__version__, \
triton.__version__, vllm.__version__)" && cd benchmarks && timeout $3 python3 vllm_burst.py --out $1 --dtypes $2 \
        --output-len 2048 --max-num-seqs 256 --workloads staggered burst)
}
case $1 in
flush)
    bash benchmarks/patched_repo.sh /tmp/repo-before $here/before.patch
    for run in package-1 before package-2; do
        dir=$repo
        [ $run = before ] && dir=/tmp/repo-before
        (cd $dir/benchmarks && PYTHONPATH=$dir timeout 80 python3 attention.py --out $OUT/$run --append-only) \
            > $OUT/$run.log 2>&1
        echo "$run: $(grep -o 'batch [0-9]*: append [0-9.]* ms, flush [0-9.]* ms' $OUT/$run.log | tr '\n' ';')"
    done | tee $OUT/flush-ab.txt
    (cd benchmarks && PYTHONPATH=$repo:$repo/benchmarks timeout 100 python3 results/h200-s21/flush_parts.py \
        --out $OUT/parts) > $OUT/parts.log 2>&1
    timeout 200 python3 -m pytest -q -x tests/test_kernels.py tests/test_ops.py tests/test_latent.py \
        > $OUT/tests.txt 2>&1
    tail -3 $OUT/tests.txt
    ;;
pkg)
    bash .device-carry/vllm023/p4/install.sh > $OUT/install.txt 2>&1
    burst $OUT/pkg "auto kvarn_k4v2_g128" ${2:-540} > $OUT/pkg.log 2>&1
    ;;
next)
    bash benchmarks/patched_repo.sh /tmp/repo-clock $here/next-flush-clock.patch
    (cd /tmp/repo-clock/benchmarks && PYTHONPATH=/tmp/repo-clock:$PWD timeout 120 python3 \
        results/h200-s22/flush_clock.py --out $OUT/clock) > $OUT/clock.log 2>&1
    (cd benchmarks && PYTHONPATH=$repo:$repo/benchmarks timeout 240 python3 results/h200-s22/next_flush_warps.py \
        --out $OUT/warps) > $OUT/warps.log 2>&1
    tail -30 $OUT/clock.log $OUT/warps.log
    ;;
fp8)
    [ -f /tmp/vllm023-site/.installed ] || bash .device-carry/vllm023/p4/install.sh > $OUT/install.txt 2>&1
    burst $OUT/fp8 "fp8 kvarn_k4v2_g128" ${2:-540} > $OUT/fp8.log 2>&1
    ;;
esac
date -u >> $OUT/env-$1.txt
