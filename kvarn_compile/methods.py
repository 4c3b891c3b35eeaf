"""KV-cache methods as tile roundtrips: KVarN presets and the baselines they are measured against.

A method turns one tile of keys and values into what attention later reads back. Evaluation runs every
method through the same cache semantics (same tiles, same exact first/current tiles), so the only
difference between two rows of a table is the method. Shape legend: k [..., G, Dk], v [..., G, Dv]
(tokens x channels, not rotated), in the KV-cache dtype.

Names:
    fp16                       no quantization (the cache dtype itself)
    kvarn_k{kb}v{vb}_g{G}      KVarN: rotation + variance normalisation (k4v2_g128 ending after two iterations
                               that do not help: ``Preset.patience``) + RTN with balanced value roundings
                               (``presets``, ``reference``)
    paper_kvarn_k{kb}v{vb}_g{G}  KVarN as the paper quantizes: all normalisation iterations, plain RTN of the values
                               (same bytes)
    hadamard_rtn_k{kb}v{vb}_g{G}   rotation and RTN, no normalisation (same bytes as KVarN)
    rtn_k{kb}v{vb}_g{G}        plain RTN: keys per channel, values per token (same bytes as KVarN)
    kivi2                      KIVI: 2-bit keys per channel, 2-bit values per token, fp16 scale/zero, G=128
    fp8                        float8 e4m3 with one scale per tile and KV head (amax / 448)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch

from .presets import DEFAULT_PRESET, NAMED_PRESETS, Preset, get_preset
from .reference import dequantize_records, quantize_records, rotate, rtn

Roundtrip = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

BASELINES = ("fp16", "paper_kvarn_k4v2_g128", "rtn_k4v2_g128", "hadamard_rtn_k4v2_g128", "kivi2", "fp8")
DEFAULT_METHODS = ("fp16", *NAMED_PRESETS, *BASELINES[1:])
FP8_MAX = 448.0  # largest finite float8 e4m3fn
KIVI_TILE = 128


@dataclasses.dataclass(frozen=True)
class Method:
    """How one KV method stores a tile: its name, tile size, roundtrip and cost.

    ``roundtrip`` is None for the unquantized cache. ``bytes_per_token(dk, dv)`` is what one token of one
    KV head costs once its tile is quantized (codes and scales). ``preset`` is the KVarN tile format the
    method stores (kvarn_, hadamard_rtn_, rtn_ names), which limits the head dims; None for the others.
    """

    name: str
    tile_size: int
    roundtrip: Roundtrip | None
    bytes_per_token: Callable[[int, int], float]
    preset: Preset | None = None

    @property
    def exact(self) -> bool:
        return self.roundtrip is None


def _preset_roundtrip(preset: Preset, rotated: bool) -> Roundtrip:
    """Quantize and read back a tile exactly as the paged cache does: rotate (or not) in fp32, round
    once to the cache dtype (what the exact tile holds), quantize, dequantize, rotate back."""

    def roundtrip(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if k.shape[-2] != preset.tile_size or v.shape[-2] != preset.tile_size:
            raise ValueError(f"expected tiles [..., {preset.tile_size}, D], got k {tuple(k.shape)}, v {tuple(v.shape)}")
        turn = rotate if rotated else (lambda x: x)
        k_in, v_in = (turn(x.float()).to(x.dtype) for x in (k, v))
        layout = preset.layout(k.shape[-1], v.shape[-1])
        k_hat, v_hat = dequantize_records(quantize_records(k_in, v_in, preset), layout)
        return turn(k_hat).to(k.dtype), turn(v_hat).to(v.dtype)

    return roundtrip


def _kivi2(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    def fake_quant(x: torch.Tensor, dim: int) -> torch.Tensor:
        codes, scale, zero = rtn(x.float(), 2, dim)
        # scales and zeros are stored in fp16, as in KIVI
        scale, zero = scale.half().float().unsqueeze(dim), zero.half().float().unsqueeze(dim)
        return (codes.float() * scale + zero).to(x.dtype)

    return fake_quant(k, -2), fake_quant(v, -1)


def _fp8(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    def fake_quant(x: torch.Tensor) -> torch.Tensor:
        scale = (x.float().abs().amax((-2, -1), keepdim=True) / FP8_MAX).clamp_min(1e-12)
        return ((x.float() / scale).to(torch.float8_e4m3fn).float() * scale).to(x.dtype)

    return fake_quant(k), fake_quant(v)


def _kivi2_bytes(dk: int, dv: int) -> float:
    # 2-bit codes; keys: fp16 scale + zero per channel and tile; values: fp16 scale + zero per token
    return (dk + dv) * 2 / 8 + 4 * dk / KIVI_TILE + 4


@functools.cache
def get_method(name: str = DEFAULT_PRESET) -> Method:
    """The method called ``name`` (see the module docstring); ValueError naming the valid forms otherwise."""
    if name == "fp16":
        return Method(name, 1, None, lambda dk, dv: 2.0 * (dk + dv))
    if name == "kivi2":
        return Method(name, KIVI_TILE, _kivi2, _kivi2_bytes)
    if name == "fp8":
        return Method(name, 128, _fp8, lambda dk, dv: float(dk + dv))
    # prefix, rotated, normalisation iterations (None: the preset's), ours (balanced value roundings and the
    # normalisation's early stop; else the paper's plain RTN of the values after all its iterations)
    stages = (
        ("kvarn_", True, None, True), ("paper_kvarn_", True, None, False),
        ("hadamard_rtn_", True, 0, False), ("rtn_", False, 0, False),
    )  # fmt: skip
    for prefix, rotated, iterations, ours in stages:
        if name.startswith(prefix):
            preset = get_preset("kvarn_" + name[len(prefix) :])
            if iterations is not None:
                preset = dataclasses.replace(preset, iterations=iterations)
            if not ours:
                preset = dataclasses.replace(preset, value_flips=0, patience=0)
            return Method(name, preset.tile_size, _preset_roundtrip(preset, rotated), preset.bytes_per_token, preset)
    raise ValueError(
        f"unknown KV method {name!r}: expected fp16, fp8, kivi2, or kvarn_/paper_kvarn_/hadamard_rtn_/rtn_ followed by "
        f"k{{kb}}v{{vb}}_g{{G}} (e.g. kvarn_k4v2_g128)"
    )
