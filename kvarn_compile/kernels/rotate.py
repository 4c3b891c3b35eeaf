"""Rotate rows by the block-diagonal Hadamard matrix: x [N, D] -> x @ blockdiag(H_R, ..., H_R).

A small fp32 kernel instead of a matmul library call: for the few rows of a decode step (tens to a
few hundred), cuBLAS picked split-K fp32 GEMMs that took ~30 us each on the H200 (torch.profiler,
batch 1), more than the attention kernel itself. Reference: ``reference.rotate``.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_kernel(x_ptr, h_ptr, out_ptr, n_rows, D: tl.constexpr, R: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                   BLOCK_COLS: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    col0 = tl.program_id(1) * BLOCK_COLS  # these output columns lie in one Hadamard block
    block = col0 // R
    k = tl.arange(0, R)
    cols = tl.arange(0, BLOCK_COLS)
    row_ok = rows[:, None] < n_rows
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * D + block * R + k[None, :], mask=row_ok, other=0.0)
    h = tl.load(h_ptr + k[:, None] * R + (col0 - block * R) + cols[None, :])
    y = tl.dot(x.to(tl.float32), h, input_precision="ieee")
    tl.store(out_ptr + rows[:, None].to(tl.int64) * D + col0 + cols[None, :], y.to(out_ptr.dtype.element_ty),
             mask=row_ok)  # fmt: skip


def rotate_rows(x: torch.Tensor, h: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """x [..., D] (any float dtype) times blockdiag(h) with h [R, R] fp32 -> [..., D] in ``out_dtype``."""
    d, r = x.shape[-1], h.shape[0]
    x2 = x.reshape(-1, d).contiguous()
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    n = x2.shape[0]
    if n:
        block_cols = min(r, 64)
        _rotate_kernel[(triton.cdiv(n, 16), d // block_cols)](
            x2, h, out, n, D=d, R=r, BLOCK_ROWS=16, BLOCK_COLS=block_cols, num_warps=4
        )
    return out.reshape(x.shape)
