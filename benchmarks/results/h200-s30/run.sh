#!/usr/bin/env bash
# Session 30's device calls (H200, device tool), from the repository root:
#   copy:  (call1/) the large shapes' 2-2.5% loss since session 28: package / one-copy (try-one-copy.patch, session
#          29's next-one-copy.patch: whole-tile programs stage the key-side scales in one copy, each staged piece's
#          address computed once) / before (before.patch: session 28's kernels, 4d13288) / package again. Found (op
#          ms): B8/32K 0.0796 / 0.0785 / 0.0778 / 0.0798, B32/8K 0.0821 / 0.0811 / 0.0802 / 0.0819: one-copy kept.
#   rotq:  (call2/) where the tiles go in halves, the Gluon programs rotate q themselves (butterflies, rotate_q), so the
#          step has no rotation launch: package / no-rotq (no-rotq.patch: q from the rotation launch, as in call1) /
#          package again, then the GPU kernel / op / latent tests of the package. Found: B1/2K 0.0081 / 0.0082 /
#          0.0081 (cuDNN 0.0081); the PDL replay test expected a rotation launch (rewritten).
#   probe: (call3/) where B1/2K's op spends the 1.2 us beyond the kernels from rotated inputs (floor probes, wrong
#          outputs: --unchecked): package / exact-norot (probe-exact-norot.patch: the exact split skips its rotation
#          of q) / gluon-noop (probe-gluon-noop.patch: the Gluon programs read q unrotated, no butterflies, no layout
#          conversions) / both; then the GPU kernel / op / latent tests of the package. Found (B1/2K op ms): 0.0082 /
#          0.0079 / 0.0071 / 0.0070: the Gluon programs' rotation (its shared-memory conversions) is 1.1 us of the step.
#   final: (final/) the Gluon programs rotate q in the B operands' layout (no shared memory): package / prev-rotq
#          (prev-rotq.patch: call2's form, rotated in the accumulator layout and moved through shared memory), then the
#          GPU kernel / op / latent tests and the README table of the package. Found (op ms): B1/2K 0.0079 / 0.0081
#          (cuDNN 0.0081), B2/2K 0.0086 / 0.0090; 184 GPU tests pass; table: B1/2K 1.03x, B8/32K 3.10x.
source benchmarks/device_steps.sh
start_call "$0" "$1"  # sets repo and here
case $1 in
copy)
    shapes=1x2048,8x32768,32x8192,128x32768
    bash benchmarks/patched_repo.sh /tmp/repo-copy $here/try-one-copy.patch
    bash benchmarks/patched_repo.sh /tmp/repo-before $here/before.patch
    {
        time_op package-1 $repo 130 --shapes $shapes
        time_op one-copy /tmp/repo-copy 90 --shapes $shapes
        time_op before /tmp/repo-before 90 --shapes $shapes
        time_op package-2 $repo 60 --shapes $shapes
    } | tee $OUT/ab.txt
    (cd $OUT && tar czf ab.tgz package-1 one-copy before package-2 ./*.log && rm -rf package-1 one-copy before package-2 ./*.log)
    ;;
rotq)
    shapes=1x2048,2x2048,4x2048,8x2048
    bash benchmarks/patched_repo.sh /tmp/repo-no-rotq $here/no-rotq.patch
    {
        time_op package-1 $repo 120 --shapes $shapes
        time_op no-rotq /tmp/repo-no-rotq 80 --shapes $shapes
        time_op package-2 $repo 50 --shapes $shapes
    } | tee $OUT/ab.txt
    (cd $OUT && tar czf ab.tgz package-1 no-rotq package-2 ./*.log && rm -rf package-1 no-rotq package-2 ./*.log)
    gpu_tests $repo 200
    ;;
probe)
    shapes=1x2048,2x2048
    bash benchmarks/patched_repo.sh /tmp/repo-exact $here/probe-exact-norot.patch
    bash benchmarks/patched_repo.sh /tmp/repo-gluon $here/probe-gluon-noop.patch
    bash benchmarks/patched_repo.sh /tmp/repo-both $here/probe-exact-norot.patch $here/probe-gluon-noop.patch
    {
        time_op package $repo 100 --shapes $shapes
        time_op exact-norot /tmp/repo-exact 70 --shapes $shapes --unchecked
        time_op gluon-noop /tmp/repo-gluon 70 --shapes $shapes --unchecked
        time_op both /tmp/repo-both 70 --shapes $shapes --unchecked
    } | tee $OUT/ab.txt
    (cd $OUT && tar czf ab.tgz package exact-norot gluon-noop both ./*.log && rm -rf package exact-norot gluon-noop both ./*.log)
    gpu_tests $repo 200
    ;;
final)
    shapes=1x2048,2x2048,8x2048,1x8192
    bash benchmarks/patched_repo.sh /tmp/repo-prev $here/prev-rotq.patch
    {
        time_op package $repo 100 --shapes $shapes
        time_op prev-rotq /tmp/repo-prev 70 --shapes $shapes
    } | tee $OUT/ab.txt
    (cd $OUT && tar czf ab.tgz package prev-rotq ./*.log && rm -rf package prev-rotq ./*.log)
    gpu_tests $repo 190
    readme_table 220
    (cd $OUT && tar czf table.tgz table && rm -rf table)
    ;;
esac
date -u >> $OUT/env-$1.txt
