"""A torchtune-style decoder for the backend tests (written here after torchtune's ``KVCache`` and
``MultiHeadAttention``; torchtune itself is not a dependency).

What the pass must see through: the cache's write positions come from a module buffer ``cache_pos``
(``arange(max_len)``, sliced to the new tokens and advanced in place after the write); GQA is spelled
``unsqueeze(2).expand(...).flatten(1, 2)``; the mask is made outside the model, as torchtune's generation
utilities do (rows of a causal mask, [B, T, max_len] bool), and indexed to [B, 1, T, max_len] inside.
"""

import torch
import torch.nn.functional as F
from torch import nn


class KVCache(nn.Module):
    def __init__(self, batch: int, max_len: int, heads: int, head_dim: int, dtype: torch.dtype):
        super().__init__()
        shape = (batch, heads, max_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("cache_pos", torch.arange(0, max_len), persistent=False)

    def update(self, k_val, v_val):  # [B, H, T, D] each
        seq_len = k_val.shape[2]
        self.k_cache[:, :, self.cache_pos[:seq_len]] = k_val
        self.v_cache[:, :, self.cache_pos[:seq_len]] = v_val
        self.cache_pos.add_(seq_len)
        return self.k_cache, self.v_cache


class MultiHeadAttention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int, cache: KVCache):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(dim, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.output_proj = nn.Linear(heads * head_dim, dim, bias=False)
        self.kv_cache = cache

    def forward(self, x, mask):
        b, s, _ = x.shape
        per_kv = self.heads // self.kv_heads
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        k, v = self.kv_cache.update(k, v)
        expand = (b, self.kv_heads, per_kv, -1, self.head_dim)
        k = k.unsqueeze(2).expand(expand).flatten(1, 2)
        v = v.unsqueeze(2).expand(expand).flatten(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, :, :], dropout_p=0.0)
        return self.output_proj(y.transpose(1, 2).contiguous().view(b, s, -1))


class TorchtuneStyle(nn.Module):
    def __init__(self, batch=2, max_len=320, vocab=512, dim=128, layers=2, heads=4, kv_heads=2, head_dim=64):
        super().__init__()
        self.max_len = max_len
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            MultiHeadAttention(
                dim, heads, kv_heads, head_dim, KVCache(batch, max_len, kv_heads, head_dim, torch.float32)
            )
            for _ in range(layers)
        )
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, mask):  # tokens [B, T], mask [B, T, max_len] bool (True: attend)
        x = self.embed(tokens)
        for layer in self.layers:
            x = x + layer(x, mask)
        return self.output(x)


def causal_rows(batch: int, start: int, tokens: int, max_len: int) -> torch.Tensor:
    """The mask torchtune's generation passes for tokens [start, start + tokens): causal mask rows."""
    causal = torch.tril(torch.ones(max_len, max_len, dtype=torch.bool))
    return causal[None, start : start + tokens].expand(batch, -1, -1)
