"""Session 9: the combine kernel alone, before (HEAD, two passes, one split per step) and after (one pass,
SPLITS per step), on the partials of benchmarks/attention.py's decode shapes (32 q heads, head_dim 128)."""

import functools
import json
import sys

import torch
import triton

sys.path.insert(0, "scratch")
import combine_old

from kvarn_compile.kernels import combine_splits as new
from kvarn_compile.kernels.paged_attention import num_splits_for
from kvarn_compile.reference import hadamard

HQ, DV = 32, 128
rows = []
sms = torch.cuda.get_device_properties(0).multi_processor_count
h = hadamard(DV, torch.float32, "cuda")
for batch in (1, 8, 32, 128, 256):
    for context in (2048, 32768):
        tiles = context // 128
        parts = num_splits_for(batch * 8, tiles, sms) + 1
        acc = torch.randn(batch, HQ, parts, DV, device="cuda")
        ml = torch.randn(batch, HQ, parts, 2, device="cuda")
        ml[..., 1] = ml[..., 1].abs() + 1
        ml[:, :, -3:, 0] = float("-inf")  # splits past a sequence's end
        outs = {}
        times = {}
        for name, mod in (("before", combine_old), ("after", new)):
            out = torch.empty(batch, HQ, DV, device="cuda", dtype=torch.float16)
            fn = functools.partial(mod.combine_splits, acc, ml, out, h)
            fn()
            torch.cuda.synchronize()
            times[name] = triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1000
            outs[name] = out.float()
        diff = float((outs["before"] - outs["after"]).abs().max())
        rows.append(
            {
                "batch": batch,
                "context": context,
                "partials": parts,
                "before_us": times["before"],
                "after_us": times["after"],
                "max_abs_diff": diff,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
with open(sys.argv[1], "w") as f:
    json.dump(rows, f, indent=1)
