#!/usr/bin/env bash
# Session 21, one device call (no vLLM): the flush with the token stds' max and min in one reduction (the package
# at this commit) against a copy without it (before-minmax.patch), alternating package / before / package:
# attention.py --append-only (the append and flush columns at 8K, batch 1/8/32/128; CUDA-graph medians).
set -u
repo=$PWD
(date -u; nvidia-smi -L) > $OUT/env-flush-ab.txt 2>&1
bash benchmarks/patched_repo.sh /tmp/repo-before benchmarks/results/h200-s21/before-minmax.patch
for run in package-1 before package-2; do
    dir=$repo
    [ $run = before ] && dir=/tmp/repo-before
    (cd $dir/benchmarks && PYTHONPATH=$dir timeout 80 python3 attention.py --out $OUT/$run --append-only) \
        > $OUT/$run.log 2>&1
    echo "$run: $(grep -o 'batch [0-9]*: append [0-9.]* ms, flush [0-9.]* ms' $OUT/$run.log | tr '\n' ';')"
done | tee $OUT/flush-ab.txt
date -u >> $OUT/env-flush-ab.txt
