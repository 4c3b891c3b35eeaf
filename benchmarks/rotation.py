"""The Hadamard rotations the decode op runs outside its kernels, timed on the GPU (CUDA-graph medians).

A decode step rotates q [B, 32, 128] and the fresh k, v [B, 8, 128] (fp16) in fp32 and rounds once to the
cache dtype (``kernels.rotate.rotated_to``). torch.profiler showed ~50 us per such fp32 GEMM at batch 1. Variants:
  fp32        x.float() @ H (fp32 H), cast: what the op does
  half_acc32  ``kernels.rotate.rotated_to``: x (fp16) @ the +-1 Sylvester matrix (exact in fp16) with fp32 sums,
              then * 1/sqrt(R): products exact, sums fp32, so it equals ``fp32`` up to summation order.
              Since session 15 that is one launch of ``kernels/rotate.py`` (results/h200-rotation-fused);
              results/h200-rotation timed its GEMM form (mm with fp32 output, scale, cast)
Writes rotation.json/.md to --out.

    python benchmarks/rotation.py --out DIR
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import pathlib

import torch
import triton

from kvarn_compile.kernels.rotate import rotated_to
from kvarn_compile.reference import hadamard, rotate

log = logging.getLogger("kvarn.bench")


def bench(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3  # us


def _fp32_rotated(x: torch.Tensor, h32: torch.Tensor) -> torch.Tensor:
    return rotate(x.float(), h32).to(torch.float16)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="rotation-out")
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    h32 = hadamard(128, torch.float32, "cuda")
    rows = []
    for batch in (1, 8, 32, 128):
        for heads in (8, 32):
            x = torch.randn(batch, heads, 128, device="cuda", dtype=torch.float16)
            fp32 = functools.partial(_fp32_rotated, x, h32)
            half_acc32 = functools.partial(rotated_to, x, torch.float16)
            mismatch = (half_acc32() != fp32()).float().mean().item()
            rows.append({"batch": batch, "heads": heads, "fp32_us": bench(fp32), "half_acc32_us": bench(half_acc32),
                         "half_acc32_mismatch": mismatch})  # fmt: skip
            log.info("%s", rows[-1])
    (out / "rotation.json").write_text(json.dumps(rows, indent=1))
    lines = [
        "| batch | heads | fp32 us | fp16 x +-1, fp32 acc us | elements differing from fp32 |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {r['batch']} | {r['heads']} | {r['fp32_us']:.1f} | {r['half_acc32_us']:.1f} | "
              f"{r['half_acc32_mismatch']:.2e} |" for r in rows]  # fmt: skip
    (out / "rotation.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
