"""Variant b of session 10 (kept for reference, not the package's kernel): tile in 4 token groups, one
inline-PTX call per 4 bytes giving both nibbles of a key byte / all four fields of a value byte, no
masks (k4v2_g128 at head_dim 128 only). Measured beside the package kernel in ab-*.json here:
as fast as it (0.1896 vs 0.1901 ms at B8/32K with 3 stages). Run: python benchmarks/attention_ab.py
--out ab.json benchmarks/results/h200-attention-v12/variant_b.py
"""

import torch
import triton
import triton.language as tl

from kvarn_compile.presets import Preset
from kvarn_compile.kernels.tile_math import LOG2E, fp16_ptr, interpreting, online_softmax_step


@triton.jit
def unpack_nibbles(x, USE_ASM: tl.constexpr):
    """uint8 -> (low nibble, high nibble) as fp16, same shape."""
    if USE_ASM:
        lo, hi = tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 t0, t1, a, c1024, c16, cm64;
            mov.b32 c1024, 0x64006400;
            mov.b32 c16, 0x2C002C00;
            mov.b32 cm64, 0xD400D400;
            prmt.b32 t0, $4, 0, 0x4140;
            prmt.b32 t1, $4, 0, 0x4342;
            lop3.b32 a, t0, 0x000F000F, 0x64006400, 0xEA;
            sub.f16x2 $0, a, c1024;
            lop3.b32 a, t1, 0x000F000F, 0x64006400, 0xEA;
            sub.f16x2 $1, a, c1024;
            lop3.b32 a, t0, 0x00F000F0, 0x64006400, 0xEA;
            fma.rn.f16x2 $2, a, c16, cm64;
            lop3.b32 a, t1, 0x00F000F0, 0x64006400, 0xEA;
            fma.rn.f16x2 $3, a, c16, cm64;
            }""",
            constraints="=r,=r,=r,=r,r", args=[x], dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    else:
        y = x.to(tl.int16)
        lo = ((y & 15) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
        hi = (((y >> 4) & 15) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
    return lo, hi


@triton.jit
def _group_scores(qa, qb, qz, k_tok, record, offs_b, offs_j, f: tl.constexpr, KROW: tl.constexpr,
                  USE_ASM: tl.constexpr):
    tok = 4 * offs_j + f
    kx = tl.load(record + tok[None, :] * KROW + offs_b[:, None])  # [DK/2, G/4] uint8
    lo, hi = unpack_nibbles(kx, USE_ASM)
    s = tl.dot(qa, lo)
    s = tl.dot(qb, hi, s)
    return (s + qz[:, None]) * k_tok[None, :]


@triton.jit
def _split4(x):
    even, odd = tl.split(tl.reshape(x, (x.shape[0], 2, 2)))  # columns (0, 2) and (1, 3)
    c0, c2 = tl.split(even)
    c1, c3 = tl.split(odd)
    return c0, c1, c2, c3


@triton.jit
def unpack_fields(x, USE_ASM: tl.constexpr):
    """uint8 -> its four 2-bit fields as fp16, same shape."""
    if USE_ASM:
        v0, v1, v2, v3 = tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 t0, t1, a, c0, s1, o1, s2, o2, s3, o3;
            mov.b32 c0, 0x64006400;
            mov.b32 s1, 0x34003400;
            mov.b32 o1, 0xDC00DC00;
            mov.b32 s2, 0x2C002C00;
            mov.b32 o2, 0xD400D400;
            mov.b32 s3, 0x24002400;
            mov.b32 o3, 0xCC00CC00;
            prmt.b32 t0, $8, 0, 0x4140;
            prmt.b32 t1, $8, 0, 0x4342;
            lop3.b32 a, t0, 0x00030003, 0x64006400, 0xEA;
            sub.f16x2 $0, a, c0;
            lop3.b32 a, t1, 0x00030003, 0x64006400, 0xEA;
            sub.f16x2 $1, a, c0;
            lop3.b32 a, t0, 0x000C000C, 0x64006400, 0xEA;
            fma.rn.f16x2 $2, a, s1, o1;
            lop3.b32 a, t1, 0x000C000C, 0x64006400, 0xEA;
            fma.rn.f16x2 $3, a, s1, o1;
            lop3.b32 a, t0, 0x00300030, 0x64006400, 0xEA;
            fma.rn.f16x2 $4, a, s2, o2;
            lop3.b32 a, t1, 0x00300030, 0x64006400, 0xEA;
            fma.rn.f16x2 $5, a, s2, o2;
            lop3.b32 a, t0, 0x00C000C0, 0x64006400, 0xEA;
            fma.rn.f16x2 $6, a, s3, o3;
            lop3.b32 a, t1, 0x00C000C0, 0x64006400, 0xEA;
            fma.rn.f16x2 $7, a, s3, o3;
            }""",
            constraints="=r,=r,=r,=r,=r,=r,=r,=r,r", args=[x], dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
            is_pure=True, pack=4)
    else:
        y = x.to(tl.int16)
        v0 = ((y & 3) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
        v1 = (((y >> 2) & 3) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
        v2 = (((y >> 4) & 3) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
        v3 = (((y >> 6) & 3) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
    return v0, v1, v2, v3


@triton.jit
def _attend_quantized_tile(
    q_e, q_o, q_pos, m, l, acc, record, tile, window,
    DK, DV, G: tl.constexpr, DK_PAD: tl.constexpr, DV_PAD: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr,
    OFF_V: tl.constexpr, OFF_KCS: tl.constexpr, OFF_KCZ: tl.constexpr, OFF_KTS: tl.constexpr,
    OFF_VCS: tl.constexpr, OFF_VTS: tl.constexpr, OFF_VTZ: tl.constexpr, USE_ASM: tl.constexpr,
):  # fmt: skip
    offs_t = tl.arange(0, G)
    offs_dk = tl.arange(0, DK_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    K_ROW: tl.constexpr = DK_PAD * KB // 8
    V_ROW: tl.constexpr = G * VB // 8
    offs_kb = tl.arange(0, K_ROW)
    offs_vb = tl.arange(0, V_ROW)

    # Tokens in four groups f (token 4j + f: the 2-bit field f of value byte j), so that the value codes
    # of a group come from one field of every byte and no reshape is needed.
    KROW: tl.constexpr = DK * KB // 8
    offs_b = tl.arange(0, DK_PAD // 2)
    offs_j = tl.arange(0, G // 4)
    pair = 2 * offs_b[:, None] + tl.arange(0, 2)[None, :]
    ks_e, ks_o = tl.split(tl.load(fp16_ptr(record + OFF_KCS) + pair).to(tl.float32))
    kz_e, kz_o = tl.split(tl.load(fp16_ptr(record + OFF_KCZ) + pair).to(tl.float32))
    quad = 4 * offs_j[:, None] + tl.arange(0, 4)[None, :]
    kt0, kt1, kt2, kt3 = _split4(tl.load(fp16_ptr(record + OFF_KTS) + quad).to(tl.float32))
    vt0, vt1, vt2, vt3 = _split4(tl.load(fp16_ptr(record + OFF_VTS) + quad).to(tl.float32))
    vz0, vz1, vz2, vz3 = _split4(tl.load(fp16_ptr(record + OFF_VTZ) + quad).to(tl.float32))
    qa = (q_e * ks_e[None, :]).to(tl.float16)
    qb = (q_o * ks_o[None, :]).to(tl.float16)
    qz = tl.sum(q_e * kz_e[None, :] + q_o * kz_o[None, :], axis=1)
    s0 = _group_scores(qa, qb, qz, kt0, record, offs_b, offs_j, 0, KROW, USE_ASM)
    s1 = _group_scores(qa, qb, qz, kt1, record, offs_b, offs_j, 1, KROW, USE_ASM)
    s2 = _group_scores(qa, qb, qz, kt2, record, offs_b, offs_j, 2, KROW, USE_ASM)
    s3 = _group_scores(qa, qb, qz, kt3, record, offs_b, offs_j, 3, KROW, USE_ASM)
    m_new = tl.maximum(tl.maximum(tl.maximum(m, tl.max(s0, axis=1)), tl.maximum(tl.max(s1, axis=1), tl.max(s2, axis=1))), tl.max(s3, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_safe)
    p0 = tl.exp2(s0 - m_safe[:, None])
    p1 = tl.exp2(s1 - m_safe[:, None])
    p2 = tl.exp2(s2 - m_safe[:, None])
    p3 = tl.exp2(s3 - m_safe[:, None])
    l = l * alpha + tl.sum(p0, axis=1) + tl.sum(p1, axis=1) + tl.sum(p2, axis=1) + tl.sum(p3, axis=1)
    m = m_new
    vx = tl.load(record + OFF_V + offs_dv[None, :] * V_ROW + offs_j[:, None])  # [G/4, DV] uint8
    v0, v1, v2, v3 = unpack_fields(vx, USE_ASM)
    v_chan = tl.load(fp16_ptr(record + OFF_VCS) + offs_dv).to(tl.float32)
    pv = tl.dot((p0 * vt0[None, :]).to(tl.float16), v0)
    pv = tl.dot((p1 * vt1[None, :]).to(tl.float16), v1, pv)
    pv = tl.dot((p2 * vt2[None, :]).to(tl.float16), v2, pv)
    pv = tl.dot((p3 * vt3[None, :]).to(tl.float16), v3, pv)
    z = (tl.sum(p0 * vz0[None, :], axis=1) + tl.sum(p1 * vz1[None, :], axis=1)
         + tl.sum(p2 * vz2[None, :], axis=1) + tl.sum(p3 * vz3[None, :], axis=1))
    pv += z[:, None]
    acc = acc * alpha[:, None] + pv * v_chan[None, :]
    return m, l, acc


@triton.jit
def _attend_exact_block(
    q, q_pos, m, l, acc, k_ptrs, v_ptrs, k_pos, key_ok, window,
    CAUSAL: tl.constexpr, DK, DV, DK_PAD: tl.constexpr, DV_PAD: tl.constexpr,
):  # fmt: skip
    """Attend to BLOCK_N unquantized keys/values at k_ptrs/v_ptrs ([BLOCK_N, D] pointer blocks)."""
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
    do_not_specialize=["window", "max_tiles", "tiles_per_split", "qblocks", "nsplit"],
    do_not_specialize_on_alignment=["slots_ptr", "start_pos_ptr", "qsl_ptr"],
)
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, pages_ptr, exact_k_ptr, exact_v_ptr, page_table_ptr,
    slots_ptr, start_pos_ptr, qsl_ptr, part_acc_ptr, part_ml_ptr,
    scale, window, max_tiles, tiles_per_split, qblocks, nsplit,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    HKV: tl.constexpr, GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, M: tl.constexpr,
    CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
    E: tl.constexpr, G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    DK_PAD: tl.constexpr, DV_PAD: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr, NBYTES: tl.constexpr,
    OFF_V: tl.constexpr, OFF_KCS: tl.constexpr, OFF_KCZ: tl.constexpr, OFF_KTS: tl.constexpr,
    OFF_VCS: tl.constexpr, OFF_VTS: tl.constexpr, OFF_VTZ: tl.constexpr, USE_ASM: tl.constexpr = 1,
):  # fmt: skip
    b = tl.program_id(0) // qblocks
    qb = tl.program_id(0) % qblocks
    h = tl.program_id(1)
    split = tl.program_id(2)
    row0 = tl.load(qsl_ptr + b)
    n = tl.load(qsl_ptr + b + 1) - row0
    if qb * BLOCK_Q >= n:
        return
    slot = tl.load(slots_ptr + b).to(tl.int64)
    p0 = tl.load(start_pos_ptr + b)

    # Rows are (query token, head of the group) pairs.
    r = tl.arange(0, M)
    tok = qb * BLOCK_Q + r // GROUP
    row_ok = (r < BLOCK_Q * GROUP) & (tok < n)
    head = h * GROUP + r % GROUP
    q_pos = p0 + tok
    offs_dk = tl.arange(0, DK_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    q_rows = (row0 + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_dk[None, :],
                mask=row_ok[:, None] & (offs_dk[None, :] < DK), other=0.0).to(tl.float32)  # fmt: skip
    q = q * (scale * LOG2E)  # scores in the log2 domain
    offs_h = tl.arange(0, DK_PAD // 2)
    q_e = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + 2 * offs_h[None, :],
                  mask=row_ok[:, None], other=0.0).to(tl.float32) * (scale * LOG2E)
    q_o = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + 2 * offs_h[None, :] + 1,
                  mask=row_ok[:, None], other=0.0).to(tl.float32) * (scale * LOG2E)

    m = tl.full([M], float("-inf"), tl.float32)
    l = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, DV_PAD], tl.float32)
    full_tiles = p0 // G  # complete tiles of history (the fresh tokens start in the next one)

    if split < nsplit:
        first = 1 if E == 2 else 0
        if window > 0:  # tiles wholly before every query's window are skipped
            first = tl.maximum(first, (p0 + qb * BLOCK_Q - window + 1) // G)
        lo = tl.maximum(split * tiles_per_split, first)
        hi = tl.minimum(tl.minimum((split + 1) * tiles_per_split, full_tiles), max_tiles)
        for tile in range(lo, hi):
            page = tl.load(page_table_ptr + slot * max_tiles + tile).to(tl.int64)
            m, l, acc = _attend_quantized_tile(
                q_e, q_o, q_pos, m, l, acc, pages_ptr + (page * HKV + h) * NBYTES, tile, window,
                DK, DV, G, DK_PAD, DV_PAD, KB, VB, OFF_V, OFF_KCS, OFF_KCZ, OFF_KTS, OFF_VCS, OFF_VTS, OFF_VTZ, USE_ASM,
            )  # fmt: skip
    else:
        offs_n = tl.arange(0, BLOCK_N)
        exact_k = exact_k_ptr + (slot * HKV + h) * E * G * DK
        exact_v = exact_v_ptr + (slot * HKV + h) * E * G * DV
        # The kept first tile (rows of exact buffer 1), then the stored part of the current tile (buffer 0).
        n_sink = G if (E == 2) else 0
        n_sink = tl.where(full_tiles > 0, n_sink, 0)
        for j in range(0, n_sink, BLOCK_N):
            idx = j + offs_n
            m, l, acc = _attend_exact_block(
                q, q_pos, m, l, acc,
                exact_k + G * DK + idx[:, None] * DK + offs_dk[None, :],
                exact_v + G * DV + idx[:, None] * DV + offs_dv[None, :],
                idx, idx < G, window, False, DK, DV, DK_PAD, DV_PAD,
            )  # fmt: skip
        n_tail = p0 - full_tiles * G
        for j in range(0, n_tail, BLOCK_N):
            idx = j + offs_n
            m, l, acc = _attend_exact_block(
                q, q_pos, m, l, acc,
                exact_k + idx[:, None] * DK + offs_dk[None, :],
                exact_v + idx[:, None] * DV + offs_dv[None, :],
                full_tiles * G + idx, idx < n_tail, window, False, DK, DV, DK_PAD, DV_PAD,
            )  # fmt: skip
        # Fresh tokens of the call: causal among themselves unless CAUSAL is off.
        n_fresh = tl.minimum(n, (qb + 1) * BLOCK_Q) if CAUSAL else n
        for j in range(0, n_fresh, BLOCK_N):
            idx = j + offs_n
            rows = (row0 + idx).to(tl.int64)
            m, l, acc = _attend_exact_block(
                q, q_pos, m, l, acc,
                k_ptr + rows[:, None] * stride_kt + h * stride_kh + offs_dk[None, :],
                v_ptr + rows[:, None] * stride_vt + h * stride_vh + offs_dv[None, :],
                p0 + idx, idx < n, window, CAUSAL, DK, DV, DK_PAD, DV_PAD,
            )  # fmt: skip

    # Partials: acc [T, HQ, nsplit+1, DV_PAD], (max, sum) [T, HQ, nsplit+1, 2].
    part = (q_rows * (HKV * GROUP) + head) * (nsplit + 1) + split
    tl.store(part_acc_ptr + part[:, None] * DV_PAD + offs_dv[None, :], acc, mask=row_ok[:, None])
    tl.store(part_ml_ptr + part * 2, m, mask=row_ok)
    tl.store(part_ml_ptr + part * 2 + 1, l, mask=row_ok)


USE_ASM = int(not interpreting())


def num_splits_for(num_programs: int, max_tiles: int, num_sms: int) -> int:
    """Splits of the quantized context: about 16 small programs per SM.

    NOTE (H200, batch 8, 32K context, k4v2_g128, benchmarks/attention.py --sweep): 33 splits 0.259 ms,
    64 splits 0.264 ms, 16 splits 0.272 ms, 5 splits (the earlier "2 programs per SM") 0.506 ms.
    """
    want = -(-16 * num_sms // max(num_programs, 1))
    return max(1, min(want, max_tiles, 64))


def paged_attention(
    q_rot: torch.Tensor,
    k_rot: torch.Tensor,
    v_rot: torch.Tensor,
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
    num_stages: int = 2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the attention kernel; returns the partials (acc, max/sum) for ``combine_splits``.

    q_rot [T, Hq, Dk], k_rot [T, Hkv, Dk], v_rot [T, Hkv, Dv]: rotated. Validation is the op's.
    """
    num_seqs, (tokens, hq, dk) = slots.numel(), q_rot.shape
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
    if num_splits is None:
        sms = torch.cuda.get_device_properties(q_rot.device).multi_processor_count if q_rot.is_cuda else 4
        num_splits = num_splits_for(num_seqs * qblocks * hkv, max_tiles, sms)
    part_acc = q_rot.new_empty(tokens, hq, num_splits + 1, dv_pad, dtype=torch.float32)
    part_ml = q_rot.new_empty(tokens, hq, num_splits + 1, 2, dtype=torch.float32)
    if tokens == 0 or num_seqs == 0:
        return part_acc, part_ml
    _paged_attention_kernel[(num_seqs * qblocks, hkv, num_splits + 1)](
        q_rot, k_rot, v_rot, pages, exact_k, exact_v, page_table, slots, start_pos, query_start_loc,
        part_acc, part_ml, float(scale), int(window), max_tiles,
        -(-max_tiles // num_splits), qblocks, num_splits,
        q_rot.stride(0), q_rot.stride(1), k_rot.stride(0), k_rot.stride(1), v_rot.stride(0), v_rot.stride(1),
        HKV=hkv, GROUP=group, BLOCK_Q=block_q, M=rows, CAUSAL=causal,
        BLOCK_N=16 if max_query_len <= 1 or d_pad > 128 else 32, E=exact_k.shape[2], G=g, DK=dk, DV=dv,
        DK_PAD=triton.next_power_of_2(dk), DV_PAD=dv_pad, KB=preset.key_bits, VB=preset.value_bits,
        NBYTES=layout.nbytes, OFF_V=layout.v_codes, OFF_KCS=layout.k_chan_scale, OFF_KCZ=layout.k_chan_zero,
        OFF_KTS=layout.k_tok_scale, OFF_VCS=layout.v_chan_scale, OFF_VTS=layout.v_tok_scale,
        OFF_VTZ=layout.v_tok_zero, USE_ASM=USE_ASM, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return part_acc, part_ml
