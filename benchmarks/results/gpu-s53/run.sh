#!/usr/bin/env bash
# Session 53's device calls, from the repository root:
#   bash benchmarks/results/gpu-s53/run.sh table   the README's decode table (attention.py --profile), cold L2 (the
#       default since session 53: each call reads another copy of the caches, from HBM) (up to 9 min; meant for an
#       H200, whose README table is still of session 33's code). On a fresh machine each step compiles its own
#       kernels: session 53's rows-fitted step, the call's first, took 27.7 s for its first shape and 18 s for batch
#       2's and was cut at 90 s with 4 of its 5 shapes done (session 50's, after the table, took 10 s); hence the
#       limits.
#   bash benchmarks/results/gpu-s53/run.sh rows   cold too, the cases the README has warm only: the op past tile
#       boundaries at batch 1-2 (rows of the current tile held) in fitted tables, batch 1-2 at 2K in 32K-wide ones (a
#       server's page tables) (up to 7 min; its wide step ran in session 53, h100-rows/).
# Results are packed into $OUT/results.tgz after each step.
source benchmarks/device_steps.sh
start_call "$0" "$1"  # sets repo and here
packed_results "$1"
case $1 in
table)
    readme_table 540 && (cd "$OUT" && tar czf table.tgz table && rm -rf table) && pack
    ;;
rows)
    time_op rows-fitted "$repo" 240 --shapes 1x2048,1x2112,1x2173,2x2112,8x8317 && pack
    time_op wide "$repo" 180 --table 32768 --shapes 1x2048,1x2112,2x2048 && pack
    ;;
*) unknown_case "$1" ;;
esac
end_call "$1"
