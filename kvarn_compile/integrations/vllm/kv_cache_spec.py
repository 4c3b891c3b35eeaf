"""vLLM 0.23's KV-cache specs for KVarN pages (0.32 instead adjusts its own specs: ``compat.packed_spec``).

0.23 sizes a layer's pages from its spec's ``real_page_size_bytes`` and has no hook to change it, so each
spec a KVarN layer can return has a subclass here whose page is one packed tile record per KV head: full
attention, sliding-window attention and MLA (one "head": the latent tile). vLLM finds each one's block
manager through its base class.

A module of its own because vLLM pickles specs between its processes: the classes must be importable by
name, and importing them must not need vLLM 0.32 (or 0.23) specifics beyond the three base specs.
"""

from __future__ import annotations

import dataclasses

from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec


class _PackedTiles:
    """A block of ``block_size`` = G tokens holds one packed tile record of ``tile_bytes`` per KV head."""

    num_kv_heads: int
    tile_bytes: int

    @property
    def real_page_size_bytes(self) -> int:
        return self.num_kv_heads * self.tile_bytes

    @classmethod
    def merge(cls, specs):
        merged = super().merge(specs)  # type: ignore[misc]
        if len({s.tile_bytes for s in specs}) != 1:
            raise ValueError("KVarN: the layers of one KV-cache group must have the same tile size")
        return dataclasses.replace(merged, tile_bytes=specs[0].tile_bytes)


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVarNFullAttentionSpec(_PackedTiles, FullAttentionSpec):
    tile_bytes: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVarNSlidingWindowSpec(_PackedTiles, SlidingWindowSpec):
    tile_bytes: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVarNMLAAttentionSpec(_PackedTiles, MLAAttentionSpec):
    tile_bytes: int = 0


PACKED = {FullAttentionSpec: KVarNFullAttentionSpec, SlidingWindowSpec: KVarNSlidingWindowSpec,
          MLAAttentionSpec: KVarNMLAAttentionSpec}  # fmt: skip


def packed_page_spec(spec, tile_bytes: int):
    """``spec`` (a layer's own spec, of one of ``PACKED``'s types exactly) as pages of ``tile_bytes`` per head."""
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.init}
    return PACKED[type(spec)](**fields, tile_bytes=tile_bytes)
