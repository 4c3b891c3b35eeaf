"""Fused append: stage new tokens, and normalise + RTN + pack + store every tile they complete.

One program per (sequence, tile touched by the call, KV head). A program whose tile is completed by the
call gathers the tile (earlier tokens from the exact current-tile buffer, new ones from the input),
runs the iterative variance normalisation, quantizes keys per channel and values per token, folds the
scales, packs codes and scales into the tile's page record and stores it. Program 0 of each sequence
then stores the tokens of the call's incomplete last tile into the exact buffer (after a barrier, since
it may overwrite rows it has just read). Everything is decided on the device: no host sync.

Inputs are already rotated (the op rotates with one matmul); reference: ``paged.append_reference``.
"""

import torch
import triton
import triton.language as tl

from ..presets import Preset
from .. import reference
from .tile_math import fp16_ptr, pack_codes

# The reference's normalisation constants, as compile-time constants of the kernel.
STD_MIN = tl.constexpr(reference.STD_MIN)
STD_MAX = tl.constexpr(reference.STD_MAX)
LOG_SCALE_MIN = tl.constexpr(reference.LOG_SCALE_MIN)
LOG_SCALE_MAX = tl.constexpr(reference.LOG_SCALE_MAX)
IMBALANCE_MARGIN = tl.constexpr(reference.IMBALANCE_MARGIN)


@triton.jit
def _std(y, valid, AXIS: tl.constexpr, N):
    """Unbiased std of y [G, D] along AXIS over the N valid entries, clamped like the reference."""
    mean = tl.sum(y, axis=AXIS) / N
    dev = tl.where(valid, y - tl.expand_dims(mean, AXIS), 0.0)
    std = tl.sqrt(tl.sum(dev * dev, axis=AXIS) / (N - 1))
    return tl.minimum(tl.maximum(std, STD_MIN), STD_MAX)


@triton.jit
def _imbalance(y, valid, chan_ok, D, G: tl.constexpr):
    st = _std(y, valid, 1, D)
    sc = _std(y, valid, 0, G)
    chan_ratio = tl.max(tl.where(chan_ok, sc, 0.0), axis=0) / tl.min(tl.where(chan_ok, sc, float("inf")), axis=0)
    return tl.max(st, axis=0) / tl.min(st, axis=0) + chan_ratio


@triton.jit
def _balance(x, valid, chan_ok, D, G: tl.constexpr, TOKENS_FIRST: tl.constexpr, ITERS: tl.constexpr):
    """Iterative variance normalisation of x [G, D_PAD]: returns (log_tok [G], log_chan [D_PAD])."""
    lt = tl.sum(x, axis=1) * 0.0
    lc = tl.sum(x, axis=0) * 0.0
    best = _imbalance(x, valid, chan_ok, D, G)
    best_lt = lt
    best_lc = lc
    for _ in range(ITERS):  # a runtime loop: unrolled, large tiles take minutes to compile
        if TOKENS_FIRST:
            y = x * tl.exp(-lt)[:, None] * tl.exp(-lc)[None, :]
            lt = tl.minimum(tl.maximum(lt + tl.log(_std(y, valid, 1, D)), LOG_SCALE_MIN), LOG_SCALE_MAX)
            y = x * tl.exp(-lt)[:, None] * tl.exp(-lc)[None, :]
            lc = tl.minimum(tl.maximum(lc + tl.log(_std(y, valid, 0, G)), LOG_SCALE_MIN), LOG_SCALE_MAX)
        else:
            y = x * tl.exp(-lt)[:, None] * tl.exp(-lc)[None, :]
            lc = tl.minimum(tl.maximum(lc + tl.log(_std(y, valid, 0, G)), LOG_SCALE_MIN), LOG_SCALE_MAX)
            y = x * tl.exp(-lt)[:, None] * tl.exp(-lc)[None, :]
            lt = tl.minimum(tl.maximum(lt + tl.log(_std(y, valid, 1, D)), LOG_SCALE_MIN), LOG_SCALE_MAX)
        y = x * tl.exp(-lt)[:, None] * tl.exp(-lc)[None, :]
        imbalance = _imbalance(y, valid, chan_ok, D, G)
        better = imbalance < best * (1.0 - IMBALANCE_MARGIN)
        best = tl.where(better, imbalance, best)
        best_lt = tl.where(better, lt, best_lt)
        best_lc = tl.where(better, lc, best_lc)
    return best_lt, best_lc


@triton.jit
def _to_fp16(x):
    return tl.minimum(tl.maximum(x, -65504.0), 65504.0).to(tl.float16)


@triton.jit
def _quantize_store_tile(
    xk, xv, record,
    DK, DV, G: tl.constexpr, DK_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    KB: tl.constexpr, VB: tl.constexpr, ITERS: tl.constexpr,
    OFF_V: tl.constexpr, OFF_KCS: tl.constexpr, OFF_KCZ: tl.constexpr, OFF_KTS: tl.constexpr,
    OFF_VCS: tl.constexpr, OFF_VTS: tl.constexpr, OFF_VTZ: tl.constexpr,
):  # fmt: skip
    """Quantize rotated fp32 tiles xk [G, DK_PAD], xv [G, DV_PAD] into the record at ``record``."""
    offs_t = tl.arange(0, G)
    offs_dk = tl.arange(0, DK_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    k_ok = offs_dk[None, :] < DK
    v_ok = offs_dv[None, :] < DV
    k_valid = k_ok & (offs_t[:, None] < G)
    v_valid = v_ok & (offs_t[:, None] < G)

    # Keys: tokens first, then RTN per channel over the tile's tokens.
    lt, lc = _balance(xk, k_valid, offs_dk < DK, DK, G, True, ITERS)
    tok, chan = tl.exp(lt), tl.exp(lc)
    y = xk / tok[:, None] / chan[None, :]
    lo = tl.min(y, axis=0)
    scale = (tl.max(y, axis=0) - lo) / (2**KB - 1)
    codes = tl.floor((y - lo[None, :]) / tl.maximum(scale, 1e-30)[None, :] + 0.5)
    codes = tl.minimum(tl.maximum(codes, 0.0), 2**KB - 1).to(tl.int32)
    K_ROW: tl.constexpr = DK_PAD * KB // 8
    offs_kb = tl.arange(0, K_ROW)
    tl.store(record + offs_t[:, None] * (DK * KB // 8) + offs_kb[None, :], pack_codes(codes, KB),
             mask=offs_kb[None, :] < DK * KB // 8)  # fmt: skip
    tl.store(fp16_ptr(record + OFF_KCS) + offs_dk, _to_fp16(scale * chan), mask=offs_dk < DK)
    tl.store(fp16_ptr(record + OFF_KCZ) + offs_dk, _to_fp16(lo * chan), mask=offs_dk < DK)
    tl.store(fp16_ptr(record + OFF_KTS) + offs_t, _to_fp16(tok))

    # Values: channels first, then RTN per token over the (valid) channels; codes stored channel-major.
    lt, lc = _balance(xv, v_valid, offs_dv < DV, DV, G, False, ITERS)
    tok, chan = tl.exp(lt), tl.exp(lc)
    y = xv / tok[:, None] / chan[None, :]
    lo = tl.min(tl.where(v_ok, y, float("inf")), axis=1)
    scale = (tl.max(tl.where(v_ok, y, float("-inf")), axis=1) - lo) / (2**VB - 1)
    codes = tl.floor((y - lo[:, None]) / tl.maximum(scale, 1e-30)[:, None] + 0.5)
    codes = tl.minimum(tl.maximum(codes, 0.0), 2**VB - 1).to(tl.int32)
    V_ROW: tl.constexpr = G * VB // 8
    offs_vb = tl.arange(0, V_ROW)
    tl.store(record + OFF_V + offs_dv[:, None] * V_ROW + offs_vb[None, :], pack_codes(tl.trans(codes), VB),
             mask=offs_dv[:, None] < DV)  # fmt: skip
    tl.store(fp16_ptr(record + OFF_VCS) + offs_dv, _to_fp16(chan), mask=offs_dv < DV)
    tl.store(fp16_ptr(record + OFF_VTS) + offs_t, _to_fp16(scale * tok))
    tl.store(fp16_ptr(record + OFF_VTZ) + offs_t, _to_fp16(lo * tok))


@triton.jit
def _quantize_store_kernel(
    k_ptr, v_ptr, pages_ptr, exact_k_ptr, exact_v_ptr, page_table_ptr, seq_lens_ptr,
    slots_ptr, start_pos_ptr, qsl_ptr,
    num_pages, max_tiles, stride_kt, stride_kh, stride_vt, stride_vh,
    HKV: tl.constexpr, E: tl.constexpr, G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    DK_PAD: tl.constexpr, DV_PAD: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr, ITERS: tl.constexpr,
    NBYTES: tl.constexpr, OFF_V: tl.constexpr, OFF_KCS: tl.constexpr, OFF_KCZ: tl.constexpr,
    OFF_KTS: tl.constexpr, OFF_VCS: tl.constexpr, OFF_VTS: tl.constexpr, OFF_VTZ: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    i = tl.program_id(1)
    h = tl.program_id(2)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    p0 = tl.load(start_pos_ptr + b)
    row0 = tl.load(qsl_ptr + b)
    end = p0 + tl.load(qsl_ptr + b + 1) - row0
    tile = p0 // G + i
    t0 = tile * G

    offs_t = tl.arange(0, G)
    offs_dk = tl.arange(0, DK_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    pos = t0 + offs_t
    exact_k = exact_k_ptr + (slot * HKV + h) * E * G * DK  # this slot and head: [E, G, DK]
    exact_v = exact_v_ptr + (slot * HKV + h) * E * G * DV

    if (t0 < end) & (t0 + G <= end) & (tile < max_tiles):
        # The call completes this tile: gather it, then quantize it (or keep it exact as the sink).
        old = pos < p0
        new = pos >= p0
        rows = (row0 + pos - p0).to(tl.int64)
        k_mask = offs_dk[None, :] < DK
        v_mask = offs_dv[None, :] < DV
        xk = tl.where(
            old[:, None],
            tl.load(exact_k + offs_t[:, None] * DK + offs_dk[None, :], mask=old[:, None] & k_mask, other=0.0),
            tl.load(k_ptr + rows[:, None] * stride_kt + h * stride_kh + offs_dk[None, :],
                    mask=new[:, None] & k_mask, other=0.0),
        )  # fmt: skip
        xv = tl.where(
            old[:, None],
            tl.load(exact_v + offs_t[:, None] * DV + offs_dv[None, :], mask=old[:, None] & v_mask, other=0.0),
            tl.load(v_ptr + rows[:, None] * stride_vt + h * stride_vh + offs_dv[None, :],
                    mask=new[:, None] & v_mask, other=0.0),
        )  # fmt: skip
        if (E == 2) & (tile == 0):
            tl.store(exact_k + G * DK + offs_t[:, None] * DK + offs_dk[None, :], xk, mask=k_mask)
            tl.store(exact_v + G * DV + offs_t[:, None] * DV + offs_dv[None, :], xv, mask=v_mask)
        else:
            page = tl.load(page_table_ptr + slot * max_tiles + tile).to(tl.int64)
            if (page >= 0) & (page < num_pages):
                _quantize_store_tile(
                    xk.to(tl.float32), xv.to(tl.float32), pages_ptr + (page * HKV + h) * NBYTES,
                    DK, DV, G, DK_PAD, DV_PAD, KB, VB, ITERS,
                    OFF_V, OFF_KCS, OFF_KCZ, OFF_KTS, OFF_VCS, OFF_VTS, OFF_VTZ,
                )  # fmt: skip

    if i == 0:
        # The incomplete last tile's new tokens go to the exact buffer; this may overwrite rows read
        # above, hence the barrier.
        tl.debug_barrier()
        last = end // G
        if (end % G != 0) & (p0 < end):
            pos = last * G + offs_t
            new = (pos >= p0) & (pos < end)
            rows = (row0 + pos - p0).to(tl.int64)
            xk = tl.load(k_ptr + rows[:, None] * stride_kt + h * stride_kh + offs_dk[None, :],
                         mask=new[:, None] & (offs_dk[None, :] < DK))  # fmt: skip
            xv = tl.load(v_ptr + rows[:, None] * stride_vt + h * stride_vh + offs_dv[None, :],
                         mask=new[:, None] & (offs_dv[None, :] < DV))  # fmt: skip
            tl.store(exact_k + offs_t[:, None] * DK + offs_dk[None, :], xk, mask=new[:, None] & (offs_dk[None, :] < DK))
            tl.store(exact_v + offs_t[:, None] * DV + offs_dv[None, :], xv, mask=new[:, None] & (offs_dv[None, :] < DV))
        if h == 0:
            tl.store(seq_lens_ptr + slot, end)


def quantize_store(
    k_rot: torch.Tensor,
    v_rot: torch.Tensor,
    pages: torch.Tensor,
    exact_k: torch.Tensor,
    exact_v: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    slots: torch.Tensor,
    start_pos: torch.Tensor,
    query_start_loc: torch.Tensor,
    preset: Preset,
    max_query_len: int,
) -> None:
    """Launch the append kernel. k_rot [T, Hkv, Dk], v_rot [T, Hkv, Dv]: rotated, in the cache dtype.

    Shapes and dtypes are validated by the op (``ops.append``); this only lays out the launch.
    """
    num_seqs = slots.numel()
    hkv, g = exact_k.shape[1], preset.tile_size
    dk, dv = exact_k.shape[-1], exact_v.shape[-1]
    if num_seqs == 0 or max_query_len == 0:
        return
    layout = preset.layout(dk, dv)
    # A call of up to max_query_len tokens per sequence touches at most this many tiles of it.
    tiles = (max_query_len + g - 2) // g + 1
    _quantize_store_kernel[(num_seqs, tiles, hkv)](
        k_rot, v_rot, pages, exact_k, exact_v, page_table, seq_lens, slots, start_pos, query_start_loc,
        pages.shape[0], page_table.shape[1], k_rot.stride(0), k_rot.stride(1), v_rot.stride(0), v_rot.stride(1),
        HKV=hkv, E=exact_k.shape[2], G=g, DK=dk, DV=dv,
        DK_PAD=triton.next_power_of_2(dk), DV_PAD=triton.next_power_of_2(dv),
        KB=preset.key_bits, VB=preset.value_bits, ITERS=preset.iterations, NBYTES=layout.nbytes,
        OFF_V=layout.v_codes, OFF_KCS=layout.k_chan_scale, OFF_KCZ=layout.k_chan_zero, OFF_KTS=layout.k_tok_scale,
        OFF_VCS=layout.v_chan_scale, OFF_VTS=layout.v_tok_scale, OFF_VTZ=layout.v_tok_zero,
        num_warps=8 if g * triton.next_power_of_2(max(dk, dv)) <= 128 * 128 else 16,
    )  # fmt: skip
