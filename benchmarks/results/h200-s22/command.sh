#!/usr/bin/env bash
# Session 22's device calls, in order (NVIDIA H200, device tool, 2026-12-03; torch 2.11.0+cu130, triton 3.6.0,
# vLLM 0.23.0 from ../shared/device/vllm023/make-bundle.sh, carried as .device-carry/vllm023/p1..p4, one a call).
# Code: 6401a7b (the append kernel's normalisation from centred one-pass sums, fast logs, int32 flip-round keys).
#   1. flush/  bash benchmarks/results/h200-s22/run.sh flush   (A/B against before.patch = 75afa8f's kernels;
#              flush_parts.py; its pytest, tests/tests-call1.txt, was cut by its 200 s limit: no failure, no summary)
#   -- p1, p2, p3 carried (one call each, seconds) --
#   2. pkg/    bash benchmarks/results/h200-s22/run.sh pkg 565   (bf16 vs kvarn: staggered + burst; carries p4)
#   3. fp8/    the GPU tests of the two changed helpers, then fp8 vs kvarn on the same machine (tests/tests-call3.txt)
#   4. tests/tests-call4.txt: the other GPU kernel/op/latent tests, cut by the call's 250 s limit (123 ran, none failed)
bash benchmarks/results/h200-s22/run.sh flush
bash benchmarks/results/h200-s22/run.sh pkg 565
timeout 50 python3 -m pytest -q tests/test_kernels.py -k "balance or roundings" > "$OUT/tests-balance.txt" 2>&1
bash benchmarks/results/h200-s22/run.sh fp8 535
timeout 250 python3 -m pytest -q tests/test_ops.py tests/test_latent.py tests/test_kernels.py -k "not roundings and not balance" \
    -p no:cacheprovider > "$OUT/tests-rest.txt" 2>&1
