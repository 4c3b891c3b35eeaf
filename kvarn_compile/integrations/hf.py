"""Run a Hugging Face transformers causal LM on a KV cache this package owns: the real paged KVarN cache
(``PagedKV``: the ``kvarn::`` ops, Triton kernels on CUDA) or a dense cache that stores every method of
``kvarn_compile.methods`` the same way (``DenseKV``: fp16, and the simulated baselines of the evaluation).

How it hooks in: ``KVSession`` switches the model to the attention implementation ``"kvarn"`` (registered
with transformers' ``AttentionInterface``) and runs its forward with ``use_cache=False`` and explicit
positions, so each attention layer hands this module its fresh post-RoPE q/k/v; the layer's store
answers attention over the cache as it was plus those fresh tokens, then appends them (the contract of
``kvarn_compile.paged``). No model code changes, and any architecture whose attention goes through
``ALL_ATTENTION_FUNCTIONS`` (Llama, Qwen, Mistral, Gemma, ...) works.

Shape legend (transformers layout): B rows (sequences of equal length, no padding), T new tokens,
Hq / Hkv query / KV heads, Dk / Dv head dims.
    q [B, Hq, T, Dk]    k [B, Hkv, T, Dk]    v [B, Hkv, T, Dv]    attention output [B, T, Hq, Dv]
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import re
import time
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F

from ..methods import Method, get_method
from ..ops import attention as paged_attention
from ..ops import prepare_constants
from ..ops import store as paged_store
from ..paged import Batch, KVarNCache, tokens_major
from ..presets import get_preset

log = logging.getLogger("kvarn.hf")

ATTN_IMPLEMENTATION = "kvarn"
_ACTIVE: contextvars.ContextVar[KVSession | None] = contextvars.ContextVar("kvarn_session", default=None)
# kwargs of transformers' attention functions that change the math and that this path does not implement
_UNSUPPORTED = ("softcap", "s_aux", "sinks", "position_bias")
# modules that carry a state from one forward to the next outside the KV cache (Mamba mixers, gated delta nets,
# short convolutions, recurrent blocks, linear attention): without a cache they restart at every forward
_RECURRENT = re.compile(r"Mamba|Mixer|DeltaNet|ShortConv|RecurrentBlock|LinearAttention|LightningAttention")


def kv_dtype_for(model_dtype: torch.dtype) -> torch.dtype:
    """The KV-cache dtype for a model: its own if half precision, else float16 (a float32 CPU model still
    gets an fp16 cache: the baseline every method is compared with)."""
    return model_dtype if model_dtype in (torch.float16, torch.bfloat16) else torch.float16


class KVStore(Protocol):
    """The KV cache of one attention layer."""

    def attend(self, q, k, v, scale: float, causal: bool, window: int) -> torch.Tensor:
        """Attention of q over the cache plus the fresh k, v (then stores them): [B, Hq, T, Dv]."""

    def nbytes(self) -> int:
        """Bytes that hold the tokens stored so far."""


def _check_rows(x: torch.Tensor, rows: int, stored: int) -> None:
    if x.shape[0] != rows and stored:
        raise ValueError(f"the cache holds {rows} sequences, got a call with {x.shape[0]} (reset the session)")


class DenseKV:
    """Every method of ``kvarn_compile.methods`` on one semantics: keys/values live densely in the cache
    dtype; a tile is replaced by its roundtrip once it is complete (the first tile stays exact when
    ``keep_first_tile``), so attention sees exactly what a paged cache of that method would hold.

    k, v [B, Hkv, S, D]: what attention reads for positions 0..S-1.
    """

    def __init__(self, method: Method | str, kv_dtype: torch.dtype, keep_first_tile: bool = True):
        self.method = get_method(method) if isinstance(method, str) else method
        self.kv_dtype = kv_dtype
        self.keep_first_tile = keep_first_tile
        self.k = self.v = None
        self.quantized = 0  # tokens whose tiles went through the roundtrip (or were skipped as the sink)

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def attend(self, q, k, v, scale: float, causal: bool, window: int) -> torch.Tensor:
        _check_rows(k, 0 if self.k is None else self.k.shape[0], self.length)
        # (a copy: the store quantizes completed tiles in place, and the model's tensors are not its to change)
        k, v = (x.to(self.kv_dtype, copy=True) for x in (k, v))
        keys = k if self.k is None else torch.cat([self.k, k], 2)
        values = v if self.v is None else torch.cat([self.v, v], 2)
        out = F.scaled_dot_product_attention(
            q, keys.to(q.dtype), values.to(q.dtype), attn_mask=_mask(self.length, k.shape[2], causal, window, q.device),
            scale=scale, enable_gqa=q.shape[1] != k.shape[1],
        )  # fmt: skip
        self.k, self.v = keys, values
        self._quantize_completed_tiles()
        return out

    def _quantize_completed_tiles(self) -> None:
        if self.method.exact:
            return
        g = self.method.tile_size
        while self.quantized + g <= self.length:
            lo, hi = self.quantized, self.quantized + g
            if not (lo == 0 and self.keep_first_tile):
                self.k[:, :, lo:hi], self.v[:, :, lo:hi] = self.method.roundtrip(
                    self.k[:, :, lo:hi], self.v[:, :, lo:hi]
                )
            self.quantized = hi

    def nbytes(self) -> int:
        if self.k is None:
            return 0
        rows, heads, _, dk = self.k.shape
        return stored_bytes(self.method, self.keep_first_tile, self.length, rows * heads, dk, self.v.shape[-1],
                            self.k.element_size())  # fmt: skip


def stored_bytes(method: Method, keep_first_tile: bool, length: int, rows: int, dk: int, dv: int, itemsize: int):
    """Bytes that hold ``length`` tokens of ``rows`` (sequence x KV head) rows: completed tiles at the
    method's cost, the rest (current tile, and the first tile when kept) exact in the cache dtype."""
    quantized = 0
    if not method.exact:
        quantized = length // method.tile_size * method.tile_size
        if keep_first_tile and quantized:
            quantized -= method.tile_size
    exact = length - quantized
    return round(rows * (exact * (dk + dv) * itemsize + quantized * method.bytes_per_token(dk, dv)))


def _mask(cached: int, new: int, causal: bool, window: int, device) -> torch.Tensor | None:
    """Boolean [new, cached + new]: query i (position cached + i) may see key j."""
    if not causal and window == 0:
        return None
    q_pos = torch.arange(cached, cached + new, device=device)[:, None]
    k_pos = torch.arange(cached + new, device=device)[None, :]
    visible = k_pos <= q_pos if causal else torch.ones_like(k_pos <= q_pos)
    if window > 0:
        visible = visible & (k_pos > q_pos - window)
    return visible


class PagedKV:
    """The real KVarN cache of one layer (``KVarNCache`` and the ``kvarn::`` ops), one slot per row.

    Allocated on first use for ``max_seq_len`` tokens per row (whole tiles); a call past ``max_seq_len`` raises.
    """

    def __init__(self, preset: str, kv_dtype: torch.dtype, max_seq_len: int, keep_first_tile: bool = True):
        self.preset = get_preset(preset)
        self.kv_dtype = kv_dtype
        self.max_seq_len = max_seq_len
        self.keep_first_tile = keep_first_tile
        self.cache: KVarNCache | None = None
        self.length = 0

    def attend(self, q, k, v, scale: float, causal: bool, window: int) -> torch.Tensor:
        rows, heads, new, dk = k.shape
        if self.cache is None:  # a sliding-window layer gets the pages its window reaches (``paged.ring_tiles``)
            self.cache = KVarNCache.allocate(rows, self.max_seq_len, heads, dk, v.shape[-1], self.preset,
                                             self.kv_dtype, k.device, self.keep_first_tile, window)  # fmt: skip
            prepare_constants(dk, v.shape[-1], self.kv_dtype, k.device)
        self.cache.check_window(window)
        _check_rows(k, self.cache.seq_lens.shape[0], self.length)
        if self.length + new > self.max_seq_len:
            raise ValueError(
                f"{self.length} + {new} tokens per row exceed this session's max_seq_len={self.max_seq_len}"
            )

        q_t, k_t, v_t = (tokens_major(x, self.kv_dtype) for x in (q, k, v))
        batch = Batch.from_lengths(range(rows), [self.length] * rows, [new] * rows, device=k.device)
        out = paged_attention(self.cache, q_t, k_t, v_t, batch, scale, causal, window)
        paged_store(self.cache, k_t, v_t, batch)
        self.length += new
        return out.view(rows, new, q.shape[1], -1).transpose(1, 2).to(q.dtype)

    def nbytes(self) -> int:
        """Bytes holding the stored tokens (as ``stored_bytes``; the pages and the exact-tile buffers
        reserved for later tokens are not counted)."""
        if self.cache is None:
            return 0
        rows, heads, _, _, dk = self.cache.exact_k.shape
        return stored_bytes(get_method(self.preset.name), self.keep_first_tile, self.length, rows * heads, dk,
                            self.cache.exact_v.shape[-1], self.cache.exact_k.element_size())  # fmt: skip


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
               is_causal=None, **kwargs):  # fmt: skip
    """transformers attention function (``attn_implementation="kvarn"``): defers to the active session."""
    session = _ACTIVE.get()
    if session is None:
        raise RuntimeError("attn_implementation='kvarn' runs inside a kvarn_compile.integrations.hf.KVSession")
    if attention_mask is not None:
        raise ValueError(
            "kvarn attention builds its own causal / sliding-window mask; got an explicit attention mask "
            "(padded batches are not supported: give each sequence its own session row of equal length)"
        )
    for name in _UNSUPPORTED:
        if kwargs.get(name) is not None:
            raise ValueError(f"kvarn attention does not support {name!r} (model {type(module).__name__})")
    if dropout:
        raise ValueError("kvarn attention is for inference: dropout must be 0")
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    out = session.store(module).attend(query, key, value, scale, bool(causal), int(sliding_window or 0))
    return out.transpose(1, 2).contiguous(), None


def _no_padding_mask(batch_size, q_length, kv_length, *args, attention_mask=None, **kwargs):
    """transformers' mask builder for "kvarn": no mask (the stores make their causal / sliding-window ones), and
    an error for a 2-D padding mask with a padded position (without a builder transformers would drop it)."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("kvarn attention does not support padded batches (the attention mask has zeros): give each "
                         "sequence its own session row of equal length")  # fmt: skip


def register() -> None:
    """Make ``attn_implementation="kvarn"`` known to transformers, with its mask builder (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, _attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_padding_mask)


class KVSession:
    """A causal LM and one KV store per attention layer: feed tokens, get logits, generate greedily.

    ``make_store()`` builds one layer's store (``DenseKV`` / ``PagedKV``). Rows of ``input_ids`` [B, T]
    are independent sequences that advance together (no padding). The model stays switched to the "kvarn"
    attention (its layers then need an active session): ``model.set_attn_implementation("sdpa")`` switches
    it back.
    """

    def __init__(self, model, make_store: Callable[[], KVStore]):
        config = model.config.get_text_config(decoder=True)
        if "chunked_attention" in (getattr(config, "layer_types", None) or ()):
            raise ValueError(f"{type(model).__name__} has chunked-attention layers (attention within chunks of "
                             f"{getattr(config, 'attention_chunk_size', '?')} tokens): the stores serve causal and "
                             "sliding-window attention only")  # fmt: skip
        recurrent = sorted({type(m).__name__ for m in model.modules() if _RECURRENT.search(type(m).__name__)})
        if recurrent:
            raise ValueError(f"{type(model).__name__} keeps a recurrent state in {', '.join(recurrent)}: a session runs "
                             "each forward without transformers' cache, so those layers would restart at every call. "
                             "Compile the model with backend='kvarn' over a transformers cache instead (its attention "
                             "layers are rewritten, its recurrent layers keep their state)")  # fmt: skip
        register()
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self.model = model
        self.make_store = make_store
        self.stores: dict[int, KVStore] = {}
        self.position = 0

    @classmethod
    def for_method(cls, model, method: str, max_seq_len: int = 8192, keep_first_tile: bool = True, paged=None):
        """A session whose cache stores ``method``: a kvarn preset runs on the real paged cache (unless
        ``paged=False``), every other method on ``DenseKV``."""
        kv_dtype = kv_dtype_for(model.dtype)
        get_method(method)  # a bad name fails here, not at the first forward
        paged = method.startswith("kvarn_") if paged is None else paged
        if paged:
            return cls(model, lambda: PagedKV(method, kv_dtype, max_seq_len, keep_first_tile))
        return cls(model, lambda: DenseKV(method, kv_dtype, keep_first_tile))

    def store(self, module) -> KVStore:
        layer = getattr(module, "layer_idx", None)
        if layer is None:
            raise ValueError(f"{type(module).__name__} has no layer_idx: cannot tell its KV cache apart")
        if layer not in self.stores:
            self.stores[layer] = self.make_store()
        return self.stores[layer]

    def reset(self) -> None:
        self.stores.clear()
        self.position = 0

    def kv_bytes(self) -> int:
        return sum(s.nbytes() for s in self.stores.values())

    @contextlib.contextmanager
    def active(self):
        """Within this block, the model's "kvarn" attention layers use this session's stores (``forward``
        enters it; enter it yourself to call the model directly, with ``use_cache=False`` and ``position_ids``
        that continue what the stores hold: without them the model restarts its positions at 0)."""
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, vocab] of the next token after each of ``input_ids`` [B, T]."""
        rows, new = input_ids.shape
        positions = torch.arange(self.position, self.position + new, device=input_ids.device).expand(rows, new)
        with self.active():
            logits = self.model(input_ids=input_ids, position_ids=positions, use_cache=False).logits
        self.position += new
        return logits

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id: int | None = None):
        """Greedy generation after prefilling ``input_ids`` [B, T]: (new tokens [B, <= max_new_tokens],
        decode tokens per second)."""
        logits = self.forward(input_ids)[:, -1]
        out = []
        start = time.perf_counter()
        for _ in range(max_new_tokens):
            token = logits.argmax(-1, keepdim=True)
            out.append(token)
            if eos_token_id is not None and bool((token == eos_token_id).all()):
                break
            logits = self.forward(token)[:, -1]
        _sync(input_ids.device)
        elapsed = time.perf_counter() - start
        return torch.cat(out, 1), len(out) * input_ids.shape[0] / max(elapsed, 1e-9)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
