#!/usr/bin/env bash
# Session 16, device call 1: A/B of the three ready patches against the package kernel, then the
# decode tests on a patched copy of the repository for the two staging patches.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ROOT=$PWD
S15=benchmarks/results/h200-decode-s15
(date -u; nvidia-smi; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)") > $OUT/env.txt 2>&1
bash benchmarks/patched_kernels.sh $S15/next-codes-via-cp-async.patch codes
bash benchmarks/patched_kernels.sh $S15/next-keys-via-cp-async.patch keys
bash benchmarks/patched_kernels.sh $S15/next-q-in-shared.patch q
cp -r kvarn_compile/kernels_q kvarn_compile/kernels_q200
sed -i 's/num_warps=1, \*\*launch/num_warps=1, maxnreg=200, **launch/' kvarn_compile/kernels_q200/decode_attention.py
grep -c "maxnreg=200" kvarn_compile/kernels_q200/decode_attention.py > $OUT/q200-check.txt
(cd benchmarks && timeout 300 python3 attention_ab.py --out $OUT/ab.json \
    kvarn_compile.kernels_codes.paged_attention kvarn_compile.kernels_keys.paged_attention \
    kvarn_compile.kernels_q.paged_attention kvarn_compile.kernels_q200.paged_attention) > $OUT/ab.txt 2>&1
date -u >> $OUT/env.txt
for name in codes keys; do
    rm -rf /tmp/repo-$name && mkdir /tmp/repo-$name
    tar cf - --exclude='./kvarn_compile/kernels_*' --exclude=./.device-carry --exclude=./.venv --exclude=./.venv-vllm . | tar xf - -C /tmp/repo-$name
    (cd /tmp/repo-$name && git apply $ROOT/$S15/next-$name-via-cp-async.patch &&
     PYTHONPATH=/tmp/repo-$name timeout 120 python3 -m pytest -q tests/test_kernels.py tests/test_ops.py \
        -k "decode_kernel or bad_positions") > $OUT/tests-$name.txt 2>&1
done
date -u >> $OUT/env.txt
