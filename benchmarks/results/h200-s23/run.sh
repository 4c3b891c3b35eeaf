#!/usr/bin/env bash
# Session 23's device calls (H200, device tool), from the repository root:
#   call1: no vLLM, ~6 min.
#     1. attention.py --sweep-only: the decode op (no checks) over the number of splits per sequence, at 10
#        shapes, beside the split count the launcher picks and the fastest fp16 (sweep/).
#     2. the flush of the package (two-pass stds, ebec026..e0f7ec9, never timed) against session 22's timed form
#        (timed-form.patch: 6401a7b's quantize_store.py), package / timed / package: attention.py --append-only.
#     3. session 22's prepared `run.sh next` (the flush clock probe; 8 vs 16 warps; the 4 / 8 knobs).
#   call2: the package with the split rule by waves (splits_by_waves, resident programs read from the compiled
#          kernel): the sweep again (now from 1 split, the launcher's new picks circled), then the README table
#          (attention.py; FA3 not carried). Outputs in results.tgz (the device tool returns at most 8 files).
#   next:  prepared for the next session (not run in session 23), no vLLM, ~6 min: attention.py --shapes at batch
#          1-128 on package / pdl / tiles / both / package; outputs in next.tgz. Patches (each compiles for sm_90
#          here, CPU tests pass): next-pdl.patch (a decode step's Gluon kernel and combine launched as
#          programmatic dependents), next-quantizable-tiles.patch (the splits share the tiles that can be
#          complete, all but the page table's last: B8/32K 16 programs of 16 tiles instead of 15 of 17 and one of 1).
#   next-tests: the GPU kernel and op tests of decode on the copy with both patches ($2 seconds).
#   call3: session 22's next_flush_warps.py again (its files did not come back from call 1), then the GPU
#          kernel / op / latent tests ($2 seconds).
# Code: d5364ca (call 1), ab70994 (calls 2, 3). The env files' commit line (e0f7ec9) came from the device copy's
# stale .git, not from the tree that ran; the line is gone from this script.
set -u
export PYTHONUNBUFFERED=1
repo=$PWD
here=benchmarks/results/h200-s23
(date -u; nvidia-smi -L; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)") \
    > $OUT/env-$1.txt 2>&1
case $1 in
call1)
    (cd benchmarks && PYTHONPATH=$repo timeout 240 python3 attention.py --out $OUT/sweep --sweep-only) \
        > $OUT/sweep.log 2>&1
    tail -3 $OUT/sweep.log
    bash benchmarks/patched_repo.sh /tmp/repo-timed $here/timed-form.patch
    bash benchmarks/append_ab.sh $OUT package-1=$repo timed=/tmp/repo-timed package-2=$repo
    bash benchmarks/results/h200-s22/run.sh next
    ;;
call2)
    (cd benchmarks && PYTHONPATH=$repo timeout 250 python3 attention.py --out $OUT/sweep --sweep-only) \
        > $OUT/sweep.log 2>&1
    (cd benchmarks && PYTHONPATH=$repo timeout 300 python3 attention.py --out $OUT/table) > $OUT/table.log 2>&1
    tail -22 $OUT/table.log
    (cd $OUT && tar czf results.tgz sweep table && rm -rf sweep table)
    ;;
call3)
    (cd benchmarks && PYTHONPATH=$repo:$repo/benchmarks timeout 150 python3 results/h200-s22/next_flush_warps.py \
        --out $OUT/warps) > $OUT/warps.log 2>&1
    timeout ${2:-400} python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_ops.py \
        tests/test_latent.py > $OUT/tests.txt 2>&1
    tail -3 $OUT/tests.txt
    ;;
next)
    bash benchmarks/patched_repo.sh /tmp/repo-pdl $here/next-pdl.patch
    bash benchmarks/patched_repo.sh /tmp/repo-tiles $here/next-quantizable-tiles.patch
    bash benchmarks/patched_repo.sh /tmp/repo-both $here/next-pdl.patch $here/next-quantizable-tiles.patch
    for run in package-1 pdl tiles both package-2; do
        dir=$repo
        [ ${run%-*} = package ] || dir=/tmp/repo-$run
        (cd $dir/benchmarks && PYTHONPATH=$dir timeout 100 python3 attention.py --out $OUT/$run \
            --shapes 1x2048,1x32768,8x2048,8x32768,8x131072,32x32768,128x2048) > $OUT/$run.log 2>&1
        grep '^| [0-9]' $OUT/$run.log | sed "s/^/$run /"
    done | tee $OUT/next-ab.txt
    (cd $OUT && tar czf next.tgz package-1 pdl tiles both package-2 *.log && rm -rf package-1 pdl tiles both \
        package-2 ./*.log)
    ;;
next-tests)
    [ -d /tmp/repo-both ] || bash benchmarks/patched_repo.sh /tmp/repo-both $here/next-pdl.patch \
        $here/next-quantizable-tiles.patch
    (cd /tmp/repo-both && timeout ${2:-300} python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py \
        tests/test_ops.py -k "split or combine or decode or graph") > $OUT/tests-both.txt 2>&1
    tail -3 $OUT/tests-both.txt
    ;;
esac
date -u >> $OUT/env-$1.txt
