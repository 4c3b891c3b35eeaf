#!/usr/bin/env bash
# Session 37's CPU A/B (this repository's 2-core CI-like machine, no GPU), from the repository root:
#     . .venv/bin/activate && bash benchmarks/results/cpu-s37/run.sh OUT
# benchmarks/cpu_ab.sh with before.patch: the reference of session 36 (torch.std, codes unpacked through int32,
# keys and values copied per query head); after = the checkout of session 37 (ea4faf7).
set -euo pipefail
bash benchmarks/cpu_ab.sh "$(dirname "$0")/before.patch" "$1"
