"""Fused append: stage new tokens, and normalise + RTN + pack + store every tile they complete.

One program per (sequence, tile touched by the call, KV head, keys or values). A program whose tile is
completed by the call gathers the tile (earlier tokens from the exact current-tile buffer, new ones from
the input), runs the iterative variance normalisation, quantizes (keys per channel, values per token),
folds the scales, packs codes and scales into the tile's page record and stores them (unless a later
tile of the same call takes the same page). Program 0 of each
sequence then stores the tokens of the call's incomplete last tile into the exact buffer (after a
barrier, since it may overwrite rows it has just read). Everything is decided on the device: no host sync.

A single-token (decode) call can also run as two launches, its ``part``s (``deferred_flush``): STAGE writes each
sequence's row to the exact buffer, also a row that completes its tile, and quantizes the completed tiles only in a
burst (more than DEFERRED_MOST of them: sequences in lockstep, whose programs fill the GPU), and writes what FLUSH
will need of the call's metadata to a snapshot of its own; FLUSH then quantizes the others, up to DEFERRED_MOST tiles
read whole from the exact buffer, on another stream, while the model goes on (and the caller may already rewrite
its batch's tensors: FLUSH reads the snapshot). One FLUSH launch serves the STAGEs of several calls (``Flush``: a
model's layers, each on a cache of its own), its pointers a tuple with one entry per call.

Inputs are already rotated (the op rotates with one matmul); reference: ``paged.append_reference``.
"""

from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import reference
from ..presets import Preset
from .tile_math import check_sequence, fast_log, fp16_ptr, interpreting, pack_codes

DECODE_ROWS = 16  # a decode-sized call: at most this many new rows a sequence (fewer than any tile's G)
# a launch's part of the append (``quantize_store``'s ``part``; compile-time constants of the kernel)
WHOLE, STAGE, FLUSH = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
# At most this many tiles a single-token call completes are left to its FLUSH launch, whose program for a KV head and
# keys / values quantizes them in turn; more are quantized by its STAGE launch, in line. FLUSH's programs are few
# (each holds an SM: ~255 registers in 8 warps) so that in the steps where no tile completes (most) they take few SMs
# from the work beside them; a program's tiles take a chain each, one after the other, which a deferred flush has
# time for (``deferred_flush.LAG`` launches). 4: a staggered batch of 128 completes more in 0.3% of its steps.
DEFERRED_MOST = tl.constexpr(4)
SEQUENCE_BLOCK = 128  # the sequences a program reads at once to count the completed tiles
SNAPSHOT = tl.constexpr(5)  # a snapshot row: a sequence's slot, start position, first and end row, its tile's page


class Flush(NamedTuple):
    """What a FLUSH launch needs of one single-token call whose STAGE ran: its cache's tensors (the page table only
    for its width: FLUSH reads pages from the snapshot) and the snapshot STAGE wrote (``snapshot_for``)."""

    pages: torch.Tensor
    exact_k: torch.Tensor
    exact_v: torch.Tensor
    page_table: torch.Tensor
    snapshot: torch.Tensor
    preset: Preset

    def launch_key(self) -> tuple:
        """Calls of equal keys can share a launch: the kernel's compile-time constants and scalar arguments."""
        return (self.preset, self.pages.device, self.pages.shape, self.exact_k.shape, self.exact_v.shape,
                self.exact_k.dtype, self.exact_v.dtype, self.page_table.shape[1], self.snapshot.shape[0])  # fmt: skip


# The reference's normalisation constants, as compile-time constants of the kernel.
STD_MIN = tl.constexpr(reference.STD_MIN)
STD_MAX = tl.constexpr(reference.STD_MAX)
LOG_SCALE_MIN = tl.constexpr(reference.LOG_SCALE_MIN)
LOG_SCALE_MAX = tl.constexpr(reference.LOG_SCALE_MAX)
IMBALANCE_MARGIN = tl.constexpr(reference.IMBALANCE_MARGIN)


@triton.jit
def _clamp_std(std):
    return tl.minimum(tl.maximum(std, STD_MIN), STD_MAX)


@triton.jit
def _spread(x, log_scale, AXIS: tl.constexpr, N):
    """Unbiased std along AXIS of x * exp(-log_scale) (log_scale [x.shape[1 - AXIS]], along the other axis) over
    the first N entries of AXIS (x is zero past them), in two passes as the reference (the mean, then the squares
    of the deviations from it), so that a mean many times the spread costs no precision. The second pass
    recomputes the products (one fma) rather than keeping a tile of them live: the kernel has no registers to
    spare."""
    s = tl.expand_dims(tl.exp(-log_scale), 1 - AXIS)
    mean = tl.sum(x * s, axis=AXIS) * (1.0 / N)
    dev = tl.fma(x, s, -tl.expand_dims(mean, AXIS))
    if x.shape[AXIS] != N:  # padded entries (channels past D): their deviation from the mean is not zero
        dev = tl.where(tl.expand_dims(tl.arange(0, x.shape[AXIS]) < N, 1 - AXIS), dev, 0.0)
    return tl.sqrt(tl.sum(dev * dev, axis=AXIS) * (1.0 / (N - 1)))


@triton.jit
def _log_step(log_scale, std, PTX: tl.constexpr):
    """A log-scale after dividing by ``std`` (the std it leaves), clamped like the reference."""
    return tl.minimum(tl.maximum(log_scale + fast_log(std, PTX), LOG_SCALE_MIN), LOG_SCALE_MAX)


@triton.jit
def _imbalance(st, sc, chan_ok):
    """max/min token std + max/min channel std (over the real channels)."""
    chan_ratio = tl.max(tl.where(chan_ok, sc, 0.0), axis=0) / tl.min(tl.where(chan_ok, sc, float("inf")), axis=0)
    return tl.max(st, axis=0) / tl.min(st, axis=0) + chan_ratio


@triton.jit
def _balance(x, chan_ok, D, G: tl.constexpr, TOKENS_FIRST: tl.constexpr, ITERS: tl.constexpr, PATIENCE: tl.constexpr,
             PTX: tl.constexpr):  # fmt: skip
    """Iterative variance normalisation of x [G, D_PAD] (zero past D): returns (log_tok [G], log_chan [D_PAD]),
    ``reference.balance`` computed another way, ending after PATIENCE iterations in a row that do not lower the
    imbalance (0: never).

    The normalised tile y = x * a[:, None] * b[None, :] (a = exp(-log_tok), b = exp(-log_chan)) is never formed:
    a token's std is a_t times the std of x[t] * b over the channels, which does not depend on a, and a channel's
    is b_d times the std of x[:, d] * a over the tokens, which does not depend on b. So an iteration takes one
    std per axis (4 flops an element) where y's stds took ~18: each serves the update and the imbalance after it.
    """
    lt = tl.sum(x, axis=1) * 0.0
    lc = tl.sum(x, axis=0) * 0.0
    tok_spread = _spread(x, lc, 1, D)
    chan_spread = _spread(x, lt, 0, G)
    st = _clamp_std(tok_spread)
    sc = _clamp_std(chan_spread)
    best = _imbalance(st, sc, chan_ok)
    best_lt = lt
    best_lc = lc
    done = 0  # iterations run, or ITERS once PATIENCE in a row did not lower the imbalance
    misses = 0  # iterations in a row that did not lower it
    while done < ITERS:  # a runtime loop: unrolled, large tiles take minutes to compile
        if TOKENS_FIRST:
            lt = _log_step(lt, st, PTX)
            chan_spread = _spread(x, lt, 0, G)
            lc = _log_step(lc, _clamp_std(tl.exp(-lc) * chan_spread), PTX)
            tok_spread = _spread(x, lc, 1, D)
        else:
            lc = _log_step(lc, sc, PTX)
            tok_spread = _spread(x, lc, 1, D)
            lt = _log_step(lt, _clamp_std(tl.exp(-lt) * tok_spread), PTX)
            chan_spread = _spread(x, lt, 0, G)
        st = _clamp_std(tl.exp(-lt) * tok_spread)
        sc = _clamp_std(tl.exp(-lc) * chan_spread)
        imbalance = _imbalance(st, sc, chan_ok)
        better = imbalance < best * (1.0 - IMBALANCE_MARGIN)
        best = tl.where(better, imbalance, best)
        best_lt = tl.where(better, lt, best_lt)
        best_lc = tl.where(better, lc, best_lc)
        misses = tl.where(better, 0, misses + 1)
        if PATIENCE > 0:
            done = tl.where(misses < PATIENCE, done + 1, ITERS)
        else:
            done = done + 1
    return best_lt, best_lc


@triton.jit
def _normalised(x, chan_ok, D, G: tl.constexpr, TOKENS_FIRST: tl.constexpr, ITERS: tl.constexpr,
                PATIENCE: tl.constexpr, PTX: tl.constexpr):  # fmt: skip
    """(y [G, D_PAD], tok [G], chan [D_PAD]): x normalised by ``_balance``'s scales, and the scales."""
    lt, lc = _balance(x, chan_ok, D, G, TOKENS_FIRST, ITERS, PATIENCE, PTX)
    tok, chan = tl.exp(lt), tl.exp(lc)
    return x / tok[:, None] / chan[None, :], tok, chan


@triton.jit
def _to_fp16(x):
    return tl.minimum(tl.maximum(x, -65504.0), 65504.0).to(tl.float16)


@triton.jit
def _rtn_codes(y, lo, scale, BITS: tl.constexpr):
    codes = tl.floor((y - lo) / tl.maximum(scale, 1e-30) + 0.5)
    return tl.minimum(tl.maximum(codes, 0.0), 2**BITS - 1).to(tl.int32)


@triton.jit
def _balance_roundings(codes, x, step, BITS: tl.constexpr, FLIPS: tl.constexpr):
    """``reference.balance_roundings`` on value codes [G, D_PAD] (int32), exact positions x [G, D_PAD] and
    token steps [G]: in each channel, up to FLIPS codes move against the sign of its weighted error sum."""
    c = codes.to(tl.float32)
    err = c - x
    total = tl.sum(step[:, None] * err, axis=0)
    down = total > 0
    sign = tl.where(down, 1.0, -1.0)
    left = tl.abs(total)
    candidate = tl.where(down[None, :], c > 0, c < 2**BITS - 1)
    cost = tl.where(candidate, 1 - 2 * sign[None, :] * err, float("inf"))
    # A round's search is one int32 minimum over the tokens of a key per code: its cost in fixed point (2^-21:
    # finer than the kernel's and the reference's positions x agree), then its token in 8 bits (the first of
    # equal costs, as torch.argmin); 32 bits, so that each step of the search is one instruction. Costs of
    # candidates lie in [0, 2] (|err| <= 1/2 after RTN; not in padded channels, never stored: the clamp keeps
    # their keys in range). NOTE (H200, benchmarks/results/h200-s22/flush): 16 rounds 0.052 -> 0.027 ms against
    # a reduction of (cost, step, token) tuples, which had replaced three reductions (h200-attention-v13)
    tl.static_assert(x.shape[0] <= 256, "the search keys hold 8 bits of token")
    fixed = tl.minimum(tl.maximum(tl.floor(cost * 2.0**21), 0.0), 2**22 - 2).to(tl.int32)
    token = tl.arange(0, x.shape[0])
    key = (tl.where(candidate, fixed, 2**22 - 1) << 8) | token[:, None]  # [G, D_PAD], distinct within a channel
    NOT_A_CANDIDATE: tl.constexpr = (2**22 - 1) << 8
    MOVED: tl.constexpr = 1 << 30
    # Rounds stop once no channel moves (the state is then unchanged: no later round could move one): ~10 of
    # 16 on Gaussian tiles (a tile's last channel stops after 9.3 moves on average, 2.6 per channel). NOTE
    # (H200, benchmarks/results/h200-flush-early-exit, side by side): flush B32 0.493 -> 0.434 ms, B128
    # 1.68 -> 1.45; B8 0.150 -> 0.145 (one program per tile and head there: bound by its chain of steps).
    # NOTE (H100, benchmarks/results/gpu-s41/h100-flips): a channel's moves are a prefix of its candidates by cost,
    # so a round may take its 2 or 4 cheapest (one reduction of tuples) in 2-4x fewer rounds: a step with a flush
    # -3 to +5% (2 a round), +5 to +11% (4) (more instructions a round; the rounds' barriers are not what it waits
    # on); each moved code's step read back from the record instead of this gather: no change beyond noise
    done = 0  # rounds run, or FLIPS once a round moved nothing
    while done < FLIPS:
        cheapest = tl.min(key, axis=0)  # each channel's cheapest code not moved yet
        w_best = tl.gather(step, cheapest & 0xFF, 0)
        move = (cheapest < NOT_A_CANDIDATE) & (left > w_best / 2)
        key = tl.where((key == cheapest[None, :]) & move[None, :], MOVED, key)
        left = left - tl.where(move, w_best, 0.0)
        done = tl.where(tl.max(move.to(tl.int32), axis=0) > 0, done + 1, FLIPS)
    return (c - tl.where(key == MOVED, sign[None, :], 0.0)).to(tl.int32)


@triton.jit
def _quantize_keys(x, record, D, G: tl.constexpr, D_PAD: tl.constexpr, BITS: tl.constexpr, ITERS: tl.constexpr,
                   PATIENCE: tl.constexpr,
                   OFF_CHAN_SCALE: tl.constexpr, OFF_CHAN_ZERO: tl.constexpr, OFF_TOK_SCALE: tl.constexpr,
                   PTX: tl.constexpr):  # fmt: skip
    """Rotated fp32 keys x [G, D_PAD]: normalise tokens first, RTN per channel, store codes and scales."""
    offs_t = tl.arange(0, G)
    offs_d = tl.arange(0, D_PAD)
    chan_ok = offs_d < D
    y, tok, chan = _normalised(x, chan_ok, D, G, True, ITERS, PATIENCE, PTX)
    lo = tl.min(y, axis=0)
    scale = (tl.max(y, axis=0) - lo) / (2**BITS - 1)
    codes = _rtn_codes(y, lo[None, :], scale[None, :], BITS)
    ROW: tl.constexpr = D_PAD * BITS // 8
    offs_b = tl.arange(0, ROW)
    tl.store(record + offs_t[:, None] * (D * BITS // 8) + offs_b[None, :], pack_codes(codes, BITS),
             mask=offs_b[None, :] < D * BITS // 8)  # fmt: skip
    tl.store(fp16_ptr(record + OFF_CHAN_SCALE) + offs_d, _to_fp16(scale * chan), mask=chan_ok)
    tl.store(fp16_ptr(record + OFF_CHAN_ZERO) + offs_d, _to_fp16(lo * chan), mask=chan_ok)
    tl.store(fp16_ptr(record + OFF_TOK_SCALE) + offs_t, _to_fp16(tok))


@triton.jit
def _quantize_values(x, record, D, G: tl.constexpr, D_PAD: tl.constexpr, BITS: tl.constexpr, ITERS: tl.constexpr,
                     PATIENCE: tl.constexpr,
                     FLIPS: tl.constexpr, OFF_CODES: tl.constexpr, OFF_CHAN_SCALE: tl.constexpr,
                     OFF_TOK_SCALE: tl.constexpr, OFF_TOK_ZERO: tl.constexpr, PTX: tl.constexpr):  # fmt: skip
    """Rotated fp32 values x [G, D_PAD]: channels first, RTN per token (roundings balanced per channel),
    codes stored channel-major."""
    offs_t = tl.arange(0, G)
    offs_d = tl.arange(0, D_PAD)
    chan_ok = offs_d < D
    y, tok, chan = _normalised(x, chan_ok, D, G, False, ITERS, PATIENCE, PTX)
    lo = tl.min(tl.where(chan_ok[None, :], y, float("inf")), axis=1)
    scale = (tl.max(tl.where(chan_ok[None, :], y, float("-inf")), axis=1) - lo) / (2**BITS - 1)
    codes = _rtn_codes(y, lo[:, None], scale[:, None], BITS)
    if FLIPS > 0:
        step = _to_fp16(scale * tok).to(tl.float32)  # as stored
        codes = _balance_roundings(codes, (y - lo[:, None]) / tl.maximum(scale, 1e-30)[:, None], step, BITS, FLIPS)
    ROW: tl.constexpr = G * BITS // 8
    offs_b = tl.arange(0, ROW)
    tl.store(record + OFF_CODES + offs_d[:, None] * ROW + offs_b[None, :], pack_codes(tl.trans(codes), BITS),
             mask=chan_ok[:, None])  # fmt: skip
    tl.store(fp16_ptr(record + OFF_CHAN_SCALE) + offs_d, _to_fp16(chan), mask=chan_ok)
    tl.store(fp16_ptr(record + OFF_TOK_SCALE) + offs_t, _to_fp16(scale * tok))
    tl.store(fp16_ptr(record + OFF_TOK_ZERO) + offs_t, _to_fp16(lo * tok))


@triton.jit
def _append_half(
    new_ptr, stride_t, exact, record, record_ok, row0, p0, end, t0, complete, is_sink, write_tail,
    D, G: tl.constexpr, TAIL: tl.constexpr, D_PAD: tl.constexpr, BITS: tl.constexpr, ITERS: tl.constexpr,
    PATIENCE: tl.constexpr, FLIPS: tl.constexpr, IS_KEYS: tl.constexpr,
    OFF_CODES: tl.constexpr, OFF_CHAN_SCALE: tl.constexpr, OFF_SCALE2: tl.constexpr, OFF_SCALE3: tl.constexpr,
    PTX: tl.constexpr, RAW: tl.constexpr = False, PART: tl.constexpr = WHOLE,
):  # fmt: skip
    """The keys (or the values) of one tile of one KV head: ``exact`` is this slot and head's [E, G, D]
    exact buffer, ``new_ptr`` the head's first new row, ``record`` the tile's page record. ``RAW``: stored
    as given, [G, D] at OFF_CODES (MLA's rope key). ``PART``: FLUSH quantizes only (its caller passes p0 = end:
    every row comes from ``exact``); STAGE also writes a row that completes its tile."""
    offs_t = tl.arange(0, G)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d[None, :] < D
    pos = t0 + offs_t
    if complete:  # the call completes this tile: gather it, then quantize it (or keep it exact as the sink)
        old = pos < p0
        rows = (row0 + pos - p0).to(tl.int64)
        x = tl.where(
            old[:, None],
            tl.load(exact + offs_t[:, None] * D + offs_d[None, :], mask=old[:, None] & d_ok, other=0.0),
            tl.load(new_ptr + rows[:, None] * stride_t + offs_d[None, :], mask=(pos >= p0)[:, None] & d_ok,
                    other=0.0),
        )  # fmt: skip
        if is_sink:
            tl.store(exact + G * D + offs_t[:, None] * D + offs_d[None, :], x, mask=d_ok)
        elif record_ok:
            if IS_KEYS:
                _quantize_keys(x.to(tl.float32), record, D, G, D_PAD, BITS, ITERS, PATIENCE, OFF_CHAN_SCALE,
                               OFF_SCALE2, OFF_SCALE3, PTX)  # fmt: skip
            elif RAW:
                raw = (record + OFF_CODES).to(tl.pointer_type(x.dtype))
                tl.store(raw + offs_t[:, None] * D + offs_d[None, :], x, mask=d_ok)
            else:
                _quantize_values(x.to(tl.float32), record, D, G, D_PAD, BITS, ITERS, PATIENCE, FLIPS, OFF_CODES,
                                 OFF_CHAN_SCALE, OFF_SCALE2, OFF_SCALE3, PTX)  # fmt: skip
    if PART != FLUSH:  # noqa: SIM102 (a compile-time branch around a run-time one)
        if write_tail:
            # The incomplete last tile's new tokens go to the exact buffer. This may overwrite rows read above
            # (in the same program only), hence the barrier. They are the last <= TAIL rows before ``end``. STAGE
            # writes the last tile with a new row, complete or not: its FLUSH reads it from there.
            tl.debug_barrier()
            tail0 = ((end - 1) // G) * G if PART == STAGE else (end // G) * G
            tail_pos = tl.maximum(tail0, end - TAIL) + tl.arange(0, TAIL)
            tail_new = ((tail_pos >= p0) & (tail_pos < end))[:, None] & d_ok
            tail_rows = (row0 + tail_pos - p0).to(tl.int64)
            tail_x = tl.load(new_ptr + tail_rows[:, None] * stride_t + offs_d[None, :], mask=tail_new)
            tl.store(exact + (tail_pos - tail0)[:, None] * D + offs_d[None, :], tail_x, mask=tail_new)


@triton.jit
def _append_sequence(
    b, i, h, keys, k_ptr, v_ptr, pages_ptr, exact_k_ptr, exact_v_ptr, page_table_ptr, seq_lens_ptr,
    slots_ptr, start_pos_ptr, qsl_ptr, snapshot_ptr,
    num_pages, num_slots, max_tiles, max_new, stride_kt, stride_kh, stride_vt, stride_vh,
    HKV: tl.constexpr, E: tl.constexpr, G: tl.constexpr, TAIL: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    DK_PAD: tl.constexpr, DV_PAD: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr, ITERS: tl.constexpr,
    PATIENCE: tl.constexpr, FLIPS: tl.constexpr,
    NBYTES: tl.constexpr, OFF_V: tl.constexpr, OFF_KCS: tl.constexpr, OFF_KCZ: tl.constexpr,
    OFF_KTS: tl.constexpr, OFF_VCS: tl.constexpr, OFF_VTS: tl.constexpr, OFF_VTZ: tl.constexpr, PTX: tl.constexpr,
    V_RAW: tl.constexpr, PART: tl.constexpr, quantize, META: tl.constexpr,
):  # fmt: skip
    """Sequence b's tile i of the call (counted from its start position's), KV head h, keys or values; ``quantize``:
    whether to quantize the tile if the call completes it. ``META``: the stride of the metadata (FLUSH: the
    snapshot's rows, whose last entry is the page)."""
    slot = tl.load(slots_ptr + b * META).to(tl.int64)
    p0 = tl.load(start_pos_ptr + b * META)
    row0 = tl.load(qsl_ptr + b * META)
    row1 = tl.load(qsl_ptr + b * META + 1)
    end = p0 + row1 - row0
    check_sequence(slot, p0, end - p0, max_new, num_slots, max_tiles * G, PTX)
    # one program writes the sequence's length, if it has new tokens (a padding row's start is no length)
    writes_length = (i == 0) & (h == 0) & keys & (end > p0) & (PART != FLUSH)
    tile = p0 // G + i
    t0 = tile * G
    complete = (t0 < end) & (t0 + G <= end) & (tile < max_tiles) & quantize
    is_sink = (E == 2) & (tile == 0)
    if PART == FLUSH:
        page = tl.load(snapshot_ptr + b * SNAPSHOT + 4).to(tl.int64)
    else:
        page = tl.load(page_table_ptr + slot * max_tiles + tl.minimum(tile, max_tiles - 1)).to(tl.int64)
    if PART == STAGE:  # noqa: SIM102 (a compile-time branch around a run-time one)
        if (i == 0) & (h == 0) & keys:  # what FLUSH will read of this sequence (the kernel's docstring)
            row = snapshot_ptr + b * SNAPSHOT
            tl.store(row, slot.to(tl.int32))
            tl.store(row + 1, p0)
            tl.store(row + 2, row0)
            tl.store(row + 3, row1)
            tl.store(row + 4, page.to(tl.int32))
    record = pages_ptr + (page * HKV + h) * NBYTES
    record_ok = (page >= 0) & (page < num_pages)
    # Tiles may share a page (a sliding-window ring): when a later tile completed by this call takes the
    # same page, it alone writes it, as the reference's in-order writes leave it (programs run in any order).
    # A runtime loop over the call's later complete tiles: none for decode-sized calls.
    for later in range(tile + 1, tl.minimum(end // G, max_tiles)):
        record_ok &= tl.load(page_table_ptr + slot * max_tiles + later) != page
    # program 0 of the call stages the last tile's rows (STAGE: also a completed one's)
    write_tail = (i == 0) & ((end % G != 0) | (PART == STAGE)) & (p0 < end)
    if PART == FLUSH:
        p0 = end  # the tile is read whole from the exact buffer, where STAGE put its last row
    if keys:
        _append_half(k_ptr + h * stride_kh, stride_kt, exact_k_ptr + (slot * HKV + h) * E * G * DK, record,
                     record_ok, row0, p0, end, t0, complete, is_sink, write_tail,
                     DK, G, TAIL, DK_PAD, KB, ITERS, PATIENCE, 0, True, 0, OFF_KCS, OFF_KCZ, OFF_KTS,
                     PTX, False, PART)  # fmt: skip
        if writes_length:
            tl.store(seq_lens_ptr + slot, end)
    else:
        _append_half(v_ptr + h * stride_vh, stride_vt, exact_v_ptr + (slot * HKV + h) * E * G * DV, record,
                     record_ok, row0, p0, end, t0, complete, is_sink, write_tail,
                     DV, G, TAIL, DV_PAD, VB, ITERS, PATIENCE, FLIPS, False, OFF_V, OFF_VCS, OFF_VTS, OFF_VTZ, PTX,
                     V_RAW, PART)  # fmt: skip


# The per-sequence metadata may start at any row (a mixed step's prefill rows): no kernel per alignment.
@triton.jit(
    do_not_specialize=["max_new", "num_seqs", "members"],
    do_not_specialize_on_alignment=["seq_lens_ptr", "slots_ptr", "start_pos_ptr", "qsl_ptr"],
)
def _quantize_store_kernel(
    k_ptr, v_ptr, pages, exact_k, exact_v, page_table_ptr, seq_lens_ptr, slots_ptr, start_pos_ptr, qsl_ptr, snapshots,
    members, num_pages, num_slots, max_tiles, max_new, num_seqs, stride_kt, stride_kh, stride_vt, stride_vh,
    HKV: tl.constexpr, E: tl.constexpr, G: tl.constexpr, TAIL: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    DK_PAD: tl.constexpr, DV_PAD: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr, ITERS: tl.constexpr,
    PATIENCE: tl.constexpr, FLIPS: tl.constexpr,
    NBYTES: tl.constexpr, OFF_V: tl.constexpr, OFF_KCS: tl.constexpr, OFF_KCZ: tl.constexpr,
    OFF_KTS: tl.constexpr, OFF_VCS: tl.constexpr, OFF_VTS: tl.constexpr, OFF_VTZ: tl.constexpr, PTX: tl.constexpr,
    V_RAW: tl.constexpr, PART: tl.constexpr, SEQUENCE_BLOCK: tl.constexpr,
):  # fmt: skip
    """Grid (sequences, tiles a call touches, 2 x KV heads); FLUSH: (1, calls, 2 x KV heads), program (0, c)
    quantizing the tiles call c completed in turn (none in a burst, which STAGE quantized). ``pages``, ``exact_k``,
    ``exact_v``, ``snapshots``: a tuple of pointers each, one entry per call (FLUSH: the first ``members`` of them; the
    other parts: one). STAGE writes each sequence's row of the snapshot ([sequences, SNAPSHOT] int32: slot, start
    position, query_start_loc's two rows, the page of the start position's tile), and FLUSH reads its metadata from
    there alone (not the slots, start positions, query rows or page table, which the caller may rewrite before FLUSH
    runs)."""
    h = tl.program_id(2) // 2
    keys = tl.program_id(2) % 2 == 0  # keys and values of a tile are quantized by two programs
    b = tl.program_id(0)
    # (the two calls below spell their arguments out: packed in a tuple, the compile-time ones would stop being so)
    if PART == FLUSH:  # the program quantizes the tiles its call completed in turn, none in a burst
        c = tl.program_id(1)
        pages_ptr, exact_k_ptr, exact_v_ptr, snapshot_ptr = _call_pointers(c, pages, exact_k, exact_v, snapshots)
        slots_ptr, start_pos_ptr, qsl_ptr = snapshot_ptr, snapshot_ptr + 1, snapshot_ptr + 2
        count, _ = _completing(start_pos_ptr, qsl_ptr, num_seqs, 0, G, SEQUENCE_BLOCK, SNAPSHOT)
        count = tl.where((c < members) & (count <= DEFERRED_MOST), count, 0)
        for j in range(count):
            _, b_th = _completing(start_pos_ptr, qsl_ptr, num_seqs, j, G, SEQUENCE_BLOCK, SNAPSHOT)
            _append_sequence(b_th, 0, h, keys, k_ptr, v_ptr, pages_ptr, exact_k_ptr, exact_v_ptr, page_table_ptr,
                             seq_lens_ptr, slots_ptr, start_pos_ptr, qsl_ptr, snapshot_ptr, num_pages, num_slots,
                             max_tiles, max_new, stride_kt, stride_kh, stride_vt, stride_vh, HKV, E, G, TAIL, DK, DV,
                             DK_PAD, DV_PAD, KB, VB, ITERS, PATIENCE, FLIPS, NBYTES, OFF_V, OFF_KCS, OFF_KCZ, OFF_KTS,
                             OFF_VCS, OFF_VTS, OFF_VTZ, PTX, V_RAW, PART, True, SNAPSHOT)  # fmt: skip
    else:
        i = tl.program_id(1)
        quantize = True
        if PART == STAGE:  # quantize only in a burst; only a program whose tile completes needs to count them
            p0 = tl.load(start_pos_ptr + b)
            new = tl.load(qsl_ptr + b + 1) - tl.load(qsl_ptr + b)
            count = tl.full((), 0, tl.int32)
            if (new > 0) & ((p0 + new) % G == 0):
                count, _ = _completing(start_pos_ptr, qsl_ptr, num_seqs, 0, G, SEQUENCE_BLOCK, 1)
            quantize = count > DEFERRED_MOST
        _append_sequence(b, i, h, keys, k_ptr, v_ptr, pages[0], exact_k[0], exact_v[0], page_table_ptr, seq_lens_ptr,
                         slots_ptr, start_pos_ptr, qsl_ptr, snapshots[0], num_pages, num_slots, max_tiles, max_new,
                         stride_kt, stride_kh, stride_vt, stride_vh, HKV, E, G, TAIL, DK, DV, DK_PAD, DV_PAD, KB, VB,
                         ITERS, PATIENCE, FLIPS, NBYTES, OFF_V, OFF_KCS, OFF_KCZ, OFF_KTS, OFF_VCS, OFF_VTS, OFF_VTZ,
                         PTX, V_RAW, PART, quantize, 1)  # fmt: skip


@triton.jit
def _call_pointers(c, pages, exact_k, exact_v, snapshots):
    """Call c's entries of the pointer tuples (a run-time index: the tuples are indexed at compile time only)."""
    pages_ptr, exact_k_ptr, exact_v_ptr, snapshot_ptr = pages[0], exact_k[0], exact_v[0], snapshots[0]
    for j in tl.static_range(1, len(pages)):
        if c == j:
            pages_ptr, exact_k_ptr, exact_v_ptr, snapshot_ptr = pages[j], exact_k[j], exact_v[j], snapshots[j]
    return pages_ptr, exact_k_ptr, exact_v_ptr, snapshot_ptr


@triton.jit
def _completing(start_pos_ptr, qsl_ptr, num_seqs, j, G: tl.constexpr, BLOCK: tl.constexpr, META: tl.constexpr):
    """How many sequences of a single-token call complete a tile, and the index of the j-th of them (-1: none);
    ``META``: the stride of the start positions and query rows (``_append_sequence``)."""
    count = tl.full((), 0, tl.int32)
    found = tl.full((), -1, tl.int32)
    for c in range(0, num_seqs, BLOCK):
        b = c + tl.arange(0, BLOCK)
        ok = b < num_seqs
        p0 = tl.load(start_pos_ptr + b * META, mask=ok, other=0)
        new = tl.load(qsl_ptr + b * META + 1, mask=ok, other=0) - tl.load(qsl_ptr + b * META, mask=ok, other=0)
        done = (ok & (new > 0) & ((p0 + new) % G == 0)).to(tl.int32)
        rank = count + tl.cumsum(done, 0) - 1
        found = tl.maximum(found, tl.max(tl.where((done > 0) & (rank == j), b, -1), 0))
        count += tl.sum(done, 0)
    return count, found


def quantize_store(k_rot, v_rot, pages, exact_k, exact_v, page_table, seq_lens, slots, start_pos, query_start_loc,
                   preset: Preset, max_query_len: int, part: tl.constexpr = WHOLE,
                   snapshot: torch.Tensor | None = None) -> None:  # fmt: skip
    """Launch the append kernel. k_rot [T, Hkv, Dk], v_rot [T, Hkv, Dv]: rotated, in the cache dtype.

    ``part``: WHOLE (stage the rows and quantize the tiles they complete), or for a single-token call
    (max_query_len 1) STAGE, which writes a ``snapshot`` (int32 [sequences, SNAPSHOT], ``snapshot_for``) that a later
    FLUSH launch (``flush_tiles``, maybe on another stream: ``deferred_flush``; the module's docstring) reads instead of
    the metadata. Shapes and dtypes are validated by the op (``kvarn::append``); this only lays out the launch.
    """
    if part == FLUSH:
        raise ValueError("FLUSH launches through flush_tiles")
    expected = (slots.numel(), SNAPSHOT.value)
    if part == STAGE and (snapshot is None or snapshot.shape != expected or snapshot.dtype != torch.int32):
        raise ValueError(f"the append's STAGE part writes a snapshot (snapshot_for(slots)), got {snapshot}")
    layout = preset.layout(exact_k.shape[-1], exact_v.shape[-1])
    _launch(k_rot, v_rot, (pages,), (exact_k,), (exact_v,), page_table, seq_lens, slots, start_pos, query_start_loc,
            (page_table if snapshot is None else snapshot,), preset, max_query_len, layout.nbytes, _offsets(layout),
            raw_values=False, part=part)  # fmt: skip


def flush_tiles(calls: Sequence[Flush], width: int | None = None) -> None:
    """One FLUSH launch: the tiles that the STAGE launches of ``calls`` (of one ``Flush.launch_key``) left to
    quantize. ``width``: how many calls the kernel's pointer tuples hold (default: as many as given); the launches
    of a deferral keep one width, so that a launch of fewer calls (the last of a step) compiles no kernel of its own."""
    width = len(calls) if width is None else width
    if not 0 < len(calls) <= width:
        raise ValueError(f"a FLUSH launch takes 1 to {width} calls, got {len(calls)}")
    first = calls[0]
    if any(c.launch_key() != first.launch_key() for c in calls):
        raise ValueError("a FLUSH launch's calls share a preset, device, cache shapes and dtypes, page-table width and "
                         f"batch size, got {[c.launch_key() for c in calls]}")  # fmt: skip
    expected = (first.snapshot.shape[0], SNAPSHOT.value)
    for c in calls:
        if c.snapshot.shape != expected or c.snapshot.dtype != torch.int32:
            raise ValueError(f"a FLUSH launch reads the snapshots STAGE wrote (snapshot_for(slots)), got {c.snapshot}")
    _launch_flush(list(calls) + [first] * (width - len(calls)), len(calls))  # (the padding's programs exit at once)


def _launch_flush(entries: Sequence[Flush], members: int) -> None:
    """The FLUSH launch over ``entries``, of which the first ``members`` are calls (``flush_tiles``; the others pad
    the pointer tuples, and their programs must write nothing)."""
    first = entries[0]
    pages, exact_k, exact_v, snapshots = (tuple(getattr(c, name) for c in entries)
                                          for name in ("pages", "exact_k", "exact_v", "snapshot"))  # fmt: skip
    layout = first.preset.layout(first.exact_k.shape[-1], first.exact_v.shape[-1])
    # FLUSH reads every row of a tile from the exact buffer (k_rot, v_rot: any pointers of their dtypes), its
    # metadata from the snapshot (slots to page: the seq_lens, slots, start_pos, query_start_loc, never read)
    meta = first.snapshot
    _launch(first.exact_k, first.exact_v, pages, exact_k, exact_v, first.page_table, meta, meta, meta, meta, snapshots,
            first.preset, 1, layout.nbytes, _offsets(layout), raw_values=False, part=FLUSH,
            members=members)  # fmt: skip


def _offsets(layout) -> tuple[int, ...]:
    """A dense tile record's field offsets as ``_launch`` takes them."""
    return (layout.v_codes, layout.k_chan_scale, layout.k_chan_zero, layout.k_tok_scale, layout.v_chan_scale,
            layout.v_tok_scale, layout.v_tok_zero)  # fmt: skip


def snapshot_for(slots: torch.Tensor) -> torch.Tensor:
    """The snapshot a single-token call's STAGE writes and its FLUSH reads (``quantize_store``)."""
    return torch.empty(slots.numel(), SNAPSHOT.value, dtype=torch.int32, device=slots.device)


def latent_store(c_rot, rope, pages, exact_c, exact_r, page_table, seq_lens, slots, start_pos, query_start_loc,
                 preset: Preset, max_query_len: int) -> None:  # fmt: skip
    """The append kernel on MLA's latent cache (``paged_latent``): the rotated latent c_rot [T, L] as one head's
    keys, the rope key [T, R] as its values stored as given. Validated by ``kvarn::latent_append``."""
    layout = preset.latent_layout(exact_c.shape[-1], exact_r.shape[-1])
    slots_n, g = exact_c.shape[:2]
    offsets = (layout.rope, layout.c_chan_scale, layout.c_chan_zero, layout.c_tok_scale, 0, 0, 0)
    _launch(c_rot[:, None], rope[:, None], (pages[:, None],), (exact_c.view(slots_n, 1, 1, g, -1),),
            (exact_r.view(slots_n, 1, 1, g, -1),), page_table, seq_lens, slots, start_pos, query_start_loc,
            (page_table,), preset, max_query_len, layout.nbytes, offsets, raw_values=True)  # fmt: skip


def _launch(k_rot, v_rot, pages, exact_k, exact_v, page_table, seq_lens, slots, start_pos, query_start_loc, snapshots,
            preset: Preset, max_query_len: int, nbytes: int, offsets: tuple[int, ...], raw_values: bool,
            part: tl.constexpr = WHOLE, members: int = 1) -> None:  # fmt: skip
    """pages [P, Hkv, nbytes], exact_k/v [S, Hkv, E, G, D], snapshots: tuples of one entry per call (FLUSH: as many
    as the kernel is compiled for, the first ``members`` of them live; the other parts: one, and WHOLE reads no
    snapshot: any int32 tensor whose alignment stays put, since a tuple's entries are specialized on it, serves);
    ``offsets``: the record's value codes (or raw values), key channel scale / zero, key token scale, value channel
    scale, value token scale / zero."""
    num_seqs = slots.numel() if part != FLUSH else snapshots[0].shape[0]
    hkv, g = exact_k[0].shape[1], preset.tile_size
    dk, dv = exact_k[0].shape[-1], exact_v[0].shape[-1]
    if num_seqs == 0 or max_query_len == 0:
        return
    if part != WHOLE and max_query_len != 1:
        raise ValueError(
            f"the append's STAGE and FLUSH parts are for single-token calls, got max_query_len {max_query_len}"
        )
    off_v, off_kcs, off_kcz, off_kts, off_vcs, off_vts, off_vtz = offsets
    # A call of up to max_query_len tokens per sequence touches at most this many tiles of it.
    tiles = (max_query_len + g - 2) // g + 1
    grid = (1, len(pages), 2 * hkv) if part == FLUSH else (num_seqs, tiles, 2 * hkv)
    # NOTE (H100, benchmarks/results/h100-s38): in a decode step these programs (8 warps, ~255 registers: one per
    # SM) mostly stage one row each, 16 waves at batch 128 (~10 us with no tile completing). Staging in a kernel
    # of small programs and running these only over the completed tiles (a work list found on the device; session
    # 36) saved 10 / 23 us at batch 128 / 256 in steps where no tile completes, but cost 18-22 us in steps where
    # one does (the flush no longer hides the staging), which at those batches are most steps: reverted.
    _quantize_store_kernel[grid](
        k_rot, v_rot, pages, exact_k, exact_v, page_table, seq_lens, slots, start_pos, query_start_loc, snapshots,
        members, pages[0].shape[0], exact_k[0].shape[0], page_table.shape[1], max_query_len, num_seqs, k_rot.stride(0),
        k_rot.stride(1), v_rot.stride(0), v_rot.stride(1),
        # decode-sized calls stage at most DECODE_ROWS rows (a [DECODE_ROWS, D] block, not [G, D]): two variants
        # only, so that a new call size never compiles a new kernel
        HKV=hkv, E=exact_k[0].shape[2], G=g, TAIL=DECODE_ROWS if max_query_len <= DECODE_ROWS else g, DK=dk, DV=dv,
        DK_PAD=triton.next_power_of_2(dk), DV_PAD=triton.next_power_of_2(dv),
        KB=preset.key_bits, VB=preset.value_bits, ITERS=preset.iterations, PATIENCE=preset.patience,
        FLIPS=preset.value_flips,
        NBYTES=nbytes, OFF_V=off_v, OFF_KCS=off_kcs, OFF_KCZ=off_kcz, OFF_KTS=off_kts, OFF_VCS=off_vcs, OFF_VTS=off_vts,
        OFF_VTZ=off_vtz, PTX=not interpreting(), V_RAW=raw_values, PART=part, SEQUENCE_BLOCK=SEQUENCE_BLOCK,
        num_warps=8 if g * triton.next_power_of_2(max(dk, dv)) <= 128 * 128 else 16,
    )  # fmt: skip
