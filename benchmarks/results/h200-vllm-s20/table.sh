#!/usr/bin/env bash
# Session 20: the package with the combine's butterflies (one-row programs at small batch): the GPU tests of the
# kernels and ops (CUDA-graph replays included; 100 s of them), then the README's decode table.
# Predicted (combine alone, combine/combine-ab.txt): op B1/2K 0.0162 -> ~0.0126 ms, B1/32K 0.042 -> ~0.030,
# B8/32K 0.1009 -> ~0.097 (2.56x -> ~2.66x cuDNN), B128/32K and larger batches ~unchanged.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
(date -u; nvidia-smi -L; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)") > $OUT/env-table.txt 2>&1
N=$(python3 -c "import xdist; print('-n 8')" 2>/dev/null)
timeout 100 python3 -m pytest -q $N tests/test_kernels.py tests/test_ops.py > $OUT/tests.txt 2>&1
(cd benchmarks && timeout 150 python3 attention.py --out /tmp/table) > $OUT/table.txt 2>&1
cp /tmp/table/results.md /tmp/table/results.json /tmp/table/speedup.png $OUT/ 2>/dev/null
date -u >> $OUT/env-table.txt
