#!/usr/bin/env bash
# A/B of the append kernel's flip rounds: HEAD (16 rounds always) vs early exit, alternating, one process each.
set -u
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/device.txt
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $OUT/device.txt
for i in 1 2; do
  for v in old new; do
    cp .device-carry/flush-ab/qs_$v.py kvarn_compile/kernels/quantize_store.py
    timeout 150 python3 benchmarks/attention.py --out $OUT/$v-$i --append-only > $OUT/$v-$i.log 2>&1
    echo "$v-$i rc=$?"; grep -E "flush|append" $OUT/$v-$i.log | tail -4
  done
done
cp .device-carry/flush-ab/qs_new.py kvarn_compile/kernels/quantize_store.py
timeout 200 python3 -m pytest -q tests/test_kernels.py -k balanced > $OUT/gpu-balanced-tests.txt 2>&1; echo "tests rc=$?"; tail -2 $OUT/gpu-balanced-tests.txt
