#!/usr/bin/env bash
# Session 35's device calls (device tool; an H100 came, no H200 could be started), from the repository root:
#   probe/:  benchmarks/results/h200-s34/run.sh probe (session 34's call, unrun there): decode_step.py (a step with
#            no, one or every sequence completing a tile) and flush_beside.py with phases of 1, 2, 4 normalisation
#            passes beside the step. Found: a phase beside the step adds about its own time alone (B8/8K: a
#            10.5 us pass adds 11.3 us to a 38.8 us step), so the side stream buys (almost) no overlap.
#            At batch 1 (a step that leaves SMs free) it overlaps: +1.0 us for a 10.3 us pass. Guess: the decode
#            kernel's 8 warps of 240 registers per SM leave 1,024 registers in each of the SM's four register-file
#            quarters (a warp's registers come from one), and a 64-register warp needs 2,048.
#   slices:  (slices/) flush_beside.py with phases of <= 32 registers (one or two rows a read; 24-32 registers on
#            sm_90 here), a 16-row slice of a token pass, a whole iteration, and 4-warp programs: whether small
#            programs do run beside the step, and what a phase costs it when they do not. Found: no phase overlaps
#            a step that fills the GPU, 24 registers or 64 (B8/8K: 16 rows +6.9 us, 7.0 alone; 4 warps +4.0, 4.7).
#   priority: (priority/) the same with the side stream at a higher priority (-1): if the phase's programs waited
#            behind the step's not yet dispatched ones (the block scheduler takes a kernel's in launch order), a
#            higher priority lets them start at once, beside the step's. Found: no change (B8/8K: +11.5, +7.1, +3.9 us).
#   small:   (small/) phases that are small fractions of the work in 4-warp programs (32 and 64 rows of a token
#            pass, a whole iteration): what the smallest phase costs a step, in order or beside it. Found: 32 or
#            64 rows +2.2-2.3 us beside at B8/8K (+5.8%), +2.4-2.5 us at B8/32K; an iteration +10.5 us.
#   timeline: (timeline.md) decode_step.py --timeline: each kernel's start and end in one graph replay of the step
#            (torch.profiler): does the exact split (_paged_attention_kernel) end before the Gluon kernel (slack)?
#            Found: no; it starts in the Gluon kernel's last ~5-20 us and ends 2-5 us after it (at batch 256: 73 us
#            before, 5 after), and the append runs last (2.6 us at B8, 16 at B128, 30 at B256).
source benchmarks/device_steps.sh
start_call "$0" "$1"  # sets repo and here
case $1 in
slices)
    (cd benchmarks && PYTHONPATH=$repo timeout 400 python3 flush_beside.py --out $OUT/slices \
        --phases 1:128:1 1:128:1:1 1:16:1:1 2:128:1:1:32 1:128:1:2:32 1:128:4) > $OUT/slices.log 2>&1
    tail -14 $OUT/slices.log
    ;;
priority)
    (cd benchmarks && PYTHONPATH=$repo timeout 300 python3 flush_beside.py --out $OUT/priority --side-priority -1 \
        --phases 1:128:1 1:16:1:1 1:128:4) > $OUT/priority.log 2>&1
    tail -10 $OUT/priority.log
    ;;
small)
    (cd benchmarks && PYTHONPATH=$repo timeout 300 python3 flush_beside.py --out $OUT/small \
        --phases 1:32:4 1:64:4 2:128:4) > $OUT/small.log 2>&1
    tail -10 $OUT/small.log
    ;;
timeline)
    (cd benchmarks && PYTHONPATH=$repo timeout 200 python3 decode_step.py --out $OUT --timeline) > $OUT/timeline.log 2>&1
    tail -60 $OUT/timeline.log
    ;;
esac
date -u >> $OUT/env-$1.txt
