#!/usr/bin/env bash
# Second device call of session 18 (caps ~560 s): the package's adaptive two-pass combine (16 warps and 16 splits a
# step while the programs are fewer than the SMs, else 4 and 4) tested on the GPU, the README table on it, the
# combine alone against the one-pass form it replaces (old-one-pass-combine.patch), then two prepared changes
# timed beside the package: the exact split on a side stream (h200-decode-s17/next-exact-side-stream.patch) and
# the flush's [128, 128] program with 16 warps (h200-decode-s17/next-flush-16-warps.patch).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
R=benchmarks/results/h200-combine-s18
S17=benchmarks/results/h200-decode-s17
(date -u; nvidia-smi -L; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)") > $OUT/env.txt 2>&1
N=$(python3 -c "import xdist; print('-n 6')" 2>/dev/null)
timeout 150 python3 -m pytest -q $N tests/test_kernels.py tests/test_ops.py > $OUT/tests-package.txt 2>&1
(cd benchmarks && timeout 130 python3 attention.py --out /tmp/table) > $OUT/table.txt 2>&1
cp /tmp/table/results.md /tmp/table/speedup.png $OUT/ 2>/dev/null
bash benchmarks/patched_kernels.sh $R/old-one-pass-combine.patch old
(cd benchmarks && timeout 80 python3 attention_ab.py --combine --out $OUT/combine-ab.json \
    kvarn_compile.kernels_old.combine_splits) > $OUT/combine-ab.txt 2>&1
bash benchmarks/patched_kernels.sh $S17/next-exact-side-stream.patch ss
(cd benchmarks && timeout 100 python3 attention_ab.py --out $OUT/ab-side-stream.json \
    kvarn_compile.kernels_ss.paged_attention) > $OUT/ab-side-stream.txt 2>&1
bash benchmarks/patched_repo.sh /tmp/repo-w16 $S17/next-flush-16-warps.patch
(cd benchmarks && timeout 40 python3 attention.py --out /tmp/append-package --append-only) > $OUT/append-package.txt 2>&1
(cd /tmp/repo-w16/benchmarks && PYTHONPATH=/tmp/repo-w16 timeout 50 python3 attention.py --out /tmp/append-w16 \
    --append-only) > $OUT/append-w16.txt 2>&1
date -u >> $OUT/env.txt
