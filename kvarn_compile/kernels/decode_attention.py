"""Decode attention over the quantized tiles, in Gluon: codes go from their bytes straight into the
tensor-core operand registers.

Grid: (sequence, KV head, split); one warp per program, one query token per sequence, the GROUP query
heads of the KV head as the rows of a 16-row mma.sync (m16n8k16). Each program writes the same
unnormalised partial (acc, max, sum) as ``paged_attention``'s quantized splits, for ``combine_splits``.

Why a second kernel: the Triton kernel (``paged_attention``) moves every unpacked operand through shared
memory (Triton converts a tl.dot operand's layout there, with barriers: ~58 BAR and ~170 LDS/STS per warp
and tile) and stays near 1.2-1.3 TB/s whatever else was tried (benchmarks/NOTES.md). Gluon lets a load
take the operand's register layout itself, so nothing is converted through shared memory. The code bytes do
pass through it, once, by cp.async, with the key-side scale vectors: the next tile's are copied while this one is
computed (two stages), and are read from there in the operand layouts below:
- keys: a key byte holds NK = 8 / KB channels; field i of the [KW bytes, GJ tokens] byte block is the
  mma's B operand for q's channels NK * b + i. The block is loaded in the operand layout with k_width 8
  (a thread holds 8 consecutive bytes of a token: 64-bit loads).
- values: the output is computed transposed, [D, N] = codes^T [D, GJ] x p^T [GJ, N] (N = 8 or 16 heads), so
  that the D channels fill the mma's rows and the heads its 8 or 16 columns (not 16 rows of which GROUP are
  real). A value byte holds NV = 8 / VB consecutive tokens; field f of the [D, GJ bytes] block is the A
  operand for the tokens NV * j + f. The probabilities are the scores' accumulator rows 0..N-1, transposed:
  that is the B operand's register layout at k_width 2, for free. The A operand at k_width 2 gives a
  thread columns 2t, 2t + 1, 2t + 8, ...; those columns are mapped to bytes (``_token_of``) so that a
  thread's bytes of a channel are consecutive in memory (wide loads), and the score columns (the key block's
  tokens) are taken in the same order.
NOTE (H200, benchmarks/results/h200-decode-gluon, kernel + the exact part, vs the Triton kernel in the same
run): B8/32K 0.186 -> 0.136 ms, B8/128K 0.698 -> 0.494 (1.84 TB/s), B256/1.5K 0.287 -> 0.217, B1/32K
0.029 -> 0.023 (with up to 128 splits); the untransposed value dot was 3% slower; a register cap of 200 or
168 (10 or 12 warps per SM instead of 8) 16% / 47% slower (spills). Then (benchmarks/results/h200-decode-s15,
ab-6.txt): the scale vectors in wide loads, small-bias codes and byte pairs, and the L2 prefetch of the next
tile: B8/32K 0.137 -> 0.114 ms, B8/128K 0.497 -> 0.405 (2.2 TB/s), B256/1.5K 0.219 -> 0.182. Then
(h200-decode-s16) the code bytes staged by cp.async: B8/32K 0.114 -> 0.095, B8/128K 0.393 -> 0.324 (2.8 TB/s);
at head_dim 256 20-26% faster; k4v4_g128 (32 KB of shared memory per program, 6 programs per SM) 2-8% slower.
Then (h200-decode-s17) the key-side scale vectors staged with the codes: B8/32K 0.095 -> 0.086, B8/128K 0.336 ->
0.308 (2.9 TB/s), k4v4_g128 and head_dim 256 12-17% faster. The value-side scales stay in global memory (L2
prefetch): shared-memory slices must start at a multiple of their length, which v_chan's offset is not for
every shape.
Where its programs are short, a decode step's launch starts during the rotation of q before it (a programmatic
dependent: ``starts_during_rotation``): it reads the metadata and copies its first tile, then waits
(griddepcontrol.wait) before it reads q.
Dequantization is folded out of the dots as in ``paged_attention``:
    scores[t] = k_tok_scale[t] * ((q * k_chan_scale) . codesK[t] + q . k_chan_zero)
    out      += v_chan_scale * ((p * v_tok_scale) @ codesV + p . v_tok_zero)
Reference: ``paged.attention_reference``; the Triton interpreter does not run Gluon, so this kernel is
tested on the GPU (``tests/test_kernels.py``) and compiled for sm_90 in CI (``tests/test_kernels_compile.py``).
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from .tile_math import _field_ptx, multiprocessors, quantized_tiles, resident_programs, splits_by_waves

LOG2E = gl.constexpr(1.4426950408889634)
ROWS = gl.constexpr(16)  # the scores' mma rows: the query heads of a KV head, padded
MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8]))
A2 = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2))
B2 = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2))
A8 = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=8))
B8 = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=8))


@gluon.constexpr_function
def _token_bits(k, GJ):
    """The byte j (of a channel's GJ value bytes) that operand column k of the value block reads: with
    k = 8A * hi + 8a + 2t + p (t: the lane's position in its quad, which holds columns 2t, 2t + 1, 2t + 8, ...),
    j = 8A * hi + 2A * t + 2a + p, so that one thread's columns are consecutive bytes. A = min(GJ, 32) / 8."""
    a_count = min(GJ, 32) // 8
    p, t, a, hi = k & 1, (k >> 1) & 3, (k >> 3) % a_count, k // (8 * a_count)
    return hi * 8 * a_count + 2 * a_count * t + 2 * a + p


@gluon.constexpr_function
def _bytes_in_order(layout, GJ):
    """``layout`` (a linear layout of a [D, GJ] tensor) with its column bases taken through ``_token_bits``:
    the layout in which a [D, GJ bytes] load gives each thread the bytes that its operand columns read."""

    def bases(vectors):
        return [[v[0], _token_bits(v[1], GJ)] for v in vectors]

    return gl.DistributedLinearLayout(
        reg_bases=bases(layout.reg_bases), lane_bases=bases(layout.lane_bases),
        warp_bases=bases(layout.warp_bases), block_bases=layout.block_bases, shape=layout.shape,
    )  # fmt: skip


@gluon.jit
def _token_of(k, GJ: gl.constexpr):
    """``_token_bits`` on a tensor of operand columns (the same formula, for the kernel's index tensors)."""
    A: gl.constexpr = min(GJ, 32) // 8
    return (k // (8 * A)) * (8 * A) + 2 * A * ((k >> 1) & 3) + 2 * ((k >> 3) % A) + (k & 1)


@gluon.jit
def _field(packed, BITS: gl.constexpr, FIELD: gl.constexpr, BIASED: gl.constexpr, PAIRS: gl.constexpr):
    """uint8 -> fp16 of the same shape and layout: the code in field FIELD of each byte, plus
    ``_bias(BITS, FIELD)`` if BIASED; PAIRS "02": of 4 consecutive elements, the 2nd and 3rd come from each
    other's bytes (``tile_math._field_ptx``)."""
    return gl.inline_asm_elementwise(_field_ptx(BITS, FIELD, BIASED, PAIRS), "=r,=r,r", [packed], dtype=gl.float16,
                                     is_pure=True, pack=4)  # fmt: skip


@gluon.constexpr_function
def _bias(bits, field):
    """What a biased field adds to its codes: 2^(10 - bits * field) (``tile_math._field_ptx``)."""
    return float(2 ** (10 - bits * field))


@gluon.constexpr_function
def _small_bias(bits, field):
    """Fields are read biased where the bias is <= 64 times a code's unit: the tensor cores' fp32 sums
    truncate, losing up to the bias times 2^-24 of the operand's sum per step, on one side (NOTE, H200,
    benchmarks/results/h200-decode-gluon/tried-biased-codes-tests.txt: a bias of 1024 on the values put every
    output channel off by the same amount, up to 0.037 after the rotation back)."""
    return bits * field >= 4


@gluon.jit
def _byte_order(k):
    """The byte that element k of a key operand holds with PAIRS "02": bits 0 and 1 of k swapped
    (``_entry_bits(k, W, "byte pairs")`` on a tensor)."""
    return (k & ~3) | ((k & 1) << 1) | ((k >> 1) & 1)


@gluon.jit
def _q_parts(q_rows, stride_qh, scale, GROUP: gl.constexpr, NK: gl.constexpr, KW: gl.constexpr):
    """q by key field, the scores' A operands: q_parts[i] = q[:, NK * byte_order(b) + i] * scale ([ROWS, KW] fp32,
    the log2 domain; ``_field`` "02" orders a key's bytes so), rows = the group's heads from q_rows on."""
    rq = gl.arange(0, ROWS, layout=gl.SliceLayout(1, A8))
    kq = _byte_order(gl.arange(0, KW, layout=gl.SliceLayout(0, A8)))
    q_parts = ()
    for i in gl.static_range(NK):
        part = gl.load(q_rows + rq[:, None] * stride_qh + NK * kq[None, :] + i, mask=(rq[:, None] < GROUP), other=0.0)
        q_parts = q_parts + (part * scale,)
    return q_parts


@gluon.jit
def _exp2(x):
    """2^x flushing denormals (one MUFU.EX2; gl.exp2 adds a range fix-up of three instructions)."""
    return gl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=gl.float32, is_pure=True,
                                     pack=1)  # fmt: skip


@gluon.constexpr_function
def _lines_layout(nbytes):
    """A warp's layout over a record's 128-byte lines (rounded up to a power of two, >= 32)."""
    lines = max(32, 1 << (-(-nbytes // 128) - 1).bit_length())
    return gl.BlockedLayout(size_per_thread=[lines // 32], threads_per_warp=[32], warps_per_cta=[1], order=[0])


@gluon.jit
def _prefetch_l2(record, NBYTES: gl.constexpr):
    """Ask L2 for the NBYTES at ``record`` (one ``prefetch.global.L2`` per 128-byte line; lines past the
    record repeat its last byte's line). Nothing waits for it."""
    LINES: gl.constexpr = _lines_layout(NBYTES)
    offsets = gl.minimum(gl.arange(0, LINES.size_per_thread[0] * 32, layout=LINES) * 128, NBYTES - 1)
    gl.inline_asm_elementwise("prefetch.global.L2 [$1];", "=r,l", [(record + offsets).to(gl.int64)],
                              dtype=gl.int32, is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def _fp16(byte_ptr):
    return byte_ptr.to(gl.pointer_type(gl.float16))


@gluon.constexpr_function
def _entry_bits(c, W, order):
    """The element j of a vector (of W) that element c of an operand-ordered tensor holds: ``"tokens"``: the
    score columns' token order (``_token_bits``); ``"byte pairs"``: the key bytes as ``_field`` "02" pairs
    them (``_byte_order``); ``None``: j = c."""
    if order == "tokens":
        return _token_bits(c, W)
    if order == "byte pairs":
        return (c & ~3) | ((c & 1) << 1) | ((c >> 1) & 1)
    return c


@gluon.constexpr_function
def _fields_layout(target, NF, order):
    """A 1-D layout over W * NF fp16 entries (entry NF * j + f: field f of element j) in which each thread
    holds all NF fields of the elements it holds in ``target`` (a linear layout over [W]), as consecutive
    entries: one wide load. Element c of ``target`` is read at j = _entry_bits(c, W, order)."""
    W = target.shape[0]
    f_bits = [[1 << b] for b in range(NF.bit_length() - 1)]

    def entry(vectors):
        return [[NF * _entry_bits(v[0], W, order)] for v in vectors]

    return gl.DistributedLinearLayout(
        reg_bases=f_bits + entry(target.reg_bases), lane_bases=entry(target.lane_bases),
        warp_bases=entry(target.warp_bases), block_bases=[], shape=[W * NF],
    )  # fmt: skip


@gluon.jit
def _split_fields(x, NF: gl.constexpr):
    """[W, NF] -> NF tensors [W] (field 0, 1, ...): splits, no data movement."""
    if NF == 1:
        fields = (gl.reshape(x, [x.shape[0]]),)
    elif NF == 2:
        fields = gl.split(x)
    else:
        even, odd = gl.split(gl.reshape(x, [x.shape[0], 2, 2]))  # fields (0, 2) and (1, 3)
        f0, f2 = gl.split(even)
        f1, f3 = gl.split(odd)
        fields = (f0, f1, f2, f3)
    return fields


@gluon.jit
def _load_fields(src, TARGET: gl.constexpr, W: gl.constexpr, NF: gl.constexpr, ORDER: gl.constexpr,
                 SHARED: gl.constexpr = False):  # fmt: skip
    """The W * NF fp16 entries at src (entry NF * j + f; a pointer, or an fp16 shared-memory view if SHARED)
    as NF fp32 tensors [W] in layout TARGET, element c of field f being entry NF * j + f with
    j = _entry_bits(c, W, ORDER): one wide load per thread instead of one 16-bit load per element."""
    LOAD: gl.constexpr = _fields_layout(gl.to_linear_layout(TARGET, [W]), NF, ORDER)
    if SHARED:
        x = src.load(LOAD).to(gl.float32)
    else:
        x = gl.load(src + gl.arange(0, W * NF, layout=LOAD)).to(gl.float32)
    parts = _split_fields(gl.reshape(x, [W, NF]), NF)
    fields = ()
    for f in gl.static_range(NF):
        fields = fields + (_relabelled(parts[f], ORDER, TARGET),)
    return fields


@gluon.constexpr_function
def _index_bits(shape, order):
    """The last dim of ``shape`` split into the index bits that ``_entry_bits(c, W, order)`` permutes, and the
    permutation that takes an entry j's bits to its element c's: "tokens": j = (hi, t, a, p) -> c =
    (hi, a, t, p); "byte pairs": j = (rest, b1, b0) -> c = (rest, b0, b1); None: no split, no permutation."""
    lead, w = list(shape[:-1]), shape[-1]
    n = len(lead)
    if order == "tokens":
        a = min(w, 32) // 8
        return lead + [w // (8 * a), 4, a, 2], list(range(n)) + [n, n + 2, n + 1, n + 3]
    if order == "byte pairs":
        return lead + [w // 4, 2, 2], list(range(n)) + [n, n + 2, n + 1]
    return list(shape), list(range(len(shape)))


@gluon.jit
def _relabelled(x, ORDER: gl.constexpr, TARGET: gl.constexpr):
    """x [..., W] as a ``_bytes_in_order`` / ``_fields_layout`` load leaves it (last dim indexed by entry j) ->
    the same registers indexed by element c, j = _entry_bits(c, W, ORDER), in layout TARGET: index bits
    relabelled, no data moves."""
    SPLIT: gl.constexpr = _index_bits(x.shape, ORDER)[0]
    PERM: gl.constexpr = _index_bits(x.shape, ORDER)[1]
    x = gl.reshape(gl.permute(gl.reshape(x, SPLIT), PERM.value), x.shape)  # .value: permute wants a plain list
    return gl.convert_layout(x, TARGET, assert_trivial=True)


@gluon.constexpr_function
def _stage_layout(row_bytes):
    """A warp's layout for copying [rows, row_bytes] bytes in 16-byte pieces (cp.async)."""
    columns = min(32, row_bytes // 16)
    return gl.BlockedLayout(size_per_thread=[1, 16], threads_per_warp=[32 // columns, columns], warps_per_cta=[1, 1],
                            order=[1, 0])  # fmt: skip


@gluon.constexpr_function
def _pow2_at_least(n):
    return max(256, 1 << (n - 1).bit_length())


@gluon.jit
def _stage_bytes(smem, src, live, ROWS: gl.constexpr, ROW: gl.constexpr, VALID: gl.constexpr = 0):
    """Start copying the [ROWS, ROW] bytes at ``src`` (row-major) into ``smem`` if ``live`` (cp.async, 16 bytes a
    piece; the caller commits the group); only the first VALID bytes (a multiple of 16) if VALID > 0."""
    LAYOUT: gl.constexpr = _stage_layout(ROW)
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, LAYOUT))
    c = gl.arange(0, ROW, layout=gl.SliceLayout(0, LAYOUT))
    offsets = r[:, None] * ROW + c[None, :]
    if VALID > 0:
        async_copy.async_copy_global_to_shared(smem, src + offsets, mask=live & (offsets < VALID))
    else:
        async_copy.async_copy_global_to_shared(smem, src + offsets, mask=live)


@gluon.jit
def _stage_tile(keys, values, key_scales, record, live, D: gl.constexpr, GJ: gl.constexpr, KEY_ROW: gl.constexpr,
                OFF_V: gl.constexpr, OFF_KCS: gl.constexpr, OFF_VCS: gl.constexpr):  # fmt: skip
    """Start copying a tile's code bytes into shared memory: keys [GJ, KEY_ROW] (row j: tokens NV * j .. NV * j
    + NV - 1), values [D, GJ], and the key-side scale vectors (bytes OFF_KCS..OFF_VCS: channel scales and
    zeros, token scales) into key_scales [SR, 256]; they arrive while the previous tile is computed."""
    _stage_bytes(keys, record, live, GJ, KEY_ROW)
    _stage_bytes(values, record + OFF_V, live, D, GJ)
    _stage_bytes(key_scales, record + OFF_KCS, live, key_scales.shape[0], key_scales.shape[1], OFF_VCS - OFF_KCS)
    async_copy.commit_group()


@gluon.jit
def _attend_tile(
    q_parts, real_rows, q_pos, m, l, acc, record, keys, values, key_scales, tile, window,
    G: gl.constexpr, D: gl.constexpr, KB: gl.constexpr, VB: gl.constexpr, N: gl.constexpr, V_ORDER: gl.constexpr,
    K_ORDER: gl.constexpr,
    OFF_KCS: gl.constexpr, OFF_KCZ: gl.constexpr, OFF_KTS: gl.constexpr,
    OFF_VCS: gl.constexpr, OFF_VTS: gl.constexpr, OFF_VTZ: gl.constexpr,
):  # fmt: skip
    NK: gl.constexpr = 8 // KB
    NV: gl.constexpr = 8 // VB
    KW: gl.constexpr = D // NK  # key bytes per token
    GJ: gl.constexpr = G // NV  # value bytes per channel = tokens per group

    # q scaled by the key channel scales, by field (A operand), and q . k_chan_zero per row.
    q_zero = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(1, A8))
    q_scaled = ()
    # the key-side scale vectors from the staged copy: [D] channel scales, [D] zeros, [G] token scales (fp16)
    SCALES: gl.constexpr = key_scales.shape[0] * key_scales.shape[1] // 2
    ks = key_scales._reinterpret(gl.float16, [SCALES], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    k_scale = _load_fields(ks.slice(0, D), gl.SliceLayout(0, A8), KW, NK, "byte pairs", True)
    k_zero = _load_fields(ks.slice((OFF_KCZ - OFF_KCS) // 2, D), gl.SliceLayout(0, A8), KW, NK, "byte pairs", True)
    for i in gl.static_range(NK):
        qs = (q_parts[i] * k_scale[i][None, :]).to(gl.float16)
        q_scaled = q_scaled + (qs,)
        if _small_bias(KB, i):  # the mma adds bias * sum(qs): taken off with q . k_chan_zero
            q_zero += gl.sum(q_parts[i] * k_zero[i][None, :] - _bias(KB, i) * qs.to(gl.float32), axis=1)
        else:
            q_zero += gl.sum(q_parts[i] * k_zero[i][None, :], axis=1)
    q_zero = gl.convert_layout(q_zero, gl.SliceLayout(1, MMA))

    # Scores of token group f (tokens NV * j + f, columns in the value operand's order).
    token_s = NV * _token_of(gl.arange(0, GJ, layout=gl.SliceLayout(0, MMA)), GJ)
    KTS: gl.constexpr = (OFF_KTS - OFF_KCS) // 2  # the token scales' first entry in the staged copy
    if KTS % G == 0:  # a shared-memory slice starts at a multiple of its length (not so for G = 256 at D = 64)
        k_tok = _load_fields(ks.slice(KTS, G), gl.SliceLayout(0, MMA), GJ, NV, "tokens", True)
    else:
        k_tok = _load_fields(_fp16(record + OFF_KTS), gl.SliceLayout(0, MMA), GJ, NV, "tokens")
    scores = ()
    m_new = m
    for f in gl.static_range(NV):
        # [KW, GJ] key bytes of tokens NV * j + f from the staged tile, in token order, relabelled to the
        # operand's column order (column k reads token NV * _token_of(k) + f, as the value operand does)
        key_bytes = keys.slice(f * KW, KW, dim=1).permute([1, 0]).load(K_ORDER)
        key_bytes = _relabelled(key_bytes, "tokens", B8)
        s = gl.zeros([ROWS, GJ], gl.float32, layout=MMA)
        for i in gl.static_range(NK):
            s = mma_v2(q_scaled[i], _field(key_bytes, KB, i, _small_bias(KB, i), "02"), s)
        s = (s + q_zero[:, None]) * k_tok[f][None, :]
        s = gl.where(real_rows[:, None], s, float("-inf"))
        if window > 0:
            s = gl.where(tile * G + token_s[None, :] + f > q_pos - window, s, float("-inf"))
        scores = scores + (s,)
        m_new = gl.maximum(m_new, gl.max(s, axis=1))

    # The value bytes once ([D, GJ], loaded in token order, relabelled to the operand's column order).
    value_bytes = _relabelled(values.load(V_ORDER), "tokens", A2)

    # Online softmax over the tile, then out += v_chan * (codes^T @ (p * v_tok)^T + p . v_zero), transposed:
    # [D, N] = [D, GJ] x [GJ, N]. The scores' accumulator rows 0..N-1, transposed, are the B operand as they
    # lie in the registers, and the D channels fill the mma's 16 rows (the query heads would fill GROUP).
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = _exp2(m - m_safe)
    l = l * alpha
    p_zero = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(1, MMA))
    pv = gl.zeros([D, N], gl.float32, layout=MMA)
    v_zero = _load_fields(_fp16(record + OFF_VTZ), gl.SliceLayout(0, MMA), GJ, NV, "tokens")
    v_tok = _load_fields(_fp16(record + OFF_VTS), gl.SliceLayout(0, MMA), GJ, NV, "tokens")
    for f in gl.static_range(NV):
        p = _exp2(scores[f] - m_safe[:, None])
        l += gl.sum(p, axis=1)
        # codes read biased where the bias is small: the mma's bias * sum(p * v_tok) is taken off with p . v_zero
        pt = (p * v_tok[f][None, :]).to(gl.float16)
        if _small_bias(VB, f):
            p_zero += gl.sum(p * v_zero[f][None, :] - _bias(VB, f) * pt.to(gl.float32), axis=1)
        else:
            p_zero += gl.sum(p * v_zero[f][None, :], axis=1)
        pv = mma_v2(_field(value_bytes, VB, f, _small_bias(VB, f), "01"), _heads_as_columns(pt, N), pv)
    v_chan = gl.load(_fp16(record + OFF_VCS) + gl.arange(0, D, layout=gl.SliceLayout(1, MMA))).to(gl.float32)
    alpha_n = _head_vector(alpha, N)
    acc = acc * alpha_n[None, :] + (pv + _head_vector(p_zero, N)[None, :]) * v_chan[:, None]
    return m_new, l, acc


@gluon.jit
def _heads_as_columns(p, N: gl.constexpr):
    """[16, GJ] in the scores' accumulator layout -> rows 0..N-1 transposed, [GJ, N], as the B operand."""
    if N == ROWS:
        top = p
    else:
        top, _ = gl.split(gl.permute(gl.reshape(p, [2, N, p.shape[1]]), (1, 2, 0)))
    return gl.convert_layout(gl.permute(top, (1, 0)), B2, assert_trivial=True)


@gluon.jit
def _head_vector(x, N: gl.constexpr):
    """Per-row [16] (rows of the scores) -> per-column [N] of the transposed output."""
    if N == ROWS:
        top = x
    else:
        top, _ = gl.split(gl.permute(gl.reshape(x, [2, N]), (1, 0)))
    return gl.convert_layout(top, gl.SliceLayout(0, MMA))


@gluon.jit(do_not_specialize=["window", "max_tiles", "tiles_per_split", "nsplit"],
           do_not_specialize_on_alignment=["slots_ptr", "start_pos_ptr", "qsl_ptr"])  # fmt: skip
def _decode_attention_kernel(
    q_ptr, pages_ptr, page_table_ptr, slots_ptr, start_pos_ptr, qsl_ptr, part_acc_ptr, part_ml_ptr,
    scale, window, num_slots, max_tiles, tiles_per_split, nsplit, stride_qt, stride_qh,
    HKV: gl.constexpr, GROUP: gl.constexpr, E: gl.constexpr, G: gl.constexpr, D: gl.constexpr,
    KB: gl.constexpr, VB: gl.constexpr, NBYTES: gl.constexpr,
    OFF_V: gl.constexpr, OFF_KCS: gl.constexpr, OFF_KCZ: gl.constexpr, OFF_KTS: gl.constexpr,
    OFF_VCS: gl.constexpr, OFF_VTS: gl.constexpr, OFF_VTZ: gl.constexpr, PDL: gl.constexpr,
):  # fmt: skip
    b = gl.program_id(0)
    h = gl.program_id(1)
    split = gl.program_id(2)
    row = gl.load(qsl_ptr + b).to(gl.int64)
    if gl.load(qsl_ptr + b + 1) == row:  # no new token: row is the next sequence's (or past the last)
        return
    slot = gl.load(slots_ptr + b).to(gl.int64)
    p0 = gl.load(start_pos_ptr + b)
    # slot and position as tile_math.check_sequence; the token count (one) is checked by the exact part's kernel
    if (slot < 0) | (slot >= num_slots) | (p0 < 0) | (p0 >= max_tiles * G):
        gl.device_print("KVarN: a slot out of range or positions beyond its capacity (slot, slots, start_pos, "
                        "capacity)", slot, num_slots, p0, max_tiles * G)  # fmt: skip
        gl.inline_asm_elementwise("trap;", "=r,r", [p0], dtype=gl.int32, is_pure=False, pack=1)
    NK: gl.constexpr = 8 // KB
    NV: gl.constexpr = 8 // VB
    KW: gl.constexpr = D // NK
    N: gl.constexpr = 8 if GROUP <= 8 else ROWS  # the output's columns: the group's heads, padded
    V_ORDER: gl.constexpr = _bytes_in_order(gl.to_linear_layout(A2, [D, G // NV]), G // NV)
    K_ORDER: gl.constexpr = _bytes_in_order(gl.to_linear_layout(B8, [KW, G // NV]), G // NV)

    q_rows = q_ptr + row * stride_qt + h * GROUP * stride_qh
    if not PDL:
        q_parts = _q_parts(q_rows, stride_qh, scale * LOG2E, GROUP, NK, KW)

    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, MMA))
    m = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, MMA))
    l = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(1, MMA))
    acc = gl.zeros([D, N], gl.float32, layout=MMA)  # the output, transposed
    lo, hi = quantized_tiles(split, tiles_per_split, p0, p0, window, max_tiles, G, E)
    # Page numbers are read two tiles ahead: the next tile's record is copied (and its value-side scales asked of
    # L2) while this one is computed; its number was read an iteration ago, so the copy waits for nothing.
    table_row = page_table_ptr + slot * max_tiles
    next_page = gl.load(table_row + gl.maximum(gl.minimum(lo, hi - 1), 0))
    after_next = gl.load(table_row + gl.maximum(gl.minimum(lo + 1, hi - 1), 0))
    # The code bytes and the key-side scales go through shared memory, two tiles' worth: the next tile's are
    # copied (cp.async) while this one is computed, so the operand loads wait on shared memory, not on L2 or HBM.
    # NOTE (H200, h200-decode-s16): keys alone gave half of the gain of keys and values.
    GJ: gl.constexpr = G // NV
    keys = gl.allocate_shared_memory(gl.uint8, [2, GJ, NV * KW], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    values = gl.allocate_shared_memory(gl.uint8, [2, D, GJ], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    SR: gl.constexpr = _pow2_at_least(OFF_VCS - OFF_KCS) // 256  # key-side scale bytes, padded, in rows of 256
    key_scales = gl.allocate_shared_memory(gl.uint8, [2, SR, 256], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    _stage_tile(keys.index(0), values.index(0), key_scales.index(0),
                pages_ptr + (next_page.to(gl.int64) * HKV + h) * NBYTES, lo < hi, D, GJ, NV * KW, OFF_V, OFF_KCS,
                OFF_VCS)  # fmt: skip
    if PDL:  # started while the rotation before it runs (a programmatic dependent): q, its output, from here on
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0 $1", "=r,r", [p0], dtype=gl.int32, is_pure=False,
                                  pack=1)  # fmt: skip
        q_parts = _q_parts(q_rows, stride_qh, scale * LOG2E, GROUP, NK, KW)
    for tile in range(lo, hi):
        stage = (tile - lo) % 2
        page = next_page.to(gl.int64)
        next_page = after_next
        after_next = gl.load(table_row + gl.minimum(tile + 2, hi - 1))
        async_copy.wait_group(0)  # this tile's staged bytes (copied during the previous tile) are in
        gl.thread_barrier()  # every lane's copies are; every lane is done reading the other stage
        next_record = pages_ptr + (next_page.to(gl.int64) * HKV + h) * NBYTES
        _stage_tile(keys.index(1 - stage), values.index(1 - stage), key_scales.index(1 - stage), next_record,
                    tile + 1 < hi, D, GJ, NV * KW, OFF_V, OFF_KCS, OFF_VCS)  # fmt: skip
        _prefetch_l2(next_record + OFF_VCS, NBYTES - OFF_VCS)  # the value-side scales: the rest is staged
        m, l, acc = _attend_tile(
            q_parts, rows < GROUP, p0, m, l, acc, pages_ptr + (page * HKV + h) * NBYTES, keys.index(stage),
            values.index(stage), key_scales.index(stage), tile,
            window, G, D, KB, VB, N, V_ORDER, K_ORDER, OFF_KCS, OFF_KCZ, OFF_KTS, OFF_VCS, OFF_VTS, OFF_VTZ,
        )  # fmt: skip
    async_copy.wait_group(0)  # nothing may land in shared memory after the program ends

    # Partials: acc [T, HQ, nsplit+1, D], (max, sum) [T, HQ, nsplit+1, 2].
    part = (row * (HKV * GROUP) + h * GROUP + rows) * (nsplit + 1) + split
    gl.store(part_ml_ptr + part * 2, m, mask=rows < GROUP)
    gl.store(part_ml_ptr + part * 2 + 1, l, mask=rows < GROUP)
    heads = gl.arange(0, N, layout=gl.SliceLayout(0, MMA))
    part_t = (row * (HKV * GROUP) + h * GROUP + heads) * (nsplit + 1) + split
    channels = gl.arange(0, D, layout=gl.SliceLayout(1, MMA))
    gl.store(part_acc_ptr + part_t[None, :] * D + channels[:, None], acc, mask=(heads < GROUP)[None, :])


def supports(preset, group: int, head_dim_k: int, head_dim_v: int) -> bool:
    """Whether this kernel serves decode for the configuration (else ``paged_attention`` does): the mma
    operands need >= 32 key bytes per token (k_width 8) and >= 16 tokens per value field (one k-block)."""
    key_bytes = head_dim_k * preset.key_bits // 8
    tokens_per_field = preset.tile_size * preset.value_bits // 8
    return (head_dim_k == head_dim_v and head_dim_k in (64, 128, 256) and group <= 16
            and preset.key_bits in (2, 4) and preset.value_bits in (2, 4) and key_bytes >= 32
            and tokens_per_field >= 16)  # fmt: skip


MOST_SPLITS = 128  # the partials' and the combine's cost grows with the splits; batch 1 at 128K wants ~114
_RESIDENT: dict[tuple, int] = {}  # programs an SM holds, per compiled specialization
# A decode step's kernel starts during the rotation before it where a program takes at most this many tiles.
# NOTE (H200, benchmarks/results/h200-s25/next, op ms, package / this edge alone / package, CUDA graphs): programs
# of 1-2 tiles gained ~1 us: B1/2K 0.0124 / 0.0112 / 0.0122, B1/8K 0.0142 / 0.0131 / 0.0141, B1/32K (2 tiles)
# 0.0229 / 0.0219 / 0.0231, B8/2K 0.0176 / 0.0168 / 0.0176; longer ones lost 1.5-3 us: B8/8K (4 tiles) 0.0338 /
# 0.0353 / 0.0335, B8/32K (16) 0.0864 / 0.0894 / 0.0867, B32/8K (16) 0.0883 / 0.0909 / 0.0890, B128/2K (15)
# 0.0922 / 0.0941 / 0.0924. At 3 tiles a program (h200-s25/most, this limit 2 / 4 / 2) nothing gained: B4/12K
# 0.0269 / 0.0269 / 0.0268, B8/6K 0.0270 / 0.0282 / 0.0270, B16/3K 0.0283 / 0.0288 / 0.0285. Why long programs lose
# is not known (an untested guess: programs waiting in griddepcontrol.wait hold SM slots the rotation's need).
PDL_MOST_TILES = 2


def _launch_arguments(q_rot, pages, page_table, slots, start_pos, query_start_loc, part_acc, part_ml, preset,
                      scale: float, window: int, num_splits: int, hkv: int, num_slots: int, keep_first_tile: bool,
                      pdl: bool = False) -> tuple[tuple, dict]:  # fmt: skip
    """The kernel's positional arguments, constexprs and launch options (a launch and a compile-only warm-up
    share them). ``pdl``: launched as a programmatic dependent of the kernel before it (``starts_during_rotation``).
    """
    d = q_rot.shape[2]
    layout = preset.layout(d, d)
    max_tiles = page_table.shape[1]
    args = (q_rot, pages, page_table, slots, start_pos, query_start_loc, part_acc, part_ml, float(scale), int(window),
            num_slots, max_tiles, tiles_per_split(max_tiles, num_splits), num_splits, q_rot.stride(0),
            q_rot.stride(1))  # fmt: skip
    constants = {
        "HKV": hkv, "GROUP": q_rot.shape[1] // hkv, "E": 2 if keep_first_tile else 1, "G": preset.tile_size, "D": d,
        "KB": preset.key_bits, "VB": preset.value_bits, "NBYTES": layout.nbytes, "OFF_V": layout.v_codes,
        "OFF_KCS": layout.k_chan_scale, "OFF_KCZ": layout.k_chan_zero, "OFF_KTS": layout.k_tok_scale,
        "OFF_VCS": layout.v_chan_scale, "OFF_VTS": layout.v_tok_scale, "OFF_VTZ": layout.v_tok_zero,
        "PDL": pdl, "launch_pdl": pdl, "num_warps": 1,
    }  # fmt: skip
    return args, constants


def decode_splits(q, pages, page_table, slots, start_pos, query_start_loc, preset, hkv: int, num_slots: int,
                  keep_first_tile: bool) -> int:  # fmt: skip
    """The splits per (sequence, KV head) for a decode step (``tile_math.splits_by_waves``), from how many of
    this specialization's programs an SM holds: compiled (not launched) at its first use to read that, since
    it follows the preset's staging buffers and the registers ptxas gave (240 and 26 KB at k4v2_g128 D 128:
    8 per SM; 168 and 17 KB at k4v4_g128 D 64: 12). q [T, Hq, D]: rotated or not (its shape is read: the kernel
    takes it rotated, in fp32)."""
    # Keyed by the constexprs; variants Triton also specializes (16-byte alignment of pointers and strides, one
    # slot, a programmatic dependent) share the first one's count: nearly the same code.
    key = (q.device, preset, hkv, q.shape[1], q.shape[2], keep_first_tile)
    if key not in _RESIDENT:  # q and the partials as the launch's fresh buffers (the partials as dtypes: aligned)
        q_rot = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        args, constants = _launch_arguments(q_rot, pages, page_table, slots, start_pos, query_start_loc,
                                            torch.float32, torch.float32, preset, 1.0, 0, 1, hkv, num_slots,
                                            keep_first_tile)  # fmt: skip
        compiled = _decode_attention_kernel.warmup(*args, grid=(1, 1, 1), **constants)
        _RESIDENT[key] = resident_programs(compiled, q.device)
    resident = _RESIDENT[key] * multiprocessors(q.device)
    return splits_by_waves(slots.numel() * hkv, quantizable_tiles(page_table.shape[1]), resident, MOST_SPLITS)


def starts_during_rotation(device: torch.device, max_tiles: int, num_splits: int) -> bool:
    """Whether a decode step's launch, right after the rotation of its q (``rotate.rotate_rows`` with
    ``early_dependents``), is that launch's programmatic dependent: on Hopper and later, where its programs are
    short (``PDL_MOST_TILES``). It then reads its sequences' metadata and copies its first tile while the rotation
    runs, and waits for it only before reading q."""
    return (torch.cuda.get_device_capability(device)[0] >= 9
            and tiles_per_split(max_tiles, num_splits) <= PDL_MOST_TILES)  # fmt: skip


def tiles_per_split(max_tiles: int, num_splits: int) -> int:
    """The tiles each of ``num_splits`` splits takes: the splits share the tiles that can be complete (the new
    token's position is below the capacity, so its tile, the last one at most, is not one of them)."""
    return max(1, -(-quantizable_tiles(max_tiles) // num_splits))


def quantizable_tiles(max_tiles: int) -> int:
    """The complete (quantized) tiles a decode step can attend to in a page table of ``max_tiles`` entries: all
    but the last, which holds the new token at the latest. NOTE: splitting the table's full width left one split
    of a single tile wherever a context fills the table (B8/32K: 15 programs of 17 tiles and one of 1, where 16
    of 16 do)."""
    return max(0, max_tiles - 1)


def decode_attention(q_rot, pages, page_table, slots, start_pos, query_start_loc, part_acc, part_ml, preset,
                     scale: float, window: int, num_splits: int, hkv: int, num_slots: int, keep_first_tile: bool,
                     pdl: bool = False, **launch) -> None:  # fmt: skip
    """Launch the kernel for the quantized splits 0..num_splits-1 of one query token per sequence;
    it writes those splits of ``paged_attention``'s partials ``part_acc`` [T, Hq, S+1, D], ``part_ml``.
    q_rot [T, Hq, D] fp32, rotated. ``pdl``: as ``_launch_arguments``. Validation is the op's."""
    args, constants = _launch_arguments(q_rot, pages, page_table, slots, start_pos, query_start_loc, part_acc,
                                        part_ml, preset, scale, window, num_splits, hkv, num_slots, keep_first_tile,
                                        pdl)  # fmt: skip
    _decode_attention_kernel[(slots.numel(), hkv, num_splits)](*args, **constants, **launch)
