"""A/B on the GPU: q/k/v rotations in one kernel launch (kernels/rotate.py, the package) against the GEMM form
before it (per tensor: mm with fp32 output, scale, cast), for a decode step's op and append, same inputs, one run.

    cd benchmarks && python3 results/h200-rotation-fused/ab_rotation.py > OUT.txt
"""

import functools
import json
import sys

import torch

sys.path.insert(0, ".")  # benchmarks/
from attention import HKV, HQ, D, bench, filled_cache

from kvarn_compile import get_preset, ops
from kvarn_compile.reference import hadamard_signs, rotate

PACKAGE = ops.rotated_many


def gemm_rotated_many(tensors, dtypes):
    """The rotation before kernels/rotate.py (ops.rotated_to at a4ea1e6), per tensor."""
    out = []
    for x, dtype in zip(tensors, dtypes, strict=True):
        if x.is_cuda and x.dtype in (torch.float16, torch.bfloat16):
            signs = hadamard_signs(x.shape[-1], x.dtype, x.device)
            r = signs.shape[0]
            y = torch.mm(x.reshape(-1, r), signs, out_dtype=torch.float32) * r**-0.5
            out.append(y.view(x.shape).to(dtype))
        else:
            out.append(rotate(x.float()).to(dtype))
    return out


def main():
    preset = get_preset("kvarn_k4v2_g128")
    rows = []
    for batch, context in ((1, 2048), (8, 2048), (32, 2048), (128, 2048), (8, 32768)):
        torch.manual_seed(0)
        q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.float16)
        k, v = (torch.randn(batch, HKV, D, device="cuda", dtype=torch.float16) for _ in range(2))
        cache = filled_cache(batch, context, preset)
        t = cache.tensors()
        slots = torch.arange(batch, dtype=torch.int32, device="cuda")
        start = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        row, outs = {"batch": batch, "context": context}, {}
        op = functools.partial(torch.ops.kvarn.decode_attention, q, k, v, *t[:4], slots, start, preset.name,
                               D**-0.5, 0)  # fmt: skip
        unchecked = functools.partial(ops.triton_attention, q, k, v, *t[:4], slots, start, qsl, preset, D**-0.5,
                                      True, 0, 1)  # fmt: skip
        for name, fn in (("fused", PACKAGE), ("gemm", gemm_rotated_many)):
            ops.rotated_many = fn  # triton_attention looks the name up at each call (and each graph capture)
            outs[name] = unchecked().float()
            row[f"{name} op ms"] = bench(op)
            row[f"{name} op w/o checks ms"] = bench(unchecked)
        ops.rotated_many = PACKAGE
        row["max diff"] = (outs["fused"] - outs["gemm"]).abs().max().item()
        rows.append(row)
        print(json.dumps(row), flush=True)
        del cache
    print("| batch | context | op: gemm rotations | op: one rotation kernel | w/o checks: gemm | w/o checks: fused |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['context']} | {r['gemm op ms']:.4f} | {r['fused op ms']:.4f} | "
            f"{r['gemm op w/o checks ms']:.4f} | {r['fused op w/o checks ms']:.4f} |"
        )


if __name__ == "__main__":
    main()
