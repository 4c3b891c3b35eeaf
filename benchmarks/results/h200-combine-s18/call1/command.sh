#!/usr/bin/env bash
# For the next session's first device call (not run yet; caps add up to ~590 s): the two-pass combine
# (next-combine-two-pass.patch: each row's max over its splits first, then 16 splits a step with 16 warps instead
# of the online form's 4 with 4 warps) timed alone against the package's combine (attention_ab.py --combine), the
# README table's op on a patched copy of the repository and on the package side by side, then the GPU tests that
# go through the combine on the patched copy. Predicted: at small batch the combine is a chain of dependent
# loads of ~1 us a step (B8/32K: 34 partials, 9 steps, ~17 us of the op's 0.106 ms; B1/32K: 129 partials, 33
# steps, ~31 us of 0.056 ms); 3-4x fewer steps: B8/32K op ~0.094 ms, B1/32K ~0.035.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
S17=benchmarks/results/h200-decode-s17
(date -u; nvidia-smi; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)") > $OUT/env.txt 2>&1
bash benchmarks/patched_kernels.sh $S17/next-combine-two-pass.patch cb
(cd benchmarks && timeout 100 python3 attention_ab.py --combine --out $OUT/combine-ab.json \
    kvarn_compile.kernels_cb.combine_splits) > $OUT/combine-ab.txt 2>&1
bash benchmarks/patched_repo.sh /tmp/repo-cb $S17/next-combine-two-pass.patch
(cd benchmarks && timeout 120 python3 attention.py --out $OUT/table-package) > $OUT/table-package.txt 2>&1
(cd /tmp/repo-cb/benchmarks && PYTHONPATH=/tmp/repo-cb timeout 120 python3 attention.py --out $OUT/table-cb) \
    > $OUT/table-cb.txt 2>&1
# the flush side by side: the package (the stds reused across normalisation iterations, commit "Append kernel: an
# iteration's first normalisation update reuses ...") and a copy with that change reverted
bash benchmarks/patched_repo.sh /tmp/repo-fb $S17/flush-before-std-reuse.patch
(cd benchmarks && timeout 60 python3 attention.py --out $OUT/append-package --append-only) > $OUT/append-package.txt 2>&1
(cd /tmp/repo-fb/benchmarks && PYTHONPATH=/tmp/repo-fb timeout 60 python3 attention.py --out $OUT/append-before \
    --append-only) > $OUT/append-before.txt 2>&1
N=$(python3 -c "import xdist; print('-n 6')" 2>/dev/null)
(cd /tmp/repo-cb && PYTHONPATH=/tmp/repo-cb timeout 130 python3 -m pytest -q $N tests/test_kernels.py tests/test_ops.py) \
    > $OUT/tests-cb.txt 2>&1
date -u >> $OUT/env.txt
