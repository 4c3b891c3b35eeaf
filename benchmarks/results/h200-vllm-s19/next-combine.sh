#!/usr/bin/env bash
# For a later device session (not run yet; ~150 s, no vLLM needed): the combine with the Hadamard signs made in
# registers instead of loaded (next-combine-signs.patch: tf32x3 as now; next-combine-bf16x3.patch: bf16 signs
# and the output in three bf16 parts, 136 registers and 36 KB of shared memory at 4 warps instead of 255 and
# 64 KB, in sm_90 compiles without a GPU as tests/test_kernels_compile.py makes them), timed against the
# package's combine on the attention kernel's partials, and the latent bad-call cases of tests/test_ops.py that
# have not run on a GPU.
# Predicted: B256/1.5K 14.8 us -> ~8 us (each of its 512 programs loads a 64 KB matrix: 32 MB of L2 reads against
# 12 MB of partials); small batches unchanged (16-32 programs). The signs patch matched the package to 7.6e-6
# under TRITON_INTERPRET (attention_ab.py --combine, CPU); the bf16 one cannot run there (the interpreter's bf16
# tl.dot gives inf), so its max_diff column here is its first check.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
R=benchmarks/results/h200-vllm-s19
(date -u; nvidia-smi -L; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)") > $OUT/env.txt 2>&1
timeout 60 python3 -m pytest -q -rs tests/test_ops.py -k "latent and bad_positions" > $OUT/tests-bad-latent.txt 2>&1
bash benchmarks/patched_kernels.sh $R/next-combine-signs.patch signs
bash benchmarks/patched_kernels.sh $R/next-combine-bf16x3.patch bf16x3
(cd benchmarks && timeout 120 python3 attention_ab.py --combine --out $OUT/combine-ab.json \
    kvarn_compile.kernels_signs.combine_splits kvarn_compile.kernels_bf16x3.combine_splits) > $OUT/combine-ab.txt 2>&1
date -u >> $OUT/env.txt
