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

from .presets import LatentLayout, Preset, TileLayout, check_head_dim, get_preset

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
    """Unbiased std of y along ``dim``, in two passes as the kernels (the mean, then the squares of the deviations
    from it). NOTE (this CPU, torch 2.13+cpu, [8, 128, 128] fp32): 0.15 ms against torch.std's 0.75 ms, which made
    2/3 of the CPU quantizer's time."""
    dev = y - y.mean(dim, keepdim=True)
    return (dev.square().sum(dim) / (y.shape[dim] - 1)).sqrt().clamp(STD_MIN, STD_MAX)


def _imbalance(y: torch.Tensor) -> torch.Tensor:
    per_tok, per_chan = _std(y, -1), _std(y, -2)
    return per_tok.amax(-1) / per_tok.amin(-1) + per_chan.amax(-1) / per_chan.amin(-1)


def normalised(x: torch.Tensor, log_tok: torch.Tensor, log_chan: torch.Tensor) -> torch.Tensor:
    """x [..., G, D] divided by exp(log_tok) [..., G] per token and exp(log_chan) [..., D] per channel."""
    return x * torch.exp(-log_tok)[..., :, None] * torch.exp(-log_chan)[..., None, :]


def normalisation_pass(x: torch.Tensor, log_tok: torch.Tensor, log_chan: torch.Tensor, tokens: bool) -> torch.Tensor:
    """One pass of ``balance``: the token log-scales [..., G] after dividing the normalised tile by each token's std
    over the channels (``tokens``), else the channel log-scales [..., D] after dividing by each channel's std over
    the tokens."""
    if tokens:
        return (log_tok + torch.log(_std(normalised(x, log_tok, log_chan), -1))).clamp(LOG_SCALE_MIN, LOG_SCALE_MAX)
    return (log_chan + torch.log(_std(normalised(x, log_tok, log_chan), -2))).clamp(LOG_SCALE_MIN, LOG_SCALE_MAX)


def balance(
    x: torch.Tensor, iterations: int, tokens_first: bool, patience: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Iterative variance normalisation of x [..., G, D] (float32).

    Each iteration divides by the per-token std (over channels) and then by the per-channel std
    (over tokens), or the other way round when ``tokens_first`` is False (``normalisation_pass``); stds are
    unbiased, about the mean, but the tile is never mean-centred. Returns the log-scales ``(log_tok [..., G],
    log_chan [..., D])`` of the iterate with the lowest imbalance (the all-zero start included), so that the
    normalised tile is ``x / exp(log_tok)[..., :, None] / exp(log_chan)[..., None, :]``.

    ``patience`` > 0: a tile's iterations end after that many in a row that do not lower its imbalance (by the
    margin), at most ``iterations``; 0: all of them, as the paper. NOTE (SmolLM2-135M, stdlib text, 4,320 key
    and 4,320 value tiles; benchmarks/normalisation_iterations.py, benchmarks/results/cpu-s39): patience 2 keeps
    the full run's iterate for every key tile and 99.4% of the value tiles after 3.05 and 4.28 iterations on
    average; patience 1 (2.05 / 3.30 iterations, 97.6% of the value tiles) raised the KL to fp16 by up to 1.8%
    (k4v2) and 7% (k4v4) on three spans of that text. Which presets use it: ``Preset.patience``.
    """
    log_tok = x.new_zeros(x.shape[:-1])
    log_chan = x.new_zeros(x.shape[:-2] + x.shape[-1:])

    best = _imbalance(x)
    best_tok, best_chan = log_tok, log_chan
    limit = patience or iterations + 1  # misses that end a tile's iterations (none, for 0)
    misses = torch.zeros_like(best, dtype=torch.int32)  # iterations in a row that did not lower a tile's imbalance
    for _ in range(iterations):
        if tokens_first:
            log_tok = normalisation_pass(x, log_tok, log_chan, tokens=True)
            log_chan = normalisation_pass(x, log_tok, log_chan, tokens=False)
        else:
            log_chan = normalisation_pass(x, log_tok, log_chan, tokens=False)
            log_tok = normalisation_pass(x, log_tok, log_chan, tokens=True)
        imbalance = _imbalance(normalised(x, log_tok, log_chan))
        better = (misses < limit) & (imbalance < best * (1 - IMBALANCE_MARGIN))
        best = torch.where(better, imbalance, best)
        best_tok = torch.where(better[..., None], log_tok, best_tok)
        best_chan = torch.where(better[..., None], log_chan, best_chan)
        misses = torch.where(better, 0, misses + 1)
        if patience and not (misses < limit).any():
            break
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


def quantize_keys(k_rot: torch.Tensor, bits: int, iterations: int, patience: int) -> tuple[torch.Tensor, ...]:
    """The key half of a tile: rotated keys k_rot [..., G, D] -> (codes [..., G, D], chan_scale [..., D],
    chan_zero [..., D], tok_scale [..., G]), scales in fp16; read back by ``dequantize_keys``. Also MLA's
    latent (``quantize_latent``). ``iterations``, ``patience``: ``balance``'s."""
    k = k_rot.float()
    # The tile viewed as [channels x tokens] normalises tokens first (values: channels first).
    k_lt, k_lc = balance(k, iterations, tokens_first=True, patience=patience)
    k_tok, k_chan = torch.exp(k_lt), torch.exp(k_lc)
    codes, scale, zero = rtn(k / k_tok[..., :, None] / k_chan[..., None, :], bits, -2)
    return codes, _fp16(scale * k_chan), _fp16(zero * k_chan), _fp16(k_tok)


def dequantize_keys(codes, chan_scale, chan_zero, tok_scale) -> torch.Tensor:
    """Keys [..., G, D] in float32, rotated space, from ``quantize_keys``' parts."""
    codes, chan_scale, chan_zero, tok_scale = (x.float() for x in (codes, chan_scale, chan_zero, tok_scale))
    return (codes * chan_scale[..., None, :] + chan_zero[..., None, :]) * tok_scale[..., :, None]


def quantize_tile(k_rot: torch.Tensor, v_rot: torch.Tensor, preset: str | Preset) -> QuantizedTile:
    """Quantize rotated tiles k_rot [..., G, Dk] and v_rot [..., G, Dv] (any float dtype)."""
    preset = get_preset(preset)
    keys = quantize_keys(k_rot, preset.key_bits, preset.iterations, preset.patience)
    v = v_rot.float()
    v_lt, v_lc = balance(v, preset.iterations, tokens_first=False, patience=preset.patience)
    v_tok, v_chan = torch.exp(v_lt), torch.exp(v_lc)
    v_norm = v / v_tok[..., :, None] / v_chan[..., None, :]
    v_codes, v_scale, v_zero = rtn(v_norm, preset.value_bits, -1)
    if preset.value_flips:
        x = (v_norm - v_zero[..., None]) / v_scale[..., None].clamp_min(1e-30)
        v_step = _fp16(v_scale * v_tok).float()  # as stored
        v_codes = balance_roundings(v_codes, x, v_step, preset.value_bits, preset.value_flips)
    k_codes, *k_scales = keys
    return QuantizedTile(k_codes, v_codes, *k_scales, _fp16(v_chan), _fp16(v_scale * v_tok), _fp16(v_zero * v_tok))


def dequantize_tile(tile: QuantizedTile) -> tuple[torch.Tensor, torch.Tensor]:
    """Read a tile back: (k_rot [..., G, Dk], v_rot [..., G, Dv]) in float32, rotated space."""
    v_codes, v_cs, v_ts, v_tz = (
        x.float() for x in (tile.v_codes, tile.v_chan_scale, tile.v_tok_scale, tile.v_tok_zero)
    )
    v = (v_codes * v_ts[..., :, None] + v_tz[..., :, None]) * v_cs[..., None, :]
    return dequantize_keys(tile.k_codes, tile.k_chan_scale, tile.k_chan_zero, tile.k_tok_scale), v


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
    shifts = torch.arange(n, device=packed.device, dtype=torch.uint8) * bits
    codes = (packed[..., None] >> shifts) & (2**bits - 1)  # in uint8: a quarter of int32's bytes to move
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * n)


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


# ----------------------------------------------------------------------------------------------------
# 6. MLA latent tiles (layout ``presets.LatentLayout``)
# ----------------------------------------------------------------------------------------------------
class LatentTile(NamedTuple):
    """A quantized MLA tile, unpacked: the latent as ``quantize_keys`` gives it, the rope key as given."""

    c_codes: torch.Tensor  # uint8 [..., G, L]
    c_chan_scale: torch.Tensor  # fp16 [..., L]
    c_chan_zero: torch.Tensor  # fp16 [..., L]
    c_tok_scale: torch.Tensor  # fp16 [..., G]
    rope: torch.Tensor  # [..., G, R] fp16 or bf16


def quantize_latent(c_rot: torch.Tensor, rope: torch.Tensor, preset: str | Preset) -> LatentTile:
    """Rotated latents c_rot [..., G, L] (any float dtype) and rope keys rope [..., G, R] (fp16/bf16, kept)."""
    preset = get_preset(preset)
    return LatentTile(*quantize_keys(c_rot, preset.key_bits, preset.iterations, preset.patience), rope)


def pack_latent(tile: LatentTile, layout: LatentLayout) -> torch.Tensor:
    """LatentTile -> uint8 records [..., layout.nbytes]."""
    batch = tile.c_codes.shape[:-2]
    parts = [pack_codes(tile.c_codes, layout.bits).reshape(*batch, -1)]
    parts += [_as_bytes(s) for s in tile[1:4]]
    parts.append(_as_bytes(tile.rope.reshape(*batch, -1)))
    parts.append(tile.c_codes.new_zeros(*batch, layout.nbytes - layout.used_bytes))
    return torch.cat(parts, -1)


def unpack_latent(records: torch.Tensor, layout: LatentLayout, rope_dtype: torch.dtype) -> LatentTile:
    """uint8 records [..., layout.nbytes] -> LatentTile (the rope key in ``rope_dtype``, as stored)."""
    if records.dtype != torch.uint8 or records.shape[-1] != layout.nbytes:
        raise ValueError(f"expected uint8 MLA tile records [..., {layout.nbytes}], got {records.dtype} "
                         f"{tuple(records.shape)}")  # fmt: skip
    batch, g, dl = records.shape[:-1], layout.tile_size, layout.latent_dim

    def view(start: int, n: int, dtype: torch.dtype) -> torch.Tensor:
        return records[..., start : start + 2 * n].contiguous().view(dtype)

    c_bytes = records[..., layout.c_codes : layout.c_chan_scale].reshape(*batch, g, layout.c_row_bytes)
    return LatentTile(
        unpack_codes(c_bytes, layout.bits),
        view(layout.c_chan_scale, dl, torch.float16), view(layout.c_chan_zero, dl, torch.float16),
        view(layout.c_tok_scale, g, torch.float16),
        view(layout.rope, g * layout.rope_dim, rope_dtype).reshape(*batch, g, layout.rope_dim),
    )  # fmt: skip


def check_latent_tiles(c: torch.Tensor, rope: torch.Tensor, preset: Preset) -> None:
    """That latents c [..., G, L] and rope keys [..., G, R] are whole tiles of ``preset``, the rope key in a dtype
    a record stores (as the model gives it: float16 or bfloat16)."""
    if c.dim() < 2 or c.shape[-2] != preset.tile_size or c.shape[:-1] != rope.shape[:-1]:
        raise ValueError(f"c and rope must be tiles [..., {preset.tile_size}, L] / [..., {preset.tile_size}, R] "
                         f"for {preset.name}, got {tuple(c.shape)} and {tuple(rope.shape)}")  # fmt: skip
    if rope.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"the rope key is stored as the model gives it: float16 or bfloat16, got {rope.dtype}")


def quantize_latent_records(c_rot: torch.Tensor, rope: torch.Tensor, preset: str | Preset) -> torch.Tensor:
    """Rotated latents c_rot [..., G, L] and rope keys [..., G, R] -> packed uint8 records [..., nbytes]."""
    preset = get_preset(preset)
    check_latent_tiles(c_rot, rope, preset)
    layout = preset.latent_layout(c_rot.shape[-1], rope.shape[-1])
    return pack_latent(quantize_latent(c_rot, rope, preset), layout)


def dequantize_latent_records(records: torch.Tensor, layout: LatentLayout,
                              rope_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Packed records [..., nbytes] -> (c_rot [..., G, L], rope [..., G, R]), float32."""
    if rope_dtype not in (torch.float16, torch.bfloat16) or records.shape[-1:] != (layout.nbytes,):
        raise ValueError(f"expected records [..., {layout.nbytes}] with a float16 or bfloat16 rope key, got "
                         f"{tuple(records.shape)} and {rope_dtype}")  # fmt: skip
    tile = unpack_latent(records, layout, rope_dtype)
    return dequantize_keys(*tile[:4]), tile.rope.float()


def latent_roundtrip(c: torch.Tensor, rope: torch.Tensor, preset: str | Preset = "kvarn_k4v2_g128"):
    """Quantize and read back MLA tiles: latents c [..., G, L] and rope keys [..., G, R] (not rotated).
    Returns (c_hat, rope_hat), same shapes and dtypes; rope_hat equals rope (it is stored as given)."""
    preset = get_preset(preset)
    check_latent_tiles(c, rope, preset)
    layout = preset.latent_layout(c.shape[-1], rope.shape[-1])
    c_hat, rope_hat = dequantize_latent_records(quantize_latent_records(rotate(c.float()), rope, preset), layout,
                                                rope.dtype)  # fmt: skip
    return rotate(c_hat).to(c.dtype), rope_hat.to(rope.dtype)
