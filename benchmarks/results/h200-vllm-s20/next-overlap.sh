#!/usr/bin/env bash
# For a later device session (not run yet; ~5 min, no vLLM needed): a decode step's append on a side stream beside
# its attention (next-append-overlap.patch), in a patched copy of the repository: its GPU kernel/op tests, then
# benchmarks/decode_step.py there, which times the op (overlapped) and the same launches in order side by side.
# Why: a tile completed in a decode step is quantized by one program, ~0.1 ms whatever the batch (the README's
# flush column), after the attention. A burst of equal prompts completes tiles in one step of 128; requests that do
# not arrive together complete some in most steps (at batch 256, 87% of them: 1 - (127/128)^256), so there the
# append would add ~0.1 ms per layer to most steps (~3.6 ms on a ~17.7 ms step of 36 layers).
# Predicted: "one" completing: op ~max(attention, 0.1 ms) instead of the sum (B8/8K ~0.15 -> ~0.11 ms, B256/1.5K
# ~0.26 -> ~0.16); "none": the append's 4-20 us hidden where the attention leaves SMs free (B256: up to ~20 us, the
# burst's missing 3%); outputs identical (the patch's CPU tests run the append first in decode steps: 88 pass).
# Then, with the vLLM bundle carried: vllm_burst.py --dtypes auto kvarn_k4v2_g128 --workloads burst staggered, with
# and without the patch.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
R=benchmarks/results/h200-vllm-s20
(date -u; nvidia-smi -L; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)") > $OUT/env-overlap.txt 2>&1
bash benchmarks/patched_repo.sh /tmp/repo-overlap $R/next-append-overlap.patch
(cd /tmp/repo-overlap && PYTHONPATH=/tmp/repo-overlap timeout 150 python3 -m pytest -q tests/test_kernels.py \
    tests/test_ops.py > $OUT/tests-overlap.txt 2>&1)
(cd /tmp/repo-overlap/benchmarks && PYTHONPATH=/tmp/repo-overlap timeout 200 python3 decode_step.py \
    --out $OUT/overlap) > $OUT/overlap.txt 2>&1
date -u >> $OUT/env-overlap.txt
