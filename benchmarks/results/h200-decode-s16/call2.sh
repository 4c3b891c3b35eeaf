#!/usr/bin/env bash
# Session 16, device call 2: the staged-codes kernel (committed form) against session 15's kernel for two more
# configurations (more shared memory per program), then the GPU tests of kernels, ops and latent ops.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
D=benchmarks/results/h200-decode-s16
(date -u; nvidia-smi; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)") > $OUT/env.txt 2>&1
bash benchmarks/patched_kernels.sh $D/s15-kernel.patch s15
for cfg in "kvarn_k4v4_g128 128" "kvarn_k4v2_g128 256"; do
    set -- $cfg
    (cd benchmarks && timeout 110 python3 attention_ab.py --out $OUT/ab-$1-d$2.json --preset $1 --head-dim $2 \
        kvarn_compile.kernels_s15.paged_attention) > $OUT/ab-$1-d$2.txt 2>&1
done
date -u >> $OUT/env.txt
rm -rf kvarn_compile/kernels_s15
N=$(python3 -c "import xdist; print('-n 6')" 2>/dev/null)
timeout 330 python3 -m pytest -q $N --durations=10 tests/test_kernels.py tests/test_ops.py tests/test_latent.py \
    > $OUT/gpu-tests.txt 2>&1
date -u >> $OUT/env.txt
