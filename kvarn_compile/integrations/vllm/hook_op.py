"""``kvarn::vllm_attention``: the op the ``--compilation-config`` hook (``kvarn_compile.vllm_pass``) puts in
place of vLLM's ``unified_attention_with_output`` in a kvarn engine's graph. Same contract, except that
query [T, Hq, Dk] (float32), key [T, Hkv, Dk] and value [T, Hkv, Dv] come rotated by the graph; it writes
output [T, Hq, Dv] (not rotated) and appends key/value to the layer's KVarN cache.

Registered the way vLLM registers its own attention ops (``direct_register_custom_op``), so that the layer
name is the same graph input (a ``LayerName`` on torch >= 2.11) and the op runs under vLLM's dispatch key.
This module has no ``from __future__ import annotations``: the op's schema is read from the annotations.
"""

import torch
from torch.library import Library
from vllm.model_executor.layers.attention.attention import get_attention_context
from vllm.utils.torch_utils import LayerNameType, _resolve_layer_name, direct_register_custom_op

_LIBRARY = Library("kvarn", "FRAGMENT")  # the op lives as long as this object


def vllm_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor,
                   layer_name: LayerNameType) -> None:  # fmt: skip
    from .attention import KVarNAttentionImpl

    name = _resolve_layer_name(layer_name)
    attn_metadata, layer, kv_cache, _ = get_attention_context(name)
    if not isinstance(layer.impl, KVarNAttentionImpl):
        raise TypeError(f"KVarN hook (kvarn_compile.vllm_pass): layer {name} is served by "
                        f"{type(layer.impl).__name__}, not KVarN: the hook needs --kv-cache-dtype kvarn_* for "
                        "every attention layer")  # fmt: skip
    layer.impl.forward(layer, query, key, value, kv_cache, attn_metadata, output=output, rotated=True)


def vllm_attention_fake(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor,
                        layer_name: LayerNameType) -> None:  # fmt: skip
    return None


def register() -> None:
    """Register the op (once per process; the plugin calls this)."""
    if not hasattr(torch.ops.kvarn, "vllm_attention"):
        direct_register_custom_op("vllm_attention", vllm_attention, mutates_args=["output"],
                                  fake_impl=vllm_attention_fake, target_lib=_LIBRARY)  # fmt: skip
