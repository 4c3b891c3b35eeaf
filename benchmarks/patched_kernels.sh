#!/usr/bin/env bash
# A patched copy of the kernels subpackage, for attention_ab.py to time against the package's own kernels:
#
#     bash benchmarks/patched_kernels.sh PATCH NAME   # -> kvarn_compile/kernels_NAME (PATCH: a git diff of kvarn_compile/kernels/)
#     cd benchmarks && python3 attention_ab.py --out ab.json kvarn_compile.kernels_NAME.paged_attention
#
# The copy's relative imports (..presets, .tile_math) keep working; it is not tracked (delete it after).
set -euo pipefail
patch_file=$(realpath "$1")
name=$2
cd "$(dirname "$0")/.."
rm -rf "kvarn_compile/kernels_$name"
cp -r kvarn_compile/kernels "kvarn_compile/kernels_$name"
sed "s#kvarn_compile/kernels/#kvarn_compile/kernels_$name/#g" "$patch_file" | git apply -
echo "kvarn_compile.kernels_$name.paged_attention"
