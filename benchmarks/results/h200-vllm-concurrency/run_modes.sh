#!/usr/bin/env bash
# run several graph-mode engines at once on one GPU, then compare
source benchmarks/device_vllm_env.sh
export VLLM_WORKER_MULTIPROC_METHOD=spawn
i=0
for spec in "$@"; do
  i=$((i+1))
  timeout 540 python scratch/graph_modes.py run "$spec" "$OUT/run$i.json" > "$OUT/log$i.txt" 2>&1 &
  sleep 2
done
wait
python scratch/graph_modes.py compare $OUT/run*.json 2>&1 | tee $OUT/compare.txt
for f in $OUT/log*.txt; do echo "== $f"; grep -E "Error|error|Traceback|assert" $f | head -5; done
