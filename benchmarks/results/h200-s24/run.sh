#!/usr/bin/env bash
# Session 24's device calls (H200, device tool), from the repository root:
#   next:  session 23's prepared A/B (`bash benchmarks/results/h200-s23/run.sh next`; code b88191c), files in next/.
#   call2: the decode step's exact split merging the splits itself (tried-merge-in-exact.patch: the exact split's
#          Triton program, launched as a programmatic dependent of the quantized launch, merges and rotates back;
#          no side stream, no combine launch) against the package (code 0503cd8), then the GPU kernel / op / latent
#          tests on the patched code. As run, the patched tree was the device's "package" and the baseline a copy
#          with the reverse diff (package-1 / before / package-2 in call2/ab.txt); this form runs the same two trees.
#   call3: the combine in one step where a row's partials fit one (the max from the same loads) and the decode op's
#          query_start_loc a view of a cached arange (ops.one_token_each), i.e. the package at 6189f4e, against
#          the package before them (before-call3.patch: the reverse diff) and against early-pdl.patch (session 23's
#          PDL patch plus early triggers: the rotation kernel and the Gluon kernel call launch_dependents first
#          thing, so the Gluon kernel starts during the rotation and the combine's programs are resident before
#          the Gluon kernel ends), package / before / pdl / package at 7 shapes; the README table on the package
#          (--profile: the op's kernels at 8K); the decode GPU tests of the package and of the pdl copy side by side.
#          Outputs in results.tgz. The tests' 100 s cut both runs short (61 and 60 passed, none failed).
#   tests: the GPU kernel / op / latent tests of the package (code 6189f4e).
#   next:  prepared for the next session (not run in session 24), ~8 min: which edge of early-pdl.patch helps small
#          steps and which one costs B8/32K. next-pdl-edges.patch is early-pdl.patch with the two edges apart
#          (ops.PDL_EDGES: rotation -> attention, attention -> combine); package / both / rotation / combine / package
#          at 8 shapes from 1 to 16 tiles per program (outputs in next.tgz), then the GPU kernel and op tests of the
#          patched copy with both edges.
set -u
export PYTHONUNBUFFERED=1
repo=$PWD
here=benchmarks/results/h200-s24
(date -u; nvidia-smi -L; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)") \
    > $OUT/env-$1.txt 2>&1
case $1 in
call2)
    bash benchmarks/patched_repo.sh /tmp/repo-merge $here/tried-merge-in-exact.patch
    for run in merge-1 package merge-2; do
        dir=$repo
        [ $run = package ] || dir=/tmp/repo-merge
        (cd $dir/benchmarks && PYTHONPATH=$dir timeout 100 python3 attention.py --out $OUT/$run \
            --shapes 1x2048,1x32768,8x2048,8x32768,8x131072,32x32768,128x2048) > $OUT/$run.log 2>&1
        grep '^| [0-9]' $OUT/$run.log | sed "s/^/$run /"
    done | tee $OUT/ab.txt
    (cd $OUT && tar czf ab.tgz merge-1 package merge-2 ./*.log && rm -rf merge-1 package merge-2 ./*.log)
    (cd /tmp/repo-merge && timeout ${2:-240} python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_kernels.py \
        tests/test_ops.py tests/test_latent.py) > $OUT/tests.txt 2>&1
    tail -5 $OUT/tests.txt
    ;;
call3)
    bash benchmarks/patched_repo.sh /tmp/repo-before $here/before-call3.patch
    bash benchmarks/patched_repo.sh /tmp/repo-pdl $here/early-pdl.patch
    for run in package-1 before pdl package-2; do
        dir=$repo
        [ ${run%-*} = package ] || dir=/tmp/repo-$run
        (cd $dir/benchmarks && PYTHONPATH=$dir timeout 90 python3 attention.py --out $OUT/$run \
            --shapes 1x2048,1x32768,8x2048,8x32768,8x131072,32x32768,128x2048) > $OUT/$run.log 2>&1
        grep '^| [0-9]' $OUT/$run.log | sed "s/^/$run /"
    done | tee $OUT/ab.txt
    (cd benchmarks && PYTHONPATH=$repo timeout 170 python3 attention.py --out $OUT/table --profile) > $OUT/table.log 2>&1
    tail -17 $OUT/table.log
    (cd $OUT && tar czf results.tgz package-1 before pdl package-2 table ./*.log && rm -rf package-1 before pdl \
        package-2 table ./*.log)
    for dir in $repo /tmp/repo-pdl; do
        (cd $dir && timeout ${2:-100} python3 -m pytest -q -p no:cacheprovider -n 6 tests/test_ops.py \
            tests/test_kernels.py -k "decode or split or combine or graph or opcheck or attend or bad_positions") > $OUT/tests-$(basename $dir).txt 2>&1 &
    done
    wait
    tail -n 3 $OUT/tests-*.txt
    ;;
tests)
    timeout ${2:-190} python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_kernels.py tests/test_ops.py \
        tests/test_latent.py > $OUT/tests.txt 2>&1
    tail -n 4 $OUT/tests.txt
    ;;
next)
    bash benchmarks/patched_repo.sh /tmp/repo-both $here/next-pdl-edges.patch
    bash benchmarks/patched_repo.sh /tmp/repo-rotation $here/next-pdl-edges.patch
    bash benchmarks/patched_repo.sh /tmp/repo-combine $here/next-pdl-edges.patch
    sed -i 's/^PDL_EDGES = (True, True)/PDL_EDGES = (True, False)/' /tmp/repo-rotation/kvarn_compile/ops.py
    sed -i 's/^PDL_EDGES = (True, True)/PDL_EDGES = (False, True)/' /tmp/repo-combine/kvarn_compile/ops.py
    grep -h '^PDL_EDGES' /tmp/repo-*/kvarn_compile/ops.py
    for run in package-1 both rotation combine package-2; do
        dir=$repo
        [ ${run%-*} = package ] || dir=/tmp/repo-$run
        (cd $dir/benchmarks && PYTHONPATH=$dir timeout 90 python3 attention.py --out $OUT/$run \
            --shapes 1x2048,1x8192,1x32768,8x2048,8x8192,8x32768,32x8192,128x2048) > $OUT/$run.log 2>&1
        grep '^| [0-9]' $OUT/$run.log | sed "s/^/$run /"
    done | tee $OUT/next-ab.txt
    (cd $OUT && tar czf next.tgz package-1 both rotation combine package-2 ./*.log && rm -rf package-1 both rotation \
        combine package-2 ./*.log)
    (cd /tmp/repo-both && timeout ${2:-150} python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_kernels.py \
        tests/test_ops.py) > $OUT/tests-both.txt 2>&1
    tail -n 3 $OUT/tests-both.txt
    ;;
table)
    (cd benchmarks && PYTHONPATH=$repo timeout 300 python3 attention.py --out $OUT/table) > $OUT/table.log 2>&1
    tail -22 $OUT/table.log
    (cd $OUT && tar czf table.tgz table && rm -rf table)
    ;;
esac
date -u >> $OUT/env-$1.txt
