#!/usr/bin/env bash
# Session 20's device calls, in order (NVIDIA H200, device tool, 2026-12-03; torch 2.11.0+cu130, triton 3.6.0,
# vLLM 0.23.0 from ../shared/device/vllm023/make-bundle.sh, carried as .device-carry/vllm023/p1..p4, one a call):
#   1. combine/   code 3323339: bash .device-carry/vllm023/p4/install.sh; bash benchmarks/results/h200-vllm-s20/combine.sh
#                 (the combine's rotation back four ways, combine alone; the latent bad-call cases of test_ops)
#   -- the machine was released while idle; a fresh one for the rest --
#   2. table/     code 4d5ff4f (the butterflies in the package): bash benchmarks/results/h200-vllm-s20/table.sh
#   3. burst-bf16/ code 4d5ff4f, after carrying p1..p4 again: bash benchmarks/results/h200-vllm-s20/run.sh burst-bf16 540
#   4. burst-hook/ code 4d5ff4f: cd benchmarks && python3 vllm_burst.py --out $OUT/burst-hook
#                 --dtypes kvarn_k4v2_g128+hook --output-len 2048 --max-num-seqs 256 --workloads burst
#                 (after `source benchmarks/device_vllm_env.sh`; its own process, same machine as 3)
bash benchmarks/results/h200-vllm-s20/combine.sh
bash benchmarks/results/h200-vllm-s20/table.sh
bash benchmarks/results/h200-vllm-s20/run.sh burst-bf16 540
