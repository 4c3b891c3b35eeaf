#!/usr/bin/env bash
# Session 38's CPU A/B (this repository's 2-core CI-like machine, no GPU), from the repository root:
#     . .venv/bin/activate && bash benchmarks/results/cpu-s38/run.sh OUT
# benchmarks/cpu_ab.sh with before.patch: the reference attention before session 38 (keys and values copied per
# query head by repeat_interleave); after = the checkout of session 38 (6b8e7da: each KV head's query heads one
# bmm over its keys and values expanded with stride 0).
set -euo pipefail
bash benchmarks/cpu_ab.sh "$(dirname "$0")/before.patch" "$1"
