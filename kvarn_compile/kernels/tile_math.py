"""Triton building blocks shared by the KVarN kernels (``@triton.jit`` helpers, no kernels).

Bit packing follows ``reference.pack_codes``: byte j holds codes n*j .. n*j+n-1, lowest bits first.
"""

import functools

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    """Whether kernels run under the Triton interpreter (TRITON_INTERPRET=1), which runs no inline PTX."""
    return bool(triton.knobs.runtime.interpret)


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """The GPU's streaming multiprocessors, for grid sizing; 4 for a CPU tensor (tests under the interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


REGISTERS_PER_SM = 65536  # every NVIDIA GPU from Volta on; torch's device properties do not report it
RESERVED_SHARED = 1024  # bytes of shared memory the driver keeps per resident program (sm_80 and later)
MAX_PROGRAMS_PER_SM = 32  # resident thread blocks per SM, sm_80 to sm_90


def resident_programs(compiled, device: torch.device) -> int:
    """How many programs of a compiled kernel one SM holds at once: its registers (allocated per warp in units
    of 256), its shared memory (plus the driver's reservation) and the SM's threads bound it."""
    compiled._init_handles()  # loads the binary: Triton reads the register count only then (not in its metadata)
    warps = compiled.metadata.num_warps
    warp_registers = -(-compiled.n_regs * 32 // 256) * 256
    props = torch.cuda.get_device_properties(device)
    by_shared = props.shared_memory_per_multiprocessor // (compiled.metadata.shared + RESERVED_SHARED)
    by_threads = props.max_threads_per_multi_processor // (32 * warps)
    return max(1, min(REGISTERS_PER_SM // (warp_registers * warps), by_shared, by_threads, MAX_PROGRAMS_PER_SM))


@functools.lru_cache(maxsize=4096)
def splits_by_waves(sequences: int, max_tiles: int, resident: int, most: int) -> int:
    """How many splits to cut each of ``sequences`` runs of ``max_tiles`` tiles (a sequence's KV head) into, when
    ``resident`` programs run at once over the GPU and a split's program takes time in proportion to its tiles
    plus one.

    Equal programs run in waves: S splits of ceil(T / S) tiles take ceil(sequences * S / resident) waves, and
    the returned S minimises waves * (tiles per split + 1) (ties: the fewest splits), every split of a full table
    non-empty.
    NOTE (H200, benchmarks/results/h200-s23, the decode op at 10 shapes and 1-128 splits): the earlier rule (the
    fewest splits for 16 programs per SM, of which 8 fit) cut batch 32 into 9 splits, 2,304 programs for 1,056
    slots, the third wave 18% full: 0.351 ms at 32K, where 4 splits take 0.313 (1.351 against 1.215 at 128K).
    This rule's pick was the fastest split count measured, or within 0.3% of it, at all 10 shapes (call2/sweep).
    The one tile of set-up per program (q, the pipeline's first copies, the partials and their merge) fits the
    sweep's ties: batch 8 at 32K ran 16 splits of 17 tiles (one wave) as fast as 33 of 8 (two).
    The tiles counted are the page table's width, not the live context (the host does not know the lengths
    without a sync): the count is a bound, and each sequence's splits share its own tiles (``quantized_tiles``), so
    with a table much wider than the contexts (a cache sized for 128K serving 2K, a sliding window) every split
    takes fewer tiles, and some none.
    """
    if max_tiles == 0:
        return 1
    best = (float("inf"), 1)
    for wanted in range(1, min(most, max_tiles) + 1):
        per = -(-max_tiles // wanted)
        splits = -(-max_tiles // per)  # no split left empty by a full table's share of [i * per, (i+1) * per)
        cost = -(-sequences * splits // resident) * (per + 1)
        best = min(best, (cost, splits))
    return best[1]


LOG2E = tl.constexpr(1.4426950408889634)


# fp16 0x6400 is 1024.0 with a 10-bit mantissa of zeros: OR-ing a code c < 1024 into it gives exactly
# 1024 + c, and one fp16 subtraction (exact) leaves c: no int-to-float conversion, which is scarce on the
# GPU. NOTE (H200, batch 8, 32K): 0.259 -> 0.198 ms for the attention kernel. Subtracting the bias after
# the dot instead (from the scores) was as fast (0.205 ms) but lost ~1% of the output to fp32 cancellation.
_FP16_1024_BITS = tl.constexpr(0x6400)


@triton.constexpr_function
def _field_ptx(bits, field, biased=False, pairs="01"):
    """PTX for ``code_field``: four packed bytes in one register -> their codes ``field`` as 2 x fp16x2.

    pairs "01": each byte goes to a 16-bit half (prmt: outputs (byte 0, byte 1), (byte 2, byte 3)); "02": the
    register is masked as it is and shifted by a byte (outputs (byte 0, byte 2), (byte 1, byte 3)), for
    callers whose operand order absorbs the swap. The field is masked into the mantissa of an fp16 power of
    two (lop3) whose last mantissa bit weighs 2^-shift, so the half reads 2^(10 - shift) + code exactly;
    ``biased`` leaves it there (the caller subtracts 2^(10 - shift) times its operand's sum), else one
    fp16x2 multiply-add by 1 and -2^(10 - shift) leaves the code (all exact): ~5 instructions per 4 codes.
    NOTE (H200, benchmarks/results/h200-attention-v12/ab-1-unpack-variants.json): the same kernel with
    Triton's element-wise form of this (byte extracts, shifts, repacking) was 23% slower (B8/32K 0.232 vs
    0.189 ms).
    """
    shift = bits * field
    mask = ((1 << bits) - 1) << shift
    magic = (25 - shift) << 10  # fp16 2^(10 - shift): ulp 2^-shift
    offset = 0x8000 | magic  # -2^(10 - shift)
    spread = (
        "prmt.b32 t0, $2, 0, 0x4140;\n    prmt.b32 t1, $2, 0, 0x4342;"
        if pairs == "01"
        else "mov.b32 t0, $2;\n    shr.b32 t1, $2, 8;"
    )
    out = [
        f"lop3.b32 {'$0' if biased else 'a0'}, t0, {mask | mask << 16:#010x}, {magic | magic << 16:#010x}, 0xEA;",
        f"lop3.b32 {'$1' if biased else 'a1'}, t1, {mask | mask << 16:#010x}, {magic | magic << 16:#010x}, 0xEA;",
    ]
    if not biased:
        out += ["mov.b32 one, 0x3C003C00;", f"mov.b32 of, {offset | offset << 16:#010x};",
                "fma.rn.f16x2 $0, a0, one, of;", "fma.rn.f16x2 $1, a1, one, of;"]  # fmt: skip
    body = "\n    ".join(out)
    return f"""{{
    .reg .b32 t0, t1, a0, a1, one, of;
    {spread}
    {body}
    }}"""


@triton.jit
def code_field(packed, BITS: tl.constexpr, FIELD: tl.constexpr, PTX: tl.constexpr):
    """uint8 -> fp16 of the same shape: the code in bits [BITS * FIELD, BITS * (FIELD + 1)) of each byte
    (``reference.pack_codes``: field i of byte j is code (8 // BITS) * j + i). ``PTX``: through inline PTX
    (the GPU); else Triton integer ops, the same values (the interpreter runs no PTX)."""
    if PTX:
        codes = tl.inline_asm_elementwise(_field_ptx(BITS, FIELD), "=r,=r,r", [packed], dtype=tl.float16,
                                          is_pure=True, pack=4)  # fmt: skip
    else:
        x = ((packed.to(tl.int16) >> (BITS * FIELD)) & ((1 << BITS) - 1)) | _FP16_1024_BITS
        codes = x.to(tl.float16, bitcast=True) - 1024.0
    return codes


@triton.jit
def fast_log(x, PTX: tl.constexpr):
    """Natural log of fp32 x. ``PTX``: the special function unit's lg2.approx (two instructions, relative error
    ~2^-22), where tl.log compiles to libdevice's logf (~25); else tl.log (the interpreter runs no PTX)."""
    if PTX:
        y = tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                      pack=1) * 0.6931471805599453  # fmt: skip
    else:
        y = tl.log(x)
    return y


@triton.jit
def check_sequence(slot, p0, n, max_n, num_slots, capacity, PTX: tl.constexpr):
    """Stop the kernel when a sequence's slot is not in [0, num_slots), its positions [p0, p0 + n) leave
    [0, capacity), or its n new tokens are more than the launch's grid covers (``max_n``: a call's
    ``max_query_len`` understated, whose tokens past it would be dropped): it prints why, then traps
    (CUDA reports "an illegal instruction was encountered" at the next sync). This replaces a device-side
    assert of the op: NOTE (H200, benchmarks/results/h200-attention-v12) that assert's ~6 small kernels cost
    ~11-13 us per decode step, more than the attention kernel itself below 8K context. The interpreter (no
    PTX) skips it: on the CPU the ops check every position on the host."""
    if PTX:  # noqa: SIM102 (a compile-time branch around a run-time one)
        if (slot < 0) | (slot >= num_slots) | (p0 < 0) | (p0 + n > capacity) | (n > max_n):
            tl.device_print("KVarN: a slot out of range, positions beyond its capacity or more tokens than "
                            "max_query_len (slot, slots, start_pos, tokens, capacity, max_query_len)", slot,
                            num_slots, p0, n, capacity, max_n)  # fmt: skip
            tl.inline_asm_elementwise("trap;", "=r,r", [p0], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def quantized_tiles(split, num_splits, p0, first_query_pos, window, max_tiles, G: tl.constexpr, E: tl.constexpr):
    """The quantized tiles [lo, hi) that split ``split`` of ``num_splits`` attends to: its share of the sequence's
    complete tiles before its start position p0 (the fresh tokens start in the next one), but not the kept first
    tile (E == 2, exact) nor tiles wholly before the window of the first query (at ``first_query_pos``). Scalars
    only: the Triton and the Gluon attention kernels share it.

    The tiles are shared out by the sequence's own length, not by its page table's width, which the host sizes the
    launch by (no host sync on the lengths): a server's tables are max_model_len wide (vLLM's block tables), and
    splits of the width left a short sequence's tiles to the first few programs. NOTE (H100,
    benchmarks/results/gpu-s44/h100-shared, op ms, splits of the width, page tables 32K tokens wide against as wide
    as the step needs, one run): B1/2K 0.0173 / 0.0082, B8/8K 0.0555 / 0.0362; these splits: 0.0143 / 0.0086,
    0.0359 / 0.0361."""
    first, last = _tile_span(p0, first_query_pos, window, max_tiles, G, E)
    per = tl.cdiv(last - first, num_splits)  # at most the launch's tiles a split (a bound: the width)
    lo = first + split * per
    hi = tl.minimum(lo + per, last)
    return lo, hi


@triton.jit
def live_splits(num_splits, p0, first_query_pos, window, max_tiles, G: tl.constexpr, E: tl.constexpr):
    """How many of a sequence's ``num_splits`` splits have tiles (``quantized_tiles``' arguments): the first ones,
    ceil(tiles / per), so that a merge can read only their partials."""
    first, last = _tile_span(p0, first_query_pos, window, max_tiles, G, E)
    per = tl.cdiv(last - first, num_splits)
    return tl.where(per > 0, tl.cdiv(last - first, tl.maximum(per, 1)), 0)


@triton.jit
def _tile_span(p0, first_query_pos, window, max_tiles, G: tl.constexpr, E: tl.constexpr):
    """A sequence's quantized tiles [first, last) to attend to (``quantized_tiles``), last >= first."""
    first = 1 if E == 2 else 0
    if window > 0:
        first = tl.maximum(first, (first_query_pos - window + 1) // G)
    last = tl.minimum(p0 // G, max_tiles)
    return first, tl.maximum(last, first)


@triton.jit
def column(x, I: tl.constexpr):
    """Column I of the last dim of x [A, B, N], N in {1, 2, 4}: [A, B] (splits, no arithmetic, when a thread
    holds the last dim)."""
    N: tl.constexpr = x.shape[2]
    if N == 1:
        col = tl.reshape(x, (x.shape[0], x.shape[1]))
    elif N == 2:
        c0, c1 = tl.split(x)
        col = c0 if I == 0 else c1
    else:
        even, odd = tl.split(tl.reshape(x, (x.shape[0], x.shape[1], 2, 2)))  # columns (0, 2) and (1, 3)
        col = column(even if I % 2 == 0 else odd, I // 2)
    return col


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
