"""The register layouts the Gluon decode kernel (``kernels/decode_attention.py``) is built on, checked on the
CPU: the kernel itself only runs on a GPU (the Triton interpreter does not run Gluon), but its value
bytes are loaded in a layout derived here from the tensor-core operand's, and a wrong derivation would read
the wrong tokens' codes."""

import itertools

import pytest
from triton._C.libtriton import gluon_ir, ir
from triton.experimental.gluon import language as gl

from kvarn_compile.kernels import decode_attention as kernel


def linear_layout(layout, shape):
    """The linear layout of a kernel's layout (a gl.constexpr, or a layout object) over ``shape``."""
    context = ir.context()
    ir.load_dialects(context)
    builder = gluon_ir.GluonOpBuilder(context)
    return builder.to_linear_layout(getattr(layout, "value", layout)._to_ir(builder), shape)


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
    same way only if ``_token_bits`` is a permutation that commutes with XOR (a permutation of bits). The kernel's
    index tensors take the same map through ``_token_of`` (its Python function, run here on integers)."""
    order = [kernel._token_bits(k, gj) for k in range(gj)]
    assert sorted(order) == list(range(gj))
    assert [kernel._token_of.fn(k, gj) for k in range(gj)] == order
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


@pytest.mark.parametrize("d, gj", [(64, 16), (128, 32), (128, 64), (256, 32)])
def test_key_bytes_load_in_operand_order(d, gj):
    """The key block [GJ tokens, KW bytes] (4-bit keys: KW = D / 2) is loaded with its rows in the value operand's
    column order: each (lane, register) of the load holds the byte that the same (lane, register) of the scores' A
    operand reads (row k <-> token row _token_bits(k)), and each thread's bytes of a token come in runs of 8 (one
    64-bit load)."""
    kw = d // 2
    operand = linear_layout(kernel.A8, [gj, kw])
    load = kernel._bytes_in_order(operand, gj, 0)
    want, got = elements(operand), elements(load)
    assert set(got.values()) == {(j, b) for j in range(gj) for b in range(kw)}
    for slot, (row, byte) in want.items():
        assert got[slot] == (kernel._token_bits(row, gj), byte)
    for lane in range(32):
        for token in {j for (ln, _), (j, _) in got.items() if ln == lane}:
            mine = sorted({b for (ln, _), (j, b) in got.items() if ln == lane and j == token})  # (D 64: replicated)
            runs = [list(g) for _, g in itertools.groupby(enumerate(mine), lambda x: x[1] - x[0])]
            assert min(len(r) for r in runs) >= 8, (lane, token, mine)


@pytest.mark.parametrize("order", ["tokens", "byte pairs"])
@pytest.mark.parametrize("w", [16, 32, 64, 128])
def test_entry_orders_are_bit_permutations(order, w):
    """``_fields_layout`` maps each basis through ``_entry_bits``: right for every element only if the order
    is a permutation that commutes with XOR. The kernel's key bytes take the "byte pairs" order through
    ``_byte_order`` (its Python function, run here on integers)."""
    entries = [kernel._entry_bits(c, w, order) for c in range(w)]
    assert sorted(entries) == list(range(w))
    if order == "byte pairs":
        assert [kernel._byte_order.fn(c) for c in range(w)] == entries
    for a, b in itertools.product(range(w), repeat=2):
        assert kernel._entry_bits(a ^ b, w, order) == entries[a] ^ entries[b]


@pytest.mark.parametrize(
    "parent, dim, w, fields, order, run",
    [
        ("B8", 1, 32, 2, "byte pairs", 4),  # key channel scales / zeros: 4-bit keys, 32 bytes per token (D 64)
        ("B8", 1, 64, 2, "byte pairs", 4),  # 4-bit keys at D 128
        ("B8", 1, 32, 4, "byte pairs", 4),  # 2-bit keys at D 128
        ("MMA", 1, 32, 4, "tokens", 4),  # token scales: g128 with 2-bit values (4 fields of 32 tokens)
        ("MMA", 1, 64, 2, "tokens", 2),  # g128 with 4-bit values
        ("MMA", 1, 16, 4, "tokens", 4),  # g64 with 2-bit values
    ],
)
def test_scale_vectors_load_whole_in_their_use_layout(parent, dim, w, fields, order, run):
    """The wide load of a tile's scale vector (``_load_fields``): each (lane, register) of the load layout holds
    field f of the element that lane holds in the target layout, read at entry fields * _entry_bits(c) + f,
    and each thread's entries come in runs of >= ``run`` fp16 (a 32-bit load or wider: a thread holds every
    other token of its rows' group, so the token scales' runs are a token's fields)."""
    target = linear_layout(gl.SliceLayout(dim, getattr(kernel, parent).value), [w])
    load = elements(kernel._fields_layout(target, fields, order))
    want = elements(target)
    assert {e for (e,) in load.values()} == set(range(w * fields))  # (slices repeat elements across lanes)
    for (lane, reg), (entry,) in load.items():
        f, element_reg = reg % fields, reg // fields
        (c,) = want[lane, element_reg]
        assert entry == fields * kernel._entry_bits(c, w, order) + f, (lane, reg)
    for lane in range(32):
        mine = sorted({e for (ln, _), (e,) in load.items() if ln == lane})
        runs = [list(g) for _, g in itertools.groupby(enumerate(mine), lambda x: x[1] - x[0])]
        assert min(len(r) for r in runs) >= run, (lane, mine)


@pytest.mark.parametrize("gj, n", [(16, 8), (32, 8), (64, 8), (16, 16), (32, 16)])
def test_transposed_blocks_are_the_value_operand(gj, n):
    """``_as_value_operand``: movmatrix.trans on each pair of registers of the probabilities [GJ, N] in the
    scores' accumulator layout (a pair: columns 2t, 2t + 1 of row r of an 8x8 block, in lane 4r + t) leaves in each
    lane the probabilities that the value product's B operand holds there, where the kernel's relabelling says:
    the (lane, register) that held index (8a + b, 8c + n) now holds (8a + n, 8c + b). This models the instruction
    (PTX ISA: lane 4r + t returns row r of the transposed block, its elements 2t and 2t + 1)."""
    accumulator = elements(linear_layout(kernel.MMA, [gj, n]))
    operand = elements(linear_layout(kernel.B2, [gj, n]))
    assert linear_layout(kernel.MMA, [gj, n]).reg_bases[0] == [0, 1], "pack=2 pairs a row's columns 2t, 2t + 1"
    after = {}
    for (lane, reg), (row, column) in accumulator.items():
        r, t, j = lane // 4, lane % 4, reg & 1
        # row r of the transposed block, element j = the block's row 2t + j, column r: lane 4 (2t + j) + r // 2,
        # register r % 2 of the same pair
        after[lane, reg] = accumulator[4 * (2 * t + j) + r // 2, (reg & ~1) | (r % 2)]
        assert after[lane, reg] == (row - row % 8 + column % 8, column - column % 8 + row % 8), (lane, reg)
    for lane in range(32):  # (the registers of a lane may come in another order: renaming them moves no data)
        held = sorted(index for (ln, _), index in after.items() if ln == lane)
        assert held == sorted(index for (ln, _), index in operand.items() if ln == lane), lane


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
