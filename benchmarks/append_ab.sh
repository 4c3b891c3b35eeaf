#!/usr/bin/env bash
# The append / flush columns (attention.py --append-only: batch 1/8/32/128 at 8K, CUDA-graph medians) of copies of
# the repository in turn, for A/B runs of the append kernel on the device machine (copies: patched_repo.sh):
#
#     bash benchmarks/append_ab.sh OUT NAME=REPO [NAME=REPO ...]     # e.g. package-1=$PWD before=/tmp/repo-x
#
# Writes OUT/NAME.log and OUT/NAME/append.json for each, and one line per copy to stdout and OUT/flush-ab.txt.
set -u
out=$1
shift
for pair in "$@"; do
    name=${pair%%=*}
    dir=$(realpath "${pair#*=}")
    (cd "$dir/benchmarks" && PYTHONPATH=$dir timeout 80 python3 attention.py --out "$out/$name" --append-only) \
        > "$out/$name.log" 2>&1
    echo "$name: $(grep -o 'batch [0-9]*: append [0-9.]* ms, flush [0-9.]* ms' "$out/$name.log" | tr '\n' ';')"
done | tee "$out/flush-ab.txt"
