#!/usr/bin/env bash
# Session 20 (~150 s, no vLLM needed): the combine's rotation back, four ways, against the package's (a tf32x3
# product with the 64 KB fp32 Hadamard matrix loaded by every program), on the attention kernel's partials:
#   signs:  the +-1 signs made in registers, tf32x3 as now (../h200-vllm-s19/next-combine-signs.patch)
#   bf16x3: bf16 signs, the output in three bf16 parts (../h200-vllm-s19/next-combine-bf16x3.patch)
#   fwht:   no matrix: log2(D) butterfly stages in registers (next-combine-butterflies.patch; 140 registers and
#           2 KB shared at sm_90 against 255 and 64 KB), and while 16-row programs would leave SMs idle, one row
#           a program (B1: 32 programs instead of 2, each loading 1/16 of the partials); [rows=16]: the same
#           butterflies with the package's 16-row programs everywhere
# Predicted: B256/1.5K 14.8 us -> ~8 us (signs, bf16x3, fwht); B1/32K 16.6 -> ~5 us and B8/32K 8.1 -> ~4 us
# (fwht's one-row programs); the latent bad-call cases of tests/test_ops.py pass (not run on a GPU yet).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
R=benchmarks/results
(date -u; nvidia-smi -L; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)") > $OUT/env.txt 2>&1
timeout 100 python3 -m pytest -q -rs tests/test_ops.py -k "latent and bad_positions" > $OUT/tests-bad-latent.txt 2>&1
bash benchmarks/patched_kernels.sh $R/h200-vllm-s19/next-combine-signs.patch signs
bash benchmarks/patched_kernels.sh $R/h200-vllm-s19/next-combine-bf16x3.patch bf16x3
bash benchmarks/patched_kernels.sh $R/h200-vllm-s20/next-combine-butterflies.patch fwht
(cd benchmarks && timeout 150 python3 attention_ab.py --combine --out $OUT/combine-ab.json \
    kvarn_compile.kernels_signs.combine_splits kvarn_compile.kernels_bf16x3.combine_splits \
    kvarn_compile.kernels_fwht.combine_splits kvarn_compile.kernels_fwht.combine_splits:rows=16) > $OUT/combine-ab.txt 2>&1
rm -rf kvarn_compile/kernels_signs kvarn_compile/kernels_bf16x3 kvarn_compile/kernels_fwht
date -u >> $OUT/env.txt
