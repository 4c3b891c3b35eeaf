#!/usr/bin/env bash
# Session 26's device calls (H200, device tool), from the repository root:
#   tform: the Gluon decode kernel with the scores transposed ([tokens, heads]: the tile's tokens as the mma's rows,
#          the heads as its 8 or 16 columns; the probabilities moved into the value product's operand by movmatrix)
#          against before-tform.patch (the reverse diff: heads as the 16 rows), package / before / package at 9
#          shapes, k4v4_g128 at 2 (package / before), then the GPU kernel / op / latent tests of the package.
#          Outputs in tform.tgz.
#   next:  two changes on top of tform (33245c5): the padded head columns unmasked (32 FSEL per tile fewer) and a
#          one-row combine program of one warp where a row's partials fit one step (no barriers), against
#          before-fsel-combine.patch (both reverted) and before-combine.patch (the combine alone reverted):
#          package / before / fsel-only at 9 shapes, the GPU kernel / op / latent tests, then the README table on
#          the package (attention.py --profile). Outputs in next.tgz.
#          Kept: the combine (the unmasked columns were a wash: tried-unmasked-heads.patch).
#   final: the package after next (the combine kept, the head mask back): the GPU kernel / op / latent tests, then
#          the README table (attention.py --profile). Outputs in final.tgz.
#   steps: one-row combine programs of one warp up to 256 partials (steps of 32 past 32) against up to 32.
#          It ran with the change in the working tree ("package") against its reverse diff ("before"); as a record,
#          the change is now tried-one-warp-steps.patch, applied to a copy: steps / package / steps at batch 1
#          (2K-128K) and B8/32K, then the GPU combine tests of the copy. Outputs in steps.tgz. A wash: not kept.
#   table: the README table on the package (attention.py --profile). Outputs in table.tgz.
set -u
export PYTHONUNBUFFERED=1
repo=$PWD
here=benchmarks/results/h200-s26
(date -u; nvidia-smi -L; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)") \
    > $OUT/env-$1.txt 2>&1
shapes=1x2048,1x8192,1x32768,8x2048,8x8192,8x32768,8x131072,32x8192,128x2048
case $1 in
tform)
    bash benchmarks/patched_repo.sh /tmp/repo-before $here/before-tform.patch
    for run in package-1 before package-2 k4v4-package k4v4-before; do
        dir=$repo
        [ ${run#*-} = before ] && dir=/tmp/repo-before
        extra="--shapes $shapes"
        [ ${run%-*} = k4v4 ] && extra="--preset kvarn_k4v4_g128 --shapes 1x2048,8x32768"
        (cd $dir/benchmarks && PYTHONPATH=$dir timeout 100 python3 attention.py --out $OUT/$run $extra) > $OUT/$run.log 2>&1
        grep '^| [0-9]\|max abs' $OUT/$run.log | sed "s/^/$run /"
        grep -i 'error\|Traceback' $OUT/$run.log | head -3
    done | tee $OUT/ab.txt
    (cd $OUT && tar czf tform.tgz package-1 before package-2 k4v4-package k4v4-before ./*.log && rm -rf package-1 \
        before package-2 k4v4-package k4v4-before ./*.log)
    timeout ${2:-200} python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_kernels.py tests/test_ops.py \
        tests/test_latent.py > $OUT/tests.txt 2>&1
    tail -n 6 $OUT/tests.txt
    ;;
next)
    bash benchmarks/patched_repo.sh /tmp/repo-before $here/before-fsel-combine.patch
    bash benchmarks/patched_repo.sh /tmp/repo-fsel $here/before-combine.patch
    for run in package before fsel-only; do
        dir=$repo
        [ $run = before ] && dir=/tmp/repo-before
        [ $run = fsel-only ] && dir=/tmp/repo-fsel
        (cd $dir/benchmarks && PYTHONPATH=$dir timeout 80 python3 attention.py --out $OUT/$run --shapes $shapes) \
            > $OUT/$run.log 2>&1
        grep '^| [0-9]\|max abs' $OUT/$run.log | sed "s/^/$run /"
        grep -i 'error\|Traceback' $OUT/$run.log | head -3
    done | tee $OUT/ab.txt
    timeout 150 python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_kernels.py tests/test_ops.py \
        tests/test_latent.py > $OUT/tests.txt 2>&1
    tail -n 3 $OUT/tests.txt
    (cd benchmarks && PYTHONPATH=$repo timeout 180 python3 attention.py --out $OUT/table --profile) > $OUT/table.log 2>&1
    tail -22 $OUT/table.log
    (cd $OUT && tar czf next.tgz package before fsel-only table ./*.log && rm -rf package before fsel-only table ./*.log)
    ;;
final)
    timeout 150 python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_kernels.py tests/test_ops.py \
        tests/test_latent.py > $OUT/tests.txt 2>&1
    tail -n 3 $OUT/tests.txt
    (cd benchmarks && PYTHONPATH=$repo timeout 180 python3 attention.py --out $OUT/table --profile) > $OUT/table.log 2>&1
    tail -22 $OUT/table.log
    (cd $OUT && tar czf final.tgz table ./*.log && rm -rf table ./*.log)
    ;;
steps)
    bash benchmarks/patched_repo.sh /tmp/repo-steps $here/tried-one-warp-steps.patch
    for run in steps-1 package steps-2; do
        dir=/tmp/repo-steps
        [ $run = package ] && dir=$repo
        (cd $dir/benchmarks && PYTHONPATH=$dir timeout 80 python3 attention.py --out $OUT/$run \
            --shapes 1x2048,1x8192,1x32768,1x131072,8x32768) > $OUT/$run.log 2>&1
        grep '^| [0-9]' $OUT/$run.log | sed "s/^/$run /"
        grep -i 'error\|Traceback' $OUT/$run.log | head -3
    done | tee $OUT/ab.txt
    (cd /tmp/repo-steps && timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k combine) \
        > $OUT/tests.txt 2>&1
    tail -n 2 $OUT/tests.txt
    (cd $OUT && tar czf steps.tgz steps-1 package steps-2 ./*.log && rm -rf steps-1 package steps-2 ./*.log)
    ;;
table)
    (cd benchmarks && PYTHONPATH=$repo timeout 300 python3 attention.py --out $OUT/table --profile) > $OUT/table.log 2>&1
    tail -22 $OUT/table.log
    (cd $OUT && tar czf table.tgz table && rm -rf table)
    ;;
esac
date -u >> $OUT/env-$1.txt
