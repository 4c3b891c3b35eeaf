"""A gpt-fast-style model (pytorch-labs/gpt-fast's cache and attention, written here from its structure):
the KV cache is a module with registered buffers written at ``input_pos`` (a tensor of positions, by
assignment; or an int start, by copy_ into the slice or assignment to it), GQA by
``repeat_interleave``, and the mask is a row slice of a registered causal-mask buffer (optionally a
sliding window, over the full-length cache; optionally value heads of another size than key heads, as
in MLA models that cache decompressed keys and values: K 192 / V 128)."""

import torch
import torch.nn.functional as F
from torch import nn


class KVCache(nn.Module):
    copy_slices = True  # with an int start: copy_ into the slice (True) or assign to it
    # with a positions tensor: None assigns buf[:, :, pos]; "broadcast" scatters along dim 2 with the positions
    # broadcast to [B, H, T, D] ("expand_as": by ``expand_as(k)``); "per_head" scatters a different order of the positions into each head
    scatter: str | None = None

    def __init__(self, batch: int, max_len: int, heads: int, head_dim: int, head_dim_v: int, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(batch, heads, max_len, head_dim, dtype=dtype))
        self.register_buffer("v_cache", torch.zeros(batch, heads, max_len, head_dim_v, dtype=dtype))

    def update(self, input_pos, k, v):  # input_pos [T] (or an int: the start), k/v [B, H, T, D]
        if isinstance(input_pos, int) and self.copy_slices:  # the slice, written by copy_
            end = input_pos + k.shape[2]
            self.k_cache[:, :, input_pos:end].copy_(k)
            self.v_cache[:, :, input_pos:end].copy_(v)
        elif isinstance(input_pos, int):  # or assigned
            end = input_pos + k.shape[2]
            self.k_cache[:, :, input_pos:end] = k
            self.v_cache[:, :, input_pos:end] = v
        elif self.scatter is not None:
            for buf, new in ((self.k_cache, k), (self.v_cache, v)):
                index = input_pos.view(1, 1, -1, 1)
                index = index.expand_as(new) if self.scatter == "expand_as" else index.expand(new.shape)
                if self.scatter == "per_head":  # head h writes its tokens in reverse order: no longer positions
                    index = torch.where(torch.arange(new.shape[1]).view(1, -1, 1, 1) > 0, index.flip(2), index)
                buf.scatter_(2, index, new)
        else:
            self.k_cache[:, :, input_pos] = k
            self.v_cache[:, :, input_pos] = v
        return self.k_cache, self.v_cache


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int, head_dim_v: int, cache: KVCache):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.head_dim_v = heads, kv_heads, head_dim, head_dim_v
        self.wqkv = nn.Linear(dim, (heads + kv_heads) * head_dim + kv_heads * head_dim_v, bias=False)
        self.wo = nn.Linear(heads * head_dim_v, dim, bias=False)
        self.kv_cache = cache

    def forward(self, x, mask, input_pos):
        b, t, _ = x.shape
        sizes = [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim_v]
        q, k, v = self.wqkv(x).split(sizes, dim=-1)
        q = q.view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.kv_heads, self.head_dim_v).transpose(1, 2)
        k, v = self.kv_cache.update(input_pos, k, v)
        k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
        v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)
        return self.wo(y.transpose(1, 2).contiguous().view(b, t, -1))


class GPTFast(nn.Module):
    def __init__(self, batch=2, max_len=320, vocab=512, dim=128, layers=2, heads=4, kv_heads=2, head_dim=64,
                 dtype=torch.float32, window=0, head_dim_v=None):  # fmt: skip
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            Attention(
                dim,
                heads,
                kv_heads,
                head_dim,
                head_dim_v or head_dim,
                KVCache(batch, max_len, kv_heads, head_dim, head_dim_v or head_dim, dtype),
            )
            for _ in range(layers)
        )
        self.output = nn.Linear(dim, vocab, bias=False)
        visible = torch.tril(torch.ones(max_len, max_len, dtype=torch.bool))
        if window:  # sliding window: query i sees keys i - window < j <= i
            visible &= ~torch.tril(visible, -window)
        self.register_buffer("causal_mask", visible)

    def forward(self, idx, input_pos):  # idx [B, T], input_pos [T] or an int (the start: slice writes)
        rows = slice(input_pos, input_pos + idx.shape[1]) if isinstance(input_pos, int) else input_pos
        mask = self.causal_mask[None, None, rows]
        x = self.embed(idx)
        for layer in self.layers:
            x = x + layer(x, mask, input_pos)
        return self.output(x)
