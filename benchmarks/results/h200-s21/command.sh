#!/usr/bin/env bash
# Session 21's device calls, in order (NVIDIA H200, device tool, 2026-12-03; torch 2.11.0+cu130, triton 3.6.0,
# vLLM 0.23.0 from ../shared/device/vllm023/make-bundle.sh, carried as .device-carry/vllm023/p1..p4, one a call):
#   0. next-overlap/  code b32f810: bash benchmarks/results/h200-vllm-s20/next-overlap.sh (its pytest was cut by its 150 s limit)
#   1. pkg/    code b32f810 + the log line in vllm_burst.py, after carrying p1..p3: bash benchmarks/results/h200-s21/run.sh pkg 540
#   -- the machine was released while idle; a fresh one for the rest (no vLLM) --
#   2. parts/  bash benchmarks/results/h200-s21/run.sh parts   (overlap_variants.py, flush_parts.py)
#   3. fork/   cd benchmarks && PYTHONPATH=$PWD/..:$PWD python3 results/h200-s21/fork_penalty.py --out $OUT/fork
#   4. flush-ab/ code e64f4b3 (the token stds' max and min in one reduction; reverted after this call, since it
#                did not pay): bash benchmarks/results/h200-s21/flush_ab.sh (before-minmax.patch applies to e64f4b3)
# run.sh's "overlap" mode (the patched copy's vLLM burst) was not run: no device time left for the bundle again.
bash benchmarks/results/h200-s21/run.sh pkg 540
bash benchmarks/results/h200-s21/run.sh parts
(cd benchmarks && PYTHONPATH=$PWD/..:$PWD python3 results/h200-s21/fork_penalty.py --out "$OUT/fork")
bash benchmarks/results/h200-s21/flush_ab.sh
