"""Attention over the KVarN cache plus a call's fresh tokens, split over the context (flash-decoding).

Grid: (sequence x query block, KV head, split). One program serves all GROUP query heads of its KV
head for BLOCK_Q query tokens: its rows are (token, head) pairs, so each quantized tile is read and
dequantized once for the whole group. Splits 0..NSPLIT-1 share the sequence's quantized tiles; splits NSPLIT..
NSPLIT+NEXACT-1 take the exact part: the first of them the fresh tokens, the others the kept rows (the kept first tile,
the current tile's stored tokens) in runs of ``exact_rows`` (``exact_parts_for``: in small decode steps several
programs share the kept rows, which one program walks too slowly), or the first all of it where NEXACT is 1.
Each program writes an unnormalised partial (acc, max, sum) that ``combine_splits`` merges, or, in a small decode
step, the exact part's last program to finish, once the quantized splits are done too (``merge_in_exact_split``: a
launch after theirs, ``MERGE``: its programs count themselves done in ``merge_counts``).
On the GPU, a decode step's quantized splits run in ``decode_attention`` (Gluon, faster: its docstring has
the numbers) where it serves the configuration; this kernel then takes only the exact split (``split0``).

Dequantization is folded out of the inner products (scales per tile, codes straight into tl.dot):
    scores[t] = k_tok_scale[t] * ((q * k_chan_scale) . codesK[t] + q . k_chan_zero)
    out      += v_chan_scale * ((p * v_tok_scale) @ codesV + p . v_tok_zero)
Codes go from their bytes to fp16 field by field (``tile_math.code_field``), never reshaped: the dots run
over the channels and tokens in the order the bytes hold them (``_attend_quantized_tile``).
NOTE (H200, benchmarks/results/h200-attention-v12, ab-*.json): 20% fewer instructions per tile than
unpacking whole tiles with join/reshape (2,325 vs 2,888 SASS per warp), the kernel 5-12% faster (B8/32K
0.200 -> 0.191 ms, B8/128K 0.767 -> 0.719, B1/32K 0.032 -> 0.028). v13 (benchmarks/results/h200-attention-v13,
ab-2.txt, "tiles_per_step=1" vs v12_kernel): the padding rows masked where the compiler sees it, whole scale
vectors loaded, each tile's page read a tile ahead (the codes double-buffered): B8/32K 0.192 -> 0.185 ms,
B8/128K 0.724 -> 0.696, B256/1.5K 0.294 -> 0.285; B1/32K 0.0285 -> 0.0296.
Everything runs in the rotated space: the op rotates q and the fresh k/v in; ``combine_splits`` rotates the output
back, or in a small decode step each program rotates its own partial back before the exact split merges them. Where
such a step's Gluon programs leave half the GPU free (``decode_attention.leaves_half_the_slots``), its merging exact
split takes q, k and v as they came (``ROTATE_IN``): it rotates q for the kept tokens, stored rotated, and takes the
fresh ones in the output's space (a score is the same in both); the Gluon programs then rotate q themselves too
(``decode_attention``'s ``ROTATE_Q``).
Reference: ``paged.attention_reference``.
"""

import functools
import logging

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from ..presets import Preset
from ..reference import rotation_block
from . import decode_attention
from .combine_splits import MAX_CHUNK, combine_splits, merge_rows
from .rotate import hadamard_blocks, rotated_many
from .tile_math import (
    LOG2E,
    check_sequence,
    code_field,
    column,
    fp16_ptr,
    interpreting,
    live_splits,
    multiprocessors,
    online_softmax_step,
    quantized_tiles,
)


@triton.jit
def _scale_fields(record, W: tl.constexpr, NF: tl.constexpr, limit):
    """The tile's fp16 scales at ``record`` as fp32, by field: field f [1, W] holds entries NF * j + f (the
    channels or tokens that packed bytes hold in turn), 0 from ``limit`` on. One load of the whole vector,
    split in registers (one layout for every field: no conversions between them)."""
    offs = tl.arange(0, W)[:, None] * NF + tl.arange(0, NF)[None, :]  # [W, NF]
    x = tl.load(fp16_ptr(record) + offs[None, :, :], mask=offs[None, :, :] < limit, other=0.0).to(tl.float32)
    fields = ()
    for f in tl.static_range(NF):
        fields = fields + (column(x, f),)
    return fields


@triton.jit
def _attend_quantized_tile(
    q_parts, q_pos, real_rows, m, l, acc, record, tile, window,
    DK, DV, G: tl.constexpr, DK_PAD: tl.constexpr, DV_PAD: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr,
    OFF_V: tl.constexpr, OFF_KCS: tl.constexpr, OFF_KCZ: tl.constexpr, OFF_KTS: tl.constexpr,
    OFF_VCS: tl.constexpr, OFF_VTS: tl.constexpr, OFF_VTZ: tl.constexpr, PTX: tl.constexpr,
):  # fmt: skip
    """One quantized tile, codes straight from their bytes into tl.dot (no reshape of unpacked codes).

    A key byte holds NK channels (channel NK*b + i is its field i): the scores are NK dots, one per field,
    against the matching q_parts[i] = q[:, i::NK]. A value byte holds NV tokens (token NV*j + f is field
    f): the tile's tokens are taken in NV groups f of GJ tokens, whose value codes are field f of every
    byte, so each group is one dot of its probabilities with one field of the value bytes.
    """
    NK: tl.constexpr = 8 // KB
    NV: tl.constexpr = 8 // VB
    KW: tl.constexpr = DK_PAD // NK  # key bytes per token (padded)
    GJ: tl.constexpr = max(G // NV, 16)  # tokens per group (tl.dot needs >= 16)
    offs_b = tl.arange(0, KW)
    offs_j = tl.arange(0, GJ)
    offs_dv = tl.arange(0, DV_PAD)
    b_ok = offs_b < DK // NK  # (the masks are all-true constants unless DK or the groups are padded)
    j_ok = offs_j < G // NV

    # Channel scales by field, folded into q; token scales by group.
    k_scale = _scale_fields(record + OFF_KCS, KW, NK, DK)
    k_zero = _scale_fields(record + OFF_KCZ, KW, NK, DK)
    q_scaled = ()
    q_zero = tl.zeros([q_parts[0].shape[0]], tl.float32)
    for i in tl.static_range(NK):
        q_scaled = q_scaled + ((q_parts[i] * k_scale[i]).to(tl.float16),)
        q_zero += tl.sum(q_parts[i] * k_zero[i], axis=1)
    k_tok = _scale_fields(record + OFF_KTS, GJ, NV, G)
    v_tok = _scale_fields(record + OFF_VTS, GJ, NV, G)
    v_zero = _scale_fields(record + OFF_VTZ, GJ, NV, G)

    # Scores of each group: scores[t] = k_tok[t] * ((q * k_scale) . codes[t] + q . k_zero).
    scores = ()
    m_new = m
    for f in tl.static_range(NV):
        key_ptrs = record + (NV * offs_j[None, :] + f) * (DK * KB // 8) + offs_b[:, None]  # [KW, GJ]
        if DK // NK < KW or G // NV < GJ:
            key_bytes = tl.load(key_ptrs, mask=b_ok[:, None] & j_ok[None, :], other=0)
        else:
            key_bytes = tl.load(key_ptrs)
        s = tl.zeros([q_parts[0].shape[0], GJ], tl.float32)
        for i in tl.static_range(NK):
            s = tl.dot(q_scaled[i], code_field(key_bytes, KB, i, PTX), s)
        s = (s + q_zero[:, None]) * k_tok[f]
        # Rows that are (token, head) pairs and tokens of the tile. The row mask is an arange bound the
        # compiler can see: a thread holds MMA rows i and i + 8, and where rows 8-15 are padding (GROUP * BLOCK_Q
        # <= 8, as in decode at GQA <= 8) their softmax folds away. NOTE (sm_90 SASS, k4v2_g128, GQA 4): 2,366
        # -> 2,236 instructions per warp and tile (MUFU 34 -> 19). With _scale_fields, H200 B8/32K kernel
        # 0.191 -> 0.187 ms (benchmarks/results/h200-attention-v13/ab-1.txt, "tiles_per_step=1").
        s = tl.where(real_rows[:, None] & j_ok[None, :], s, float("-inf"))
        if window > 0:
            s = tl.where(tile * G + NV * offs_j[None, :] + f > q_pos[:, None] - window, s, float("-inf"))
        scores = scores + (s,)
        m_new = tl.maximum(m_new, tl.max(s, axis=1))

    # Online softmax over the whole tile, then out += v_chan * ((p * v_tok) @ codes + p . v_zero).
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_safe)
    value_bytes = tl.load(
        record + OFF_V + offs_dv[None, :] * (G * VB // 8) + offs_j[:, None],
        mask=(offs_dv[None, :] < DV) & j_ok[:, None],
        other=0,
    )  # [GJ, DV_PAD] fmt: skip
    pv = tl.zeros([q_parts[0].shape[0], DV_PAD], tl.float32)
    p_zero = tl.zeros([q_parts[0].shape[0]], tl.float32)
    l = l * alpha
    for f in tl.static_range(NV):
        p = tl.exp2(scores[f] - m_safe[:, None])
        l += tl.sum(p, axis=1)
        p_zero += tl.sum(p * v_zero[f], axis=1)
        pv = tl.dot((p * v_tok[f]).to(tl.float16), code_field(value_bytes, VB, f, PTX), pv)
    v_chan = _scale_fields(record + OFF_VCS, DV_PAD, 1, DV)[0]
    acc = acc * alpha[:, None] + (pv + p_zero[:, None]) * v_chan
    return m_new, l, acc


@triton.jit
def _attend_exact_block(
    q, q_pos, m, l, acc, k_ptrs, v_ptrs, k_pos, key_ok, window,
    CAUSAL: tl.constexpr, DK, DV, DK_PAD: tl.constexpr, DV_PAD: tl.constexpr,
):  # fmt: skip
    """Attend to a block of unquantized keys/values at k_ptrs/v_ptrs ([rows, D] pointer blocks: BLOCK_N fresh
    tokens or BLOCK_KEPT kept rows)."""
    offs_dk = tl.arange(0, DK_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    # fp32 operands (tf32 on the GPU): bf16 inputs keep their range, and the Triton interpreter's bf16
    # tl.dot is wrong (3.6). These blocks are the small, exact part of the context.
    keys = tl.load(k_ptrs, mask=key_ok[:, None] & (offs_dk[None, :] < DK), other=0.0).to(tl.float32)
    values = tl.load(v_ptrs, mask=key_ok[:, None] & (offs_dv[None, :] < DV), other=0.0).to(tl.float32)
    s = tl.dot(q, tl.trans(keys))
    # Visible: a real key, not after the query (when causal), inside the window (when there is one).
    last = q_pos if CAUSAL else q_pos + (1 << 30)
    first = tl.where(window > 0, q_pos - window + 1, 0)
    visible = key_ok[None, :] & (k_pos[None, :] <= last[:, None]) & (k_pos[None, :] >= first[:, None])
    s = tl.where(visible, s, float("-inf"))
    p, alpha, m, l = online_softmax_step(s, m, l)
    acc = acc * alpha[:, None] + tl.dot(p, values)
    return m, l, acc


# Sizes that follow the batch (query blocks, splits) are runtime arguments: a constexpr would compile a new
# kernel for every new batch shape, seconds each in the middle of serving (NOTE: vLLM 0.23 on the H200,
# benchmarks/results/h200-vllm-steps: prefill steps of 5.6-8.2 s instead of ~0.4 s before this). Likewise
# the per-sequence metadata's addresses: a mixed step's prefill rows start at row d of slots and start_pos,
# 16-byte aligned or not as d is a multiple of 4 or not, and Triton would compile a kernel for each.
@triton.jit(
    do_not_specialize=["window", "max_tiles", "qblocks", "nsplit", "nexact", "exact_rows", "tile_parts", "split0"],
    do_not_specialize_on_alignment=["slots_ptr", "start_pos_ptr", "qsl_ptr"],
)
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, pages_ptr, exact_k_ptr, exact_v_ptr, page_table_ptr,
    slots_ptr, start_pos_ptr, qsl_ptr, part_acc_ptr, part_ml_ptr, out_ptr, counts_ptr,
    scale, window, num_slots, max_tiles, qblocks, nsplit, nexact, exact_rows, tile_parts, split0,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    HKV: tl.constexpr, GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, M: tl.constexpr,
    CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KEPT: tl.constexpr,
    E: tl.constexpr, G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    DK_PAD: tl.constexpr, DV_PAD: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr, NBYTES: tl.constexpr,
    OFF_V: tl.constexpr, OFF_KCS: tl.constexpr, OFF_KCZ: tl.constexpr, OFF_KTS: tl.constexpr,
    OFF_VCS: tl.constexpr, OFF_VTS: tl.constexpr, OFF_VTZ: tl.constexpr, PTX: tl.constexpr,
    MERGE: tl.constexpr, WAIT: tl.constexpr, MERGE_ROWS: tl.constexpr, MERGE_SPLITS: tl.constexpr,
    MERGE_TAIL: tl.constexpr, ROTATE_BLOCK: tl.constexpr, ROTATE_IN: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0) // qblocks
    qb = tl.program_id(0) % qblocks
    h = tl.program_id(1)
    split = split0 + tl.program_id(2)
    nparts = nsplit + nexact
    row0 = tl.load(qsl_ptr + b)
    n = tl.load(qsl_ptr + b + 1) - row0
    if qb * BLOCK_Q >= n:
        return
    slot = tl.load(slots_ptr + b).to(tl.int64)
    p0 = tl.load(start_pos_ptr + b)
    check_sequence(slot, p0, n, qblocks * BLOCK_Q, num_slots, max_tiles * G, PTX)

    # Rows are (query token, head of the group) pairs.
    r = tl.arange(0, M)
    tok = qb * BLOCK_Q + r // GROUP
    row_ok = (r < BLOCK_Q * GROUP) & (tok < n)
    head = h * GROUP + r % GROUP
    q_pos = p0 + tok
    offs_dk = tl.arange(0, DK_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    q_rows = (row0 + tok).to(tl.int64)
    q_row_ptr = q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh
    m = tl.full([M], float("-inf"), tl.float32)
    l = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, DV_PAD], tl.float32)
    full_tiles = p0 // G  # complete tiles of history (the fresh tokens start in the next one)
    # The exact part's programs: split nsplit + e. Program 0 takes the fresh tokens, 1.. runs of exact_rows of the kept
    # rows (the first tile kept, rows of exact buffer 1, then the stored part of the current tile, buffer 0), or program
    # 0 all of them where it is the only one. A run wholly past a sequence's kept rows has nothing to attend: in a
    # merging step its program neither stores nor counts (the merge takes the live ones' partials, the first).
    n_sink = tl.where(full_tiles > 0, G if (E == 2) else 0, 0)
    n_tail = p0 - full_tiles * G
    live_exact = tl.where(nexact > 1, 1 + tl.cdiv(n_sink + n_tail, exact_rows), 1)
    if MERGE and split - nsplit >= live_exact:
        return
    # A merging step reads only the quantized partials that have tiles: a sequence's first live_q (its splits share its
    # own tiles, the first ones taking them: tile_math.live_splits; a server's page tables are max_model_len wide, and
    # the launch's splits are sized by that), the exact part's stored right after them, where the empty splits' Gluon
    # programs, which run beside these, store nothing (under the interpreter the quantized splits' launch, over before
    # this one, stores there first). Elsewhere the combine reads all.
    live_q = nsplit
    if MERGE:
        live_q = live_splits(nsplit // tile_parts, p0, p0, window, max_tiles, G, E) * tile_parts

    if split < nsplit:
        # q by key field: q_parts[i] = q[:, i::NK] (see _attend_quantized_tile), scores in the log2 domain
        NK: tl.constexpr = 8 // KB
        offs_b = tl.arange(0, DK_PAD // NK)
        q_parts = ()
        for i in tl.static_range(NK):
            channel = NK * offs_b[None, :] + i
            part = tl.load(q_row_ptr + channel, mask=row_ok[:, None] & (channel < DK), other=0.0)
            q_parts = q_parts + (part.to(tl.float32) * (scale * LOG2E),)
        lo, hi = quantized_tiles(split, nsplit, p0, p0 + qb * BLOCK_Q, window, max_tiles, G, E)
        # Each tile's page is loaded a tile ahead: with the address of its codes coming from a load in the
        # same iteration, Triton's pipeliner gave the codes one buffer, copied after the tile's compute and
        # waited for at the next one (NOTE: benchmarks/NOTES.md, session 11: ~1% of the kernel's time).
        table_row = page_table_ptr + slot * max_tiles
        next_page = tl.load(table_row + tl.maximum(tl.minimum(lo, hi - 1), 0))
        for tile in range(lo, hi):
            page = next_page.to(tl.int64)
            next_page = tl.load(table_row + tl.minimum(tile + 1, hi - 1))
            m, l, acc = _attend_quantized_tile(
                q_parts, q_pos, r < BLOCK_Q * GROUP, m, l, acc, pages_ptr + (page * HKV + h) * NBYTES, tile, window,
                DK, DV, G, DK_PAD, DV_PAD, KB, VB, OFF_V, OFF_KCS, OFF_KCZ, OFF_KTS, OFF_VCS, OFF_VTS, OFF_VTZ, PTX,
            )  # fmt: skip
    else:
        q = tl.load(q_row_ptr + offs_dk[None, :], mask=row_ok[:, None] & (offs_dk[None, :] < DK), other=0.0)
        q = q.to(tl.float32) * (scale * LOG2E)  # scores in the log2 domain
        q_fresh = q  # ROTATE_IN: q as it came, for the fresh tokens (a score is the same in either space)
        if ROTATE_IN > 0:  # for the kept tokens, stored rotated
            q = hadamard_blocks(q, ROTATE_IN)
        offs_n = tl.arange(0, BLOCK_N)
        offs_kept = tl.arange(0, BLOCK_KEPT)
        exact_k = exact_k_ptr + (slot * HKV + h) * E * G * DK
        exact_v = exact_v_ptr + (slot * HKV + h) * E * G * DV
        # This program's kept rows: [lo, hi) (exact_rows a multiple of BLOCK_KEPT, as the sink's G rows are: no block
        # straddles the two buffers); program 0 of several has none (lo < 0, hi 0).
        lo = (split - nsplit - tl.minimum(nexact - 1, 1)) * exact_rows
        hi = lo + exact_rows
        for j in range(tl.maximum(lo, 0), tl.minimum(hi, n_sink), BLOCK_KEPT):
            idx = j + offs_kept
            m, l, acc = _attend_exact_block(
                q, q_pos, m, l, acc,
                exact_k + G * DK + idx[:, None] * DK + offs_dk[None, :],
                exact_v + G * DV + idx[:, None] * DV + offs_dv[None, :],
                idx, idx < G, window, False, DK, DV, DK_PAD, DV_PAD,
            )  # fmt: skip
        for j in range(tl.maximum(lo, n_sink), tl.minimum(hi, n_sink + n_tail), BLOCK_KEPT):
            idx = j - n_sink + offs_kept
            m, l, acc = _attend_exact_block(
                q, q_pos, m, l, acc,
                exact_k + idx[:, None] * DK + offs_dk[None, :],
                exact_v + idx[:, None] * DV + offs_dv[None, :],
                full_tiles * G + idx, idx < n_tail, window, False, DK, DV, DK_PAD, DV_PAD,
            )  # fmt: skip
        if ROTATE_IN > 0:  # the fresh tokens' values as they came: an acc of their own, in the output's space
            m_kept = m
            acc_kept = acc
            acc = tl.zeros([M, DV_PAD], tl.float32)
        # Fresh tokens of the call (exact program 0's): causal among themselves unless CAUSAL is off.
        n_fresh = tl.minimum(n, (qb + 1) * BLOCK_Q) if CAUSAL else n
        n_fresh = tl.where(split == nsplit, n_fresh, 0)
        for j in range(0, n_fresh, BLOCK_N):
            idx = j + offs_n
            rows = (row0 + idx).to(tl.int64)
            m, l, acc = _attend_exact_block(
                q_fresh, q_pos, m, l, acc,
                k_ptr + rows[:, None] * stride_kt + h * stride_kh + offs_dk[None, :],
                v_ptr + rows[:, None] * stride_vt + h * stride_vh + offs_dv[None, :],
                p0 + idx, idx < n, window, CAUSAL, DK, DV, DK_PAD, DV_PAD,
            )  # fmt: skip
        if ROTATE_IN > 0:  # the kept tokens' acc out of the rotated space, weighed to the final max, plus the fresh
            weight = tl.exp2(m_kept - tl.where(m == float("-inf"), 0.0, m))
            acc = acc + hadamard_blocks(acc_kept, ROTATE_BLOCK) * weight[:, None]

    # Partials: acc [T, HQ, nparts, DV_PAD], (max, sum) [T, HQ, nparts, 2]; acc rotated back where the merge in
    # the exact split takes them (ROTATE_BLOCK > 0), so that it only weighs and sums (ROTATE_IN: the exact part did).
    if ROTATE_BLOCK > 0 and ROTATE_IN == 0:
        acc = hadamard_blocks(acc, ROTATE_BLOCK)
    # A lone live program of a merging step takes its own partial from registers where, stored, it would take another
    # merge step (halves: 32 stored and its own; NOTE, H100, benchmarks/results/gpu-s43/h100-spread: stored, B1/2K
    # 0.0079 -> 0.0089 ms); else it stores it with the others.
    if MERGE:
        own_in_registers = (live_exact == 1) & (live_q + 1 > MERGE_SPLITS)
    else:
        own_in_registers = live_exact < 1  # (never)
    part = (q_rows * (HKV * GROUP) + head) * nparts + tl.where(split < nsplit, split, live_q + split - nsplit)
    stored = row_ok & ~own_in_registers
    tl.store(part_acc_ptr + part[:, None] * DV_PAD + offs_dv[None, :], acc, mask=stored[:, None])
    tl.store(part_ml_ptr + part * 2, m, mask=stored)
    tl.store(part_ml_ptr + part * 2 + 1, l, mask=stored)
    if MERGE:  # a decode step's exact part (one token): the last of its live programs to finish merges the KV head's
        # partials into the output. counts_ptr: one count a (sequence, KV head) of the launch, zero between launches.
        tl.debug_barrier()  # this program's partial, stored by all of its threads, before it counts itself done
        count = counts_ptr + b * HKV + h
        done = live_exact - 1  # alone: no count (NOTE, H100, gpu-s43/h100-counted: counting cost B1/2K ~1.4 us)
        if live_exact > 1:
            done = tl.atomic_add(count, 1, sem="acq_rel", scope="gpu")  # (release: the partial; acquire: the others')
        if done == live_exact - 1:
            if live_exact > 1:
                tl.store(count, 0)
            if WAIT:  # the quantized splits' launch, a programmatic dependency: complete, its stores visible
                gdc_wait()
            g = tl.arange(0, MERGE_ROWS)  # the token's heads: its rows of the output
            out_rows = row0 * (HKV * GROUP) + h * GROUP + g
            if own_in_registers:  # (rows 0..GROUP-1 of this program's: the token's heads)
                own = (_leading_rows(m, MERGE_ROWS), _leading_rows(l, MERGE_ROWS), _leading_rows(acc, MERGE_ROWS))
                merge_rows(part_acc_ptr, part_ml_ptr, out_ptr, out_rows, g < GROUP, nparts, live_q, stride_ot,
                           stride_oh, HKV * GROUP, DV, DV_PAD, MERGE_SPLITS, MERGE_CHUNK, 0, MERGE_TAIL, own)  # fmt: skip
            else:
                merge_rows(part_acc_ptr, part_ml_ptr, out_ptr, out_rows, g < GROUP, nparts, live_q + live_exact,
                           stride_ot, stride_oh, HKV * GROUP, DV, DV_PAD, MERGE_SPLITS, MERGE_CHUNK, 0,
                           MERGE_TAIL)  # fmt: skip


@triton.jit
def _leading_rows(x, R: tl.constexpr):
    """The first R rows of x [M] or [M, D] (M a multiple of R)."""
    M: tl.constexpr = x.shape[0]
    if M == R:
        rows = x
    elif len(x.shape) == 1:
        first = (tl.arange(0, M // R) == 0)[:, None]
        rows = tl.sum(tl.where(first, tl.reshape(x, [M // R, R]), 0.0), 0)
    else:
        first = (tl.arange(0, M // R) == 0)[:, None, None]
        rows = tl.sum(tl.where(first, tl.reshape(x, [M // R, R, x.shape[1]]), 0.0), 0)
    return rows


log = logging.getLogger("kvarn.kernels")

# A decode step's exact split merges the step's partials itself (``merge_in_exact_split``) where a row has at most
# MERGE_MOST_PARTS of them (up to three merge steps at GQA 4, D 128) and the step has at most
# MERGE_MOST_PROGRAMS_PER_SM exact-split programs per SM; these programs have MERGE_WARPS warps.
MERGE_MOST_PARTS = 96
MERGE_MOST_PROGRAMS_PER_SM = 2
MERGE_WARPS = 4
MERGE_ELEMENTS_PER_THREAD = 128  # fp32 partials a thread holds in a merge step (the one-warp combine's budget)
MERGE_CHUNK = tl.constexpr(MAX_CHUNK)  # the merge's first pass (of the maxima) in steps of the combine's
# The merge takes up to a step's partials and this part of a step more at once (combine_splits._merge_at_once: the
# halves' step plus the exact part's live programs, 8 at GQA 4 and D 128). A fixed part of the step, not the step's
# exact programs: those follow the batch, and a constexpr that did would compile a kernel a batch size mid-serving.
MERGE_TAIL_PART = 4
EXACT_ROWS = 32  # kept rows a program of a decode step's exact part takes where the step spreads them (exact_parts_for)


_MERGE_COUNTS: dict[torch.device, torch.Tensor] = {}


def merge_counts(device: torch.device, programs: int = 0) -> torch.Tensor:
    """The counts a decode step's merging exact part keeps, one per (sequence, KV head) of a launch: int32, zero
    between launches (the program that merges sets its count back to 0). At least ``programs`` of them; made at
    first use on a device, MERGE_MOST_PROGRAMS_PER_SM per SM (what ``merge_in_exact_split`` launches at most), which
    must not be inside a CUDA graph's capture or memory pool: ``ops.prepare_constants`` makes them before. One set a
    device: two merging decode steps running at once on two streams of a device would share them (no integration
    here runs attention on two streams at once)."""
    counts = _MERGE_COUNTS.get(device)
    if counts is None or counts.numel() < programs:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "kvarn: the decode step's merge counts are first needed inside a CUDA graph capture; "
                "call kvarn_compile.ops.prepare_constants(...) on this device before capturing"
            )
        size = max(programs, MERGE_MOST_PROGRAMS_PER_SM * multiprocessors(device))
        counts = _MERGE_COUNTS[device] = torch.zeros(size, dtype=torch.int32, device=device)
    return counts


@functools.cache
def _exact_part_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream a decode step's exact split runs on, one per device."""
    return torch.cuda.Stream(device)


@functools.cache
def _warn_general_decode(preset: Preset, group: int, dk: int, dv: int) -> None:
    log.warning("kvarn: decode of %s with %d query heads per KV head and head dims %d/%d runs the general Triton "
                "kernel, not the faster Gluon one (it serves equal K/V head dims 64/128/256, <= 16 heads per KV "
                "head, 2/4-bit codes, >= 32 key bytes per token, >= 16 tokens per value byte field)",
                preset.name, group, dk, dv)  # fmt: skip


def num_splits_for(num_programs: int, max_tiles: int, num_sms: int) -> int:
    """Splits of the quantized context for this kernel's (and the latent kernel's) programs: about 16 small
    programs per SM, at most 64. Decode steps in the Gluon kernel split by ``decode_attention.decode_splits``.

    NOTE (H200, batch 8, 32K context, k4v2_g128, a split sweep once in benchmarks/attention.py): 33 splits 0.259 ms,
    64 splits 0.264 ms, 16 splits 0.272 ms, 5 splits (the earlier "2 programs per SM") 0.506 ms.
    """
    want = -(-16 * num_sms // max(num_programs, 1))
    return max(1, min(want, max_tiles, 64))


def merge_step_for(group: int, dv_pad: int) -> int:
    """The partials a decode step's merging exact split takes in one step, at ``group`` query heads per KV head and
    a padded value head dim ``dv_pad``: as many as its threads hold MERGE_ELEMENTS_PER_THREAD of (32 at GQA 4, D 128)."""
    step = MERGE_ELEMENTS_PER_THREAD * 32 * MERGE_WARPS // (triton.next_power_of_2(group) * dv_pad)
    return max(1, min(triton.next_power_of_2(MERGE_MOST_PARTS), step))


def exact_parts_for(max_query_len: int, programs: int, num_sms: int, kept_rows: int) -> int:
    """Programs for the exact part of each of a step's ``programs`` (sequence, KV head): in a decode step, the one
    that takes the fresh token plus one per EXACT_ROWS of the ``kept_rows`` a sequence can hold exact (its current
    tile's, and the first tile where it is kept), at most about one exact program per multiprocessor in all; one
    where that leaves no room, and in prefill steps.

    Why: one program walking a current tile's rows a block at a time is a small step's longest path. NOTE (H100,
    benchmarks/results/gpu-s43/h100-spread, op ms with 0 / 64 / 125 rows held in each current tile, the package before
    -> with this, one machine): batch 1 at 2K 0.0079 / 0.0124 / 0.0157 -> 0.0089 / 0.0102 / 0.0102 (cuDNN fp16
    0.0081-0.0083; the lone program's partial from registers since: 0.0084 / 0.0105 / 0.0108, h100-final), B1/8K+125
    rows 0.0189 -> 0.0130; batch 8 unchanged. Its sweep (sweep/sweep-exact.md): 5 and 9 programs tie at batch 1; at
    B8/8K+125 rows 1-5 within 6%; at B32/8K+125 1 0.1048, 2 0.1072, 5 0.1184: where the SMs are busy, more programs
    only add to the step."""
    if max_query_len > 1:
        return 1
    return max(1, min(1 + -(-kept_rows // EXACT_ROWS), num_sms // max(programs, 1)))


def merge_in_exact_split(device: torch.device, max_query_len: int, nparts: int, programs: int, gluon: bool) -> bool:
    """Whether a step's exact part, launched after its quantized splits, merges every partial of its KV head into
    the output itself (no combine launch, no side stream; the last of its programs to finish, ``merge_counts``):
    decode steps of at most MERGE_MOST_PARTS partials a row and ``programs`` (sequences x KV heads) <=
    MERGE_MOST_PROGRAMS_PER_SM a multiprocessor; on Hopper and later after the Gluon kernel (a programmatic dependent
    of it: its programs start once every Gluon program has read q (or, without tiles, exited), or at once where the
    Gluon programs leave half the GPU free, compute the exact part beside them, and wait for them only before
    merging), and under the interpreter (the same two launches, in turn). Every program of such a step with something
    to attend stores its partial rotated back (out of the rotated space), so the merge only weighs and sums
    (``decode_attention._rotated_back``).

    Elsewhere the exact split runs beside the quantized ones (on a side stream beside the Gluon kernel, or in one
    launch with them) and ``combine_splits`` merges. NOTE (H200, benchmarks/results/h200-s27/call2/ab.txt, op ms,
    the side stream and the combine -> this, in one run): B1/2K 0.0105 -> 0.0104, B1/8K (65 partials) 0.0132 ->
    0.0129, B8/2K 0.0159 -> 0.0149, B8/8K 0.0319 -> 0.0306, B32/8K (256 programs) 0.0819 -> 0.0801, B8/32K 0.0797 ->
    0.0803. Beyond the limits it lost (call1/ab.txt): B1/32K (129 partials, in 5 steps) 0.0214 -> 0.0220; B128/2K
    (1,024 programs, which wait for the Gluon programs instead of running beside them) 0.0865 -> 0.0981. Its exact
    keys 32 or 64 at a time (4 warps) were slower than 16: B1/2K 0.0108 / 0.0119, B8/8K 0.0330 / 0.0335 (the fresh
    token's blocks and the kept rows' one size then; the kept rows are 32 a block since session 44: paged_partials)."""
    most_programs = MERGE_MOST_PROGRAMS_PER_SM * multiprocessors(device)
    if max_query_len > 1 or nparts > MERGE_MOST_PARTS or programs > most_programs:
        return False
    if interpreting():
        return True
    return gluon and torch.cuda.get_device_capability(device)[0] >= 9


def paged_partials(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pages: torch.Tensor,
    exact_k: torch.Tensor,
    exact_v: torch.Tensor,
    page_table: torch.Tensor,
    slots: torch.Tensor,
    start_pos: torch.Tensor,
    query_start_loc: torch.Tensor,
    preset: Preset,
    scale: float,
    causal: bool,
    window: int,
    max_query_len: int,
    num_splits: int | None = None,
    num_warps: int = 2,  # NOTE: 2 warps 0.259 ms, 4 warps 0.347 ms, 8 warps 0.450 ms (same sweep, 33 splits)
    num_stages: int = 3,  # NOTE (H200, v12): 2-3% faster than 2 at B8/32K, B8/128K, B256/1.5K
    rotated: bool = True,
    out: torch.Tensor | None = None,
    tile_parts: int | None = None,
    exact_parts: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Launch the attention kernels; returns the partials (acc [T, Hq, S+X, DV_PAD], max/sum [T, Hq, S+X, 2]) for
    ``combine_splits``; or, given ``out`` [T, Hq, Dv] where ``merge_in_exact_split``, merges them into ``out``
    (rotated back) in the exact part's last program to finish and returns None. S: the quantized partials, num_splits
    x the Gluon kernel's programs per tile (``tile_parts``: ``decode_attention.tile_parts`` where ``num_splits`` is
    chosen here, else 1). X: the exact part's programs (``exact_parts``, else ``exact_parts_for``): the first takes
    the fresh tokens, the others the kept rows in equal runs (the first all of them where X is 1).

    q [T, Hq, Dk], k [T, Hkv, Dk], v [T, Hkv, Dv]: rotated (q in fp32), or raw (``rotated`` False: rotated here,
    by ``rotate.rotated_many``; a decode step's Gluon kernel may then start during that rotation:
    ``decode_attention.starts_during_rotation``; where its Gluon programs leave half the GPU free and the exact split
    merges, the kernels rotate q themselves and nothing is launched for it). Validation is the op's.
    """
    num_seqs, (tokens, hq, dk) = slots.numel(), q.shape
    hkv, dv, g = exact_k.shape[1], exact_v.shape[-1], preset.tile_size
    group = hq // hkv
    layout = preset.layout(dk, dv)
    dv_pad = triton.next_power_of_2(dv)
    # Decode: one token, all GROUP heads in one program. Prefill: rows of (token, head) per program, fewer
    # for wide heads so that the tiles of a program fit in shared memory (64 rows at head_dim 128).
    d_pad = triton.next_power_of_2(max(dk, dv))
    block_q = 1 if max_query_len <= 1 else max(1, max(16, 8192 // d_pad) // triton.next_power_of_2(group))
    rows = max(16, triton.next_power_of_2(block_q * group))
    qblocks = max(1, -(-max_query_len // block_q))
    max_tiles = page_table.shape[1]
    block_n = 16 if max_query_len <= 1 or d_pad > 128 else 32  # fresh tokens a step of the exact part's loop
    kept_rows = exact_k.shape[2] * g  # a bound on the rows a sequence holds exact
    nexact = (
        exact_parts_for(max_query_len, num_seqs * hkv, multiprocessors(q.device), kept_rows)
        if exact_parts is None
        else exact_parts
    )
    if nexact < 1:
        raise ValueError(f"exact_parts={exact_parts}: expected at least 1 program for the exact part")
    # kept rows a program: all of them where one program takes the exact part, else runs of whole blocks
    # Kept rows 32 a step (16 where the padded head dim is above 128, for the registers). NOTE (H100,
    # benchmarks/results/gpu-s44/h100-tail and h100-diag, op ms, 16 -> 32, two runs): B8/8K+125 rows 0.0433 -> 0.0409
    # and 0.0442 -> 0.0418, B32/8K+125 -2%.
    block_kept = 32 if d_pad <= 128 else 16
    exact_rows = kept_rows if nexact == 1 else block_kept * -(-kept_rows // ((nexact - 1) * block_kept))
    # Decode on the GPU: the quantized splits in the Gluon kernel, the exact part here.
    mma_decode = max_query_len <= 1 and not interpreting() and decode_attention.supports(preset, group, dk, dv)
    if max_query_len <= 1 and not interpreting() and not mma_decode:
        _warn_general_decode(preset, group, dk, dv)
    if tile_parts is not None and tile_parts > 1 and not mma_decode:
        raise ValueError(f"tile_parts={tile_parts} needs the Gluon decode kernel (a GPU decode step it serves)")
    launch_gluon = mma_decode and q.is_cuda and tokens > 0 and num_seqs > 0
    merge_step = merge_step_for(group, dv_pad)
    can_merge = out is not None and merge_in_exact_split(q.device, max_query_len, nexact, num_seqs * hkv, launch_gluon)
    parts = tile_parts or 1
    if num_seqs == 0:
        num_splits = 1  # nothing to launch (and no kernel to compile for the split rule)
    elif num_splits is None and mma_decode:
        num_splits, picked_parts = decode_attention.decode_splits(
            q, pages, page_table, slots, start_pos, query_start_loc, preset, hkv, exact_k.shape[0],
            exact_k.shape[2] == 2, merge_step if can_merge else 0,
        )  # fmt: skip
        parts = tile_parts or picked_parts
    elif num_splits is None:
        num_splits = num_splits_for(num_seqs * qblocks * hkv, max_tiles, multiprocessors(q.device))
    nsplit = num_splits * parts  # the quantized partials
    nparts = nsplit + nexact
    merge = can_merge and merge_in_exact_split(q.device, max_query_len, nparts, num_seqs * hkv, launch_gluon)
    # Where the Gluon programs leave half the slots free (``decode_attention.leaves_half_the_slots``; always where its
    # tiles go in halves), the merging exact split takes q, k and v as they came (``ROTATE_IN``), and so do the Gluon
    # programs (``rotate_q``): the step has no rotation launch, and the exact split starts at once, beside the Gluon
    # kernel. NOTE (H200, benchmarks/results/h200-s29/call3, op ms, halves, the exact split after the Gluon programs
    # have read q -> beside the rotation launch of q): B1/2K 0.0087 -> 0.0083, B2/2K 0.0088 -> 0.0090. The Gluon
    # programs' own rotation (h200-s30, B1/2K, rotation launch -> theirs): 0.0082 -> 0.0081 (call2, through shared
    # memory), 0.0081 -> 0.0079 (final/ab.txt, that -> in operand registers).
    # With the slots full its programs start only as the Gluon ones end, so there it would only add its own rotation
    # of q to the step's path. (Without the Gluon kernel, under the interpreter, the quantized splits' launch is over
    # before the exact split's: it takes them as they came too.)
    beside = not launch_gluon or parts > 1
    if merge and not rotated and not beside:
        resident = decode_attention.resident_slots(q, pages, page_table, slots, start_pos, query_start_loc, preset,
                                                   hkv, exact_k.shape[0], exact_k.shape[2] == 2)  # fmt: skip
        beside = decode_attention.leaves_half_the_slots(num_seqs * hkv * nsplit, resident)
    exact_rotates = merge and not rotated and beside
    gluon_rotates = exact_rotates and launch_gluon
    pdl = (launch_gluon and not rotated and not gluon_rotates
           and decode_attention.starts_during_rotation(q.device, max_tiles, num_splits))  # fmt: skip
    if rotated or gluon_rotates:
        q_rot = q
    elif exact_rotates:
        (q_rot,) = rotated_many([q], [torch.float32])  # for the Triton kernel's quantized splits (the interpreter)
    else:
        q, k, v = rotated_many([q, k, v], [torch.float32, k.dtype, v.dtype], early_dependents=pdl)
        q_rot = q
    part_acc = q.new_empty(tokens, hq, nparts, dv_pad, dtype=torch.float32)
    part_ml = q.new_empty(tokens, hq, nparts, 2, dtype=torch.float32)
    if tokens == 0 or num_seqs == 0:
        return None if merge else (part_acc, part_ml)
    # the arguments after q, k and v up to split0, and the strides after q's
    tensors = (pages, exact_k, exact_v, page_table, slots, start_pos, query_start_loc, part_acc, part_ml,
               out if merge else part_acc, merge_counts(q.device, num_seqs * hkv) if merge else part_ml, float(scale),
               int(window), exact_k.shape[0], max_tiles, qblocks, nsplit, nexact, exact_rows, parts)  # fmt: skip
    strides = (k.stride(0), k.stride(1), v.stride(0), v.stride(1), *(out.stride()[:2] if merge else (0, 0)))
    constants = {
        "HKV": hkv, "GROUP": group, "BLOCK_Q": block_q, "M": rows, "CAUSAL": causal,
        "BLOCK_N": block_n, "BLOCK_KEPT": block_kept, "E": exact_k.shape[2], "G": g, "DK": dk,
        "DV": dv, "DK_PAD": triton.next_power_of_2(dk), "DV_PAD": dv_pad, "KB": preset.key_bits,
        "VB": preset.value_bits, "NBYTES": layout.nbytes, "OFF_V": layout.v_codes, "OFF_KCS": layout.k_chan_scale,
        "OFF_KCZ": layout.k_chan_zero, "OFF_KTS": layout.k_tok_scale, "OFF_VCS": layout.v_chan_scale,
        "OFF_VTS": layout.v_tok_scale, "OFF_VTZ": layout.v_tok_zero, "PTX": not interpreting(),
        "num_stages": num_stages,
    }  # fmt: skip
    no_merge = {"MERGE": False, "WAIT": False, "MERGE_ROWS": 1, "MERGE_SPLITS": 1, "MERGE_TAIL": 0, "ROTATE_BLOCK": 0,
                "ROTATE_IN": 0, "num_warps": num_warps}  # fmt: skip
    grid = (num_seqs * qblocks, hkv)
    # Without the merge, the exact split runs beside the Gluon kernel (a fork and join, captured into CUDA graphs as
    # two branches) instead of after it. NOTE (H200, benchmarks/results/h200-combine-s18, both launches, CUDA
    # graphs): B1/2K 0.0095 -> 0.0062 ms, B8/2K 0.0132 -> 0.0112, B8/32K 0.0859 -> 0.0818, B128/2K 0.0948 -> 0.0907.
    side = _exact_part_stream(q.device) if launch_gluon and not merge else None
    if side is not None:  # the fork: before the Gluon launch, so that the exact split waits only for the rotation
        side.wait_stream(torch.cuda.current_stream())
    if mma_decode:
        decode_attention.decode_attention(q_rot, pages, page_table, slots, start_pos, query_start_loc, part_acc,
                                          part_ml, preset, scale, window, num_splits, hkv, exact_k.shape[0],
                                          exact_k.shape[2] == 2, parts=parts, pdl=pdl,
                                          early_dependents=("start" if exact_rotates else "q") if merge else None,
                                          rotate_q=gluon_rotates, rotate_back=merge)  # fmt: skip
    elif merge:  # the quantized splits first (the interpreter), their partials rotated back
        _paged_attention_kernel[(*grid, nsplit)](q_rot, k, v, *tensors, 0, *q_rot.stride()[:2], *strides, **constants,
                                                 **(no_merge | {"ROTATE_BLOCK": rotation_block(dv)}))  # fmt: skip
    if merge:  # the exact part's programs, the last of them to finish merging (after the Gluon kernel: its
        # programmatic dependent)
        _paged_attention_kernel[(*grid, nexact)](
            q, k, v, *tensors, nsplit, *q.stride()[:2], *strides, **constants, MERGE=True, WAIT=mma_decode,
            MERGE_ROWS=triton.next_power_of_2(group), MERGE_SPLITS=merge_step, MERGE_TAIL=merge_step // MERGE_TAIL_PART,
            ROTATE_BLOCK=rotation_block(dv),
            ROTATE_IN=rotation_block(dk) if exact_rotates else 0, num_warps=MERGE_WARPS, launch_pdl=mma_decode,
        )  # fmt: skip
        return None
    with torch.cuda.stream(side):  # None: the current stream
        split0 = nsplit if mma_decode else 0
        _paged_attention_kernel[(*grid, nparts - split0)](q, k, v, *tensors, split0, *q.stride()[:2], *strides,
                                                          **constants, **no_merge)  # fmt: skip
    if side is not None:
        torch.cuda.current_stream().wait_stream(side)
    return part_acc, part_ml


def paged_attention(q, k, v, pages, exact_k, exact_v, page_table, slots, start_pos, query_start_loc,
                    preset: Preset, scale: float, causal: bool, window: int, max_query_len: int,
                    out: torch.Tensor | None = None, **launch) -> torch.Tensor:  # fmt: skip
    """The attention output [T, Hq, Dv] (in ``out`` if given, else in k's dtype), rotated back: ``paged_partials``,
    merged by the exact split or by ``combine_splits``. ``launch``: ``paged_partials``' options."""
    if out is None:
        out = k.new_empty(q.shape[0], q.shape[1], exact_v.shape[-1])
    partials = paged_partials(q, k, v, pages, exact_k, exact_v, page_table, slots, start_pos, query_start_loc, preset,
                              scale, causal, window, max_query_len, out=out, **launch)  # fmt: skip
    if partials is not None:
        combine_splits(*partials, out, rotate_back=True)
    return out
