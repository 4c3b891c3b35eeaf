#!/usr/bin/env bash
# Third device call of session 18: the package with both changes (adaptive two-pass combine, exact split on a side
# stream): the GPU tests of the kernels, ops (CUDA-graph replays included), latent attention and decode layouts,
# then the README's decode table.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
(date -u; nvidia-smi -L; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)") > $OUT/env.txt 2>&1
N=$(python3 -c "import xdist; print('-n 8')" 2>/dev/null)
timeout 200 python3 -m pytest -q $N tests/test_kernels.py tests/test_ops.py tests/test_latent.py \
    tests/test_decode_layouts.py > $OUT/tests.txt 2>&1
(cd benchmarks && timeout 130 python3 attention.py --out /tmp/table) > $OUT/table.txt 2>&1
cp /tmp/table/results.md /tmp/table/results.json /tmp/table/speedup.png $OUT/ 2>/dev/null
date -u >> $OUT/env.txt
