#!/usr/bin/env bash
# Session 25's device calls (H200, device tool), from the repository root:
#   next:  session 24's prepared PDL-edge A/B (`bash benchmarks/results/h200-s24/run.sh next 150`; code eb13f0d),
#          files in next/.
#   rotq:  a decode step's Gluon kernel rotating q itself (one mma per key field of the raw q and the +-1 block's
#          columns), the rotation of q, k, v for the exact part on the exact part's stream beside it: the package
#          against before-rotq.patch (the reverse diff: the rotation launch before the Gluon kernel), package /
#          before / package at 9 shapes, k4v4_g128 at 2 shapes (package / before), then the GPU kernel / op / latent
#          tests of the package. Outputs in rotq.tgz. Slower everywhere: reverted (tried-rotq.patch).
#   pdl:   the rotation -> attention edge of session 24's early-pdl.patch alone, where a program takes at most
#          PDL_MOST_TILES = 2 tiles (decode_attention.starts_during_rotation), the rotation now launched by
#          paged_attention: package / before (before-pdl.patch, the reverse diff) / package at 8 shapes, the GPU
#          kernel / op / latent tests, then the README table on the package. Outputs in pdl.tgz.
#   most:  PDL_MOST_TILES 2 (the package) against 4 at shapes of 3 and 4 tiles per program (package / most4 /
#          package), to place the edge's threshold between the 2 and 4 tiles measured. Outputs in most.tgz.
set -u
export PYTHONUNBUFFERED=1
repo=$PWD
here=benchmarks/results/h200-s25
source benchmarks/device_steps.sh  # (since session 26; the same command the calls ran inline)
record_env $OUT/env-$1.txt
shapes=1x2048,1x8192,1x32768,8x2048,8x8192,8x32768,8x131072,32x8192,128x2048
case $1 in
rotq)
    bash benchmarks/patched_repo.sh /tmp/repo-before $here/before-rotq.patch
    for run in package-1 before package-2 k4v4-package k4v4-before; do
        dir=$repo
        [ ${run#*-} = before ] && dir=/tmp/repo-before
        extra="--shapes $shapes"
        [ ${run%-*} = k4v4 ] && extra="--preset kvarn_k4v4_g128 --shapes 1x2048,8x32768"
        (cd $dir/benchmarks && PYTHONPATH=$dir timeout 100 python3 attention.py --out $OUT/$run $extra) > $OUT/$run.log 2>&1
        grep '^| [0-9]' $OUT/$run.log | sed "s/^/$run /"
        grep -i 'error\|Traceback' $OUT/$run.log | head -3
    done | tee $OUT/ab.txt
    (cd $OUT && tar czf rotq.tgz package-1 before package-2 k4v4-package k4v4-before ./*.log && rm -rf package-1 before \
        package-2 k4v4-package k4v4-before ./*.log)
    timeout ${2:-200} python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_kernels.py tests/test_ops.py \
        tests/test_latent.py > $OUT/tests.txt 2>&1
    tail -n 6 $OUT/tests.txt
    ;;
pdl)
    bash benchmarks/patched_repo.sh /tmp/repo-before $here/before-pdl.patch
    for run in package-1 before package-2; do
        dir=$repo
        [ $run = before ] && dir=/tmp/repo-before
        (cd $dir/benchmarks && PYTHONPATH=$dir timeout 90 python3 attention.py --out $OUT/$run \
            --shapes 1x2048,1x8192,1x32768,8x2048,8x8192,8x32768,32x8192,128x2048) > $OUT/$run.log 2>&1
        grep '^| [0-9]' $OUT/$run.log | sed "s/^/$run /"
        grep -i 'error\|Traceback' $OUT/$run.log | head -3
    done | tee $OUT/ab.txt
    timeout ${2:-150} python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_kernels.py tests/test_ops.py \
        tests/test_latent.py > $OUT/tests.txt 2>&1
    tail -n 4 $OUT/tests.txt
    (cd benchmarks && PYTHONPATH=$repo timeout 200 python3 attention.py --out $OUT/table) > $OUT/table.log 2>&1
    tail -20 $OUT/table.log
    (cd $OUT && tar czf pdl.tgz package-1 before package-2 table ./*.log && rm -rf package-1 before package-2 table \
        ./*.log)
    ;;
most)
    bash benchmarks/patched_repo.sh /tmp/repo-most4
    sed -i 's/^PDL_MOST_TILES = 2$/PDL_MOST_TILES = 4/' /tmp/repo-most4/kvarn_compile/kernels/decode_attention.py
    grep -h '^PDL_MOST_TILES' kvarn_compile/kernels/decode_attention.py /tmp/repo-most4/kvarn_compile/kernels/*.py
    for run in package-1 most4 package-2; do
        dir=$repo
        [ $run = most4 ] && dir=/tmp/repo-most4
        (cd $dir/benchmarks && PYTHONPATH=$dir timeout 90 python3 attention.py --out $OUT/$run \
            --shapes 4x12288,8x6144,16x3072,2x32768,8x8192,32x2048) > $OUT/$run.log 2>&1
        grep '^| [0-9]' $OUT/$run.log | sed "s/^/$run /"
    done | tee $OUT/most-ab.txt
    (cd $OUT && tar czf most.tgz package-1 most4 package-2 ./*.log && rm -rf package-1 most4 package-2 ./*.log)
    ;;
table)
    (cd benchmarks && PYTHONPATH=$repo timeout 300 python3 attention.py --out $OUT/table --profile) > $OUT/table.log 2>&1
    tail -22 $OUT/table.log
    (cd $OUT && tar czf table.tgz table && rm -rf table)
    ;;
esac
date -u >> $OUT/env-$1.txt
