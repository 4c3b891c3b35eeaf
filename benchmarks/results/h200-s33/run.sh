#!/usr/bin/env bash
# Session 33's device calls (H200, device tool), from the repository root:
#   check: (check/) the GPU kernel / op / latent tests of the package (sessions 31-32 changed the append kernel: no
#          length written for a sequence without new tokens; tightened kernel-vs-reference comparisons; session 30's
#          three decode rows), then the README table of the package. Found: 202 passed, 1 skipped; the table within
#          1-3% of session 30's (flush B8 0.0828 ms against 0.0805).
#   step:  (step/) one layer's decode step as vLLM runs it (benchmarks/decode_step.py: kvarn::attend_and_append against
#          the same kernels in order) with no, one or every sequence completing a tile: what a flush costs in the
#          path serving runs, on the current kernels (last run in session 21). Not run: no device machine could be
#          started again this session.
source benchmarks/device_steps.sh
start_call "$0" "$1"  # sets repo and here
case $1 in
check)
    gpu_tests $repo 280
    readme_table 250
    (cd $OUT && tar czf table.tgz table && rm -rf table)
    ;;
step)
    (cd benchmarks && PYTHONPATH=$repo timeout 400 python3 decode_step.py --out $OUT/step) > $OUT/step.log 2>&1
    tail -25 $OUT/step.log
    ;;
esac
date -u >> $OUT/env-$1.txt
