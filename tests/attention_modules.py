"""Single attention layers that own their cache buffers, for one compiled step function called with each layer
(``step(layer, x, pos)``): Dynamo passes the layer's weights and buffers as inputs and guards them by shape, so one
graph serves every layer of a kind. MLA (``LatentAttention``) and a mask read from a module table
(``MaskTableAttention``, gpt-fast's way)."""

import torch
import torch.nn.functional as F
from torch import nn


class LatentAttention(nn.Module):
    """MLA as DeepSeek-V3 caches it: the latent c [B, 1, L, R] and the rope key [B, 1, L, Dr] are written at
    ``pos``; K = [c @ W_kb, rope] and V = c @ W_vb per head, expanded from the whole cache each step."""

    def __init__(self, dim=128, heads=2, rank=64, rope=64, nope=64, dv=64, batch=1, max_len=320):
        super().__init__()
        self.heads, self.rank, self.rope, self.nope, self.dv = heads, rank, rope, nope, dv
        self.wq = nn.Linear(dim, heads * (nope + rope), bias=False)
        self.wkv_a = nn.Linear(dim, rank + rope, bias=False)
        self.wkv_b = nn.Linear(rank, heads * (nope + dv), bias=False)
        self.register_buffer("c_cache", torch.zeros(batch, 1, max_len, rank))
        self.register_buffer("r_cache", torch.zeros(batch, 1, max_len, rope))

    def forward(self, x, pos):  # x [B, T, dim], pos [T]: the positions written, consecutive
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.heads, -1).transpose(1, 2)
        c, rope = self.wkv_a(x).split([self.rank, self.rope], -1)
        self.c_cache.index_copy_(2, pos, c[:, None])
        self.r_cache.index_copy_(2, pos, rope[:, None])
        length = self.c_cache.shape[2]
        kv = self.wkv_b(self.c_cache[:, 0]).view(b, length, self.heads, -1).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.dv], -1)
        k = torch.cat([k_nope, self.r_cache.expand(b, self.heads, length, self.rope)], -1)
        mask = torch.arange(length)[None, :] <= pos[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, heads, T, dv]


class MaskTableAttention(nn.Module):
    """Attention over K/V cache buffers [B, 2, L, 64] written at ``pos``, masked by rows of a registered table,
    causal within ``window`` tokens (0: plain causal): the window is in the table's values only."""

    def __init__(self, window=0, batch=1, max_len=320):
        super().__init__()
        k_pos, q_pos = torch.arange(max_len)[None, :], torch.arange(max_len)[:, None]
        table = (k_pos <= q_pos) & (k_pos > q_pos - window) if window else k_pos <= q_pos
        self.register_buffer("mask_table", table)
        self.register_buffer("k_cache", torch.zeros(batch, 2, max_len, 64))
        self.register_buffer("v_cache", torch.zeros(batch, 2, max_len, 64))

    def forward(self, q, k, v, pos):  # q/k/v [B, 2, T, 64], pos [T]
        self.k_cache.index_copy_(2, pos, k)
        self.v_cache.index_copy_(2, pos, v)
        return F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=self.mask_table[pos])
