#!/usr/bin/env bash
# A copy of this checkout with patches applied, for timing or testing a prepared change beside the package
# (run it from the device's copy of the repository; its .git may be stale, so patches go in with git apply):
#
#     bash benchmarks/patched_repo.sh /tmp/repo-x PATCH [PATCH ...]
#     (cd /tmp/repo-x/benchmarks && PYTHONPATH=/tmp/repo-x python3 attention.py --out DIR)
#
# The virtual environments, the device carry and patched kernel copies (patched_kernels.sh) stay behind.
set -euo pipefail
dest=$1
shift
cd "$(dirname "$0")/.."
root=$PWD
rm -rf "$dest" && mkdir -p "$dest"
# a patch that does not apply leaves no copy behind: a caller timing "$dest" must not time this checkout instead
trap 'rm -rf "$dest"' ERR
tar cf - --exclude='./kvarn_compile/kernels_*' --exclude=./.device-carry --exclude=./.venv --exclude=./.venv-vllm . |
    tar xf - -C "$dest"
for patch in "$@"; do
    (cd "$dest" && git apply "$(cd "$root" && realpath "$patch")")
done
