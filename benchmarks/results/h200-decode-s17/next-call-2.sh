#!/usr/bin/env bash
# For a later device call of the next session (not run yet; caps add up to ~570 s): where the flush's time goes. An ncu profile
# of the append kernel in a decode step where all 8 sequences complete a tile (0.13 ms, 128 programs of 8 warps:
# one program's chain of 8 normalisation iterations and up to 16 flip rounds), with the stall samples by
# instruction (benchmarks/ncu_stalls.py), to choose between fewer cross-warp reductions per iteration, the value
# tile's flips over more programs, and other warp counts.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ROOT=$PWD
cd benchmarks
timeout 120 ncu --clock-control none -k regex:_quantize_store_kernel -s 2 -c 1 --set full -o /tmp/flush -f \
    python3 profile_kernel.py --batch 8 --context 8192 --flush > $OUT/ncu-flush-log.txt 2>&1
ncu -i /tmp/flush.ncu-rep --page details > $OUT/ncu-flush-details.txt 2>&1
ncu -i /tmp/flush.ncu-rep --page source --csv --print-source sass > /tmp/flush-source.csv 2>/dev/null
python3 ncu_stalls.py /tmp/flush-source.csv > $OUT/ncu-flush-stalls.txt 2>&1
# The [128, 128] tiles' program with 16 warps instead of 8 (next-flush-16-warps.patch; sm_90 compile: 128 registers
# and the same spills, 304 B of stack, instead of 255; 1,408 instructions per normalisation iteration and warp
# instead of 1,930, but 16 x 1,408 > 8 x 1,930 in all: faster only if the chain waits on latency, not issue):
# the flush side by side with the package's 8 warps.
cd "$ROOT"
bash benchmarks/patched_repo.sh /tmp/repo-w16 benchmarks/results/h200-decode-s17/next-flush-16-warps.patch
(cd benchmarks && timeout 60 python3 attention.py --out $OUT/append-package --append-only) > $OUT/append-package.txt 2>&1
(cd /tmp/repo-w16/benchmarks && PYTHONPATH=/tmp/repo-w16 timeout 60 python3 attention.py --out $OUT/append-w16 \
    --append-only) > $OUT/append-w16.txt 2>&1
# A decode step's exact split on a side stream, beside the Gluon kernel (next-exact-side-stream.patch: a fork and
# join in paged_attention, captured into CUDA graphs as two branches), instead of after it: the kernel column at
# small batch is the two launches one after the other (B8/2K 0.0132 ms). Kernel-level A/B (both launches, CUDA
# graphs), then the GPU kernel and op tests (CUDA-graph replays included) on a patched copy.
bash benchmarks/patched_kernels.sh benchmarks/results/h200-decode-s17/next-exact-side-stream.patch ss
(cd benchmarks && timeout 120 python3 attention_ab.py --out $OUT/ab-side-stream.json \
    kvarn_compile.kernels_ss.paged_attention) > $OUT/ab-side-stream.txt 2>&1
bash benchmarks/patched_repo.sh /tmp/repo-ss benchmarks/results/h200-decode-s17/next-exact-side-stream.patch
N=$(python3 -c "import xdist; print('-n 6')" 2>/dev/null)
(cd /tmp/repo-ss && PYTHONPATH=/tmp/repo-ss timeout 150 python3 -m pytest -q $N tests/test_kernels.py tests/test_ops.py) \
    > $OUT/tests-side-stream.txt 2>&1
