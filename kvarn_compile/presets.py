"""KVarN presets and the byte layout of one quantized tile.

A preset is named ``kvarn_k{kb}v{vb}_g{G}``: keys of ``kb`` bits, values of ``vb`` bits, tiles of ``G``
tokens. One tile of one KV head is stored as a single 16-byte-aligned uint8 record (a "page record"):

====================  =====================  ==============================================
section               shape                  meaning
====================  =====================  ==============================================
``k_codes``           uint8 [G, Dk*kb/8]     key codes, packed along channels: byte ``(t, j)``
                                             holds channels ``n*j .. n*j+n-1`` (``n = 8/kb``),
                                             channel ``n*j+i`` in bits ``[i*kb, (i+1)*kb)``
``v_codes``           uint8 [Dv, G*vb/8]     value codes, channel-major, packed along tokens:
                                             byte ``(d, j)`` holds tokens ``n*j .. n*j+n-1``
``k_chan_scale``      fp16 [Dk]              RTN scale x normalisation scale, per channel
``k_chan_zero``       fp16 [Dk]              RTN zero x normalisation scale, per channel
``k_tok_scale``       fp16 [G]               normalisation scale, per token
``v_chan_scale``      fp16 [Dv]              normalisation scale, per channel
``v_tok_scale``       fp16 [G]               RTN scale x normalisation scale, per token
``v_tok_zero``        fp16 [G]               RTN zero x normalisation scale, per token
padding               up to 15 bytes         the record is a multiple of 16 bytes
====================  =====================  ==============================================

Read-back (rotated space): ``K'[t, d] = (qK[t, d] * k_chan_scale[d] + k_chan_zero[d]) * k_tok_scale[t]``
and ``V'[t, d] = (qV[t, d] * v_tok_scale[t] + v_tok_zero[t]) * v_chan_scale[d]``.
So bytes per tile and head are ``G*Dk*kb/8 + G*Dv*vb/8 + 2*(2*Dk + Dv + 3*G)`` rounded up to 16, which
is the paper's ``G*D*(kb+vb)/8 + 2*(3D + 3G)`` when ``Dk == Dv``: k4v2_g128 at D=128 is 13,824 B per tile
(108 B per token and head, 4.74x less than fp16's 512).

MLA models (DeepSeek-V2/V3) cache one latent c [L] and one rope key r [R] per token, shared by all heads;
attention reads c both as keys and as values. Their tile (``LatentLayout``) stores the latent as KVarN
stores keys, at the preset's key bits, and the rope key as the model gives it (it carries positions):

====================  =====================  ==============================================
``c_codes``           uint8 [G, L*kb/8]      latent codes, packed along channels (as ``k_codes``)
``c_chan_scale``      fp16 [L]               RTN scale x normalisation scale, per channel
``c_chan_zero``       fp16 [L]               RTN zero x normalisation scale, per channel
``c_tok_scale``       fp16 [G]               normalisation scale, per token
``rope``              fp16/bf16 [G, R]       the rope key, unrotated, in the model's dtype
padding               up to 15 bytes
====================  =====================  ==============================================

k4 at L=512, R=64, G=128 (DeepSeek-V2/V3): 51,456 B per tile, 402 B per token, 2.87x less than bf16's 1,152.
"""

from __future__ import annotations

import dataclasses
import functools
import re

VALID_BITS = (2, 4, 8)
VALID_TILE_SIZES = (32, 64, 128, 256)
# 192 is the key head dim of MLA models (DeepSeek-V3: 128 nope + 64 rope channels).
SUPPORTED_HEAD_DIMS = (64, 128, 192, 256, 512)
# MLA: the latent is rotated and quantized like a key head, at a power-of-two width (the latent attention kernel
# splits its channels into power-of-two fields); the rope key is kept.
SUPPORTED_LATENT_DIMS = (64, 128, 256, 512)
SUPPORTED_ROPE_DIMS = (32, 64, 128)
DEFAULT_PRESET = "kvarn_k4v2_g128"
# The presets the project documents and evaluates; any other valid name also parses.
NAMED_PRESETS = ("kvarn_k4v2_g128", "kvarn_k4v2_g64", "kvarn_k4v4_g128", "kvarn_k4v4_g64")

_NAME = re.compile(r"kvarn_k([1-9][0-9]*)v([1-9][0-9]*)_g([1-9][0-9]*)")  # whole names, ASCII digits: one per preset
_ALIGN = 16
_SCALE_BYTES = 2  # scales and zeros are fp16
_ROPE_BYTES = 2  # MLA's rope key, in the model's fp16 or bf16


def check_head_dim(head_dim: int, what: str = "head_dim") -> None:
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"KVarN supports {what} in {SUPPORTED_HEAD_DIMS}, got {head_dim}")


@dataclasses.dataclass(frozen=True)
class TileLayout:
    """Byte offsets of the sections of one tile record (see the module docstring)."""

    tile_size: int
    head_dim_k: int
    head_dim_v: int
    key_bits: int
    value_bits: int

    @property
    def k_row_bytes(self) -> int:
        """Bytes of one token's packed key codes."""
        return self.head_dim_k * self.key_bits // 8

    @property
    def v_row_bytes(self) -> int:
        """Bytes of one channel's packed value codes."""
        return self.tile_size * self.value_bits // 8

    @property
    def k_codes(self) -> int:
        return 0

    @property
    def v_codes(self) -> int:
        return self.k_codes + self.tile_size * self.k_row_bytes

    @property
    def k_chan_scale(self) -> int:
        return self.v_codes + self.head_dim_v * self.v_row_bytes

    @property
    def k_chan_zero(self) -> int:
        return self.k_chan_scale + _SCALE_BYTES * self.head_dim_k

    @property
    def k_tok_scale(self) -> int:
        return self.k_chan_zero + _SCALE_BYTES * self.head_dim_k

    @property
    def v_chan_scale(self) -> int:
        return self.k_tok_scale + _SCALE_BYTES * self.tile_size

    @property
    def v_tok_scale(self) -> int:
        return self.v_chan_scale + _SCALE_BYTES * self.head_dim_v

    @property
    def v_tok_zero(self) -> int:
        return self.v_tok_scale + _SCALE_BYTES * self.tile_size

    @property
    def used_bytes(self) -> int:
        return self.v_tok_zero + _SCALE_BYTES * self.tile_size

    @property
    def nbytes(self) -> int:
        """Bytes of the whole record: ``used_bytes`` rounded up to 16-byte alignment."""
        return -(-self.used_bytes // _ALIGN) * _ALIGN


@dataclasses.dataclass(frozen=True)
class LatentLayout:
    """Byte offsets of the sections of one MLA tile record (see the module docstring)."""

    tile_size: int
    latent_dim: int
    rope_dim: int
    bits: int

    @property
    def c_row_bytes(self) -> int:
        """Bytes of one token's packed latent codes."""
        return self.latent_dim * self.bits // 8

    @property
    def c_codes(self) -> int:
        return 0

    @property
    def c_chan_scale(self) -> int:
        return self.c_codes + self.tile_size * self.c_row_bytes

    @property
    def c_chan_zero(self) -> int:
        return self.c_chan_scale + _SCALE_BYTES * self.latent_dim

    @property
    def c_tok_scale(self) -> int:
        return self.c_chan_zero + _SCALE_BYTES * self.latent_dim

    @property
    def rope(self) -> int:
        return self.c_tok_scale + _SCALE_BYTES * self.tile_size

    @property
    def used_bytes(self) -> int:
        return self.rope + _ROPE_BYTES * self.tile_size * self.rope_dim

    @property
    def nbytes(self) -> int:
        """Bytes of the whole record: ``used_bytes`` rounded up to 16-byte alignment."""
        return -(-self.used_bytes // _ALIGN) * _ALIGN


@dataclasses.dataclass(frozen=True)
class Preset:
    """One KVarN configuration: key bits, value bits and tile size (tokens per tile)."""

    key_bits: int
    value_bits: int
    tile_size: int
    # Normalisation iterations, at most (the method converges by about 4; the paper runs 8).
    iterations: int = 8
    # Value roundings moved per channel so that its errors cancel over the tile (``reference.balance_roundings``);
    # 0: plain round-to-nearest, as the paper.
    value_flips: int = 16
    # A tile's normalisation ends after this many iterations in a row that do not lower its imbalance
    # (``reference.balance``); 0: all ``iterations``, as the paper; None: 2 for k4v2_g128 (the default), else 0.
    # NOTE (SmolLM2-135M, KL to fp16 on 7 held-out spans, a paired bootstrap's 95% interval): a patience of 2 moved
    # k4v2_g128's by -0.7% (-1.4 to 0.0%) and k4v4_g128's by +2.5% (+0.8 to +4.4%) (benchmarks/results/cpu-s40/eval),
    # k4v2_g64's by +1.2% (+0.1 to +2.4%) and k2v2_g128's by +0.7% (-0.2 to +1.6%) (cpu-s41/eval-g64, eval-k2v2);
    # it makes the flush of a tile 14% shorter in a decode step and bursts of them 21-23% (H100, results/gpu-s40)
    patience: int | None = None

    def __post_init__(self) -> None:
        if self.patience is None:  # frozen: set through object, once, before the checks
            default = (self.key_bits, self.value_bits, self.tile_size) == (4, 2, 128)
            object.__setattr__(self, "patience", 2 if default else 0)
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"KVarN preset {field.name} must be a non-negative int, got {value!r}")
        for what, bits in (("key bits", self.key_bits), ("value bits", self.value_bits)):
            if bits not in VALID_BITS:
                raise ValueError(f"KVarN {what} must be one of {VALID_BITS}, got {bits}")
        if self.tile_size not in VALID_TILE_SIZES:
            raise ValueError(f"KVarN tile size must be one of {VALID_TILE_SIZES}, got {self.tile_size}")

    @property
    def name(self) -> str:
        return f"kvarn_k{self.key_bits}v{self.value_bits}_g{self.tile_size}"

    def layout(self, head_dim: int, head_dim_v: int | None = None) -> TileLayout:
        """The tile record layout for keys of ``head_dim`` and values of ``head_dim_v`` channels."""
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        check_head_dim(head_dim, "key head_dim")
        check_head_dim(head_dim_v, "value head_dim")
        return TileLayout(self.tile_size, head_dim, head_dim_v, self.key_bits, self.value_bits)

    def latent_layout(self, latent_dim: int, rope_dim: int) -> LatentLayout:
        """The MLA tile record layout for a latent of ``latent_dim`` and a rope key of ``rope_dim`` channels
        (the latent at the preset's key bits: it is read as keys and as values)."""
        if latent_dim not in SUPPORTED_LATENT_DIMS:
            raise ValueError(
                f"KVarN supports MLA latent dims (kv_lora_rank) in {SUPPORTED_LATENT_DIMS}, got {latent_dim}"
            )
        if rope_dim not in SUPPORTED_ROPE_DIMS:
            raise ValueError(f"KVarN supports MLA rope key dims in {SUPPORTED_ROPE_DIMS}, got {rope_dim}")
        return LatentLayout(self.tile_size, latent_dim, rope_dim, self.key_bits)

    def bytes_per_tile(self, head_dim: int, head_dim_v: int | None = None) -> int:
        """Bytes of one tile of one KV head (keys and values, scales, alignment)."""
        return self.layout(head_dim, head_dim_v).nbytes

    def bytes_per_token(self, head_dim: int, head_dim_v: int | None = None) -> float:
        """K+V bytes per token per KV head (108.0 for k4v2_g128 at head_dim 128)."""
        return self.bytes_per_tile(head_dim, head_dim_v) / self.tile_size

    def compression(self, head_dim: int, head_dim_v: int | None = None) -> float:
        """How many times smaller than an fp16 cache of the same heads."""
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        return 2 * (head_dim + head_dim_v) / self.bytes_per_token(head_dim, head_dim_v)


@functools.cache
def _parse(name: str) -> Preset:
    expected = (
        f"expected 'kvarn_k{{kb}}v{{vb}}_g{{G}}' with bits in {VALID_BITS} and G in {VALID_TILE_SIZES}, "
        f"e.g. {DEFAULT_PRESET!r}"
    )
    match = _NAME.fullmatch(name)
    if match is None:
        raise ValueError(f"not a KVarN preset name: {name!r}; {expected}")
    try:
        return Preset(*(int(g) for g in match.groups()))
    except ValueError as e:
        raise ValueError(f"not a KVarN preset name: {name!r} ({e}); {expected}") from None


def get_preset(preset: str | Preset = DEFAULT_PRESET) -> Preset:
    """Parse a preset name such as ``"kvarn_k4v2_g128"`` (a Preset passes through)."""
    if isinstance(preset, Preset):
        return preset
    if not isinstance(preset, str):
        raise TypeError(f"a KVarN preset is a name like {DEFAULT_PRESET!r}, got {type(preset).__name__}")
    return _parse(preset)


def named_preset(preset: str | Preset = DEFAULT_PRESET) -> Preset:
    """``get_preset`` for a cache: its ops take the preset by name, so a Preset with knobs its name does not carry
    (other normalisation iterations, value flips or patience) is an error here, not quantized silently with the
    name's."""
    p = get_preset(preset)
    if p != _parse(p.name):
        raise ValueError(f"the cache ops take a preset by its name, and {p} is not what {p.name!r} names (its "
                         f"iterations, value_flips or patience differ); allocate with {p.name!r}")  # fmt: skip
    return p
