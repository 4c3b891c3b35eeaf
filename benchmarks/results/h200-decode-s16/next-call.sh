#!/usr/bin/env bash
# For the next session's first device call (not run yet): the key-side scale staging patch and the keys-only
# variant (value bytes loaded from global memory, as before session 16: for a rule on when to stage the values;
# k4v4_g128 was 2-8% slower with both staged) timed against the package kernel at three configurations, then the
# GPU decode tests on a copy of the repository with the scale staging patch.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ROOT=$PWD
S16=benchmarks/results/h200-decode-s16
(date -u; nvidia-smi; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)") > $OUT/env.txt 2>&1
bash benchmarks/patched_kernels.sh $S16/next-key-scales-staged.patch ks
bash benchmarks/patched_kernels.sh $S16/next-values-unstaged.patch kv
for cfg in "kvarn_k4v2_g128 128" "kvarn_k4v4_g128 128" "kvarn_k4v2_g128 256"; do
    set -- $cfg
    (cd benchmarks && timeout 140 python3 attention_ab.py --out $OUT/ab-$1-d$2.json --preset $1 --head-dim $2 \
        kvarn_compile.kernels_ks.paged_attention kvarn_compile.kernels_kv.paged_attention) > $OUT/ab-$1-d$2.txt 2>&1
done
rm -rf /tmp/repo-ks && mkdir /tmp/repo-ks
tar cf - --exclude='./kvarn_compile/kernels_*' --exclude=./.device-carry --exclude=./.venv --exclude=./.venv-vllm . |
    tar xf - -C /tmp/repo-ks
N=$(python3 -c "import xdist; print('-n 6')" 2>/dev/null)
(cd /tmp/repo-ks && git apply $ROOT/$S16/next-key-scales-staged.patch &&
 PYTHONPATH=/tmp/repo-ks timeout 170 python3 -m pytest -q $N tests/test_kernels.py tests/test_ops.py \
    -k "decode_kernel or bad_positions or g128") > $OUT/tests-ks.txt 2>&1
date -u >> $OUT/env.txt
