"""The inline PTX that unpacks codes from their bytes on the GPU (``tile_math._field_ptx``), run on the CPU by a
small emulator of the six instructions it uses: the Triton interpreter runs no PTX, and the GPU tests only see
its effect through whole attention results."""

import re

import numpy as np
import pytest

from kvarn_compile.kernels.tile_math import _field_ptx


def _operand(token: str, regs: dict) -> int:
    return regs[token] if token in regs else int(token, 0)


def _half_fma(a: int, b: int, c: int) -> int:
    """fma.rn.f16x2 on two fp16 halves (exact inputs and results here, so fp32 then fp16 rounding is the same)."""
    out = 0
    for shift in (0, 16):
        x, y, z = (np.array([v >> shift & 0xFFFF], np.uint16).view(np.float16)[0] for v in (a, b, c))
        r = np.float16(np.float32(x) * np.float32(y) + np.float32(z))
        out |= int(np.array([r]).view(np.uint16)[0]) << shift
    return out


def run_ptx(ptx: str, word: int) -> tuple[int, int]:
    """Outputs $0, $1 of the PTX for the input register $2 = word."""
    regs = {"$2": word}
    for line in ptx.strip().strip("{}").split(";"):
        words = re.split(r"[\s,]+", line.strip())
        op, args = words[0], words[1:]
        if op in ("", ".reg"):
            continue
        get = [_operand(a, regs) for a in args[1:]]
        if op == "mov.b32":
            value = get[0]
        elif op == "shr.b32":
            value = get[0] >> get[1]
        elif op == "prmt.b32":  # bytes of {b, a}: selector nibble i picks output byte i (no sign mode here)
            pool = get[0] | get[1] << 32
            assert all(get[2] >> 4 * i & 8 == 0 for i in range(4)), "sign-replicating selectors not emulated"
            value = sum((pool >> 8 * (get[2] >> 4 * i & 7) & 0xFF) << 8 * i for i in range(4))
        elif op == "lop3.b32":  # lut bit (4a + 2b + c) of each bit position
            a, b, c, lut = get
            value = 0
            for i in range(8):
                if lut >> i & 1:
                    value |= (a if i & 4 else ~a) & (b if i & 2 else ~b) & (c if i & 1 else ~c)
        elif op == "fma.rn.f16x2":
            value = _half_fma(*get)
        else:
            raise AssertionError(f"instruction not emulated: {op}")
        regs[args[0]] = value & 0xFFFFFFFF
    return regs["$0"], regs["$1"]


@pytest.mark.parametrize("pairs", ["01", "02"])
@pytest.mark.parametrize("biased", [False, True])
@pytest.mark.parametrize("bits, field", [(2, 0), (2, 1), (2, 2), (2, 3), (4, 0), (4, 1), (8, 0)])
def test_field_ptx_gives_the_codes(bits, field, biased, pairs):
    """Outputs (lo $0, hi $0, lo $1, hi $1) are the field's codes of bytes (0, 1, 2, 3) for pairs "01" and of
    bytes (0, 2, 1, 3) for "02" (the decode kernel's key operand takes q's channels in that order), plus
    2^(10 - shift) if biased (the decode kernel subtracts that times its operand's sum)."""
    ptx = _field_ptx(bits, field, biased, pairs)
    order = (0, 1, 2, 3) if pairs == "01" else (0, 2, 1, 3)
    bias = 2.0 ** (10 - bits * field) if biased else 0.0
    words = np.random.default_rng(bits * 8 + field).integers(0, 2**32, size=200, dtype=np.uint64).tolist()
    for word in [0, 0xFFFFFFFF, 0x01234567, *words]:
        out0, out1 = run_ptx(ptx, word)
        halves = np.array([out0 & 0xFFFF, out0 >> 16, out1 & 0xFFFF, out1 >> 16], np.uint16).view(np.float16)
        codes = [(word >> 8 * byte) >> (bits * field) & ((1 << bits) - 1) for byte in order]
        assert halves.astype(np.float64).tolist() == [c + bias for c in codes], hex(word)
