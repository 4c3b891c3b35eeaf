#!/usr/bin/env bash
# Session 40's device call, from the repository root, after carrying the vLLM 0.23 bundle
# (../shared/device/vllm023/make-bundle.sh: .device-carry/vllm023/p1 .. p3 one a call, then this with p4):
#   bash .device-carry/vllm023/p4/install.sh && bash benchmarks/results/gpu-s40/run.sh vllm-tests
# vLLM's full CUDA graphs against piecewise ones (dense fp16 and MLA bf16) and the --compilation-config hook, on the
# decode path of sessions 23-38 (last run on a GPU in session 19), 3 pytest-xdist workers, into $OUT.
source benchmarks/device_steps.sh
start_call "$0" "$1"  # sets repo and here
export VLLM_WORKER_MULTIPROC_METHOD=spawn
source benchmarks/device_vllm_env.sh
python3 -c "import vllm; print('vllm', vllm.__version__)" >> "$OUT/env-$1.txt" 2>&1
workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n 3")  # serial where pytest-xdist is missing
case $1 in
vllm-tests)
    timeout 540 python3 -m pytest -q -rs -p no:cacheprovider $workers tests/test_vllm_plugin.py \
        -k "full_cuda_graphs or compilation_config_hook" > "$OUT/tests-vllm.txt" 2>&1
    tail -n 5 "$OUT/tests-vllm.txt"
    ;;
esac
date -u >> "$OUT/env-$1.txt"
