#!/usr/bin/env bash
# Session 34's device call (H200, device tool), from the repository root:
#   probe: (step/) one layer's decode step with no, one or every sequence completing a tile
#          (benchmarks/decode_step.py: what a flush costs in the path serving runs; prepared in session 33, not run
#          there), then (beside/) benchmarks/flush_beside.py: the decode step with a quantization phase (one-warp
#          programs of 64-72 registers, phases of 1, 2 or 4 normalisation passes per tile) on a side stream beside it, alone
#          and in order: whether a tile's quantization can move off the step's path in phases.
source benchmarks/device_steps.sh
start_call "$0" "$1"  # sets repo and here
case $1 in
probe)
    (cd benchmarks && PYTHONPATH=$repo timeout 240 python3 decode_step.py --out $OUT/step) > $OUT/step.log 2>&1
    tail -22 $OUT/step.log
    (cd benchmarks && PYTHONPATH=$repo timeout 300 python3 flush_beside.py --out $OUT/beside) > $OUT/beside.log 2>&1
    tail -12 $OUT/beside.log
    ;;
esac
date -u >> $OUT/env-$1.txt
