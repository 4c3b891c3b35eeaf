#!/usr/bin/env bash
# Session 26's device calls (H200, device tool), from the repository root (the commands they repeat are
# benchmarks/device_steps.sh, moved there after the calls: the same commands, traced side by side on a CPU
# with stubbed tools, except that steps' combine tests now run on 8 workers as the others do):
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
source benchmarks/device_steps.sh
record_env $OUT/env-$1.txt
shapes=1x2048,1x8192,1x32768,8x2048,8x8192,8x32768,8x131072,32x8192,128x2048
case $1 in
tform)
    bash benchmarks/patched_repo.sh /tmp/repo-before $here/before-tform.patch
    {
        time_op package-1 $repo 100 --shapes $shapes
        time_op before /tmp/repo-before 100 --shapes $shapes
        time_op package-2 $repo 100 --shapes $shapes
        time_op k4v4-package $repo 100 --preset kvarn_k4v4_g128 --shapes 1x2048,8x32768
        time_op k4v4-before /tmp/repo-before 100 --preset kvarn_k4v4_g128 --shapes 1x2048,8x32768
    } | tee $OUT/ab.txt
    (cd $OUT && tar czf tform.tgz package-1 before package-2 k4v4-package k4v4-before ./*.log && rm -rf package-1 \
        before package-2 k4v4-package k4v4-before ./*.log)
    gpu_tests $repo ${2:-200}
    ;;
next)
    bash benchmarks/patched_repo.sh /tmp/repo-before $here/before-fsel-combine.patch
    bash benchmarks/patched_repo.sh /tmp/repo-fsel $here/before-combine.patch
    {
        time_op package $repo 80 --shapes $shapes
        time_op before /tmp/repo-before 80 --shapes $shapes
        time_op fsel-only /tmp/repo-fsel 80 --shapes $shapes
    } | tee $OUT/ab.txt
    gpu_tests $repo 150
    readme_table 180
    (cd $OUT && tar czf next.tgz package before fsel-only table ./*.log && rm -rf package before fsel-only table ./*.log)
    ;;
final)
    gpu_tests $repo 150
    readme_table 180
    (cd $OUT && tar czf final.tgz table ./*.log && rm -rf table ./*.log)
    ;;
steps)
    bash benchmarks/patched_repo.sh /tmp/repo-steps $here/tried-one-warp-steps.patch
    steps_shapes=1x2048,1x8192,1x32768,1x131072,8x32768
    {
        time_op steps-1 /tmp/repo-steps 80 --shapes $steps_shapes
        time_op package $repo 80 --shapes $steps_shapes
        time_op steps-2 /tmp/repo-steps 80 --shapes $steps_shapes
    } | tee $OUT/ab.txt
    gpu_tests /tmp/repo-steps 100 tests/test_kernels.py -k combine
    (cd $OUT && tar czf steps.tgz steps-1 package steps-2 ./*.log && rm -rf steps-1 package steps-2 ./*.log)
    ;;
table)
    readme_table 300
    (cd $OUT && tar czf table.tgz table && rm -rf table)
    ;;
esac
date -u >> $OUT/env-$1.txt
