#!/usr/bin/env bash
# Fourth device call of session 18: the kernels' own check of a call's token count (a sequence with more new tokens
# than max_query_len stops the kernel instead of losing the tokens past it; the latent attention kernel now checks its
# slots, token count and kv_lens too; the Gluon decode kernel skips a sequence with no new token, whose row was the
# next sequence's or past the last; the combine test runs both launch forms): the GPU tests of the ops (the bad calls
# run in subprocesses), kernels and latent path. Result: 122 passed (tests.txt).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
(date -u; nvidia-smi -L; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)") > $OUT/env.txt 2>&1
N=$(python3 -c "import xdist; print('-n 8')" 2>/dev/null)
timeout 280 python3 -m pytest -q $N -rs tests/test_ops.py tests/test_kernels.py tests/test_latent.py > $OUT/tests.txt 2>&1
date -u >> $OUT/env.txt
