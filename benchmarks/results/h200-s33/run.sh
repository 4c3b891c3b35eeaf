#!/usr/bin/env bash
# Session 33's device calls (H200, device tool), from the repository root:
#   check: (check/) the GPU kernel / op / latent tests of the package (sessions 31-32 changed the append kernel: no
#          length written for a sequence without new tokens; tightened kernel-vs-reference comparisons; session 30's
#          three decode rows), then the README table of the package.
source benchmarks/device_steps.sh
start_call "$0" "$1"  # sets repo and here
case $1 in
check)
    gpu_tests $repo 280
    readme_table 250
    (cd $OUT && tar czf table.tgz table && rm -rf table)
    ;;
esac
date -u >> $OUT/env-$1.txt
