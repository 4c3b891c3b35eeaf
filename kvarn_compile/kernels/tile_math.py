"""Triton building blocks shared by the KVarN kernels (``@triton.jit`` helpers, no kernels).

Bit packing follows ``reference.pack_codes``: byte j holds codes n*j .. n*j+n-1, lowest bits first.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


# fp16 0x6400 is 1024.0 with a 10-bit mantissa of zeros: OR-ing a code c < 1024 into it gives exactly
# 1024 + c, and one fp16 subtraction (exact) leaves c: no int-to-float conversion, which is scarce on the
# GPU. NOTE (H200, batch 8, 32K): 0.259 -> 0.198 ms for the attention kernel. Subtracting the bias after
# the dot instead (from the scores) was as fast (0.205 ms) but lost ~1% of the output to fp32 cancellation.
_FP16_1024_BITS = tl.constexpr(0x6400)


@triton.jit
def unpack_codes_fp16(packed, BITS: tl.constexpr):
    """uint8 [R, C] -> fp16 codes [R, C * 8 // BITS] (inverse of ``pack_codes``)."""
    x = packed.to(tl.int16)
    R: tl.constexpr = packed.shape[0]
    C: tl.constexpr = packed.shape[1]
    if BITS == 8:
        codes = x
    elif BITS == 4:
        codes = tl.reshape(tl.join(x & 15, x >> 4), (R, 2 * C))
    else:
        # tl.join adds a trailing axis: join(join(c0, c2), join(c1, c3))[.., i, j] = c(2i + j).
        even = tl.join(x & 3, (x >> 4) & 3)
        odd = tl.join((x >> 2) & 3, (x >> 6) & 3)
        codes = tl.reshape(tl.join(even, odd), (R, 4 * C))
    return (codes | _FP16_1024_BITS).to(tl.float16, bitcast=True) - 1024.0


@triton.jit
def pack_codes(codes, BITS: tl.constexpr):
    """int32 codes [R, C] -> uint8 [R, C * BITS // 8]."""
    R: tl.constexpr = codes.shape[0]
    C: tl.constexpr = codes.shape[1]
    if BITS == 8:
        packed = codes
    else:
        N: tl.constexpr = 8 // BITS
        grouped = tl.reshape(codes, (R, C // N, N))
        shifts = tl.arange(0, N) * BITS
        packed = tl.sum(grouped << shifts[None, None, :], axis=2)
    return packed.to(tl.uint8)


@triton.jit
def fp16_ptr(byte_ptr):
    return byte_ptr.to(tl.pointer_type(tl.float16))


@triton.jit
def online_softmax_step(s, m, l):
    """One step of the online softmax on log2-domain scores s [M, N] with running max m and sum l [M].

    Returns (p [M, N], alpha [M], m_new, l_new); rows with no visible key so far stay at m = -inf.
    """
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return p, alpha, m_new, l * alpha + tl.sum(p, axis=1)
