"""A transformers ``StaticCache`` that ``torch.compile(model, backend="kvarn")`` can serve in every layer.

transformers makes each sliding-window layer's static cache a ring of the window
(``StaticSlidingWindowLayer``): it writes by ``index_copy_`` until the window fills, by ``cat`` + copy while
it fills, and by ``roll`` + copy once full, three graphs whose positions are relative to the ring. The
backend leaves such layers alone. ``static_cache`` gives those layers a full-length ``StaticLayer``
instead: every layer then writes at absolute positions (``cache_position``), and the model's own
sliding-window mask (built from ``config.sliding_window`` over absolute positions) tells the backend the
window; where the mask is made outside the compiled graph (``generate``), the window declared here for the
layer's buffers (``backend.declare_window``) does. The backend then keeps only the KVarN pages that window
reaches (``paged.ring_tiles``), so the quantized cache of a sliding layer stays window-sized.

Memory: the fp16 buffers are transformers' full-length cache, what the backend adopts an eager prefill
from, and what the compiled graphs keep writing too, so that an eager forward later (a second turn's prefill,
beam search's ``reorder_cache``) reads every token (``release_fp16_cache=True`` frees them after). When every
forward goes through the compiled model (``model.forward = torch.compile(model.forward, backend="kvarn")``:
``generate``'s prefill then too), ``fp16_buffers=False`` never allocates them: each is one element seen at its
full shape (``backend.memoryless``), which the rewritten graphs do not read; an eager write into it raises.
"""

from __future__ import annotations

import torch

from ..backend import declare_window, memoryless


def static_cache(model, max_cache_len: int, batch_size: int = 1, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, initialize: bool = True, fp16_buffers: bool = True):  # fmt: skip
    """A ``transformers.StaticCache`` for ``model`` (``batch_size`` rows of up to ``max_cache_len`` tokens),
    sliding-window layers full length. Pass it as ``past_key_values`` (``model(...)`` or
    ``model.generate(...)``). ``initialize``: allocate the layers now (the backend needs the buffers before
    it compiles) from the config's KV heads and head dim; otherwise the first (eager) call allocates them
    with whatever shapes each layer has. ``fp16_buffers=False``: no memory behind them (see above).
    """
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

    config = model.config.get_text_config(decoder=True)
    cache = StaticCache(config=config, max_cache_len=max_cache_len)
    types = getattr(config, "layer_types", None) or [None] * len(cache.layers)
    windows = {}  # layer index -> its sliding window, where it cuts into max_cache_len
    for i, (layer, kind) in enumerate(zip(cache.layers, types)):
        # (chunked attention shares the ring class; its mask is not a window: left as transformers made it)
        if isinstance(layer, StaticSlidingWindowLayer) and kind in (None, "sliding_attention"):
            if layer.max_cache_len < max_cache_len:  # the ring's length: min(window, max_cache_len)
                windows[i] = layer.max_cache_len
            cache.layers[i] = StaticLayer(max_cache_len=max_cache_len)
    if initialize and getattr(config, "kv_lora_rank", None):
        raise ValueError(f"{type(model).__name__} is MLA (kv_lora_rank {config.kv_lora_rank}): its layers cache a "
                         "latent, not the config's K/V heads, so they cannot be allocated from the config here; pass "
                         "initialize=False (its first eager call allocates them), or cache_implementation='static'")  # fmt: skip
    if not initialize:
        if not fp16_buffers:
            raise ValueError("fp16_buffers=False needs initialize=True (the buffers are made here, without memory)")
        return cache
    heads, head_dim = _head_shapes(config)
    dtype, device = dtype or model.dtype, torch.device(device or model.device)
    cache.early_initialization(batch_size, heads, head_dim, dtype, device if fp16_buffers else "meta")
    if not fp16_buffers:
        for layer in cache.layers:
            if getattr(layer, "keys", None) is None:
                continue
            layer.keys, layer.values = (memoryless(x.shape, dtype, device) for x in (layer.keys, layer.values))
            for x in (layer.keys, layer.values):
                torch._dynamo.mark_static_address(x)  # as transformers marks its own buffers
            layer.device = device
            if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):  # a fresh cache: 0 tokens
                layer.cumulative_length = torch.zeros_like(layer.cumulative_length, device=device)
    for i, window in windows.items():
        declare_window(cache.layers[i].keys, window)
        declare_window(cache.layers[i].values, window)
    return cache


def _head_shapes(config) -> tuple[int | list[int], int | list[int]]:
    """(KV heads, head dim), each an int or one per layer (Gemma4's full-attention layers have other head dims
    than its sliding ones), as ``StaticCache.early_initialization`` takes them."""
    try:  # transformers with per-layer configs, where a global head_dim can be ambiguous
        from transformers.configuration_utils import get_head_shapes
    except ImportError:
        heads = config.num_key_value_heads
        return heads, getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return get_head_shapes(config)
