"""A transparent model of what the KVarN cache must serve, built from the tile-level reference only.

It keeps every token of every slot unquantized and rebuilds, for any call, the keys and values attention
must see: quantized-and-read-back tiles before the chunk's first tile (the first tile exact when it is
kept), exact rows after that. Tests compare the paged cache and the kernels against it.
"""

import torch

from kvarn_compile import Batch
from kvarn_compile.reference import dequantize_records, quantize_records, rotate


def random_call(call, lengths, hq, hkv, dk, dv, dtype):
    """Random q, k, v for one call ({slot: new tokens}) continuing ``lengths`` ({slot: cached tokens}).

    Keys have channels of very different scales and one outlier channel, like real post-RoPE keys.
    Returns (batch, q, k, v).
    """
    slots = list(call)
    counts = [call[s] for s in slots]
    total = sum(counts)
    q = torch.randn(total, hq, dk).to(dtype)
    k = torch.randn(total, hkv, dk) * torch.linspace(0.2, 5, dk)
    k[:, :, 3] += 8
    v = torch.randn(total, hkv, dv).to(dtype)
    return Batch.from_lengths(slots, [lengths.get(s, 0) for s in slots], counts), q, k.to(dtype), v


class CacheModel:
    def __init__(self, preset, dtype, keep_first_tile=False):
        self.preset, self.dtype, self.sink = preset, dtype, keep_first_tile
        self.k, self.v = {}, {}  # slot -> [L, Hkv, D] float32 (unrotated)

    def store(self, slot, start, k, v):
        old_k = self.k.get(slot, k[:0].float())[:start]
        old_v = self.v.get(slot, v[:0].float())[:start]
        self.k[slot] = torch.cat([old_k, k.float()])
        self.v[slot] = torch.cat([old_v, v.float()])

    def _exact(self, x):
        return rotate(rotate(x).to(self.dtype).float())

    def seen(self, slot, length):
        """(k, v) [length, Hkv, D] float32 as attention sees a slot's first ``length`` tokens."""
        g = self.preset.tile_size
        k, v = self.k[slot][:length], self.v[slot][:length]
        full = length // g
        k_seen, v_seen = self._exact(k), self._exact(v)
        first = 1 if self.sink else 0
        if full > first:
            tiles_k = rotate(k[first * g : full * g]).to(self.dtype).unflatten(0, (-1, g)).transpose(1, 2)
            tiles_v = rotate(v[first * g : full * g]).to(self.dtype).unflatten(0, (-1, g)).transpose(1, 2)
            records = quantize_records(tiles_k, tiles_v, self.preset)
            k_hat, v_hat = dequantize_records(records, self.preset.layout(k.shape[-1], v.shape[-1]))
            k_seen[first * g : full * g] = rotate(k_hat).transpose(1, 2).flatten(0, 1)
            v_seen[first * g : full * g] = rotate(v_hat).transpose(1, 2).flatten(0, 1)
        return k_seen, v_seen


def dense_attention(q, k, v, start, scale, causal=True, window=0):
    """q [n, Hq, D] at positions start.., k/v [start+n, Hkv, D] -> [n, Hq, Dv] (float64 math)."""
    n, hq = q.shape[:2]
    group = hq // k.shape[1]
    keys = k.double().repeat_interleave(group, 1).transpose(0, 1)
    values = v.double().repeat_interleave(group, 1).transpose(0, 1)
    q_pos = start + torch.arange(n)[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    visible = (k_pos < start) | (k_pos <= q_pos) if causal else torch.ones(n, k.shape[0], dtype=torch.bool)
    if window:
        visible &= k_pos > q_pos - window
    scores = q.double().transpose(0, 1) @ keys.transpose(1, 2) * scale
    return (scores.masked_fill(~visible, float("-inf")).softmax(-1) @ values).transpose(0, 1)
