#!/usr/bin/env bash
# Session 38's CPU A/B (this repository's 2-core CI-like machine, no GPU), from the repository root:
#     . .venv/bin/activate && bash benchmarks/results/cpu-s38/run.sh OUT
# benchmarks/cpu_reference.py of two versions of the package in turn, twice (before, after, before, after):
# before/ = before.patch (the reference before session 38: keys and values copied per query head by
# repeat_interleave), after/ = this checkout (each KV head's query heads batched over its keys, stride 0).
# Results: OUT/{before,after}-{1,2}/cpu.md; after-N/cpu.md and cpu.png put before-N beside it.
set -euo pipefail
out=$(realpath -m "$1")
root=$PWD
here=$(dirname "$0")
bash benchmarks/patched_repo.sh /tmp/before-cpu38 "$here/before.patch"
for round in 1 2; do
    (cd benchmarks && PYTHONPATH=/tmp/before-cpu38 python3 cpu_reference.py --out "$out/before-$round")
    (cd benchmarks && PYTHONPATH=$root python3 cpu_reference.py --out "$out/after-$round" --baseline "$out/before-$round")
done
