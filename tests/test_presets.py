import pytest

from kvarn_compile import NAMED_PRESETS, KVarNCache, get_preset
from kvarn_compile.presets import SUPPORTED_HEAD_DIMS, VALID_BITS, VALID_TILE_SIZES, Preset


@pytest.mark.parametrize(
    "name, head_dim, head_dim_v, bytes_per_token",
    # a tile: G*Dk*kb/8 + G*Dv*vb/8 code bytes + fp16 scales 2*(2*Dk + Dv + 3*G), over G tokens
    [
        ("kvarn_k4v2_g128", 128, None, 108),  # 8,192 + 4,096 + 1,536 = 13,824 B per tile: 4.74x less than fp16
        ("kvarn_k4v2_g64", 128, None, 114),  # (4,096 + 2,048 + 1,152) / 64
        ("kvarn_k4v4_g128", 128, None, 140),  # (8,192 + 8,192 + 1,536) / 128
        ("kvarn_k4v4_g64", 128, None, 146),  # (4,096 + 4,096 + 1,152) / 64
        ("kvarn_k4v2_g128", 256, None, 210),  # (16,384 + 8,192 + 2,304) / 128: ~4.9x (the fork falls to 4x)
        ("kvarn_k4v2_g128", 192, 128, 142),  # MLA's K 192 / V 128: (12,288 + 4,096 + 1,792) / 128
    ],
)
def test_bytes_per_token(name, head_dim, head_dim_v, bytes_per_token):
    assert get_preset(name).bytes_per_token(head_dim, head_dim_v) == bytes_per_token


def test_default_is_4_7x_smaller_than_fp16():
    preset = get_preset()
    assert preset.name == "kvarn_k4v2_g128"
    assert preset.bytes_per_tile(128) == 13_824
    assert preset.compression(128) == pytest.approx(512 / 108)
    assert preset.compression(256) > 4.7


@pytest.mark.parametrize("kb", VALID_BITS)
@pytest.mark.parametrize("vb", VALID_BITS)
@pytest.mark.parametrize("g", VALID_TILE_SIZES)
@pytest.mark.parametrize("d", SUPPORTED_HEAD_DIMS)
def test_every_valid_name_parses_and_is_aligned_without_waste(kb, vb, g, d):
    preset = get_preset(f"kvarn_k{kb}v{vb}_g{g}")
    assert (preset.key_bits, preset.value_bits, preset.tile_size) == (kb, vb, g)
    layout = preset.layout(d)
    assert layout.nbytes % 16 == 0
    assert 0 <= layout.nbytes - layout.used_bytes < 16  # rounded up, never below what the record holds
    assert layout.used_bytes == g * d * (kb + vb) // 8 + 2 * (3 * d + 3 * g)


def test_named_presets_roundtrip_their_names():
    for name in NAMED_PRESETS:
        assert get_preset(name).name == name
    assert get_preset(get_preset("kvarn_k4v2_g64")) == Preset(4, 2, 64)


# not one name per preset either: a final newline, leading zeros, non-ASCII digits (each once parsed as another name)
@pytest.mark.parametrize("bad", ["kvarn_k3v2_g128", "kvarn_k4v2_g100", "k4v2_g128", "kvarn_k4v2", "", "fp8",
                                 "kvarn_k4v2_g128\n", "kvarn_k04v2_g0128", "kvarn_k\u0664v2_g128", " kvarn_k4v2_g128"])  # fmt: skip
def test_bad_names_say_what_is_expected(bad):
    # the expected form, not the bad name echoed back (most bad names contain "kvarn_k" themselves)
    with pytest.raises(ValueError, match=r"expected 'kvarn_k\{kb\}v\{vb\}_g\{G\}'"):
        get_preset(bad)


@pytest.mark.parametrize(
    "fields", [(4.0, 2, 64), (True, 2, 64), (4, 2, 64, -3), (4, 2, 64, 8, -5), (4, 2, 64, 8, 16, True)]
)
def test_preset_fields_are_non_negative_ints(fields):
    with pytest.raises(ValueError, match="must be a non-negative int"):
        Preset(*fields)


def test_a_cache_refuses_knobs_its_preset_name_does_not_carry():
    """The cache ops take presets by name: a preset of 4 iterations would be quantized with the name's 8."""
    for knobs in ({"iterations": 4}, {"patience": 2}):
        with pytest.raises(ValueError, match="is not what 'kvarn_k4v2_g64' names"):
            KVarNCache.allocate(1, 64, 1, 64, preset=Preset(4, 2, 64, **knobs))
    assert KVarNCache.allocate(1, 64, 1, 64, preset=Preset(4, 2, 64)).preset == get_preset("kvarn_k4v2_g64")


def test_the_normalisation_stops_early_for_the_default_preset_only():
    """A patience of 2 for k4v2_g128 (its KL on SmolLM2 0.7% lower), all iterations otherwise (k4v4_g128's KL rose
    2.5%, k4v2_g64's 1.2%, k2v2_g128's 0.7%): ``Preset.patience``; an explicit patience is kept."""
    assert get_preset().patience == get_preset("kvarn_k4v2_g128").patience == 2
    others = ("kvarn_k4v2_g64", "kvarn_k4v2_g256", "kvarn_k2v2_g128", "kvarn_k8v2_g128", "kvarn_k4v4_g128")
    assert [get_preset(n).patience for n in others] == [0] * len(others)
    assert Preset(4, 4, 128, patience=3).patience == 3 and Preset(4, 2, 128, patience=0).patience == 0


def test_bad_head_dim_names_the_supported_ones():
    with pytest.raises(ValueError, match=r"\(64, 128, 192, 256, 512\)"):
        get_preset().bytes_per_token(96)
    with pytest.raises(ValueError, match="value head_dim"):
        get_preset().layout(128, 80)
    with pytest.raises(TypeError):
        get_preset(128)
