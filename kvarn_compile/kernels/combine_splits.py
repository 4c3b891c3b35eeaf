"""Merge the per-split partials of ``paged_attention`` into the attention output.

Rows are (query token, query head) pairs, ROWS of them per program: out = sum_s 2^(m_s - M) acc_s /
sum_s 2^(m_s - M) l_s, then (optionally, for head dims up to 128) rotated back by the Hadamard matrix,
out @ H, as one [ROWS, DV] x [DV, DV] tensor-core product.

NOTE (vLLM 0.23 on the H200, batch 256 decode, benchmarks/results/h200-vllm-steps): the earlier one-row
programs rotated with a broadcast sum ([DV, DV] multiply-adds per row on the CUDA cores) and took 66 us per
layer, a third of the attention kernel's time.
"""

import torch
import triton
import triton.language as tl

ROWS = 16  # tl.dot's smallest M


# nparts follows the batch (the attention kernel's splits): a runtime argument, so no new compile per batch
@triton.jit(do_not_specialize=["num_rows", "nparts"])
def _combine_splits_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr, hadamard_ptr, num_rows, nparts, stride_ot, stride_oh,
    HQ: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr, ROWS: tl.constexpr, ROTATE: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = r < num_rows
    base = r.to(tl.int64) * nparts  # partial s of row r: base + s
    offs_d = tl.arange(0, DV_PAD)
    m_max = tl.full([ROWS], float("-inf"), tl.float32)
    for s in range(nparts):
        m_max = tl.maximum(m_max, tl.load(part_ml_ptr + (base + s) * 2, mask=ok, other=float("-inf")))
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # rows with nothing visible (masked rows) stay 0
    acc = tl.zeros([ROWS, DV_PAD], tl.float32)
    total = tl.zeros([ROWS], tl.float32)
    for s in range(nparts):
        m = tl.load(part_ml_ptr + (base + s) * 2, mask=ok, other=float("-inf"))
        w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max))
        total += w * tl.load(part_ml_ptr + (base + s) * 2 + 1, mask=ok, other=0.0)
        acc += w[:, None] * tl.load(part_acc_ptr + (base + s)[:, None] * DV_PAD + offs_d[None, :], mask=ok[:, None],
                                    other=0.0)  # fmt: skip
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    if ROTATE:  # tf32x3: fp32-level accuracy from the tensor cores
        rotation = tl.load(hadamard_ptr + offs_d[:, None] * DV + offs_d[None, :])
        out = tl.dot(out, rotation, input_precision="tf32x3")
    t = (r // HQ).to(tl.int64)
    h = r % HQ
    tl.store(out_ptr + t[:, None] * stride_ot + h[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=ok[:, None] & (offs_d[None, :] < DV))  # fmt: skip


def combine_splits(part_acc: torch.Tensor, part_ml: torch.Tensor, out: torch.Tensor,
                   hadamard: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """part_acc [T, Hq, S, DV_PAD] fp32, part_ml [T, Hq, S, 2] fp32 -> out [T, Hq, Dv] (written, returned).

    With ``hadamard`` (the [Dv, Dv] fp32 matrix, Dv <= 128) the output is also rotated back.
    """
    tokens, hq, nparts, dv_pad = part_acc.shape
    if tokens > 0:
        _combine_splits_kernel[(triton.cdiv(tokens * hq, ROWS),)](
            part_acc, part_ml, out, part_ml if hadamard is None else hadamard, tokens * hq, nparts,
            out.stride(0), out.stride(1), HQ=hq, DV=out.shape[-1], DV_PAD=dv_pad, ROWS=ROWS,
            ROTATE=hadamard is not None,
        )  # fmt: skip
    return out
