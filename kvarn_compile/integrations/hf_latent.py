"""MLA models (DeepSeek-V2/V3) in transformers, on the KVarN latent cache (``paged_latent``).

transformers' MLA attention writes its cache while the latent is still compressed:
``past_key_values.update(c [B, 1, T, L], k_pe [B, 1, T, R], layer_idx)`` (c after ``kv_a_layernorm``, k_pe
after RoPE), then expands what it gets back through ``kv_b_proj`` and attends. ``LatentKVarNCache`` is a
transformers ``Cache`` whose layers store those latents as KVarN latent tiles (402 bytes per token at
DeepSeek's sizes instead of bf16's 1,152) and give them back as the cache holds them, in the order vLLM's
MLA layers use (``integrations.vllm.mla``): a call's tokens are stored first, then

- a call of several tokens (a prefill chunk) sees its context [0, start) as stored after the write (tiles
  the chunk completed read back quantized), and its own tokens exactly;
- a call of one token (decode) sees every stored token as stored, itself included.

So a model gives vLLM's KVarN MLA backend and this cache the same attention inputs: this is the reference
path the vLLM tests compare with. ``LatentSession`` drives a model on it (``KVSession``'s interface).

Shape legend: B rows (sequences of equal length), T new tokens, S tokens seen, L latent dim, R rope dim.
"""

from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..paged import Batch
from ..paged_latent import LatentCache, gather_latents
from ..presets import Preset, get_preset
from ..reference import rotate
from .hf import KVSession


def is_mla(config) -> bool:
    """Whether a transformers config describes an MLA model (a compressed latent KV cache)."""
    return bool(getattr(config, "kv_lora_rank", None))


class LatentLayer(CacheLayerMixin):
    """One MLA layer's latent cache: one ``LatentCache`` slot per row, allocated on first use."""

    def __init__(self, preset: Preset, max_seq_len: int):
        super().__init__()
        self.preset, self.max_seq_len = preset, max_seq_len
        self.cache: LatentCache | None = None
        self.length = 0

    def lazy_initialization(self, c: torch.Tensor, k_pe: torch.Tensor) -> None:
        self.dtype, self.device = c.dtype, c.device
        self.cache = LatentCache.allocate(c.shape[0], self.max_seq_len, c.shape[-1], k_pe.shape[-1], self.preset,
                                          c.dtype, c.device)  # fmt: skip
        self.is_initialized = True

    def update(self, c: torch.Tensor, k_pe: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Store c [B, 1, T, L] and k_pe [B, 1, T, R]; return the latents attention sees, [B, 1, S, L] and
        [B, 1, S, R] (module docstring)."""
        if not self.is_initialized:
            self.lazy_initialization(c, k_pe)
        rows, _, new, _ = c.shape
        if rows != self.cache.seq_lens.shape[0]:
            raise ValueError(f"this cache holds {self.cache.seq_lens.shape[0]} sequences, got {rows} (reset it)")
        start = self.length
        batch = Batch.from_lengths(range(rows), [start] * rows, [new] * rows, device=c.device)
        torch.ops.kvarn.latent_append(c[:, 0].flatten(0, 1).contiguous(), k_pe[:, 0].flatten(0, 1).contiguous(),
                                      *self.cache.tensors(), *batch[:3], self.preset.name, new)  # fmt: skip
        self.length += new
        seen = self.length if new == 1 else start
        held = [gather_latents(*self.cache.tensors()[:4], row, seen, self.length, self.preset) for row in range(rows)]
        c_seen = rotate(torch.stack([c_row for c_row, _ in held]))[:, None].to(c.dtype)
        r_seen = torch.stack([r_row for _, r_row in held])[:, None].to(k_pe.dtype)
        if new == 1:
            return c_seen, r_seen
        return torch.cat([c_seen, c], 2), torch.cat([r_seen, k_pe], 2)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.max_seq_len

    def reset(self) -> None:
        self.cache, self.length, self.is_initialized = None, 0, False

    # What generation does to a cache's rows besides appending: beam search reorders them, expanding inputs
    # repeats them, contrastive search keeps some. Each row is a slot of the latent cache.
    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        self._select(lambda rows: beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select(lambda rows: rows.repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(lambda rows: rows[indices.to(rows.device) if isinstance(indices, torch.Tensor) else indices])

    def _select(self, which) -> None:
        """The cache's slots chosen by ``which(rows)`` (rows: the slots' indices), copied into a new cache."""
        if self.cache is not None:
            self.cache = self.cache.select_slots(which(torch.arange(self.cache.seq_lens.shape[0],
                                                                    device=self.cache.seq_lens.device)))  # fmt: skip

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (a negative count, transformers' convention since 5.2x; a
        positive one is the length to keep, the older one). Only tokens of the current tile can go: a completed tile
        was quantized, and its exact rows cannot be had back from it. (So assisted decoding, whose rejected drafts
        may reach into a tile they completed, is not served: the layers keep ``is_croppable`` False, which
        transformers 5.2x checks before it starts.)"""
        keep = tokens_to_remove if tokens_to_remove > 0 else self.length + tokens_to_remove
        g = self.preset.tile_size
        if keep < 0 or keep > self.length or (keep < self.length and keep < self.length // g * g):
            raise ValueError(
                f"cannot crop the latent cache from {self.length} to {keep} tokens: tokens before "
                f"{self.length // g * g} are in quantized tiles of {g} (only the current tile's rows can be removed)"
            )
        if self.cache is not None and keep < self.length:
            self.cache.seq_lens.fill_(keep)
        self.length = keep

    def nbytes(self) -> int:
        """Bytes holding the stored tokens: their complete tiles' records, and the current tile's latents and
        rope keys as the model dtype holds them."""
        if self.cache is None:
            return 0
        rows, g = self.cache.seq_lens.shape[0], self.preset.tile_size
        full, rest = divmod(self.length, g)
        per_token = (self.cache.exact_c.shape[-1] + self.cache.exact_r.shape[-1]) * self.cache.exact_c.element_size()
        return rows * (full * self.cache.pages.shape[1] + rest * per_token)


class LatentKVarNCache(Cache):
    """A transformers cache for MLA models on the KVarN latent cache: pass it as ``past_key_values``."""

    def __init__(self, config, preset: str | Preset = "kvarn_k4v2_g128", max_seq_len: int = 8192):
        if not is_mla(config):
            raise ValueError(f"LatentKVarNCache holds MLA latents (a config with kv_lora_rank); {type(config).__name__} "
                             f"has none: use KVSession for this model")  # fmt: skip
        preset = get_preset(preset)
        preset.latent_layout(config.kv_lora_rank, config.qk_rope_head_dim)  # unsupported dims fail here
        super().__init__(layers=[LatentLayer(preset, max_seq_len) for _ in range(config.num_hidden_layers)])

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)


class LatentSession(KVSession):
    """``KVSession``'s interface (forward, generate, reset, kv_bytes) for an MLA model on
    ``LatentKVarNCache``, with the model's own attention (SDPA)."""

    def __init__(self, model, preset: str | Preset = "kvarn_k4v2_g128", max_seq_len: int = 8192):
        model.set_attn_implementation("sdpa")
        self.model, self.position = model, 0
        self.cache = LatentKVarNCache(model.config, preset, max_seq_len)

    def reset(self) -> None:
        self.cache = LatentKVarNCache(self.model.config, self.cache.layers[0].preset, self.cache.layers[0].max_seq_len)
        self.position = 0

    def kv_bytes(self) -> int:
        return self.cache.nbytes()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, vocab] of the next token after each of ``input_ids`` [B, T]."""
        rows, new = input_ids.shape
        positions = torch.arange(self.position, self.position + new, device=input_ids.device).expand(rows, new)
        cache = {_cache_argument(self.model): self.cache}
        logits = self.model(input_ids=input_ids, position_ids=positions, use_cache=True, **cache).logits
        self.position += new
        return logits


def _cache_argument(model) -> str:
    """The name a model's forward takes its cache by: ``cache`` in newer transformers (5.24 here, where
    ``past_key_values`` is deprecated), ``past_key_values`` before (5.19)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
