"""The KVarN attention backend for vLLM: attention and KV writes on vLLM's pages through the kvarn ops.

vLLM allocates each layer's KV cache from the spec (``customize_spec``: one page per block of G tokens,
one packed tile record per KV head), so its block manager, prefix cache and capacity all count KVarN
bytes. A vLLM block is one KVarN tile; the page table of a request is its vLLM block table.

Shape legend (per layer):

    kv_cache    uint8 [num_blocks, Hkv, 1, nbytes]   vLLM's pages, viewed as the ops' ``pages`` [P, Hkv, nbytes]
    exact_k/v   [S, Hkv, 1, G, Dk/Dv]                the current tile of each request slot, unquantized
    page_table  int32 [S, W]                         vLLM block table rows, moved to the rows' slots
    query       [T, Hq, Dk], key [T, Hkv, Dk], value [T, Hkv, Dv], output [T, Hq, Dv]

S = max_num_seqs + 1 slots (``slots.RequestSlots``). The exact tiles are allocated with the model, so
where vLLM measures free memory (GPU) they come out of its KV budget; with a fixed
``kv_cache_memory_bytes`` they come on top. Logged at start-up with their size. Each sequence's first
tile is quantized like the others here (the core's ``keep_first_tile`` is off): vLLM's prefix cache
shares full blocks between requests, and only pages are shared.

Each layer call is ``kvarn::attend_and_append`` (once, or twice in a mixed step: ``KVarNMetadata.parts``):
attention over the cache as it was plus the fresh k/v, written into vLLM's output, then the append
(``forward_includes_kv_cache_update``). Steps with speculative draft tokens take another path
(``_forward_speculative``): drafts are attended to but held back from the cache until accepted. On a GPU a decode
call quantizes the tiles it completes on a side stream (``defers_flush``; KVARN_DEFER_FLUSH=0 keeps it in line).
A request whose prefix-cache hit reads blocks that another request of the same step fills (vLLM caches a block when
it schedules it: the same prompt twice, ``n > 1``) attends again after the step's appends (``LateRows``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
from typing import ClassVar

import torch
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.logger import init_logger
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_interface import AttentionSpec

from ...ops import prepare_constants
from ...paged import SUPPORTED_DTYPES
from ...presets import SUPPORTED_HEAD_DIMS, Preset, get_preset
from ...reference import rotate
from . import compat
from .config import check_block_size, check_layer
from .rows import StepRows
from .slots import request_slots
from .speculative import CatchUp, SpeculativeStep

# Under vLLM's logger, so vLLM's handler, format and level apply to these messages.
logger = init_logger(f"vllm.{__name__}")


class KVarNAttentionBackend(AttentionBackend):
    """vLLM asks some questions (block sizes, the spec) with no config at hand: the preset comes from the
    layers' impls, which are built first (``serve``)."""

    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = list(SUPPORTED_DTYPES)
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(compat.CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"  # the registry member compat.route_attention points at this class

    @staticmethod
    def get_impl_cls() -> type[KVarNAttentionImpl]:
        return KVarNAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[KVarNMetadataBuilder]:
        return KVarNMetadataBuilder

    _preset: ClassVar[Preset | None] = None

    @classmethod
    def serve(cls, cache_dtype: str) -> Preset:
        """Record the preset of the engine being built (vLLM runs one KV-cache dtype per engine, and asks its
        questions while it builds it): an engine made after another in the same process may serve another."""
        preset = get_preset(cache_dtype)
        if cls._preset is not None and cls._preset != preset:
            logger.info("KVarN: this process now serves %s (was %s)", preset.name, cls._preset.name)
        cls._preset = preset
        return preset

    @classmethod
    def preset(cls) -> Preset:
        if cls._preset is not None:
            return cls._preset
        from vllm.config import get_current_vllm_config_or_none

        config = get_current_vllm_config_or_none()  # before the model is built (block-size choice)
        if config is None or not compat.is_kvarn(config.cache_config.cache_dtype):
            raise RuntimeError("KVarN: no attention layer was built with a kvarn --kv-cache-dtype")
        return get_preset(config.cache_config.cache_dtype)

    @classmethod
    def get_kv_cache_shape(cls, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:  # fmt: skip
        """vLLM 0.23 shapes the pages from this (0.32 from the spec): [num_blocks, Hkv, 1, nbytes] uint8."""
        preset = get_preset(cache_dtype_str)
        check_block_size(preset, block_size)
        return (num_blocks, num_kv_heads, 1, preset.layout(head_size, head_size).nbytes)

    @classmethod
    def get_supported_kernel_block_sizes(cls, kv_cache_spec=None) -> list[int]:
        return [cls.preset().tile_size]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(SUPPORTED_HEAD_DIMS)

    @classmethod
    def supported_kv_cache_layouts(cls):  # vLLM 0.32 (0.23 has no KVCacheLayout; it uses get_kv_cache_shape)
        from vllm.v1.kv_cache_interface import KVCacheLayout

        return (KVCacheLayout.LBHNC,)  # block-major, heads inside: [num_blocks, Hkv, 1, nbytes] contiguous

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        preset = cls.preset()
        layout = preset.layout(spec.head_size, spec.head_size_v)  # raises for unsupported head dims
        if spec.block_size == 1:
            # vLLM 0.32 sizes a sliding-window layer's block from a one-token spec: the bytes per token
            return compat.packed_spec(spec, 1, math.ceil(layout.nbytes / preset.tile_size))
        check_block_size(preset, spec.block_size)
        return compat.packed_spec(spec, preset.tile_size, layout.nbytes)


@dataclasses.dataclass
class KVarNMetadata:
    """One step's batch as the kvarn ops take it (rows: the requests of the step, in batch order)."""

    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor  # int32 [B+1]
    slots: torch.Tensor  # int32 [B]      exact-tile slot of each row
    start_pos: torch.Tensor  # int32 [B]  tokens already cached for each row
    page_table: torch.Tensor  # int32 [S, W]
    seq_lens: torch.Tensor  # int32 [S]   written by kvarn::append
    num_decodes: int  # leading rows with one new token (vLLM orders them first: reorder_batch_threshold)
    speculative: SpeculativeStep | None = None  # a step with draft tokens to hold back or commit
    late: LateRows | None = None  # rows whose prefix-cache hit reads pages the step writes: attended again after

    def parts(self) -> list[tuple[slice, slice, torch.Tensor, int]]:
        """(rows, tokens, query_start_loc, max_query_len) of the calls to make: the single-token rows apart
        from the longer ones when a step mixes both, since the ops size their grids by the longest query of
        a call (one 2,048-token prefill chunk would otherwise give every decode row 2,048 tokens' worth)."""
        b, n, d = self.slots.shape[0], self.num_actual_tokens, self.num_decodes
        if not 0 < d < b or self.max_query_len <= 1:
            return [(slice(0, b), slice(0, n), self.query_start_loc, self.max_query_len)]
        rest = self.query_start_loc[d:] - d  # the decode rows hold tokens [0, d)
        return [(slice(0, d), slice(0, d), self.query_start_loc[: d + 1], 1), (slice(d, b), slice(d, n), rest,
                self.max_query_len)]  # fmt: skip


@dataclasses.dataclass
class LateRows:
    """The rows of a step whose prefix-cache hit reads pages that other rows of the step complete
    (``slots.rows_reading_pages_written_in_step``), as one ``chunk_attention`` call run after the step's appends.
    Each starts at a tile boundary (its hit is whole blocks), so what its own append wrote is not in its history."""

    tokens: torch.Tensor  # long [N]  their tokens among the step's
    slots: torch.Tensor  # int32 [R]
    start_pos: torch.Tensor  # int32 [R]
    query_start_loc: torch.Tensor  # int32 [R+1]
    max_query_len: int

    @classmethod
    def of(cls, rows: list[int], query_start_loc_cpu: torch.Tensor, slots: torch.Tensor, start_pos: torch.Tensor,
           device: torch.device) -> LateRows:  # fmt: skip
        bounds = [(int(query_start_loc_cpu[r]), int(query_start_loc_cpu[r + 1])) for r in rows]
        counts = [end - begin for begin, end in bounds]
        index = torch.tensor(rows, dtype=torch.long, device=device)
        tokens = torch.tensor([t for begin, end in bounds for t in range(begin, end)], dtype=torch.long, device=device)
        offsets = torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int32, device=device)
        return cls(tokens, slots[index], start_pos[index], offsets, max(counts))


class KVarNMetadataBuilder(AttentionMetadataBuilder[KVarNMetadata]):
    """Builds each step's metadata into persistent buffers (fixed addresses), so that uniform decode batches
    can replay full CUDA graphs: the graph reads ``slots``, ``start_pos`` and ``page_table`` where capture
    saw them, refreshed here before each replay. Mixed prefill/decode batches run attention eagerly
    between piecewise graphs."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    reorder_batch_threshold: int | None = 1  # single-token rows first (``KVarNMetadata.parts``)

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: VllmConfig,
                 device: torch.device):  # fmt: skip
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if getattr(vllm_config, "use_v2_model_runner", False):  # a guard: compat.choose_model_runner sets V1
            raise RuntimeError("KVarN: this engine runs vLLM's V2 model runner, which does not say which request "
                               "is in which batch row (KVarN keeps each request's current tile in a slot of its "
                               "own): set VLLM_USE_V2_MODEL_RUNNER=0")  # fmt: skip
        self.layer_names, self.vllm_config = layer_names, vllm_config  # (read by _commit_drafts)
        self.rows = StepRows(vllm_config, device)
        # the CUDA path's cached tensors, made before vLLM captures its CUDA graphs
        prepare_constants(kv_cache_spec.head_size, kv_cache_spec.head_size, kv_cache_spec.dtype, device)
        spec = vllm_config.speculative_config
        self.max_drafts = spec.num_speculative_tokens if spec is not None else 0

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> KVarNMetadata:  # fmt: skip
        m = common_attn_metadata
        b = m.num_reqs
        new_tokens = m.query_start_loc_cpu[1 : b + 1] - m.query_start_loc_cpu[:b]
        num_decodes = int((new_tokens == 1).int().cumprod(0).sum())  # the leading single-token rows
        slots, start_pos, page_table = self.rows.update(m)
        seq_lens = self.rows.seq_lens
        speculative = None
        if self.max_drafts:  # one host sync per step: what the cache holds vs where vLLM continues
            starts, committed = torch.stack([start_pos, seq_lens[slots.long()]]).tolist()
            plan = self.rows.slots.speculative_plan(new_tokens.tolist(), starts, committed)
            if plan is not None and plan.catch_up:
                self._commit_drafts(CatchUp.of(plan, self.device))
            if plan is not None and plan.stage:  # this step has drafts: attention runs eagerly (not one token per row)
                speculative = SpeculativeStep.of(plan, self.device)
        late = self.rows.slots.late(b)
        if late and m.max_query_len == 1:
            logger.warning_once(
                "KVarN: a request's prefix-cache hit reads a block that another request completes in the same "
                "decode step; if vLLM replays a full CUDA graph for it, its first token reads that block before it "
                "is written (the step's other requests are unaffected)"
            )  # fmt: skip
        return KVarNMetadata(
            num_actual_tokens=m.num_actual_tokens,
            max_query_len=m.max_query_len,
            query_start_loc=m.query_start_loc[: b + 1],  # vLLM's own persistent buffer
            slots=slots,
            start_pos=start_pos,
            page_table=page_table,
            seq_lens=seq_lens,
            num_decodes=num_decodes,
            speculative=speculative,
            late=LateRows.of(late, m.query_start_loc_cpu, slots, start_pos, self.device) if late else None,
        )

    def _commit_drafts(self, catch_up: CatchUp) -> None:
        """Append the accepted drafts to every layer's cache, here, before the step's forward: a step whose
        rows are all single tokens again may replay a full CUDA graph, which knows nothing of drafts."""
        layers = self.vllm_config.compilation_config.static_forward_context
        for name in self.layer_names:
            layer = layers[name]
            layer.impl.commit_drafts(compat.layer_kv_cache(layer), self.rows.page_table, self.rows.seq_lens, catch_up)


def defer_flush_setting() -> bool:
    """KVARN_DEFER_FLUSH: 1 (the default) to quantize decode steps' completed tiles on a side stream where the
    layers can (``KVarNAttentionImpl.defers_flush``), 0 to keep them in line. NOTE (H100s, vLLM 0.23, benchmarks/
    results/gpu-s48/h100-vllm-group and gpu-s49/h100-vllm-burst, sessions 48-49): the issue's staggered workload
    9,102 and 8,961 output tokens/s deferred against 8,393 and 8,417 in line (+8.4%, +6.5%) on two machines."""
    value = os.environ.get("KVARN_DEFER_FLUSH", "1")
    if value not in ("0", "1"):
        raise ValueError(f"KVARN_DEFER_FLUSH must be 0 (quantize completed tiles in line) or 1 (deferred, the "
                         f"default), got {value!r}")  # fmt: skip
    return value == "1"


def last_kvarn_layer(layers: dict) -> str | None:
    """The name of the last layer (vLLM's registry of attention layers by name, in the order the model made them)
    that attends with KVarN, or None."""
    names = [name for name, layer in layers.items() if isinstance(getattr(layer, "impl", None), KVarNAttentionImpl)]
    return names[-1] if names else None


class KVarNAttentionImpl(AttentionImpl):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        check_layer(kv_cache_dtype, decoder=attn_type == AttentionType.DECODER, alibi=alibi_slopes is not None,
                    soft_cap=bool(logits_soft_cap), sinks=sinks is not None,
                    shares_kv=kv_sharing_target_layer_name is not None, sliding_window=sliding_window)  # fmt: skip
        self.preset = KVarNAttentionBackend.serve(kv_cache_dtype)
        self.preset.layout(head_size, head_size)  # unsupported head dims fail at start-up, naming the supported
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.scale = float(scale)
        # vLLM's window w: each query sees itself and the w - 1 keys before it, as kvarn's ``window`` does
        self.window = sliding_window or 0
        # The exact tiles are allocated with the model, before vLLM measures the memory left for its KV
        # cache: on a GPU the budget then shrinks by their size instead of overflowing it.
        config = get_current_vllm_config()
        slots = request_slots(config.scheduler_config.max_num_seqs).num_slots
        g, dtype, device = self.preset.tile_size, config.model_config.dtype, config.device_config.device
        self.exact_k = torch.zeros(slots, num_kv_heads, 1, g, head_size, dtype=dtype, device=device)
        self.exact_v = torch.zeros(slots, num_kv_heads, 1, g, head_size, dtype=dtype, device=device)
        # speculative decoding: each slot's draft keys/values, held until accepted (``speculative``)
        drafts = config.speculative_config.num_speculative_tokens if config.speculative_config else 0
        self.staged_k = torch.zeros(slots, drafts, num_kv_heads, head_size, dtype=dtype, device=device)
        self.staged_v = torch.zeros(slots, drafts, num_kv_heads, head_size, dtype=dtype, device=device)
        # vLLM's attention layers by name, in the order the model made them (filled as it is built)
        self.layers = config.compilation_config.static_forward_context
        self.defer = defer_flush_setting() and not drafts and self.exact_k.is_cuda
        self.defers: bool | None = None  # decided at the first forward, when every layer is known (``defers_flush``)
        logger.warning_once(
            "KVarN: the current (unquantized) tile of up to %d requests (max_num_seqs) takes %.1f MiB per attention "
            "layer (%d slots x %d KV heads x %d tokens, K and V), allocated with the model",
            slots - 1, 2 * self.exact_k.numel() * self.exact_k.element_size() / 2**20, slots, num_kv_heads, g,
        )  # fmt: skip

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: KVarNMetadata | None, output: torch.Tensor, output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None, rotated: bool = False) -> torch.Tensor:  # fmt: skip
        """``rotated``: query (float32), key and value come rotated (``kvarn::vllm_attention``, the hook)."""
        if output_scale is not None or output_block_scale is not None:
            # vLLM's fusion pass only passes these to impls whose fused_output_quant_supported() is True (ours
            # keeps the base class's False): a guard, should another caller pass them
            raise ValueError("the KVarN attention backend writes unquantized outputs: it takes no output_scale / "
                             "output_block_scale (turn off the attention + quantization fusion in --compilation-config)")  # fmt: skip
        if attn_metadata is None:  # memory profiling: no cache yet
            return output
        m = attn_metadata
        pages = kv_cache.view(kv_cache.shape[0], kv_cache.shape[1], -1)
        cache = (pages, self.exact_k, self.exact_v, m.page_table)
        if rotated and (m.speculative is not None or m.late is not None):
            # these rare paths take them as vLLM gives them: the rotation is its own inverse
            query, key, value = (rotate(x.float()).to(key.dtype) for x in (query, key, value))
            rotated = False
        if m.speculative is not None:
            self._forward_speculative(query, key, value, output, cache, m)
        else:
            # (a deferred flush would leave the pages the late rows read unwritten when they attend again)
            defer = self.defers_flush(layer.layer_name) and m.late is None
            for rows, tokens, qsl, max_q in m.parts():  # attention over the cache as it was, then the append
                torch.ops.kvarn.attend_and_append(query[tokens], key[tokens], value[tokens], output[tokens], *cache,
                                                  m.seq_lens, m.slots[rows], m.start_pos[rows], qsl, self.preset.name,
                                                  self.scale, True, self.window, max_q, rotated, defer)  # fmt: skip
        if m.late is not None:  # their attention again, over the pages the step has now written
            late = m.late
            output[late.tokens] = torch.ops.kvarn.chunk_attention(
                query[late.tokens], key[late.tokens], value[late.tokens], *cache, late.slots, late.start_pos,
                late.query_start_loc, self.preset.name, self.scale, True, self.window, late.max_query_len)  # fmt: skip
        return output

    def defers_flush(self, layer_name: str) -> bool:
        """Whether this layer's single-token calls quantize the tiles they complete on a side stream
        (``kvarn_compile.deferred_flush``), on CUDA unless KVARN_DEFER_FLUSH=0: every KVarN layer but the model's
        last, whose call joins them all, since vLLM captures a decode step's whole forward in one CUDA graph, which
        must not end with work left on another stream. Not with speculative decoding: a drafter's layers come
        after the model's in vLLM's registry, and run in forwards of their own."""
        if self.defers is None:
            last = last_kvarn_layer(self.layers)
            self.defers = self.defer and layer_name != last
            if self.defer:
                logger.info_once("KVarN: decode steps quantize the tiles they complete on a side stream, joined by "
                                 "the last KVarN layer, %s (KVARN_DEFER_FLUSH=0: in line)", last)  # fmt: skip
        return self.defers

    def _forward_speculative(self, query, key, value, output, cache, m: KVarNMetadata) -> None:
        """A step with draft tokens (``speculative``): attend over all of the step's tokens, append the
        certain ones, stage the drafts (the builder commits the accepted ones next step)."""
        step, name = m.speculative, self.preset.name
        n = m.num_actual_tokens
        output[:n].copy_(torch.ops.kvarn.chunk_attention(query[:n], key[:n], value[:n], *cache, m.slots, m.start_pos,
                                                         m.query_start_loc, name, self.scale, True, self.window,
                                                         m.max_query_len))  # fmt: skip
        torch.ops.kvarn.append(key[step.certain], value[step.certain], *cache, m.seq_lens, m.slots, m.start_pos,
                               step.certain_qsl, name, step.certain_max)  # fmt: skip
        tokens, slots, drafts = step.stage
        self.staged_k[slots, drafts] = key[tokens]
        self.staged_v[slots, drafts] = value[tokens]

    def commit_drafts(self, kv_cache: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor,
                      catch_up: CatchUp) -> None:  # fmt: skip
        """Append the staged drafts vLLM accepted (``KVarNMetadataBuilder._commit_drafts``)."""
        pages = kv_cache.view(kv_cache.shape[0], kv_cache.shape[1], -1)
        c = catch_up
        torch.ops.kvarn.append(self.staged_k[c.staged_slot, c.staged_index], self.staged_v[c.staged_slot, c.staged_index],
                               pages, self.exact_k, self.exact_v, page_table, seq_lens, c.slots, c.start_pos,
                               c.query_start_loc, self.preset.name, c.max_query_len)  # fmt: skip
