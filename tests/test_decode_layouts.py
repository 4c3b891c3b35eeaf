"""The register layouts the Gluon decode kernel (``kernels/decode_attention.py``) is built on, checked on the
CPU: the kernel itself only runs on a GPU (the Triton interpreter does not run Gluon), but its value
bytes are loaded in a layout derived here from the tensor-core operand's, and a wrong derivation would read
the wrong tokens' codes."""

import itertools

import pytest
from triton._C.libtriton import gluon_ir, ir

from kvarn_compile.kernels import decode_attention as kernel


def linear_layout(layout, shape):
    """The linear layout of a kernel's layout constant (a gl.constexpr) over ``shape``."""
    context = ir.context()
    ir.load_dialects(context)
    builder = gluon_ir.GluonOpBuilder(context)
    return builder.to_linear_layout(layout.value._to_ir(builder), shape)


def elements(layout):
    """{(lane, register): index} of a linear layout of one warp: the XOR of the bases of the set bits."""
    out = {}
    for lane, reg in itertools.product(range(32), range(1 << len(layout.reg_bases))):
        index = [0] * len(layout.shape)
        for bases, value in ((layout.lane_bases, lane), (layout.reg_bases, reg)):
            for bit, basis in enumerate(bases):
                if value >> bit & 1:
                    index = [a ^ b for a, b in zip(index, basis, strict=True)]
        out[lane, reg] = tuple(index)
    return out


@pytest.mark.parametrize("gj", [16, 32, 64])
def test_token_order_is_a_bit_permutation(gj):
    """``_bytes_in_order`` maps each basis of a layout through ``_token_bits``: that maps every element the
    same way only if ``_token_bits`` is a permutation that commutes with XOR (a permutation of bits)."""
    order = [kernel._token_bits(k, gj) for k in range(gj)]
    assert sorted(order) == list(range(gj))
    for a, b in itertools.product(range(gj), repeat=2):
        assert kernel._token_bits(a ^ b, gj) == order[a] ^ order[b]


@pytest.mark.parametrize("d, gj", [(64, 16), (128, 32), (128, 64), (256, 32)])
def test_value_bytes_load_in_operand_order(d, gj):
    """Each (lane, register) of the load layout holds the byte that the same (lane, register) of the A operand
    reads (column k <-> byte _token_bits(k)), and each thread's bytes of a channel come in runs of >= 4
    consecutive bytes (one 32-bit load or wider)."""
    operand = linear_layout(kernel.A2, [d, gj])
    load = kernel._bytes_in_order(operand, gj)
    want, got = elements(operand), elements(load)
    assert set(got.values()) == {(c, j) for c in range(d) for j in range(gj)}
    for slot, (channel, column) in want.items():
        assert got[slot] == (channel, kernel._token_bits(column, gj))
    for lane in range(32):
        for channel in {c for (ln, _), (c, _) in got.items() if ln == lane}:
            mine = sorted(j for (ln, _), (c, j) in got.items() if ln == lane and c == channel)
            runs = [list(g) for _, g in itertools.groupby(enumerate(mine), lambda x: x[1] - x[0])]
            assert min(len(r) for r in runs) >= 4, (lane, channel, mine)


def test_probabilities_are_the_value_operand_as_they_lie():
    """The scores' accumulator rows 0..7, transposed, are the B operand of the value product at k_width 2
    (what ``_heads_as_columns`` asserts is a free conversion): the same (lane, register) holds (row h, column
    t) of the one and (t, h) of the other."""
    accumulator = elements(linear_layout(kernel.MMA, [16, 32]))
    operand = elements(linear_layout(kernel.B2, [32, 8]))
    rows_0_7 = {(lane, reg): (h, t) for (lane, reg), (h, t) in accumulator.items() if h < 8}
    assert {v[::-1] for v in rows_0_7.values()} == set(operand.values())
    by_value = {v: k for k, v in operand.items()}
    lanes = {by_value[(t, h)][0] == lane for (lane, _), (h, t) in rows_0_7.items()}
    assert lanes == {True}, "a value would have to move between lanes"


def test_which_decode_steps_the_gluon_kernel_serves():
    """Every documented preset at head dims 64/128/256 and GQA up to 16 (the README says so); the rest, which
    its operands cannot hold, goes to the Triton kernel."""
    from kvarn_compile import get_preset
    from kvarn_compile.presets import NAMED_PRESETS

    for name, d, group in itertools.product(NAMED_PRESETS, (64, 128, 256), (1, 4, 16)):
        assert kernel.supports(get_preset(name), group, d, d), (name, d, group)
    for name, group, dk, dv in [
        ("kvarn_k4v2_g128", 17, 128, 128),  # more heads than the 16 mma rows
        ("kvarn_k4v2_g128", 4, 192, 128),  # MLA-like unequal head dims
        ("kvarn_k2v2_g128", 4, 64, 64),  # 16 key bytes per token: below one k_width-8 operand
        ("kvarn_k4v2_g32", 4, 128, 128),  # 8 tokens per value field: below one k-block
        ("kvarn_k8v8_g128", 4, 128, 128),
    ]:
        assert not kernel.supports(get_preset(name), group, dk, dv), name
