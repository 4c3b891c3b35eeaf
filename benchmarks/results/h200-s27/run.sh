#!/usr/bin/env bash
# Session 27's device calls (H200, device tool), from the repository root:
#   merge: (call1/) a decode step's exact split, launched after the Gluon kernel as its programmatic dependent,
#          merges the step's partials into the output itself where a row has <= 32 of them (no combine launch, no
#          side stream), against call1/before-merge.patch (the reverse diff: the exact split on a side stream, then
#          the combine) and call1/try-merge-256.patch (the merge up to 256 partials a row, in steps): package /
#          before / merge-256 / package at 9 shapes, then the GPU kernel / op / latent tests. Outputs in merge.tgz.
#          Found: the side stream's fork had moved after the Gluon launch (the exact split then waited for it:
#          B1/8K 0.0135 -> 0.0157 ms), and B128/2K lost 13% (1,024 exact programs that no longer ran beside).
#   gate:  (call2/) the fork back before the Gluon launch; the merge only up to 96 partials a row and 2 exact
#          programs per SM, its exact keys 32 at a time, against before-merge.patch (the reverse diff) and
#          try-block-n-16.patch / try-block-n-64.patch (16 / 64 exact keys at a time): package / before / bn16 /
#          bn64 / package at 8 shapes, then the GPU kernel / op / latent tests. Outputs in gate.tgz. The first
#          package run was cut off by its time limit (its kernels compiled): package-2 is the package's row.
#   final: the package (the merge as in gate, 16 exact keys at a time): package / try-merge-warps-2.patch (the
#          merging programs with 2 warps) / package at 4 small shapes, the GPU kernel / op / latent tests, then the
#          README table (attention.py --profile). Outputs in final.tgz. The tests were cut off by their 150-s limit
#          after 161 of 162 had passed (tests.txt): run again in tests.
#   tests: the GPU kernel / op / latent tests of the final code (docstrings and the gate's form changed since
#          final), with a longer limit. Output in tests.txt.
#   sweep: the op over its number of splits at B1/2K, B1/8K and B8/2K (attention.py --sweep-only): how a step's
#          time grows with the tiles a Gluon program takes (1 at 16 splits of B1/2K), for the next lever.
#          Outputs in call5/sweep/.
# (Calls 2-4 ran with the steps of start_call written out here, call1 without its matplotlib step; they moved
# into device_steps.sh after the calls.)
source benchmarks/device_steps.sh
start_call "$0" "$1"  # sets repo and here
case $1 in
merge)
    shapes=1x2048,1x8192,1x32768,8x2048,8x8192,8x32768,8x131072,32x8192,128x2048
    bash benchmarks/patched_repo.sh /tmp/repo-before $here/call1/before-merge.patch
    bash benchmarks/patched_repo.sh /tmp/repo-256 $here/call1/try-merge-256.patch
    {
        time_op package-1 $repo 90 --shapes $shapes
        time_op before /tmp/repo-before 90 --shapes $shapes
        time_op merge-256 /tmp/repo-256 90 --shapes $shapes
        time_op package-2 $repo 90 --shapes $shapes
    } | tee $OUT/ab.txt
    gpu_tests $repo 150
    (cd $OUT && tar czf merge.tgz package-1 before merge-256 package-2 ./*.log && rm -rf package-1 before merge-256 \
        package-2 ./*.log)
    ;;
gate)
    shapes=1x2048,1x8192,1x32768,8x2048,8x8192,8x32768,32x8192,128x2048
    bash benchmarks/patched_repo.sh /tmp/repo-before $here/call2/before-merge.patch
    bash benchmarks/patched_repo.sh /tmp/repo-bn16 $here/call2/try-block-n-16.patch
    bash benchmarks/patched_repo.sh /tmp/repo-bn64 $here/call2/try-block-n-64.patch
    {
        time_op package-1 $repo 80 --shapes $shapes
        time_op before /tmp/repo-before 80 --shapes $shapes
        time_op bn16 /tmp/repo-bn16 80 --shapes $shapes
        time_op bn64 /tmp/repo-bn64 80 --shapes $shapes
        time_op package-2 $repo 80 --shapes $shapes
    } | tee $OUT/ab.txt
    gpu_tests $repo 150
    (cd $OUT && tar czf gate.tgz package-1 before bn16 bn64 package-2 ./*.log && rm -rf package-1 before bn16 bn64 \
        package-2 ./*.log)
    ;;
final)
    shapes=1x2048,1x8192,8x2048,8x8192
    bash benchmarks/patched_repo.sh /tmp/repo-w2 $here/try-merge-warps-2.patch
    {
        time_op package-1 $repo 75 --shapes $shapes
        time_op warps-2 /tmp/repo-w2 60 --shapes $shapes
        time_op package-2 $repo 50 --shapes $shapes
    } | tee $OUT/ab.txt
    gpu_tests $repo 150
    readme_table 200
    (cd $OUT && tar czf final.tgz package-1 warps-2 package-2 table ./*.log && rm -rf package-1 warps-2 package-2 \
        table ./*.log)
    ;;
tests)
    gpu_tests $repo 300
    ;;
sweep)
    (cd benchmarks && PYTHONPATH=$repo timeout 170 python3 attention.py --out $OUT/sweep --sweep-only \
        --shapes 1x2048,1x8192,8x2048) > $OUT/sweep.log 2>&1
    tail -n 40 $OUT/sweep.log
    ;;
esac
date -u >> $OUT/env-$1.txt
