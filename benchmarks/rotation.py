"""The Hadamard rotations the decode op runs outside its kernels, timed on the GPU (CUDA-graph medians).

A decode step rotates q [B, 32, 128] and the fresh k, v [B, 8, 128] (fp16) in fp32 and rounds once to the
cache dtype (``ops._rotated``). torch.profiler showed ~50 us per such fp32 GEMM at batch 1. Variants:
  fp32        x.float() @ H (fp32 H), cast: what the op does
  half_acc32  x (fp16) @ S (the +-1 Sylvester matrix, exact in fp16) with fp32 output, then * 1/sqrt(R):
              the products are exact and the sums fp32, so it equals ``fp32`` up to summation order
Writes rotation.json/.md to --out.

    python benchmarks/rotation.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import pathlib

import torch
import triton

from kvarn_compile.reference import _sylvester, hadamard, rotate


def bench(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3  # us


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="rotation-out")
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    h32 = hadamard(128, torch.float32, "cuda")
    signs = (_sylvester(128) * 128**0.5).round().to(torch.float16).cuda()
    rows = []
    for batch in (1, 8, 32, 128):
        for heads in (8, 32):
            x = torch.randn(batch, heads, 128, device="cuda", dtype=torch.float16)
            ref = rotate(x.float(), h32).half()

            def fp32():
                return rotate(x.float(), h32).to(torch.float16)

            def half_acc32():
                y = torch.mm(x.view(-1, 128), signs, out_dtype=torch.float32)
                return (y * 128**-0.5).to(torch.float16).view(x.shape)

            mismatch = (half_acc32() != ref).float().mean().item()
            rows.append({"batch": batch, "heads": heads, "fp32_us": bench(fp32), "half_acc32_us": bench(half_acc32),
                         "half_acc32_mismatch": mismatch})  # fmt: skip
            print(rows[-1], flush=True)
    (out / "rotation.json").write_text(json.dumps(rows, indent=1))
    lines = ["| batch | heads | fp32 us | fp16 x +-1, fp32 acc us | elements differing from fp32 |", "|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['heads']} | {r['fp32_us']:.1f} | {r['half_acc32_us']:.1f} | "
              f"{r['half_acc32_mismatch']:.2e} |" for r in rows]  # fmt: skip
    (out / "rotation.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
