#!/usr/bin/env bash
# Session 52's device calls, from the repository root:
#   bash benchmarks/results/gpu-s52/run.sh cold   the README table's shapes whose working set fits (or nearly
#       fits) the 50 MB L2 on either side (B1 2K / 8K / 32K, B8 2K / 8K, B32 2K), timed as the README's tables are
#       (the same caches every call: warm L2) and with attention.py --cold-l2 (each call on another copy than the
#       calls beside it: from HBM), in one process each, twice in turn (warm, cold, warm, cold: the spread between a
#       run and its repeat) (~2-4 min).
# Results are packed into $OUT/results.tgz after each step.
source benchmarks/device_steps.sh
start_call "$0" "$1"  # sets repo and here
packed_results "$1"
case $1 in
cold)
    shapes=1x2048,1x8192,1x32768,8x2048,8x8192,32x2048
    for round in 1 2; do
        time_op warm-$round "$repo" 120 --shapes $shapes --no-cold-l2 && pack  # (warm: the default until session 53)
        time_op cold-$round "$repo" 120 --shapes $shapes --cold-l2 && pack
    done
    ;;
*) unknown_case "$1" ;;
esac
end_call "$1"
