"""Merge the per-split partials of ``paged_attention`` into the attention output.

Rows are (query token, query head) pairs, ROWS of them per program: out = sum_s 2^(m_s - M) acc_s /
sum_s 2^(m_s - M) l_s (M the running max over splits, SPLITS of them per step), then (optionally, for head dims up to 128) rotated back by the Hadamard matrix,
out @ H, as one [ROWS, DV] x [DV, DV] tensor-core product.

NOTE (vLLM 0.23 on the H200, batch 256 decode, benchmarks/results/h200-vllm-steps): the earlier one-row
programs rotated with a broadcast sum ([DV, DV] multiply-adds per row on the CUDA cores) and took 66 us per
layer, a third of the attention kernel's time.
"""

import torch
import triton
import triton.language as tl

ROWS = 16  # tl.dot's smallest M
SPLIT_ELEMENTS = 512  # splits merged per step x DV_PAD: 4 splits of 128 channels, 64 fp32 per thread (4 warps)


# nparts follows the batch (the attention kernel's splits): a runtime argument, so no new compile per batch
@triton.jit(do_not_specialize=["num_rows", "nparts"])
def _combine_splits_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr, hadamard_ptr, num_rows, nparts, stride_ot, stride_oh,
    HQ: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr, ROWS: tl.constexpr, SPLITS: tl.constexpr,
    ROTATE: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = r < num_rows
    base = r.to(tl.int64) * nparts  # partial s of row r: base + s
    offs_d = tl.arange(0, DV_PAD)
    # One pass, SPLITS partials of each row per step (an online softmax over the splits): at small batch a
    # program's rows are few and its splits many, and a step's loads wait for memory together, not in turn.
    m_run = tl.full([ROWS], float("-inf"), tl.float32)
    acc = tl.zeros([ROWS, DV_PAD], tl.float32)
    total = tl.zeros([ROWS], tl.float32)
    for s0 in range(0, nparts, SPLITS):
        part = base[:, None] + s0 + tl.arange(0, SPLITS)[None, :]  # [ROWS, SPLITS]
        live = ok[:, None] & (s0 + tl.arange(0, SPLITS)[None, :] < nparts)
        m = tl.load(part_ml_ptr + part * 2, mask=live, other=float("-inf"))
        l = tl.load(part_ml_ptr + part * 2 + 1, mask=live, other=0.0)
        a = tl.load(part_acc_ptr + part[:, :, None] * DV_PAD + offs_d[None, None, :], mask=live[:, :, None],
                    other=0.0)  # fmt: skip
        m_new = tl.maximum(m_run, tl.max(m, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible (masked rows) stay 0
        alpha = tl.where(m_run == float("-inf"), 0.0, tl.exp2(m_run - m_ref))
        w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_ref[:, None]))
        total = total * alpha + tl.sum(w * l, 1)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * a, 1)
        m_run = m_new
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
            SPLITS=max(1, SPLIT_ELEMENTS // dv_pad), ROTATE=hadamard is not None,
        )  # fmt: skip
    return out
