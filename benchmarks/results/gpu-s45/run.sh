#!/usr/bin/env bash
# Session 45's device calls, from the repository root:
#   bash benchmarks/results/gpu-s45/run.sh beside  whole-tile decode steps whose Gluon programs leave half the GPU
#       free rotate q themselves and start the merging exact split at once, as halves did
#       (decode_attention.leaves_half_the_slots): the kernel, op and latent tests, then attention.py of the package
#       before (undo-beside.patch) and now, with page tables 32K tokens wide and as wide as each step needs (~7 min).
#   bash benchmarks/results/gpu-s45/run.sh all     both in one call (an H200 came, with less device time left): the
#       tests, `beside`'s comparison, the README's decode table (attention.py --profile), then a server's page tables
#       128K tokens wide (~9 min).
#   bash benchmarks/results/gpu-s45/run.sh final   after the test fix (b65d3d3): the kernel, op and latent tests, then
#       attention.py at batch 1-2 past tile boundaries with page tables 32K tokens wide (~2 min; run as these commands
#       on the warm machine of `all`, results in h100-final/; tests-fixed-case.txt: the mended test and its kin first).
#   bash benchmarks/results/gpu-s45/run.sh merge   after the review's race fix (c818f7b): the GPU kernel, op and latent
#       tests of the package first; then the merge of a small step with rows held: the package, a step and a short
#       tail loaded at once (tail.patch: session 44's 98f6904 again, whose run then never reached its case: 32 halves'
#       partials and the exact part's 3-5 live ones) and merge steps of 64 (merge8.patch: 8 merge warps, which also
#       lets halves reach 32 splits), attention.py past tile boundaries one after the other; then tail.patch's merge
#       and split tests (~5 min). Ran at a4fd8ea with a 50 s limit for the fitted runs, which cut the package's
#       (its first run compiles; the case now gives them 90), results in h100-merge/.
#   bash benchmarks/results/gpu-s45/run.sh tail    RAN in session 48 at 59407fb (gpu-s48/h100-tail/; tail2 applied since):
#       the package, tail.patch and tail2.patch (the tail's loads only where a row's
#       partials pass a step: no tail at 0 rows, where tail.patch was 7% slower in another call), attention.py at
#       batch 1-2 past tile boundaries one after the other, the package first with time to compile; then tail2's
#       GPU kernel, op and latent tests (~6 min).
# Each case ran at the commit benchmarks/NOTES.md (session 45) names, where its patches apply. Results are packed
# into $OUT/results.tgz after each step.
source benchmarks/device_steps.sh
start_call "$0" "$1"  # sets repo and here
packed_results "$1"
case $1 in
beside)
    gpu_tests "$repo" 200 && pack
    bash benchmarks/patched_repo.sh /tmp/before "$here/undo-beside.patch" || exit 1
    for run in before now; do
        dir=/tmp/before; [ "$run" = now ] && dir=$repo
        time_op "$run-table32k" "$dir" 100 --table 32768 --shapes 1x2048,1x2112,1x8192,2x2048,4x2048,8x8192 && pack
        time_op "$run-fitted" "$dir" 100 --shapes 1x2048,1x2112,1x32768,1x131072,2x2048,4x2048,8x32768 && pack
    done
    ;;
all)
    gpu_tests "$repo" 200 && pack
    bash benchmarks/patched_repo.sh /tmp/before "$here/undo-beside.patch" || exit 1
    for run in before now; do
        dir=/tmp/before; [ "$run" = now ] && dir=$repo
        time_op "$run-table32k" "$dir" 80 --table 32768 --shapes 1x2048,1x2112,1x8192,2x2048,4x2048,8x8192,8x8317 && pack
        time_op "$run-fitted" "$dir" 80 --shapes 1x2048,1x2112,1x2173,1x32768,2x2048,4x2048,8x8317 && pack
    done
    readme_table 200 && (cd "$OUT" && tar czf table.tgz table && rm -rf table) && pack
    time_op now-table128k "$repo" 60 --table 131072 --shapes 8x32768,32x32768 && pack
    ;;
merge)
    gpu_tests "$repo" 150 && pack
    bash benchmarks/patched_repo.sh /tmp/tail "$here/tail.patch" || exit 1
    bash benchmarks/patched_repo.sh /tmp/merge8 "$here/merge8.patch" || exit 1
    for run in package tail merge8; do
        dir=/tmp/$run; [ "$run" = package ] && dir=$repo
        time_op "$run-fitted" "$dir" 90 --shapes 1x2048,1x2112,1x2173,2x2112,8x8317 && pack
        [ "$run" = merge8 ] || time_op "$run-table32k" "$dir" 35 --table 32768 --shapes 1x2112 && pack
    done
    (cd /tmp/tail && timeout 60 python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_kernels.py \
        -k "merge or split or decode") > "$OUT/tail-tests.txt" 2>&1; tail -n 2 "$OUT/tail-tests.txt"
    ;;
tail)
    bash benchmarks/patched_repo.sh /tmp/tail "$here/tail.patch" || exit 1
    bash benchmarks/patched_repo.sh /tmp/tail2 "$here/tail2.patch" || exit 1
    for run in package tail tail2; do
        dir=/tmp/$run; [ "$run" = package ] && dir=$repo
        time_op "$run-fitted" "$dir" 90 --shapes 1x2048,1x2112,1x2173,2x2112,8x8317 && pack
    done
    gpu_tests /tmp/tail2 200 && pack
    ;;
final)
    gpu_tests "$repo" 200 && pack
    time_op final-table32k "$repo" 100 --table 32768 --shapes 1x2048,1x2112,1x2173,1x8192,1x8317,2x2112 && pack
    ;;
esac
date -u >> "$OUT/env-$1.txt"
pack
