"""The KVarN math in plain PyTorch: the test oracle for every kernel and the CPU implementation.

One tile is G consecutive tokens of one KV head. Shape legend (leading ``...`` = any batch of tiles):

    G   tokens per tile            Dk, Dv   key / value head dims
    k   [..., G, Dk]  keys         v        [..., G, Dv] values          (tokens x channels)

Steps (facts in the project notes, kvarn-method.md):
  1. rotate channels with a normalised Sylvester Hadamard matrix (``rotate``; block-diagonal when the
     head dim is not a power of two, e.g. 3 blocks of 64 for 192);
  2. iterative variance normalisation in log space (``balance``);
  3. asymmetric round-to-nearest: keys per channel, values per token (``rtn``), value roundings then
     balanced over each channel's tokens (``balance_roundings``; this project's addition);
  4. fold the RTN scale/zero into the normalisation scale of the same axis (``quantize_tile``), so that
     read-back is one multiply-add and one multiply (``dequantize_tile``);
  5. pack the codes and fp16 scales into one uint8 record per tile (``pack_tile`` / ``unpack_tile``,
     layout in ``presets``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from .presets import Preset, TileLayout, check_head_dim, get_preset

# Normalisation constants of the method: clamp each std, clip the accumulated log-scales.
STD_MIN, STD_MAX = 1e-3, 1e3
LOG_SCALE_MIN, LOG_SCALE_MAX = -0.3, 10.0
# A later iterate replaces the best one only if it lowers the imbalance by this relative margin.
# NOTE: with a strict "<", a 1e-6 perturbation changed the chosen iterate in 25-55% of tiles (notes);
# the margin makes kernels and this reference pick the same iterate except in rare near-ties.
IMBALANCE_MARGIN = 1e-3
FP16_MAX = 65504.0


# ----------------------------------------------------------------------------------------------------
# 1. Rotation
# ----------------------------------------------------------------------------------------------------
def rotation_block(head_dim: int) -> int:
    """Size of the Hadamard blocks for ``head_dim``: its largest power-of-two divisor."""
    check_head_dim(head_dim)
    return head_dim & -head_dim


@functools.cache
def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n**0.5


@functools.cache
def _hadamard_on(head_dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return _sylvester(rotation_block(head_dim)).to(dtype=dtype, device=device)


def hadamard(head_dim: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """The [R, R] normalised Sylvester Hadamard block used for ``head_dim`` (H = H^T = H^-1).

    Cached per device and dtype, so that a call under CUDA-graph capture copies nothing from the host.
    """
    return _hadamard_on(head_dim, dtype, torch.device(device if device is not None else "cpu"))


@functools.cache
def hadamard_signs(head_dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The unnormalised +-1 block of ``hadamard`` (exact in fp16/bf16; ``hadamard = signs / sqrt(R)``).
    Cached per device and dtype (nothing is copied under CUDA-graph capture)."""
    r = rotation_block(head_dim)
    return (_sylvester(r) * r**0.5).round().to(dtype=dtype, device=device)


def rotate(x: torch.Tensor, h: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., D] -> x @ blockdiag(H, ..., H). Its own inverse. Computed in x's dtype unless h differs."""
    d = x.shape[-1]
    if h is None:
        h = hadamard(d, x.dtype, x.device)
    r = h.shape[-1]
    return (x.reshape(-1, r) @ h.to(x.dtype)).reshape(x.shape)  # one 2-D GEMM (batched ones are slow here)


# ----------------------------------------------------------------------------------------------------
# 2. Variance normalisation
# ----------------------------------------------------------------------------------------------------
def _std(y: torch.Tensor, dim: int) -> torch.Tensor:
    return y.std(dim=dim, correction=1).clamp(STD_MIN, STD_MAX)


def _imbalance(y: torch.Tensor) -> torch.Tensor:
    per_tok, per_chan = _std(y, -1), _std(y, -2)
    return per_tok.amax(-1) / per_tok.amin(-1) + per_chan.amax(-1) / per_chan.amin(-1)


def balance(x: torch.Tensor, iterations: int, tokens_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Iterative variance normalisation of x [..., G, D] (float32).

    Each iteration divides by the per-token std (over channels) and then by the per-channel std
    (over tokens), or the other way round when ``tokens_first`` is False; stds are unbiased, about the
    mean, but the tile is never mean-centred. Returns the log-scales ``(log_tok [..., G], log_chan [..., D])``
    of the iterate with the lowest imbalance (the all-zero start included), so that the normalised tile is
    ``x / exp(log_tok)[..., :, None] / exp(log_chan)[..., None, :]``.
    """
    log_tok = x.new_zeros(x.shape[:-1])
    log_chan = x.new_zeros(x.shape[:-2] + x.shape[-1:])

    def normalized(lt: torch.Tensor, lc: torch.Tensor) -> torch.Tensor:
        return x * torch.exp(-lt)[..., :, None] * torch.exp(-lc)[..., None, :]

    def step_tok(lt, lc):
        return (lt + torch.log(_std(normalized(lt, lc), -1))).clamp(LOG_SCALE_MIN, LOG_SCALE_MAX)

    def step_chan(lt, lc):
        return (lc + torch.log(_std(normalized(lt, lc), -2))).clamp(LOG_SCALE_MIN, LOG_SCALE_MAX)

    best = _imbalance(x)
    best_tok, best_chan = log_tok, log_chan
    for _ in range(iterations):
        if tokens_first:
            log_tok = step_tok(log_tok, log_chan)
            log_chan = step_chan(log_tok, log_chan)
        else:
            log_chan = step_chan(log_tok, log_chan)
            log_tok = step_tok(log_tok, log_chan)
        imbalance = _imbalance(normalized(log_tok, log_chan))
        better = imbalance < best * (1 - IMBALANCE_MARGIN)
        best = torch.where(better, imbalance, best)
        best_tok = torch.where(better[..., None], log_tok, best_tok)
        best_chan = torch.where(better[..., None], log_chan, best_chan)
    return best_tok, best_chan


# ----------------------------------------------------------------------------------------------------
# 3. Round-to-nearest
# ----------------------------------------------------------------------------------------------------
def rtn(y: torch.Tensor, bits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric RTN of y along ``dim``: returns (codes uint8, scale, zero) with y ~ codes*scale + zero."""
    levels = 2**bits - 1
    lo = y.amin(dim, keepdim=True)
    scale = (y.amax(dim, keepdim=True) - lo) / levels
    # floor(x + 0.5), not torch.round (half-to-even), so that the kernels can match it exactly.
    codes = torch.floor((y - lo) / scale.clamp_min(1e-30) + 0.5).clamp(0, levels)
    return codes.to(torch.uint8), scale.squeeze(dim), lo.squeeze(dim)


def balance_roundings(codes: torch.Tensor, x: torch.Tensor, step: torch.Tensor, bits: int, flips: int) -> torch.Tensor:
    """Re-round value codes so that each channel's rounding errors cancel over the tile's tokens.

    codes [..., G, D] (RTN of x along D, per token), x [..., G, D] the exact positions in code units, step
    [..., G] each token's code step in value units. Attention reads a tile's values as a p-weighted sum over
    its tokens; errors that RTN leaves with the same sign in one channel add up there instead of cancelling.
    So each channel's weighted error sum E_d = sum_t step_t (codes - x)[t, d] is cancelled greedily: codes
    move, one at a time, by one step against the sign of E_d (within [0, 2^bits - 1]), the cheapest first
    (the one whose error grows least, 1 - 2 |codes - x| in code units), as long as the part of E_d left
    exceeds half the step of the code moved, at most ``flips`` per channel.
    Same bytes, same decode; the error per element grows ~3%, |E_d| shrinks ~10x.
    NOTE (SmolLM2-135M, stdlib corpus, first tile exact, 2026-12-01, benchmarks/results/smollm2-eval):
    KL of kvarn_k4v2_g128 5-7% lower on the evaluation text and on four held-out spans of it.
    """
    levels = 2**bits - 1
    codes = codes.float()
    err = codes - x
    w = step[..., :, None].expand_as(x)
    total = (w * err).sum(-2, keepdim=True)  # [..., 1, D]
    down = total > 0  # move codes down (each removes its step from E_d) or up
    sign = torch.where(down, 1.0, -1.0)
    left = total.abs()
    candidate = torch.where(down, codes > 0, codes < levels)
    cost = torch.where(candidate, 1 - 2 * sign * err, torch.inf)  # growth of the squared error, code units
    for _ in range(flips):
        best = cost.argmin(-2, keepdim=True)  # [..., 1, D]: the cheapest code of each channel not moved yet
        w_best = w.gather(-2, best)
        move = (cost.gather(-2, best) < torch.inf) & (left > w_best / 2)
        chosen = torch.zeros_like(candidate).scatter_(-2, best, move)
        codes = codes - torch.where(chosen, sign, 0.0)
        left = left - torch.where(move, w_best, 0.0)
        cost = torch.where(chosen, torch.inf, cost)
    return codes.to(torch.uint8)


# ----------------------------------------------------------------------------------------------------
# 4. Tiles
# ----------------------------------------------------------------------------------------------------
class QuantizedTile(NamedTuple):
    """A quantized tile, unpacked. Codes are uint8 (one code per element), scales fp16."""

    k_codes: torch.Tensor  # [..., G, Dk]
    v_codes: torch.Tensor  # [..., G, Dv]
    k_chan_scale: torch.Tensor  # [..., Dk]
    k_chan_zero: torch.Tensor  # [..., Dk]
    k_tok_scale: torch.Tensor  # [..., G]
    v_chan_scale: torch.Tensor  # [..., Dv]
    v_tok_scale: torch.Tensor  # [..., G]
    v_tok_zero: torch.Tensor  # [..., G]


def _fp16(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-FP16_MAX, FP16_MAX).to(torch.float16)


def quantize_tile(k_rot: torch.Tensor, v_rot: torch.Tensor, preset: str | Preset) -> QuantizedTile:
    """Quantize rotated tiles k_rot [..., G, Dk] and v_rot [..., G, Dv] (any float dtype)."""
    preset = get_preset(preset)
    k, v = k_rot.float(), v_rot.float()
    # Keys: the tile viewed as [channels x tokens] normalises tokens first; values, channels first.
    k_lt, k_lc = balance(k, preset.iterations, tokens_first=True)
    v_lt, v_lc = balance(v, preset.iterations, tokens_first=False)
    k_tok, k_chan, v_tok, v_chan = (torch.exp(s) for s in (k_lt, k_lc, v_lt, v_lc))
    k_codes, k_scale, k_zero = rtn(k / k_tok[..., :, None] / k_chan[..., None, :], preset.key_bits, -2)
    v_norm = v / v_tok[..., :, None] / v_chan[..., None, :]
    v_codes, v_scale, v_zero = rtn(v_norm, preset.value_bits, -1)
    if preset.value_flips:
        x = (v_norm - v_zero[..., None]) / v_scale[..., None].clamp_min(1e-30)
        v_step = _fp16(v_scale * v_tok).float()  # as stored
        v_codes = balance_roundings(v_codes, x, v_step, preset.value_bits, preset.value_flips)
    return QuantizedTile(
        k_codes, v_codes,
        _fp16(k_scale * k_chan), _fp16(k_zero * k_chan), _fp16(k_tok),
        _fp16(v_chan), _fp16(v_scale * v_tok), _fp16(v_zero * v_tok),
    )  # fmt: skip


def dequantize_tile(tile: QuantizedTile) -> tuple[torch.Tensor, torch.Tensor]:
    """Read a tile back: (k_rot [..., G, Dk], v_rot [..., G, Dv]) in float32, rotated space."""
    t = [x.float() for x in tile]
    k_codes, v_codes, k_cs, k_cz, k_ts, v_cs, v_ts, v_tz = t
    k = (k_codes * k_cs[..., None, :] + k_cz[..., None, :]) * k_ts[..., :, None]
    v = (v_codes * v_ts[..., :, None] + v_tz[..., :, None]) * v_cs[..., None, :]
    return k, v


# ----------------------------------------------------------------------------------------------------
# 5. Packing
# ----------------------------------------------------------------------------------------------------
def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes uint8 [..., n*C] -> bytes uint8 [..., C]: byte j holds codes n*j..n*j+n-1, low bits first."""
    n = 8 // bits
    grouped = codes.reshape(*codes.shape[:-1], codes.shape[-1] // n, n).to(torch.int32)
    shifts = torch.arange(n, device=codes.device, dtype=torch.int32) * bits
    return (grouped << shifts).sum(-1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of ``pack_codes``: bytes uint8 [..., C] -> codes uint8 [..., n*C]."""
    n = 8 // bits
    shifts = torch.arange(n, device=packed.device, dtype=torch.int32) * bits
    codes = (packed.to(torch.int32)[..., None] >> shifts) & (2**bits - 1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * n).to(torch.uint8)


def _as_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8).reshape(*x.shape[:-1], -1)


def pack_tile(tile: QuantizedTile, layout: TileLayout) -> torch.Tensor:
    """QuantizedTile -> uint8 records [..., layout.nbytes] (layout in ``presets``)."""
    batch = tile.k_codes.shape[:-2]
    k_bytes = pack_codes(tile.k_codes, layout.key_bits)  # [..., G, Dk*kb/8]
    v_bytes = pack_codes(tile.v_codes.transpose(-1, -2), layout.value_bits)  # [..., Dv, G*vb/8]
    parts = [k_bytes.reshape(*batch, -1), v_bytes.reshape(*batch, -1)]
    parts += [_as_bytes(s) for s in tile[2:]]
    pad = layout.nbytes - layout.used_bytes
    parts.append(tile.k_codes.new_zeros(*batch, pad))
    return torch.cat(parts, -1)


def unpack_tile(records: torch.Tensor, layout: TileLayout) -> QuantizedTile:
    """uint8 records [..., layout.nbytes] -> QuantizedTile."""
    if records.dtype != torch.uint8 or records.shape[-1] != layout.nbytes:
        raise ValueError(f"expected uint8 tile records [..., {layout.nbytes}], got {records.dtype} "
                         f"{tuple(records.shape)}")  # fmt: skip
    batch = records.shape[:-1]
    g, dk, dv = layout.tile_size, layout.head_dim_k, layout.head_dim_v

    def section(start: int, stop: int) -> torch.Tensor:
        return records[..., start:stop]

    def fp16(start: int, n: int) -> torch.Tensor:
        return section(start, start + 2 * n).contiguous().view(torch.float16)

    k_bytes = section(layout.k_codes, layout.v_codes).reshape(*batch, g, layout.k_row_bytes)
    v_bytes = section(layout.v_codes, layout.k_chan_scale).reshape(*batch, dv, layout.v_row_bytes)
    return QuantizedTile(
        unpack_codes(k_bytes, layout.key_bits),
        unpack_codes(v_bytes, layout.value_bits).transpose(-1, -2),
        fp16(layout.k_chan_scale, dk), fp16(layout.k_chan_zero, dk), fp16(layout.k_tok_scale, g),
        fp16(layout.v_chan_scale, dv), fp16(layout.v_tok_scale, g), fp16(layout.v_tok_zero, g),
    )  # fmt: skip


def quantize_records(k_rot: torch.Tensor, v_rot: torch.Tensor, preset: str | Preset) -> torch.Tensor:
    """Rotated tiles k_rot [..., G, Dk], v_rot [..., G, Dv] -> packed uint8 records [..., nbytes]."""
    preset = get_preset(preset)
    layout = preset.layout(k_rot.shape[-1], v_rot.shape[-1])
    return pack_tile(quantize_tile(k_rot, v_rot, preset), layout)


def dequantize_records(records: torch.Tensor, layout: TileLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed records [..., nbytes] -> (k_rot [..., G, Dk], v_rot [..., G, Dv]) float32."""
    return dequantize_tile(unpack_tile(records, layout))


def roundtrip(k: torch.Tensor, v: torch.Tensor, preset: str | Preset = "kvarn_k4v2_g128"):
    """Quantize and read back tiles k [..., G, Dk], v [..., G, Dv] (tokens x channels, not rotated).

    Returns (k_hat, v_hat) with the same shapes and dtypes: what attention sees from the cache.
    """
    preset = get_preset(preset)
    for name, x in (("k", k), ("v", v)):
        if x.dim() < 2 or x.shape[-2] != preset.tile_size:
            raise ValueError(f"{name} must be tiles [..., {preset.tile_size}, D] for {preset.name}, got "
                             f"{tuple(x.shape)}")  # fmt: skip
        if not x.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree on all but the last dim")
    k_rot, v_rot = rotate(k.float()), rotate(v.float())
    k_hat, v_hat = dequantize_records(quantize_records(k_rot, v_rot, preset), preset.layout(k.shape[-1], v.shape[-1]))
    return rotate(k_hat).to(k.dtype), rotate(v_hat).to(v.dtype)
