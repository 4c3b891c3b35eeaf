"""vLLM 0.23's KV-cache spec for KVarN pages (0.32 instead adjusts its own spec: ``compat.packed_spec``).

A module of its own because vLLM pickles specs between its processes: the class must be importable by
name, and importing it must not need vLLM 0.32 (or 0.23) specifics beyond ``FullAttentionSpec``.
"""

from __future__ import annotations

import dataclasses

from vllm.v1.kv_cache_interface import FullAttentionSpec

from ...presets import Preset


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVarNFullAttentionSpec(FullAttentionSpec):
    """A block of ``block_size`` = G tokens holds one packed tile record of ``tile_bytes`` per KV head."""

    tile_bytes: int = 0

    @property
    def real_page_size_bytes(self) -> int:
        return self.num_kv_heads * self.tile_bytes

    @classmethod
    def merge(cls, specs):
        merged = super().merge(specs)
        if len({s.tile_bytes for s in specs}) != 1:
            raise ValueError("KVarN: the layers of one KV-cache group must have the same tile size")
        return dataclasses.replace(merged, tile_bytes=specs[0].tile_bytes)


def kvarn_full_attention_spec(spec: FullAttentionSpec, preset: Preset) -> KVarNFullAttentionSpec:
    """``spec`` (a layer's fp16 FullAttentionSpec) as KVarN pages of ``preset``."""
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.init}
    return KVarNFullAttentionSpec(**fields, tile_bytes=preset.layout(spec.head_size, spec.head_size_v).nbytes)
