#!/usr/bin/env bash
# Session 53's device calls, from the repository root:
#   bash benchmarks/results/gpu-s53/run.sh table   the README's decode table (attention.py --profile), cold L2 (the
#       default since session 53: each call reads another copy of the caches, from HBM), then, cold too, the op past
#       tile boundaries at batch 1-2 (rows of the current tile held) in fitted tables and batch 1-2 at 2K in 32K-wide
#       ones (a server's page tables): the cases the README left warm-only (~5 min; meant for an H200, whose README
#       table is still of session 33's code).
#   bash benchmarks/results/gpu-s53/run.sh rows   the last two steps of `table` alone (~1.5 min): batch 1-2 at 2K cold
#       with rows of the current tile held and in 32K-wide page tables.
# Results are packed into $OUT/results.tgz after each step.
source benchmarks/device_steps.sh
start_call "$0" "$1"  # sets repo and here
packed_results "$1"
case $1 in
table | rows)
    [ "$1" = table ] && readme_table 240 && (cd "$OUT" && tar czf table.tgz table && rm -rf table) && pack
    time_op rows-fitted "$repo" 90 --shapes 1x2048,1x2112,1x2173,2x2112,8x8317 && pack
    time_op wide "$repo" 90 --table 32768 --shapes 1x2048,1x2112,2x2048 && pack
    ;;
*) unknown_case "$1" ;;
esac
end_call "$1"
