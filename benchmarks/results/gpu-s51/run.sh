#!/usr/bin/env bash
# Session 51's device calls, from the repository root:
#   bash benchmarks/results/gpu-s51/run.sh span   (prepared in session 50) whether a side branch costs the nodes it
#       spans or the whole graph (the H100's +16 us of 16 layers for one tiny fork): 16 layers at B8/8K and B32/8K,
#       staged-none, tiny-16 (forked at layer 0, joined at the end), tiny-last (forked after the last layer's
#       attention), tiny-4, tiny-4-soon (joined a layer later), wide-4 (tiny-4 with 128 light programs, as many as an
#       empty FLUSH launch's heavy ones), deferred, deferred-none; then, on a copy with join-next.patch (a launched
#       flush joined by the next deferring call: its branch spans one layer, not eight), the deferral's GPU tests
#       (one fails by design: test_a_caller_on_the_flush_stream_gets_another_or_a_warning[launched], as on the CPU,
#       since the patch joins a launched flush before that check) and deferred, deferred-none; last, the package's
#       staged-none, tiny-16 and deferred-none with CUDA_DEVICE_MAX_CONNECTIONS=32 (the hardware work queues a
#       process may use, 8 by default: whether the graph's streams share one) (~5 min).
#   bash benchmarks/results/gpu-s51/run.sh table   the README's decode table (attention.py --profile) and the op past
#       tile boundaries at batch 1-2 (rows of the current tile held), for an H200 (~4 min).
#   bash benchmarks/results/gpu-s51/run.sh halves   whether tiles in halves serve batch 1 in a server's page tables
#       (32K tokens wide, as max_model_len's). A fitted table at B1/2K gets 16 splits of one tile in halves (0.0081-
#       0.0082 ms, H100, sessions 44-45), a 32K-wide one 64 splits of 4 whole tiles (0.0096); half as many splits in
#       halves would give a short context's live tiles the fitted table's programs, if long contexts lose nothing by
#       them. First the op (attention.py) of the package and of a copy with wide-halves.patch (splits of several
#       tiles at a small batch: half as many splits in halves, where twice the programs leave half the slots free)
#       side by side: 32K-wide tables at B1 2K / 30K / 8K and B2/2K, fitted tables at B1 2K and 32K; then
#       attention.py's splits sweeps in 32K-wide tables with whole tiles and with every tile in halves
#       (--sweep-halves), B1 at 2K, 8K and 30K, B2 at 2K (~6 min in all; the sweeps may be cut by a call's 600 s).
#   bash benchmarks/results/gpu-s51/run.sh halves-op   the op runs of `halves` alone (no sweeps; ~3 min), to share a
#       call with another case.
# Session 53 ran `span` and `halves-op` (benchmarks/results/gpu-s53/), warm L2 as then; attention.py has timed cold by
# default since (its --no-cold-l2 gives the old timing).
# Results are packed into $OUT/results.tgz after each step.
source benchmarks/device_steps.sh
start_call "$0" "$1"  # sets repo and here
packed_results "$1"
case $1 in
span)
    bench_script flush_overlap.py 150 package "$repo" --layers 16 --rounds 3 --shapes 8x8192,32x8192 \
        --costs staged-none tiny-16 tiny-last tiny-4 tiny-4-soon wide-4 deferred deferred-none && pack
    bash benchmarks/patched_repo.sh /tmp/join-next "$here/join-next.patch" || exit 1
    gpu_tests /tmp/join-next 120 tests/test_ops.py -k "defer or flush" && pack
    bench_script flush_overlap.py 120 join-next /tmp/join-next --layers 16 --rounds 3 --shapes 8x8192,32x8192 \
        --costs deferred deferred-none && pack
    CUDA_DEVICE_MAX_CONNECTIONS=32 bench_script flush_overlap.py 100 connections32 "$repo" --layers 16 --rounds 3 \
        --shapes 8x8192,32x8192 --costs staged-none tiny-16 deferred-none && pack
    ;;
table)
    readme_table 200 && (cd "$OUT" && tar czf table.tgz table && rm -rf table) && pack
    time_op rows-fitted "$repo" 60 --shapes 1x2048,1x2112,1x2173,2x2112,8x8317 && pack
    ;;
halves | halves-op)  # halves-op: the op runs alone (the sweeps left out)
    bash benchmarks/patched_repo.sh /tmp/wide-halves "$here/wide-halves.patch" || exit 1
    for run in wide fitted; do  # the package and the patched copy side by side, in case the call is cut
        for copy in package wide-halves; do
            dir=$repo && [ $copy = wide-halves ] && dir=/tmp/wide-halves
            if [ $run = wide ]; then args="--table 32768 --shapes 1x2048,1x30720,1x8192,2x2048"
            else args="--shapes 1x2048,1x32768"; fi
            time_op $run-$copy "$dir" 90 $args && pack
        done
    done
    sweeps="sweep-only sweep-halves" && [ "$1" = halves-op ] && sweeps=""
    for sweep in $sweeps; do  # (what the 600 s of a call leave: results are packed after each)
        time_op $sweep "$repo" 120 --$sweep --table 32768 --shapes 1x2048,1x8192,1x30720,2x2048 && pack
    done
    ;;
*) unknown_case "$1" ;;
esac
end_call "$1"
