"""Stage a decode-sized append: the sequences' lengths, and the new rows of every sequence whose tile they do not
complete, written into the exact current-tile buffer.

One small program per (sequence, KV head), keys and values both: all of a batch's programs run in one wave. The
rows of a sequence that completes a tile are left to the quantize-and-store kernel (``quantize_store``), which
gathers the tile, quantizes it and then stages those rows itself. NOTE (H100,
benchmarks/results/h100-s35/timeline) before this kernel, one program of the quantize-and-store kernel (8 warps,
~255 registers: one per SM) per sequence, KV head and keys or values staged the rows: 2,048 such programs at batch
128 ran in 16 waves, 16 us of a 124 us decode step with no tile completing (30 us at batch 256).

Reference: ``paged.append_reference``.
"""

import triton
import triton.language as tl

from .tile_math import check_sequence

DECODE_ROWS = 16  # a decode-sized call: at most this many new rows a sequence (fewer than any tile's G)


@triton.jit
def completes_first_tile(p0, end, max_tiles, G: tl.constexpr):
    """Whether a call of tokens [p0, end) completes the tile it starts in (the only one a call of at most G
    tokens can complete); scalars or blocks."""
    tile = p0 // G
    return ((tile + 1) * G <= end) & (tile < max_tiles)


@triton.jit
def stage_rows(new_ptr, stride_t, exact, row0, p0, end, D, G: tl.constexpr, TAIL: tl.constexpr,
               D_PAD: tl.constexpr):  # fmt: skip
    """Write a call's new rows of the incomplete tile it ends in (the last <= TAIL rows before ``end``) into
    ``exact``, one slot and head's [G, D] exact buffer, from ``new_ptr``, the head's first new row (row ``row0`` of
    the call is position ``p0``)."""
    offs_d = tl.arange(0, D_PAD)
    tail0 = (end // G) * G
    pos = tl.maximum(tail0, end - TAIL) + tl.arange(0, TAIL)
    new = ((pos >= p0) & (pos < end))[:, None] & (offs_d[None, :] < D)
    rows = (row0 + pos - p0).to(tl.int64)
    x = tl.load(new_ptr + rows[:, None] * stride_t + offs_d[None, :], mask=new)
    tl.store(exact + (pos - tail0)[:, None] * D + offs_d[None, :], x, mask=new)


# The per-sequence metadata may start at any row (a mixed step's prefill rows): no kernel per alignment.
@triton.jit(
    do_not_specialize=["max_new"],
    do_not_specialize_on_alignment=["seq_lens_ptr", "slots_ptr", "start_pos_ptr", "qsl_ptr"],
)
def _stage_rows_kernel(
    k_ptr, v_ptr, exact_k_ptr, exact_v_ptr, seq_lens_ptr, slots_ptr, start_pos_ptr, qsl_ptr,
    num_slots, max_tiles, max_new, stride_kt, stride_kh, stride_vt, stride_vh,
    HKV: tl.constexpr, E: tl.constexpr, G: tl.constexpr, TAIL: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    DK_PAD: tl.constexpr, DV_PAD: tl.constexpr, PTX: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    p0 = tl.load(start_pos_ptr + b)
    row0 = tl.load(qsl_ptr + b)
    end = p0 + tl.load(qsl_ptr + b + 1) - row0
    check_sequence(slot, p0, end - p0, max_new, num_slots, max_tiles * G, PTX)
    if (h == 0) & (end > p0):  # a padding row (no new tokens) has no length to write
        tl.store(seq_lens_ptr + slot, end)
    if (end > p0) & ~completes_first_tile(p0, end, max_tiles, G):
        exact = (slot * HKV + h) * E * G
        stage_rows(k_ptr + h * stride_kh, stride_kt, exact_k_ptr + exact * DK, row0, p0, end, DK, G, TAIL, DK_PAD)
        stage_rows(v_ptr + h * stride_vh, stride_vt, exact_v_ptr + exact * DV, row0, p0, end, DV, G, TAIL, DV_PAD)


def stage(k_rot, v_rot, exact_k, exact_v, page_table, seq_lens, slots, start_pos, query_start_loc, tile_size: int,
          max_query_len: int, ptx: bool) -> None:  # fmt: skip
    """Launch the stage kernel: k_rot [T, Hkv, Dk], v_rot [T, Hkv, Dv] rotated; exact_k/v [S, Hkv, E, G, D].
    Decode-sized calls only (``max_query_len`` <= ``DECODE_ROWS``, fewer than a tile)."""
    hkv, dk, dv = exact_k.shape[1], exact_k.shape[-1], exact_v.shape[-1]
    assert max_query_len <= DECODE_ROWS < tile_size, "the stage kernel serves decode-sized calls"
    _stage_rows_kernel[(slots.numel(), hkv)](
        k_rot, v_rot, exact_k, exact_v, seq_lens, slots, start_pos, query_start_loc,
        exact_k.shape[0], page_table.shape[1], max_query_len, k_rot.stride(0), k_rot.stride(1), v_rot.stride(0),
        v_rot.stride(1),
        HKV=hkv, E=exact_k.shape[2], G=tile_size, TAIL=DECODE_ROWS, DK=dk, DV=dv, DK_PAD=triton.next_power_of_2(dk),
        DV_PAD=triton.next_power_of_2(dv), PTX=ptx, num_warps=2,
    )  # fmt: skip
