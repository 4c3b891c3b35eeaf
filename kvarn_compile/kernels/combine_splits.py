"""Merge the per-split partials of ``paged_attention`` into the attention output.

Rows are (query token, query head) pairs, ROWS of them per program, or one while the rows are few (a program of
one warp while the row's partials fit one step of it): out =
sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s (M the row's max over its splits, found first; then SPLITS
partials per step), then (optionally) rotated back, out @ blockdiag(H, ..., H), by butterflies in registers. (A small
decode step's merge, ``merge_rows`` in the exact split of ``paged_attention``, takes partials already rotated back.)

NOTE (H200, the combine alone, benchmarks/results/h200-vllm-s20/combine): the rotation back was a tf32x3
product with the [DV, DV] fp32 matrix, loaded by every program (64 KB: at batch 256 / 1.5K, 32 MB of L2 reads
against 12 MB of partials; 255 registers and 64 KB of shared memory at sm_90). The butterflies need neither
(140 registers, 2 KB): B256/1.5K 14.7 -> 7.6 us, B128/2K 8.5 -> 4.4. At small batch a program of 16 rows
loads 16 rows' partials alone, and the few programs leave most SMs idle: one-row programs there (up to
ONE_ROW_PROGRAMS rows per SM) give B1/2K 6.4 -> 2.8 us, B1/32K 16.6 -> 4.5, B8/32K 8.1 -> 3.9; past that
they lose (B32/8K: 1,024 one-row programs 10.7 us, 64 of 16 rows 4.1).

NOTE (vLLM 0.23 on the H200, batch 256 decode, benchmarks/results/h200-vllm-steps): the earlier one-row
programs rotated with a broadcast sum ([DV, DV] multiply-adds per row on the CUDA cores) and took 66 us per
layer, a third of the attention kernel's time.
"""

import torch
import triton
import triton.language as tl

from ..reference import rotation_block
from .rotate import hadamard_blocks
from .tile_math import multiprocessors

ROWS = 16  # rows a program merges, unless the rows are few
ONE_ROW_PROGRAMS = 2  # rows per SM up to which a program merges one row
ELEMENTS_PER_THREAD = 64  # fp32 partials a thread holds in each merge step (rows x splits x DV_PAD / threads)
MAX_CHUNK = 256  # the first pass's splits per step: one step for a decode step's (at most 2 x 64 and the exact part's)
WARPS = 4  # per program
ONE_WARP_SPLITS = 32  # a one-row program of one warp holds this many partials per step (128 fp32 a thread at D 128)


# nparts follows the batch (the attention kernel's splits): a runtime argument, so no new compile per batch
@triton.jit(do_not_specialize=["num_rows", "nparts"])
def _combine_splits_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr, num_rows, nparts, stride_ot, stride_oh,
    HQ: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr, ROWS: tl.constexpr, SPLITS: tl.constexpr,
    MAX_CHUNK: tl.constexpr, ROTATE_BLOCK: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    merge_rows(part_acc_ptr, part_ml_ptr, out_ptr, r, r < num_rows, nparts, nparts, stride_ot, stride_oh, HQ, DV,
               DV_PAD, SPLITS, MAX_CHUNK, ROTATE_BLOCK)  # fmt: skip


@triton.jit
def merge_rows(part_acc_ptr, part_ml_ptr, out_ptr, r, ok, nparts, count, stride_ot, stride_oh, HQ: tl.constexpr,
               DV: tl.constexpr, DV_PAD: tl.constexpr, SPLITS: tl.constexpr, MAX_CHUNK: tl.constexpr,
               ROTATE_BLOCK: tl.constexpr, TAIL: tl.constexpr = 0, own=None):  # fmt: skip
    """Rows r [ROWS] (row = token * HQ + head; those ``ok``) merged from the first ``count`` of their ``nparts``
    stored partials, and from ``own`` (the caller's partial of the same rows in registers: max and sum [ROWS], acc
    [ROWS, DV_PAD]; None: none), rotated back if ROTATE_BLOCK > 0 (``rotate.hadamard_blocks``), and stored to
    out; SPLITS partials a step, or SPLITS + TAIL at once (a step and a short tail: ``_merge_at_once``). The
    combine's programs, and a small decode step's exact split (its own partial in registers:
    ``paged_attention.merge_in_exact_split``)."""
    ROWS: tl.constexpr = r.shape[0]
    base = r.to(tl.int64) * nparts  # partial s of row r: base + s
    offs_d = tl.arange(0, DV_PAD)
    if count <= SPLITS:  # (the tail's loads only where a row's partials need them: no rows held, no tail)
        out = _merge_at_once(part_acc_ptr, part_ml_ptr, base, ok, count, ROWS, DV_PAD, SPLITS, 0, own)
    elif count <= SPLITS + TAIL:
        out = _merge_at_once(part_acc_ptr, part_ml_ptr, base, ok, count, ROWS, DV_PAD, SPLITS, TAIL, own)
    else:
        out = _merge_in_steps(part_acc_ptr, part_ml_ptr, base, ok, count, ROWS, DV_PAD, SPLITS, MAX_CHUNK, own)
    if ROTATE_BLOCK > 0:
        out = hadamard_blocks(out, ROTATE_BLOCK)
    t = (r // HQ).to(tl.int64)
    h = r % HQ
    tl.store(out_ptr + t[:, None] * stride_ot + h[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=ok[:, None] & (offs_d[None, :] < DV))  # fmt: skip


@triton.jit
def _merge_at_once(part_acc_ptr, part_ml_ptr, base, ok, count, ROWS: tl.constexpr, DV_PAD: tl.constexpr,
                   SPLITS: tl.constexpr, TAIL: tl.constexpr, own):  # fmt: skip
    """The merged rows [ROWS, DV_PAD] from count <= SPLITS + TAIL partials, all loaded at once (a step of SPLITS and,
    where TAIL > 0, one of TAIL) and the max taken from the same loads: one round trip where the max pass and the
    steps take three. NOTE (H200, benchmarks/results/h200-s24/call3, one step of SPLITS: op w/o checks B8/32K 0.0862
    -> 0.0857 / 0.0853 ms). The tail: a small decode step's halves fill a step (32 partials at GQA 4, D 128) and its
    exact part's live programs add a few (H100, benchmarks/results/gpu-s43: two merge steps for 33 partials instead
    of one cost B1/2K ~1 us)."""
    m, l, a = _step_partials(part_acc_ptr, part_ml_ptr, base, ok, 0, count, SPLITS, DV_PAD)
    m_max = tl.max(m, 1)
    if TAIL > 0:
        m_tail, l_tail, a_tail = _step_partials(part_acc_ptr, part_ml_ptr, base, ok, SPLITS, count, TAIL, DV_PAD)
        m_max = tl.maximum(m_max, tl.max(m_tail, 1))
    m_ref = _finite_max(m_max, own)
    acc, total = _own_terms(own, m_ref, ROWS, DV_PAD)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_ref[:, None]))
    acc += tl.sum(w[:, :, None] * a, 1)
    total += tl.sum(w * l, 1)
    if TAIL > 0:
        w_tail = tl.where(m_tail == float("-inf"), 0.0, tl.exp2(m_tail - m_ref[:, None]))
        acc += tl.sum(w_tail[:, :, None] * a_tail, 1)
        total += tl.sum(w_tail * l_tail, 1)
    return acc / tl.maximum(total, 1e-30)[:, None]  # a visible split's sum is >= 1 (its max term is 2^0)


@triton.jit
def _finite_max(m_max, own):
    """The rows' reference max for the weights 2^(m - ref): their max over the stored partials [ROWS] and ``own``'s,
    finite for rows with nothing visible (masked rows: their weights are all 0, and so is their output)."""
    if own is not None:
        m_max = tl.maximum(m_max, own[0])
    return tl.maximum(m_max, -1e30)


@triton.jit
def _own_terms(own, m_ref, ROWS: tl.constexpr, DV_PAD: tl.constexpr):
    """``own``'s weighted acc [ROWS, DV_PAD] and sum [ROWS] against the reference max (zeros if own is None)."""
    if own is not None:
        w = tl.where(own[0] == float("-inf"), 0.0, tl.exp2(own[0] - m_ref))
        acc = w[:, None] * own[2]
        total = w * own[1]
    else:
        acc = tl.zeros([ROWS, DV_PAD], tl.float32)
        total = tl.zeros([ROWS], tl.float32)
    return acc, total


@triton.jit
def _step_partials(part_acc_ptr, part_ml_ptr, base, ok, s0, count, SPLITS: tl.constexpr, DV_PAD: tl.constexpr):
    """Partials s0..s0+SPLITS-1 of each row (past count, or in rows not ``ok``: max -inf, sum 0, acc 0): max and
    sum [ROWS, SPLITS], acc [ROWS, SPLITS, DV_PAD]."""
    part = base[:, None] + s0 + tl.arange(0, SPLITS)[None, :]  # [ROWS, SPLITS]
    live = ok[:, None] & (s0 + tl.arange(0, SPLITS)[None, :] < count)
    m = tl.load(part_ml_ptr + part * 2, mask=live, other=float("-inf"))
    l = tl.load(part_ml_ptr + part * 2 + 1, mask=live, other=0.0)
    offs_d = tl.arange(0, DV_PAD)
    a = tl.load(part_acc_ptr + part[:, :, None] * DV_PAD + offs_d[None, None, :], mask=live[:, :, None], other=0.0)
    return m, l, a


@triton.jit
def _merge_in_steps(part_acc_ptr, part_ml_ptr, base, ok, count, ROWS: tl.constexpr, DV_PAD: tl.constexpr,
                    SPLITS: tl.constexpr, MAX_CHUNK: tl.constexpr, own):  # fmt: skip
    """The merged rows [ROWS, DV_PAD] from more partials than one step holds."""
    # First pass: each row's max over its splits (8 bytes a split), so that the second pass's weights are
    # known before each step's loads (no rescaling chain from step to step).
    m_max = tl.full([ROWS], float("-inf"), tl.float32)
    for s0 in range(0, count, MAX_CHUNK):
        s = s0 + tl.arange(0, MAX_CHUNK)[None, :]
        m = tl.load(part_ml_ptr + (base[:, None] + s) * 2, mask=ok[:, None] & (s < count), other=float("-inf"))
        m_max = tl.maximum(m_max, tl.max(m, 1))
    # one use of each loop result, as Triton's thread-locality pass for reductions in loops requires
    m_ref = _finite_max(m_max, own)
    acc, total = _own_terms(own, m_ref, ROWS, DV_PAD)
    for s0 in range(0, count, SPLITS):
        m, l, a = _step_partials(part_acc_ptr, part_ml_ptr, base, ok, s0, count, SPLITS, DV_PAD)
        w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_ref[:, None]))
        total += tl.sum(w * l, 1)
        acc += tl.sum(w[:, :, None] * a, 1)
    return acc / tl.maximum(total, 1e-30)[:, None]  # a visible split's sum is >= 1 (its max term is 2^0)


def combine_splits(part_acc: torch.Tensor, part_ml: torch.Tensor, out: torch.Tensor, rotate_back: bool = False,
                   rows: int | None = None) -> torch.Tensor:  # fmt: skip
    """part_acc [T, Hq, S, DV_PAD] fp32, part_ml [T, Hq, S, 2] fp32 -> out [T, Hq, Dv] (written, returned).

    ``rotate_back``: the output is also rotated back (``reference.rotate``). ``rows``: rows per program
    (default: 1 up to ONE_ROW_PROGRAMS rows per SM, else ROWS).
    """
    tokens, hq, nparts, dv_pad = part_acc.shape
    if tokens > 0:
        if rows is None:
            rows = 1 if tokens * hq <= ONE_ROW_PROGRAMS * multiprocessors(out.device) else ROWS
        # One row's partials that fit one step of one warp: one warp (its reductions and the rotation back stay in
        # the warp: 25 bar.sync in the 4-warp form's PTX, 3 here); else WARPS. NOTE (H200, benchmarks/results/
        # h200-s26/next/ab.txt, op ms, "package" against "fsel-only"): B1/2K 0.0109 -> 0.0105, B8/2K 0.0164 ->
        # 0.0159, B8/8K 0.0328 -> 0.0319, B8/32K 0.0806 -> 0.0797; B1/32K's 129 partials keep 4 warps.
        one_warp = rows == 1 and nparts <= ONE_WARP_SPLITS
        warps = 1 if one_warp else WARPS
        splits = ONE_WARP_SPLITS if one_warp else max(1, ELEMENTS_PER_THREAD * 32 * WARPS // (rows * dv_pad))
        _combine_splits_kernel[(triton.cdiv(tokens * hq, rows),)](
            part_acc, part_ml, out, tokens * hq, nparts, out.stride(0), out.stride(1), HQ=hq, DV=out.shape[-1],
            DV_PAD=dv_pad, ROWS=rows, SPLITS=splits, MAX_CHUNK=MAX_CHUNK,
            ROTATE_BLOCK=rotation_block(out.shape[-1]) if rotate_back else 0, num_warps=warps,
        )  # fmt: skip
    return out
