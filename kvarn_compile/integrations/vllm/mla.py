"""The KVarN attention backend for vLLM's MLA layers (DeepSeek-V2/V3-like models): the latent cache of
``paged_latent`` on vLLM's pages, through the ``kvarn::latent_*`` ops.

An MLA layer caches one latent c [L] and one rope key r [R] per token for all its heads. vLLM's
``MLAAttention`` drives each step in three calls, and this backend takes each one:

1. the cache write, before any attention (``do_kv_cache_update``; the step's metadata comes from vLLM's
   forward context under the layer's name, ``compat.step_metadata``): the new tokens' c and r go to each
   request's exact current tile; each tile they complete is quantized into its page (4-bit latent, rope
   key kept);
2. decode rows (``forward_mqa``): queries absorbed into latent space by vLLM (q_c = q_nope W_UK, q_r)
   attend to all of the request's tokens, the new one included, from the cache; vLLM applies W_UV;
3. prefill rows (``forward_mha``, vLLM's): attention over the chunk's own tokens exactly (vLLM's MHA), and
   over the context before the chunk from the cache (``_compute_prefill_context``, here in latent space
   with the layer's W_UK / W_UV), merged by log-sum-exp.

vLLM calls the impl for steps 1 and 3 without its layer; ``compat.attach_latent_impls`` gives it the layer
(``attach``) when vLLM builds it.

Shape legend (per layer; S = max_num_seqs + 1 slots, G tokens per tile):

    kv_cache    uint8 [num_blocks, 1, nbytes]   vLLM's pages (one latent tile record per block)
    exact_c     [S, G, L], exact_r [S, G, R]    each request slot's current tile (``rows.StepRows``)
    kv_c        [T, L], k_pe [T, 1, R]          the step's new latents and rope keys
    q (decode)  ([B, N, L], [B, N, R])          q (prefill) [T, N, P + R], P: per-head no-rope dims

On a GPU the latent ops run their Triton kernels (vLLM 0.23 on an H200).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import ClassVar

import torch
from vllm.config import get_current_vllm_config
from vllm.logger import init_logger
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonBackend,
    MLACommonImpl,
    MLACommonMetadata,
    MLACommonMetadataBuilder,
)
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType, CommonAttentionMetadata
from vllm.v1.kv_cache_interface import AttentionSpec

from ...paged import SUPPORTED_DTYPES
from ...presets import LatentLayout
from . import compat
from .attention import KVarNAttentionBackend
from .config import check_block_size, check_layer
from .rows import StepRows
from .slots import request_slots

logger = init_logger(f"vllm.{__name__}")


class KVarNMLABackend(MLACommonBackend):
    """The MLA counterpart of ``attention.KVarNAttentionBackend`` (same preset, one per process)."""

    supported_dtypes: ClassVar[list[torch.dtype]] = list(SUPPORTED_DTYPES)
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(compat.CACHE_DTYPES)
    _layout: ClassVar[LatentLayout | None] = None  # recorded by the first layer built

    @staticmethod
    def get_name() -> str:
        return "KVARN_MLA"

    @staticmethod
    def get_impl_cls() -> type[KVarNMLAImpl]:
        return KVarNMLAImpl

    @staticmethod
    def get_builder_cls() -> type[KVarNMLAMetadataBuilder]:
        return KVarNMLAMetadataBuilder

    @classmethod
    def get_supported_kernel_block_sizes(cls, kv_cache_spec=None) -> list[int]:
        return [KVarNAttentionBackend.preset().tile_size]

    @classmethod
    def get_kv_cache_shape(cls, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:  # fmt: skip
        """vLLM 0.23 shapes the pages from this (0.32 from the spec): [num_blocks, 1, nbytes] uint8."""
        layout = cls._layout
        if layout is None or layout.latent_dim + layout.rope_dim != head_size:
            raise RuntimeError(f"KVarN: no MLA layer was built with latent + rope = {head_size} channels")
        check_block_size(KVarNAttentionBackend.preset(), block_size)
        return (num_blocks, 1, layout.nbytes)

    @classmethod
    def serve(cls, cache_dtype: str, latent_dim: int, rope_dim: int) -> LatentLayout:
        preset = KVarNAttentionBackend.serve(cache_dtype)
        # unsupported dims fail at start-up, naming the supported; a later engine may serve others (``serve``)
        cls._layout = preset.latent_layout(latent_dim, rope_dim)
        return cls._layout

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        layout = cls._layout
        if layout is None or layout.latent_dim + layout.rope_dim != spec.head_size:
            raise RuntimeError(f"KVarN: no MLA layer was built with latent + rope = {spec.head_size} channels")
        check_block_size(KVarNAttentionBackend.preset(), spec.block_size)
        return compat.packed_spec(spec, layout.tile_size, layout.nbytes)


@dataclasses.dataclass
class KVarNRows:
    """One step's batch as the latent ops take it (rows in batch order: decodes first)."""

    slots: torch.Tensor  # int32 [B]
    start_pos: torch.Tensor  # int32 [B]  tokens cached before this step
    seq_lens: torch.Tensor  # int32 [B]   tokens after it (vLLM's)
    query_start_loc: torch.Tensor  # int32 [B+1]
    max_query_len: int
    page_table: torch.Tensor  # int32 [S, W]
    slot_lens: torch.Tensor  # int32 [S]  tokens each slot's cache holds (written by latent_append)


@dataclasses.dataclass
class KVarNMLAMetadata(MLACommonMetadata):
    kvarn: KVarNRows | None = None


class KVarNMLAMetadataBuilder(MLACommonMetadataBuilder[KVarNMLAMetadata]):
    """vLLM's MLA metadata (decode/prefill split, context lengths), plus the KVarN rows. Decode-only steps run
    in full CUDA graphs: the rows live at fixed addresses (``rows.StepRows``), as for the dense backend."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device, metadata_cls=KVarNMLAMetadata)
        self.rows = StepRows(vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> KVarNMLAMetadata:  # fmt: skip
        m = common_attn_metadata
        metadata = super().build(common_prefix_len, m, fast_build)
        slots, start_pos, page_table = self.rows.update(m)
        b = m.num_reqs
        metadata.kvarn = KVarNRows(slots, start_pos, m.seq_lens[:b].to(torch.int32), m.query_start_loc[: b + 1],
                                   m.max_query_len, page_table, self.rows.seq_lens)  # fmt: skip
        return metadata


class KVarNMLAImpl(MLACommonImpl[KVarNMLAMetadata]):
    can_return_lse_for_decode: bool = False  # (decode-context parallelism is not supported)

    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                 logits_soft_cap, attn_type, kv_sharing_target_layer_name, **mla_args) -> None:  # fmt: skip
        check_layer(kv_cache_dtype, decoder=attn_type == AttentionType.DECODER, alibi=alibi_slopes is not None,
                    soft_cap=bool(logits_soft_cap), sinks=False, shares_kv=kv_sharing_target_layer_name is not None,
                    sliding_window=sliding_window, mla=True)  # fmt: skip
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                         logits_soft_cap, attn_type, kv_sharing_target_layer_name, **mla_args)  # fmt: skip
        self.supports_quant_query_input = False  # queries come in the model dtype
        self.layout = KVarNMLABackend.serve(kv_cache_dtype, self.kv_lora_rank, self.qk_rope_head_dim)
        self.preset_name = KVarNAttentionBackend.preset().name
        config = get_current_vllm_config()
        slots = request_slots(config.scheduler_config.max_num_seqs).num_slots
        g, dtype, device = self.layout.tile_size, config.model_config.dtype, config.device_config.device
        self.exact_c = torch.zeros(slots, g, self.kv_lora_rank, dtype=dtype, device=device)
        self.exact_r = torch.zeros(slots, g, self.qk_rope_head_dim, dtype=dtype, device=device)
        self.layer = None  # the MLAAttention layer this impl serves (``attach``)
        logger.warning_once(
            "KVarN: the current (unquantized) MLA tile of up to %d requests (max_num_seqs) takes %.1f MiB per "
            "attention layer (%d slots x %d tokens x (%d latent + %d rope) channels), allocated with the model",
            slots - 1, (self.exact_c.nbytes + self.exact_r.nbytes) / 2**20, slots, g, self.kv_lora_rank,
            self.qk_rope_head_dim,
        )  # fmt: skip

    def attach(self, layer) -> None:
        """Called by ``compat.attach_latent_impls`` once vLLM has built ``layer`` (an ``MLAAttention``) with this
        impl: the cache write looks up the step's metadata under the layer's name, and the prefill context uses
        the layer's W_UK_T [N, P, L] and W_UV [N, L, V] (vLLM sets them after loading the weights)."""
        self.layer = weakref.proxy(layer)  # the layer owns this impl

    def _cache(self, kv_cache: torch.Tensor, rows: KVarNRows) -> tuple[torch.Tensor, ...]:
        """(pages, exact_c, exact_r, page_table, slot_lens): the order the latent ops take them in."""
        return kv_cache.view(kv_cache.shape[0], -1), self.exact_c, self.exact_r, rows.page_table, rows.slot_lens

    def store(self, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
              attn_metadata: KVarNMLAMetadata) -> None:  # fmt: skip
        """Step 1 (module docstring): store the step's new latents kv_c [T, L] and rope keys k_pe [T, 1, R]."""
        rows = attn_metadata.kvarn
        n = attn_metadata.num_actual_tokens
        torch.ops.kvarn.latent_append(kv_c[:n], k_pe[:n, 0], *self._cache(kv_cache, rows), rows.slots, rows.start_pos,
                                      rows.query_start_loc, self.preset_name, rows.max_query_len)  # fmt: skip

    def do_kv_cache_update(self, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor | None, *args) -> None:  # fmt: skip
        """vLLM's cache write (step 1) for the layer's new tokens; vLLM's slot mapping is not used: the rows'
        slots and positions come with the step's metadata."""
        if self.layer is None:
            raise RuntimeError("KVarN MLA: this impl was not attached to its layer (compat.attach_latent_impls: "
                               "kvarn_compile's vLLM plugin did not load?)")  # fmt: skip
        metadata = compat.step_metadata(self.layer.layer_name)
        if slot_mapping is None or metadata is None:  # vLLM's profiling run: no cache yet
            return
        self.store(kv_c, k_pe, kv_cache, metadata)

    def forward_mqa(self, q, kv_c_and_k_pe_cache: torch.Tensor, attn_metadata: KVarNMLAMetadata,
                    layer) -> tuple[torch.Tensor, None]:  # fmt: skip
        """Step 2: decode rows (the first ``num_decodes``, one token each) -> latent outputs [B, N, L]."""
        q_c, q_r = q if isinstance(q, tuple) else q.split([self.kv_lora_rank, self.qk_rope_head_dim], -1)
        rows, d = attn_metadata.kvarn, attn_metadata.num_decodes
        out, _ = torch.ops.kvarn.latent_attention(q_c.contiguous(), q_r.contiguous(),
                                                  *self._cache(kv_c_and_k_pe_cache, rows), rows.slots[:d],
                                                  rows.seq_lens[:d], rows.query_start_loc[: d + 1], self.preset_name,
                                                  self.scale, 1)  # fmt: skip
        return out, None

    def _compute_prefill_context(self, q: torch.Tensor, kv_c_and_k_pe_cache: torch.Tensor,
                                 attn_metadata: KVarNMLAMetadata, k_scale) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Step 3, the context part: prefill queries q [T, N, P + R] over each row's cached context, in latent
        space -> (out [T, N, V], lse [N, T]) for vLLM's merge with the chunk's own attention."""
        rows, d = attn_metadata.kvarn, attn_metadata.num_decodes
        q_nope, q_r = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], -1)
        q_c = torch.einsum("tnp,npl->tnl", q_nope, self.layer.W_UK_T)
        qsl = rows.query_start_loc[d:] - rows.query_start_loc[d]
        out, lse = torch.ops.kvarn.latent_attention(q_c, q_r.contiguous(), *self._cache(kv_c_and_k_pe_cache, rows),
                                                    rows.slots[d:], rows.start_pos[d:], qsl, self.preset_name,
                                                    self.scale, rows.max_query_len)  # fmt: skip
        return torch.einsum("tnl,nlv->tnv", out, self.layer.W_UV).contiguous(), lse.transpose(0, 1).contiguous()
