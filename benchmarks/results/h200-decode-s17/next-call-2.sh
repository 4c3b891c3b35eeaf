#!/usr/bin/env bash
# For a later device call of the next session (not run yet, ~3 min): where the flush's time goes. An ncu profile
# of the append kernel in a decode step where all 8 sequences complete a tile (0.13 ms, 128 programs of 8 warps:
# one program's chain of 8 normalisation iterations and up to 16 flip rounds), with the stall samples by
# instruction (benchmarks/ncu_stalls.py), to choose between fewer cross-warp reductions per iteration, the value
# tile's flips over more programs, and other warp counts.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
cd benchmarks
ncu --clock-control none -k regex:_quantize_store_kernel -s 2 -c 1 --set full -o /tmp/flush -f \
    python3 profile_kernel.py --batch 8 --context 8192 --flush > $OUT/ncu-flush-log.txt 2>&1
ncu -i /tmp/flush.ncu-rep --page details > $OUT/ncu-flush-details.txt 2>&1
ncu -i /tmp/flush.ncu-rep --page source --csv --print-source sass > /tmp/flush-source.csv 2>/dev/null
python3 ncu_stalls.py /tmp/flush-source.csv > $OUT/ncu-flush-stalls.txt 2>&1
