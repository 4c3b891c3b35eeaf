"""Merge the per-split partials of ``paged_attention`` into the attention output.

One program per (query token, query head): out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s, then
(optionally, for head dims up to 128) rotated back by the Hadamard matrix: out @ H.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _combine_splits_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr, hadamard_ptr, stride_ot, stride_oh,
    HQ: tl.constexpr, NPARTS: tl.constexpr, NPARTS_PAD: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr,
    ROTATE: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, NPARTS_PAD)
    offs_d = tl.arange(0, DV_PAD)
    base = (t * HQ + h) * NPARTS
    s_ok = offs_s < NPARTS
    m = tl.load(part_ml_ptr + (base + offs_s) * 2, mask=s_ok, other=float("-inf"))
    l = tl.load(part_ml_ptr + (base + offs_s) * 2 + 1, mask=s_ok, other=0.0)
    acc = tl.load(part_acc_ptr + (base + offs_s)[:, None] * DV_PAD + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max))
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    if ROTATE:  # a row vector times [DV, DV]: a broadcast sum (tl.dot needs 16 rows)
        rotation = tl.load(hadamard_ptr + offs_d[:, None] * DV + offs_d[None, :])
        out = tl.sum(out[:, None] * rotation, axis=0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=offs_d < DV)


def combine_splits(part_acc: torch.Tensor, part_ml: torch.Tensor, out: torch.Tensor,
                   hadamard: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """part_acc [T, Hq, S, DV_PAD] fp32, part_ml [T, Hq, S, 2] fp32 -> out [T, Hq, Dv] (written, returned).

    With ``hadamard`` (the [Dv, Dv] fp32 matrix, Dv <= 128) the output is also rotated back.
    """
    tokens, hq, nparts, dv_pad = part_acc.shape
    if tokens > 0:
        _combine_splits_kernel[(tokens, hq)](
            part_acc, part_ml, out, part_ml if hadamard is None else hadamard, out.stride(0), out.stride(1),
            HQ=hq, NPARTS=nparts, NPARTS_PAD=triton.next_power_of_2(nparts), DV=out.shape[-1], DV_PAD=dv_pad,
            ROTATE=hadamard is not None,
        )  # fmt: skip
    return out
