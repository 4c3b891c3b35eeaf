"""Decode attention over the quantized tiles, in Gluon: codes go from their bytes straight into the
tensor-core operand registers.

Grid: (sequence, KV head, split x part of a tile); one warp per program, one query token per sequence, the GROUP
query heads of the KV head as the 8 or 16 columns of mma.sync (m16n8k16) products whose rows are the tile's tokens
or channels. Each program writes the same unnormalised partial (acc, max, sum) as ``paged_attention``'s
quantized splits: ``combine_splits`` merges them, or in a small step the exact split's programs
(``paged_attention.merge_in_exact_split``).

Why a second kernel: the Triton kernel (``paged_attention``) moves every unpacked operand through shared
memory (Triton converts a tl.dot operand's layout there, with barriers: ~58 BAR and ~170 LDS/STS per warp
and tile) and stays near 1.2-1.3 TB/s whatever else was tried (benchmarks/NOTES.md). Gluon lets a load
take the operand's register layout itself, so nothing is converted through shared memory. The code bytes do
pass through it, once, by cp.async, with the key-side scale vectors: the next tile's are copied while this one is
computed (two stages), and are read from there in the operand layouts below:
- keys: the scores are computed transposed, [GJ, N] = codes [GJ, KW] x q^T [KW, N]: the tokens fill the mma's
  rows (all real) and the heads its 8 or 16 columns. A key byte holds NK = 8 / KB channels; field i of the
  [GJ tokens, KW bytes] byte block is the A operand for q's channels NK * b + i. The block is loaded in the
  operand layout with k_width 8 (a thread holds 8 consecutive bytes of a token: 64-bit loads).
- values: the output is computed transposed, [D, N] = codes^T [D, GJ] x p^T [GJ, N] (N = 8 or 16 heads), so
  that the D channels fill the mma's rows and the heads its 8 or 16 columns (not 16 rows of which GROUP are
  real). A value byte holds NV = 8 / VB consecutive tokens; field f of the [D, GJ bytes] block is the A
  operand for the tokens NV * j + f. The probabilities [GJ, N] go from the scores' accumulator layout into the
  B operand's (k_width 2) by one movmatrix (an 8x8 transpose in registers) per 8x8 block. The A operand at
  k_width 2 gives a thread columns 2t, 2t + 1, 2t + 8, ...; those columns are mapped to bytes (``_token_of``)
  so that a thread's bytes of a channel are consecutive in memory (wide loads), and the score rows (the key
  block's tokens) are taken in the same order.
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
Then (h200-s26/tform) the scores transposed (above; they had the heads as the rows of 16, GROUP of them real):
HMMA 192 -> 128 and 2,298 -> 2,144 instructions per tile, 240 -> 224 registers; B8/32K kernels 0.0784 -> 0.0722 ms,
B8/128K 0.2953 -> 0.2676 (3.4 TB/s), k4v4_g128 B8/32K 0.1190 -> 0.1051.
Where its programs are short, a decode step's launch starts during the rotation of q before it (a programmatic
dependent: ``starts_during_rotation``): it reads the metadata and copies its first tile, then waits
(griddepcontrol.wait) before it reads q. In a small step the launch after it (the exact split, which then merges
the partials: ``paged_attention.merge_in_exact_split``) is its programmatic dependent in turn, let start once every
program has read q (or, without tiles, waited for the rotation and exited); each program with tiles stores its
partial rotated back (``ROTATE_BACK``, ``_rotated_back``), so that the merge only weighs and sums (one without tiles
stores nothing: the merge reads the live splits' partials only, and the exact split stores its own from the first
empty split's index on). Where programs are few, each tile is
taken by two programs of half its tokens (``tile_parts``). Where they leave half the GPU free
(``leaves_half_the_slots``) and the op takes q as it came (``kvarn::decode_attention``, ``chunk_attention``; not
``attend_and_append``, which rotates q, k and v in one launch for the append too) the step has no rotation launch:
these programs rotate q themselves (``ROTATE_Q``, ``_rotated_q_parts``) and the exact split, let start at once
(``EARLY_DEPENDENTS``), rotates its own.
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
def _bytes_in_order(layout, GJ, dim=1):
    """``layout`` (a linear layout of a 2-D tensor) with its bases along ``dim`` (of size GJ) taken through
    ``_token_bits``: the layout in which a load of a [D, GJ bytes] value block (dim 1) or a [GJ, KW bytes] key
    block (dim 0) gives each thread the bytes that its operand columns or rows read."""

    def bases(vectors):
        return [[_token_bits(x, GJ) if d == dim else x for d, x in enumerate(v)] for v in vectors]

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


@gluon.constexpr_function
def _byte_order_bit(j):
    """The bit of b that holds bit j of ``_byte_order(b)``."""
    return j ^ 1 if j < 2 else j


@gluon.jit
def _q_parts(q_rows, stride_qh, scale, GROUP: gl.constexpr, NK: gl.constexpr, KW: gl.constexpr, N: gl.constexpr):
    """q by key field, transposed, the scores' B operands: q_parts[i][b, n] = q[n, NK * byte_order(b) + i] * scale
    ([KW, N] fp32, the log2 domain; ``_field`` "02" orders a key's bytes so), column n = the group's head n from
    q_rows on (0 past GROUP); q fp32 (rotated), or fp16/bf16 (``_rotated_q_parts``)."""
    kq = _byte_order(gl.arange(0, KW, layout=gl.SliceLayout(1, B8)))
    nq = gl.arange(0, N, layout=gl.SliceLayout(0, B8))
    q_parts = ()
    for i in gl.static_range(NK):
        part = gl.load(q_rows + nq[None, :] * stride_qh + NK * kq[:, None] + i, mask=(nq[None, :] < GROUP), other=0.0)
        q_parts = q_parts + (part.to(gl.float32) * scale,)
    return q_parts


@gluon.jit
def _rotated_q_parts(q_rows, stride_qh, scale, GROUP: gl.constexpr, NK: gl.constexpr, KW: gl.constexpr,
                     N: gl.constexpr):  # fmt: skip
    """``_q_parts`` of q as it came (fp16/bf16), rotated in the B operands' own layout: one butterfly stage (a + b,
    a - b) per bit of the channel index NK * b' + i: its low log2(NK) bits (the field i) between the parts, the bits of
    b' between a thread's registers or lanes (``_butterfly``; a part's row b holds b' = ``_byte_order(b)``, so b'
    bits 0 and 1 are b bits 1 and 0). No shared memory, nothing loaded but q.
    NOTE why (H200, benchmarks/results/h200-s30, op ms): q rotated in the accumulator layout, then moved into the
    operands' by layout conversions through shared memory, cost each program 1.1 us of the step's path (call3: B1/2K
    0.0082 against 0.0071 with q read unrotated, a wrong-output probe); this form, side by side with that one
    (final/ab.txt): B1/2K 0.0081 -> 0.0079 (cuDNN 0.0081), B2/2K 0.0090 -> 0.0086."""
    D: gl.constexpr = NK * KW
    parts = _q_parts(q_rows, stride_qh, scale * D**-0.5, GROUP, NK, KW, N)
    if NK == 2:  # channel bit 0: the two fields
        parts = (parts[0] + parts[1], parts[0] - parts[1])
    elif NK == 4:  # channel bit 0 (fields 2c and 2c + 1), then bit 1 (fields e and 2 + e)
        p0, p1, p2, p3 = parts[0] + parts[1], parts[0] - parts[1], parts[2] + parts[3], parts[2] - parts[3]
        parts = (p0 + p2, p1 + p3, p0 - p2, p1 - p3)
    rows = gl.arange(0, KW, layout=gl.SliceLayout(1, B8))[:, None]
    for j in gl.static_range(KW.bit_length() - 1):  # bit j of b'
        rotated = ()
        for i in gl.static_range(NK):
            rotated = rotated + (_butterfly(parts[i], rows, _byte_order_bit(j),
                                            _lane_of_row_bit(gl.to_linear_layout(B8, [KW, N]), _byte_order_bit(j)),
                                            B8),)  # fmt: skip
        parts = rotated
    return parts


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
def _relabelled(x, ORDER: gl.constexpr, TARGET: gl.constexpr, FIRST_DIM: gl.constexpr = False):
    """x [..., W] as a ``_bytes_in_order`` / ``_fields_layout`` load leaves it (last dim indexed by entry j) ->
    the same registers indexed by element c, j = _entry_bits(c, W, ORDER), in layout TARGET: index bits
    relabelled, no data moves. ``FIRST_DIM``: x is [W, C], its first dim indexed by entry j."""
    if FIRST_DIM:
        x = gl.permute(x, (1, 0))
    SPLIT: gl.constexpr = _index_bits(x.shape, ORDER)[0]
    PERM: gl.constexpr = _index_bits(x.shape, ORDER)[1]
    x = gl.reshape(gl.permute(gl.reshape(x, SPLIT), PERM.value), x.shape)  # .value: permute wants a plain list
    if FIRST_DIM:
        x = gl.permute(x, (1, 0))
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
def _stage_bytes(smem, src, live, ROWS: gl.constexpr, ROW: gl.constexpr, VALID: gl.constexpr = 0,
                 SRC_ROW: gl.constexpr = 0):  # fmt: skip
    """Start copying [ROWS, ROW] bytes at ``src`` (rows SRC_ROW bytes apart; ROW if 0) into ``smem`` if ``live``
    (cp.async, 16 bytes a piece; the caller commits the group); only the first VALID bytes (a multiple of 16) if
    VALID > 0."""
    LAYOUT: gl.constexpr = _stage_layout(ROW)
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, LAYOUT))
    c = gl.arange(0, ROW, layout=gl.SliceLayout(0, LAYOUT))
    offsets = r[:, None] * ROW + c[None, :]
    if SRC_ROW == 0 or SRC_ROW == ROW:  # the same offsets (computed once: one address per piece)
        source = src + offsets
    else:
        source = src + r[:, None] * SRC_ROW + c[None, :]
    if VALID > 0:
        async_copy.async_copy_global_to_shared(smem, source, mask=live & (offsets < VALID))
    else:
        async_copy.async_copy_global_to_shared(smem, source, mask=live)


@gluon.constexpr_function
def _scale_rows(nbytes):
    """Rows of 256 bytes that ``nbytes`` of staged scales take."""
    return -(-nbytes // 256)


@gluon.constexpr_function
def _token_scales_row(channel_bytes, token_bytes):
    """The staged key-side scales' row (of 256 bytes) at which the token scales start: past the channel scales and
    zeros, at a multiple of the rows they take (a shared-memory slice starts at a multiple of its length)."""
    rows = _scale_rows(token_bytes)
    return -(-_scale_rows(channel_bytes) // rows) * rows


@gluon.jit
def _stage_tile(keys, values, key_scales, record, part, live, D: gl.constexpr, GJ: gl.constexpr, NV: gl.constexpr,
                KEY_ROW: gl.constexpr, PARTS: gl.constexpr, OFF_V: gl.constexpr, OFF_KCS: gl.constexpr,
                OFF_KTS: gl.constexpr):  # fmt: skip
    """Start copying part ``part`` (of PARTS: tokens part * GS .. part * GS + GS - 1, GS = GJ * NV) of a tile's code
    bytes into shared memory: keys [GJ, KEY_ROW] (row j: tokens NV * j .. NV * j + NV - 1 of the part), values
    [D, GJ] (of each channel's PARTS * GJ bytes), and the key-side scale vectors into key_scales [SR, 256]: the
    channel scales and zeros (bytes OFF_KCS..OFF_KTS) from row 0, the part's token scales from row
    ``_token_scales_row``. They arrive while the previous tile is computed."""
    _stage_bytes(keys, record + part * (GJ * KEY_ROW), live, GJ, KEY_ROW)
    _stage_bytes(values, record + OFF_V + part * GJ, live, D, GJ, SRC_ROW=PARTS * GJ)
    CHANNEL_BYTES: gl.constexpr = OFF_KTS - OFF_KCS
    TOKEN_BYTES: gl.constexpr = 2 * GJ * NV  # fp16, one for each of the part's tokens
    CHANNEL_ROWS: gl.constexpr = _scale_rows(CHANNEL_BYTES)
    TOKEN_ROWS: gl.constexpr = _scale_rows(TOKEN_BYTES)
    # whole tiles whose token scales follow the channel scales and zeros at a row edge: one copy of both (measured,
    # benchmarks/results/h200-s30/call1: B8/32K op 0.0796 -> 0.0785 ms against two)
    if PARTS == 1 and _token_scales_row(CHANNEL_BYTES, TOKEN_BYTES) * 256 == CHANNEL_BYTES:
        _stage_bytes(key_scales, record + OFF_KCS, live, key_scales.shape[0], 256, CHANNEL_BYTES + TOKEN_BYTES)
    else:
        _stage_bytes(key_scales.slice(0, CHANNEL_ROWS), record + OFF_KCS, live, CHANNEL_ROWS, 256, CHANNEL_BYTES)
        _stage_bytes(key_scales.slice(_token_scales_row(CHANNEL_BYTES, TOKEN_BYTES), TOKEN_ROWS),
                     record + OFF_KTS + part * TOKEN_BYTES, live, TOKEN_ROWS, 256, TOKEN_BYTES)  # fmt: skip
    async_copy.commit_group()


@gluon.jit
def _attend_tile(
    q_parts, real_heads, q_pos, m, l, acc, record, token_record, keys, values, key_scales, first, window,
    G: gl.constexpr, D: gl.constexpr, KB: gl.constexpr, VB: gl.constexpr, N: gl.constexpr, V_ORDER: gl.constexpr,
    K_ORDER: gl.constexpr, KTS: gl.constexpr,
    OFF_KCS: gl.constexpr, OFF_KCZ: gl.constexpr, OFF_VCS: gl.constexpr, OFF_VTS: gl.constexpr, OFF_VTZ: gl.constexpr,
):  # fmt: skip
    """The online softmax over G tokens of a tile (all of it, or a part: ``_stage_tile``), the first at position
    ``first``: the staged keys, values and key-side scales; the value-side scales from ``record`` (the tile's, by
    channel) and ``token_record`` (its offsets of the part's tokens: the record moved by the tokens before the part).
    KTS: the staged token scales' first fp16 entry."""
    NK: gl.constexpr = 8 // KB
    NV: gl.constexpr = 8 // VB
    KW: gl.constexpr = D // NK  # key bytes per token
    GJ: gl.constexpr = G // NV  # value bytes per channel = tokens per group

    # q scaled by the key channel scales, by field (B operand), and q . k_chan_zero per head.
    q_zero = gl.zeros([N], gl.float32, layout=gl.SliceLayout(0, B8))
    q_scaled = ()
    # the key-side scale vectors from the staged copy: [D] channel scales, [D] zeros, [G] token scales (fp16)
    SCALES: gl.constexpr = key_scales.shape[0] * key_scales.shape[1] // 2
    ks = key_scales._reinterpret(gl.float16, [SCALES], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    k_scale = _load_fields(ks.slice(0, D), gl.SliceLayout(1, B8), KW, NK, "byte pairs", True)
    k_zero = _load_fields(ks.slice((OFF_KCZ - OFF_KCS) // 2, D), gl.SliceLayout(1, B8), KW, NK, "byte pairs", True)
    for i in gl.static_range(NK):
        qs = (q_parts[i] * k_scale[i][:, None]).to(gl.float16)
        q_scaled = q_scaled + (qs,)
        if _small_bias(KB, i):  # the mma adds bias * sum(qs): taken off with q . k_chan_zero
            q_zero += gl.sum(q_parts[i] * k_zero[i][:, None] - _bias(KB, i) * qs.to(gl.float32), axis=0)
        else:
            q_zero += gl.sum(q_parts[i] * k_zero[i][:, None], axis=0)
    q_zero = gl.convert_layout(q_zero, gl.SliceLayout(0, MMA))

    # Scores of token group f (tokens NV * j + f), transposed: [GJ tokens, N heads], the tokens as the mma's rows
    # (all real) and the heads as its 8 or 16 columns; rows in the value operand's column order (row k is token
    # NV * _token_of(k) + f, as the value operand's column k).
    token_s = NV * _token_of(gl.arange(0, GJ, layout=gl.SliceLayout(1, MMA)), GJ)
    k_tok = _load_fields(ks.slice(KTS, G), gl.SliceLayout(1, MMA), GJ, NV, "tokens", True)
    scores = ()
    top = gl.full([GJ, N], float("-inf"), gl.float32, layout=MMA)  # the groups' element-wise max
    for f in gl.static_range(NV):
        # [GJ, KW] key bytes of tokens NV * j + f from the staged tile, rows in token order, relabelled to the
        # operand's row order
        key_bytes = _relabelled(keys.slice(f * KW, KW, dim=1).load(K_ORDER), "tokens", A8, FIRST_DIM=True)
        s = gl.zeros([GJ, N], gl.float32, layout=MMA)
        for i in gl.static_range(NK):
            s = mma_v2(_field(key_bytes, KB, i, _small_bias(KB, i), "02"), q_scaled[i], s)
        s = (s + q_zero[None, :]) * k_tok[f][:, None]
        s = gl.where(real_heads[None, :], s, float("-inf"))
        if window > 0:
            s = gl.where(first + token_s[:, None] + f > q_pos - window, s, float("-inf"))
        scores = scores + (s,)
        top = gl.maximum(top, s)
    m_new = gl.maximum(m, gl.max(top, axis=0))

    # The value bytes once ([D, GJ], loaded in token order, relabelled to the operand's column order).
    value_bytes = _relabelled(values.load(V_ORDER), "tokens", A2)

    # Online softmax over the tile, then out += v_chan * (codes^T @ (p * v_tok) + p . v_zero), transposed:
    # [D, N] = [D, GJ] x [GJ, N], the D channels as the mma's rows. The probabilities [GJ, N] are the scores'
    # layout; ``_as_value_operand`` moves them into the B operand's by 8x8 transposes in registers.
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = _exp2(m - m_safe)
    # Sums over the tokens (of p, of p . v_zero): once per tile from the groups' element-wise sums where a
    # group's block takes <= 8 registers a thread, else per group. NOTE (sm_90 SASS, test_kernels_compile --sass):
    # k4v2_g128 D 128, 4 groups of 32 tokens: 2,144 instructions per tile (per group: 2,198, 252 registers);
    # k4v4_g128 D 64, 2 groups of 64: 186 registers (one program per SM fewer) against 168 per group.
    ONCE: gl.constexpr = GJ * N <= 256
    p_sum = _token_sums(GJ, N, ONCE)
    p_zero = _token_sums(GJ, N, ONCE)
    pv = gl.zeros([D, N], gl.float32, layout=MMA)
    v_zero = _load_fields(_fp16(token_record + OFF_VTZ), gl.SliceLayout(1, MMA), GJ, NV, "tokens")
    v_tok = _load_fields(_fp16(token_record + OFF_VTS), gl.SliceLayout(1, MMA), GJ, NV, "tokens")
    for f in gl.static_range(NV):
        p = _exp2(scores[f] - m_safe[None, :])
        p_sum = _add_over_tokens(p_sum, p, ONCE)
        # codes read biased where the bias is small: the mma's bias * sum(p * v_tok) is taken off with p . v_zero
        pt = (p * v_tok[f][:, None]).to(gl.float16)
        if _small_bias(VB, f):
            p_zero = _add_over_tokens(p_zero, p * v_zero[f][:, None] - _bias(VB, f) * pt.to(gl.float32), ONCE)
        else:
            p_zero = _add_over_tokens(p_zero, p * v_zero[f][:, None], ONCE)
        pv = mma_v2(_field(value_bytes, VB, f, _small_bias(VB, f), "01"), _as_value_operand(pt), pv)
    l = l * alpha + _over_tokens(p_sum, ONCE)
    v_chan = gl.load(_fp16(record + OFF_VCS) + gl.arange(0, D, layout=gl.SliceLayout(1, MMA))).to(gl.float32)
    acc = acc * alpha[None, :] + (pv + _over_tokens(p_zero, ONCE)[None, :]) * v_chan[:, None]
    return m_new, l, acc


@gluon.jit
def _token_sums(GJ: gl.constexpr, N: gl.constexpr, ONCE: gl.constexpr):
    """Zero sums over a tile's tokens per head: [GJ, N] element-wise partial sums (``ONCE``), or [N]."""
    if ONCE:
        sums = gl.zeros([GJ, N], gl.float32, layout=MMA)
    else:
        sums = gl.zeros([N], gl.float32, layout=gl.SliceLayout(0, MMA))
    return sums


@gluon.jit
def _add_over_tokens(sums, x, ONCE: gl.constexpr):
    """``_token_sums`` plus x [GJ, N] (a group's values)."""
    if ONCE:
        sums = sums + x
    else:
        sums = sums + gl.sum(x, axis=0)
    return sums


@gluon.jit
def _over_tokens(sums, ONCE: gl.constexpr):
    """``_token_sums`` as [N]: the sum over the tokens per head."""
    if ONCE:
        sums = gl.sum(sums, axis=0)
    return sums


@gluon.jit
def _as_value_operand(p):
    """[GJ, N] fp16 in the scores' accumulator layout -> the same values as the value product's B operand
    (k_width 2). Each 8x8 block is transposed in registers (movmatrix: a lane's row r, columns 2t and 2t + 1 of a
    block come back as its column r, rows 2t and 2t + 1), which leaves every value where the B operand holds it
    under the other index; the index bits are then relabelled (no data moves)."""
    GJ: gl.constexpr = p.shape[0]
    N: gl.constexpr = p.shape[1]
    t = gl.inline_asm_elementwise("movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;", "=r,r", [p], dtype=gl.float16,
                                  is_pure=True, pack=2)  # fmt: skip
    # t[8a + b, 8c + n] holds p[8a + n, 8c + b]
    t = gl.reshape(gl.permute(gl.reshape(t, [GJ // 8, 8, N // 8, 8]), (0, 3, 2, 1)), [GJ, N])
    return gl.convert_layout(t, B2, assert_trivial=True)


@gluon.constexpr_function
def _lane_of_row_bit(layout, bit):
    """The lane-id bit that holds bit ``bit`` of the row index in ``layout`` (a linear layout of a 2-D tensor: the
    mma accumulator's, or a B operand's), or -1 where a register holds it."""
    for j, base in enumerate(layout.lane_bases):
        if base == [1 << bit, 0]:
            return j
    return -1


@gluon.constexpr_function
def _shuffle_xor_ptx(mask):
    """PTX: the value of the lane whose id differs from this lane's in ``mask`` (every lane of the warp takes part)."""
    return f"shfl.sync.bfly.b32 $0, $1, {mask}, 0x1f, -1;"


@gluon.jit
def _rotated_back(acc, ACC_LAYOUT: gl.constexpr):
    """acc [D, N] (the output transposed, in the mma accumulator layout MMA) with each column rotated back,
    H_D @ acc (H_D the normalised Sylvester-Hadamard matrix, ``reference.rotate``): one butterfly stage (a + b,
    a - b) per bit of the row index (``_butterfly``). ACC_LAYOUT: MMA as a linear layout of [D, N].
    NOTE why (H200, benchmarks/results/h200-s28): in a small decode step, the merge's own rotation back of the merged
    rows was on the step's path after the wait (butterflies between 4 warps: 1.7 us of the B1/2K op's 10.2; by two
    small dots, session 28's first form: 1.0 us). Here each program adds 368 SASS instructions (D 128: 96 shuffles,
    no shared memory; 252 registers, still 8 programs per SM) and the merge only weighs and sums (call6/ab.txt, op
    ms, the dots -> this): B1/2K 0.0096 -> 0.0091, B8/2K 0.0144 -> 0.0143, B8/32K 0.0784 -> 0.0789 (noise: 0.0784-
    0.0810 across the session's runs)."""
    D: gl.constexpr = acc.shape[0]
    rows = gl.arange(0, D, layout=gl.SliceLayout(1, MMA))[:, None]
    for b in gl.static_range(D.bit_length() - 1):
        acc = _butterfly(acc, rows, b, _lane_of_row_bit(ACC_LAYOUT, b), MMA)
    return acc * (D**-0.5)


@gluon.jit
def _butterfly(acc, rows, BIT: gl.constexpr, LANE: gl.constexpr, LAYOUT: gl.constexpr):
    """(a + b, a - b) over the pairs of rows of acc [D, N] (in LAYOUT; rows: its row indices, [D, 1]) that differ in
    row bit BIT: between lanes (a shuffle) where lane-id bit LANE holds that row bit, else (LANE -1) between a
    thread's own registers."""
    D: gl.constexpr = acc.shape[0]
    N: gl.constexpr = acc.shape[1]
    if LANE >= 0:  # the other row of the pair sits in the lane 2^LANE away, in the same register
        other = gl.inline_asm_elementwise(_shuffle_xor_ptx(1 << LANE), "=f,f", [acc], dtype=gl.float32, is_pure=True,
                                          pack=1)  # fmt: skip
        acc = other + gl.where(((rows >> BIT) & 1) == 0, 1.0, -1.0) * acc  # a + b, or a - b on the pair's second
    else:  # the pair is two registers of this thread: sums over a register axis, no data moves (not split / join,
        # which a layout holding each value twice, a B operand's of 32 rows, does not pass)
        PAIRS: gl.constexpr = [D >> (BIT + 1), 2, 1 << BIT, N]
        first = (((rows >> BIT) & 1) == 0) & gl.full([D, N], 1, gl.int1, layout=LAYOUT)  # the pair's first rows
        total = gl.expand_dims(gl.sum(gl.reshape(acc, PAIRS), axis=1), 1)  # a + b
        diff = gl.expand_dims(gl.sum(gl.reshape(gl.where(first, acc, -acc), PAIRS), axis=1), 1)  # a - b
        x = gl.where(gl.reshape(first, PAIRS), total, diff)
        acc = gl.convert_layout(gl.reshape(x, [D, N]), LAYOUT, assert_trivial=True)
    return acc


@gluon.jit(do_not_specialize=["window", "max_tiles", "num_splits", "nparts"],
           do_not_specialize_on_alignment=["slots_ptr", "start_pos_ptr", "qsl_ptr"])  # fmt: skip
def _decode_attention_kernel(
    q_ptr, pages_ptr, page_table_ptr, slots_ptr, start_pos_ptr, qsl_ptr, part_acc_ptr, part_ml_ptr,
    scale, window, num_slots, max_tiles, num_splits, nparts, stride_qt, stride_qh,
    HKV: gl.constexpr, GROUP: gl.constexpr, E: gl.constexpr, G: gl.constexpr, D: gl.constexpr,
    KB: gl.constexpr, VB: gl.constexpr, NBYTES: gl.constexpr,
    OFF_V: gl.constexpr, OFF_KCS: gl.constexpr, OFF_KCZ: gl.constexpr, OFF_KTS: gl.constexpr,
    OFF_VCS: gl.constexpr, OFF_VTS: gl.constexpr, OFF_VTZ: gl.constexpr, PARTS: gl.constexpr, PDL: gl.constexpr,
    EARLY_DEPENDENTS: gl.constexpr, ROTATE_Q: gl.constexpr, ROTATE_BACK: gl.constexpr,
):  # fmt: skip
    b = gl.program_id(0)
    h = gl.program_id(1)
    if EARLY_DEPENDENTS == 1:  # the next launch (the exact split, a programmatic dependent, which reads nothing the
        # launch before this one writes) may start
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0 $1", "=r,r", [h], dtype=gl.int32,
                                  is_pure=False, pack=1)  # fmt: skip
    split = gl.program_id(2) // PARTS  # the split's tiles, each in PARTS parts of G / PARTS tokens: this program's
    part = gl.program_id(2) % PARTS
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
    N: gl.constexpr = 8 if GROUP <= 8 else 16  # the mma columns: the group's heads, padded
    GS: gl.constexpr = G // PARTS  # tokens of a tile this program takes
    GJ: gl.constexpr = GS // NV  # their value bytes per channel, key rows of NV tokens
    V_ORDER: gl.constexpr = _bytes_in_order(gl.to_linear_layout(A2, [D, GJ]), GJ)
    K_ORDER: gl.constexpr = _bytes_in_order(gl.to_linear_layout(A8, [GJ, KW]), GJ, 0)

    q_rows = q_ptr + row * stride_qt + h * GROUP * stride_qh
    if not PDL and not ROTATE_Q:
        q_parts = _q_parts(q_rows, stride_qh, scale * LOG2E, GROUP, NK, KW, N)

    heads = gl.arange(0, N, layout=gl.SliceLayout(0, MMA))
    m = gl.full([N], float("-inf"), gl.float32, layout=gl.SliceLayout(0, MMA))
    l = gl.zeros([N], gl.float32, layout=gl.SliceLayout(0, MMA))
    acc = gl.zeros([D, N], gl.float32, layout=MMA)  # the output, transposed
    lo, hi = quantized_tiles(split, num_splits, p0, p0, window, max_tiles, G, E)
    if ROTATE_BACK and lo >= hi:  # a merging step's exact part stores its own partials from the first empty split's
        # index on (it reads only the live ones: paged_attention's live_q), and runs beside this launch: no store here.
        if PDL:  # The exact part starts once every program here has read q (or exited) and then reads the rotation's
            # outputs itself: an exit must not come before the rotation has ended (all programs empty: a batch of
            # sequences with no complete tile).
            gl.inline_asm_elementwise("griddepcontrol.wait; // $0 $1", "=r,r", [p0], dtype=gl.int32, is_pure=False,
                                      pack=1)  # fmt: skip
        return
    # Page numbers are read two tiles ahead: the next tile's record is copied (and its value-side scales asked of
    # L2) while this one is computed; its number was read an iteration ago, so the copy waits for nothing.
    table_row = page_table_ptr + slot * max_tiles
    next_page = gl.load(table_row + gl.maximum(gl.minimum(lo, hi - 1), 0))
    after_next = gl.load(table_row + gl.maximum(gl.minimum(lo + 1, hi - 1), 0))
    # The code bytes and the key-side scales go through shared memory, two tiles' worth: the next tile's are
    # copied (cp.async) while this one is computed, so the operand loads wait on shared memory, not on L2 or HBM.
    # NOTE (H200, h200-decode-s16): keys alone gave half of the gain of keys and values.
    keys = gl.allocate_shared_memory(gl.uint8, [2, GJ, NV * KW], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    values = gl.allocate_shared_memory(gl.uint8, [2, D, GJ], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    # key-side scales: channel scales and zeros, then the part's token scales (``_stage_tile``), in rows of 256
    KTS_ROW: gl.constexpr = _token_scales_row(OFF_KTS - OFF_KCS, 2 * GS)
    SR: gl.constexpr = _pow2_at_least(256 * (KTS_ROW + _scale_rows(2 * GS))) // 256
    key_scales = gl.allocate_shared_memory(gl.uint8, [2, SR, 256], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    _stage_tile(keys.index(0), values.index(0), key_scales.index(0),
                pages_ptr + (next_page.to(gl.int64) * HKV + h) * NBYTES, part, lo < hi, D, GJ, NV, NV * KW, PARTS,
                OFF_V, OFF_KCS, OFF_KTS)  # fmt: skip
    if PDL:  # started while the rotation before it runs (a programmatic dependent): q, its output, from here on
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0 $1", "=r,r", [p0], dtype=gl.int32, is_pure=False,
                                  pack=1)  # fmt: skip
        q_parts = _q_parts(q_rows, stride_qh, scale * LOG2E, GROUP, NK, KW, N)
    if ROTATE_Q:  # q as it came, rotated while the first tile's bytes arrive
        q_parts = _rotated_q_parts(q_rows, stride_qh, scale * LOG2E, GROUP, NK, KW, N)
    if EARLY_DEPENDENTS == 2:  # the next launch (the exact split, a programmatic dependent) may start: q is read
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0 $1", "=r,r", [p0], dtype=gl.int32,
                                  is_pure=False, pack=1)  # fmt: skip
    for tile in range(lo, hi):
        stage = (tile - lo) % 2
        page = next_page.to(gl.int64)
        next_page = after_next
        after_next = gl.load(table_row + gl.minimum(tile + 2, hi - 1))
        async_copy.wait_group(0)  # this tile's staged bytes (copied during the previous tile) are in
        gl.thread_barrier()  # every lane's copies are; every lane is done reading the other stage
        next_record = pages_ptr + (next_page.to(gl.int64) * HKV + h) * NBYTES
        _stage_tile(keys.index(1 - stage), values.index(1 - stage), key_scales.index(1 - stage), next_record, part,
                    tile + 1 < hi, D, GJ, NV, NV * KW, PARTS, OFF_V, OFF_KCS, OFF_KTS)  # fmt: skip
        _prefetch_l2(next_record + OFF_VCS, NBYTES - OFF_VCS)  # the value-side scales: the rest is staged
        record = pages_ptr + (page * HKV + h) * NBYTES
        m, l, acc = _attend_tile(
            q_parts, heads < GROUP, p0, m, l, acc, record, record + part * (2 * GS), keys.index(stage),
            values.index(stage), key_scales.index(stage), tile * G + part * GS, window, GS, D, KB, VB, N, V_ORDER,
            K_ORDER, KTS_ROW * 128, OFF_KCS, OFF_KCZ, OFF_VCS, OFF_VTS, OFF_VTZ,
        )  # fmt: skip
    async_copy.wait_group(0)  # nothing may land in shared memory after the program ends
    if ROTATE_BACK:  # the partial in the output's space (the merge in the exact split then only weighs and sums)
        acc = _rotated_back(acc, gl.to_linear_layout(MMA, [D, N]))

    # Partials: acc [T, HQ, nparts, D], (max, sum) [T, HQ, nparts, 2]; this program's is partial program_id(2).
    partial = (row * (HKV * GROUP) + h * GROUP + heads) * nparts + gl.program_id(2)
    gl.store(part_ml_ptr + partial * 2, m, mask=heads < GROUP)
    gl.store(part_ml_ptr + partial * 2 + 1, l, mask=heads < GROUP)
    channels = gl.arange(0, D, layout=gl.SliceLayout(1, MMA))
    gl.store(part_acc_ptr + partial[None, :] * D + channels[:, None], acc, mask=(heads < GROUP)[None, :])


def supports(preset, group: int, head_dim_k: int, head_dim_v: int) -> bool:
    """Whether this kernel serves decode for the configuration (else ``paged_attention`` does): the mma
    operands need >= 32 key bytes per token (k_width 8) and >= 16 tokens per value field (one k-block)."""
    key_bytes = head_dim_k * preset.key_bits // 8
    tokens_per_field = preset.tile_size * preset.value_bits // 8
    return (head_dim_k == head_dim_v and head_dim_k in (64, 128, 256) and group <= 16
            and preset.key_bits in (2, 4) and preset.value_bits in (2, 4) and key_bytes >= 32
            and tokens_per_field >= 16)  # fmt: skip


# A decode step's splits per sequence at most (batch 1 and 2 reach it): with the exact part's few programs, its
# partials stay within MERGE_MOST_PARTS and merge in the exact part (no combine launch). NOTE (H100, op ms at batch 1,
# 64 / 128 splits, benchmarks/results/gpu-s44/h100-sweep): page tables 32K tokens wide, as a server's: 2K 0.0122 /
# 0.0145, 8K 0.0124 / 0.0148; 128K wide at 32K 0.0208 / 0.0230; tables as wide as the step needs: 32K 0.0209 /
# 0.0204, 128K 0.0580 / 0.0558 (128 before: the fitted tables' choice, ~114 at 128K on the H200, h200-s23).
MOST_SPLITS = 64
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
                      parts: int = 1, pdl: bool = False, early_dependents: str | None = None,
                      rotate_q: bool = False, rotate_back: bool = False,
                      nparts: int = 1) -> tuple[tuple, dict]:  # fmt: skip
    """The kernel's positional arguments, constexprs and launch options (a launch and a compile-only warm-up
    share them). ``nparts``: a row's partials in part_acc / part_ml (dim 2: these programs' and the exact part's).
    ``parts``: programs per tile of a split (``tile_parts``). ``pdl``: launched as a programmatic
    dependent of the kernel before it (``starts_during_rotation``). ``early_dependents``: the launch after it, a
    programmatic dependent, may start: "start" at once (it must read nothing the launch before this one writes),
    "q" once every program has read q (a program without tiles of a merging step: waited for the rotation, if
    ``pdl``, and exited). ``rotate_q``: q_rot is q as it came (fp16/bf16), each program rotates it
    (``_rotated_q_parts``; not with ``pdl``, whose wait is for a rotation launch).
    ``rotate_back``: each program rotates its partial acc back (out of the rotated space) before storing it.
    """
    assert not (pdl and rotate_q), "a kernel that rotates q itself waits for no rotation launch"
    d = q_rot.shape[2]
    layout = preset.layout(d, d)
    max_tiles = page_table.shape[1]
    args = (q_rot, pages, page_table, slots, start_pos, query_start_loc, part_acc, part_ml, float(scale), int(window),
            num_slots, max_tiles, num_splits, nparts, q_rot.stride(0),
            q_rot.stride(1))  # fmt: skip
    constants = {
        "HKV": hkv, "GROUP": q_rot.shape[1] // hkv, "E": 2 if keep_first_tile else 1, "G": preset.tile_size, "D": d,
        "KB": preset.key_bits, "VB": preset.value_bits, "NBYTES": layout.nbytes, "OFF_V": layout.v_codes,
        "OFF_KCS": layout.k_chan_scale, "OFF_KCZ": layout.k_chan_zero, "OFF_KTS": layout.k_tok_scale,
        "OFF_VCS": layout.v_chan_scale, "OFF_VTS": layout.v_tok_scale, "OFF_VTZ": layout.v_tok_zero, "PARTS": parts,
        "PDL": pdl, "EARLY_DEPENDENTS": {None: 0, "start": 1, "q": 2}[early_dependents], "ROTATE_Q": rotate_q,
        "ROTATE_BACK": rotate_back, "launch_pdl": pdl,
        "num_warps": 1,
    }  # fmt: skip
    return args, constants


def resident_slots(q, pages, page_table, slots, start_pos, query_start_loc, preset, hkv: int, num_slots: int,
                   keep_first_tile: bool) -> int:  # fmt: skip
    """How many of this specialization's programs the GPU holds at once (programs an SM holds x SMs): compiled (not
    launched) at its first use to read that, since it follows the preset's staging buffers and the registers ptxas
    gave (224 and 26 KB at k4v2_g128 D 128: 8 per SM; 168 and 17 KB at k4v4_g128 D 64: 12). q [T, Hq, D]: rotated
    or not (its shape is read; the count is read of the whole-tile form that takes it rotated, in fp32)."""
    # Keyed by the constexprs; variants Triton also specializes (16-byte alignment of pointers and strides, one
    # slot, a programmatic dependent), the halves' (PARTS) and the form that rotates q (ROTATE_Q: both run where the
    # slots are at most half full, ``tile_parts``, ``leaves_half_the_slots``) share the whole-tile form's count.
    key = (q.device, preset, hkv, q.shape[1], q.shape[2], keep_first_tile)
    if key not in _RESIDENT:  # q and the partials as the launch's fresh buffers (the partials as dtypes: aligned)
        q_rot = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        args, constants = _launch_arguments(q_rot, pages, page_table, slots, start_pos, query_start_loc,
                                            torch.float32, torch.float32, preset, 1.0, 0, 1, hkv, num_slots,
                                            keep_first_tile)  # fmt: skip
        compiled = _decode_attention_kernel.warmup(*args, grid=(1, 1, 1), **constants)
        _RESIDENT[key] = resident_programs(compiled, q.device)
    return _RESIDENT[key] * multiprocessors(q.device)


def decode_splits(q, pages, page_table, slots, start_pos, query_start_loc, preset, hkv: int, num_slots: int,
                  keep_first_tile: bool, most_partials: int = 0) -> tuple[int, int]:  # fmt: skip
    """The splits per (sequence, KV head) for a decode step (``tile_math.splits_by_waves``) and the programs per
    tile of a split (``tile_parts``; ``most_partials``: as there), from the programs the GPU holds at once
    (``resident_slots``, whose arguments these are)."""
    resident = resident_slots(q, pages, page_table, slots, start_pos, query_start_loc, preset, hkv, num_slots,
                              keep_first_tile)  # fmt: skip
    programs, max_tiles = slots.numel() * hkv, page_table.shape[1]
    splits = splits_by_waves(programs, quantizable_tiles(max_tiles), resident, MOST_SPLITS)
    return splits, tile_parts(preset, max_tiles, splits, programs, resident, most_partials)


def leaves_half_the_slots(programs: int, resident: int) -> bool:
    """Whether a decode launch of ``programs`` leaves at least half of the ``resident`` slots free (so that a launch
    after it, its programmatic dependent, runs beside it rather than after it)."""
    return 2 * programs <= resident


def tile_parts(preset, max_tiles: int, num_splits: int, programs: int, resident: int, most_partials: int) -> int:
    """Programs per tile of a decode step's splits: 2 (each of half the tile's tokens, a partial each) where the
    splits take one tile each, twice their programs (``programs`` sequences x KV heads, times the splits) fill at
    most half of the ``resident`` slots, the 2 x ``num_splits`` partials a row are at most ``most_partials`` (what
    the step's merge takes at once; 0: no halves), and a half tile fills the value product's k-block
    (``halves_fill_a_block``); else 1.
    NOTE why (H200, benchmarks/results/h200-s29/call1, op ms at 2K context, whole tiles -> halves): a small step is the
    chain of one program (its set-up, one tile of ~2.7 us of one warp at k4v2_g128 D 128, its store) and the merge
    after it; the kernels from rotated inputs at batch 1 0.0079 -> 0.0069, batch 2 0.0083 -> 0.0076. With the
    slots half full or more, halves lose: batch 4 (1,024 programs for 1,056 slots) 0.0105 -> 0.0128."""
    one_tile = tiles_per_split(max_tiles, num_splits) == 1
    fits = leaves_half_the_slots(2 * programs * num_splits, resident) and 2 * num_splits <= most_partials
    return 2 if halves_fill_a_block(preset) and one_tile and fits else 1


def halves_fill_a_block(preset) -> bool:
    """Whether half a tile fills the value product's k-block: >= 16 tokens a value byte field (k4v2_g128: 16;
    g64 with 2-bit values: 8, no)."""
    return preset.tile_size // 2 * preset.value_bits // 8 >= 16


def starts_during_rotation(device: torch.device, max_tiles: int, num_splits: int) -> bool:
    """Whether a decode step's launch, right after the rotation of its q (``rotate.rotate_rows`` with
    ``early_dependents``), is that launch's programmatic dependent: on Hopper and later, where its programs are
    short (``PDL_MOST_TILES``). It then reads its sequences' metadata and copies its first tile while the rotation
    runs, and waits for it only before reading q."""
    return (torch.cuda.get_device_capability(device)[0] >= 9
            and tiles_per_split(max_tiles, num_splits) <= PDL_MOST_TILES)  # fmt: skip


def tiles_per_split(max_tiles: int, num_splits: int) -> int:
    """The most tiles each of ``num_splits`` splits takes (a sequence's splits share its own complete tiles:
    ``tile_math.quantized_tiles``; at most all the tiles that can be complete: the new
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
                     parts: int = 1, pdl: bool = False, early_dependents: str | None = None,
                     rotate_q: bool = False, rotate_back: bool = False, **launch) -> None:  # fmt: skip
    """Launch the kernel for the quantized splits 0..num_splits-1 of one query token per sequence, each tile of a
    split in ``parts`` programs (``tile_parts``); it writes partials 0..num_splits * parts - 1 of
    ``paged_attention``'s ``part_acc`` [T, Hq, P, D], ``part_ml`` [T, Hq, P, 2] (P: all of a row's partials, these and
    the exact part's), or with ``rotate_back`` (a merging step) only those of splits that have tiles, the first ones
    (``tile_math.live_splits``; the exact part's follow them). q_rot [T, Hq, D] fp32, rotated (or as it came,
    ``rotate_q``). ``pdl``, ``early_dependents``, ``rotate_q``, ``rotate_back``: as ``_launch_arguments``. Validation
    is the op's."""
    args, constants = _launch_arguments(q_rot, pages, page_table, slots, start_pos, query_start_loc, part_acc,
                                        part_ml, preset, scale, window, num_splits, hkv, num_slots, keep_first_tile,
                                        parts, pdl, early_dependents, rotate_q, rotate_back,
                                        part_acc.shape[2])  # fmt: skip
    _decode_attention_kernel[(slots.numel(), hkv, num_splits * parts)](*args, **constants, **launch)
