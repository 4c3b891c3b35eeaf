#!/usr/bin/env bash
# The CPU path's A/B on this machine's CPUs (no GPU), from the repository root:
#     . .venv/bin/activate && bash benchmarks/cpu_ab.sh PATCH OUT
# benchmarks/cpu_reference.py of two versions of the package in turn, twice (before, after, before, after):
# before/ = this checkout with PATCH applied (a session's results/cpu-*/before.patch), after/ = this checkout.
# Results: OUT/{before,after}-{1,2}/cpu.md; after-N/cpu.md and cpu.png put before-N beside it.
set -euo pipefail
patch=$(realpath "$1")
out=$(realpath -m "$2")
root=$PWD
bash benchmarks/patched_repo.sh /tmp/cpu-ab-before "$patch"
for round in 1 2; do
    (cd benchmarks && PYTHONPATH=/tmp/cpu-ab-before python3 cpu_reference.py --out "$out/before-$round")
    (cd benchmarks && PYTHONPATH=$root python3 cpu_reference.py --out "$out/after-$round" --baseline "$out/before-$round")
done
