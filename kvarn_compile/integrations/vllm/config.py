"""Checks of a vLLM engine's settings against a kvarn KV-cache dtype, run at start-up in the process that
parses them, so that a bad combination fails there with the fix in the message (pure: no vLLM import).
"""

from __future__ import annotations

import torch

from ...paged import SUPPORTED_DTYPES
from ...presets import SUPPORTED_HEAD_DIMS, Preset, get_preset


def check_block_size(preset: Preset, block_size: int) -> None:
    if block_size != preset.tile_size:
        raise ValueError(
            f"--kv-cache-dtype {preset.name} stores tiles of {preset.tile_size} tokens, one per vLLM block: "
            f"use --block-size {preset.tile_size} (got {block_size})"
        )


def serving_block_size(cache_dtype: str, block_size: int, user_specified: bool) -> int:
    """The block size to serve ``cache_dtype`` with: the preset's tile size, which a user-given block size
    must equal."""
    preset = get_preset(cache_dtype)
    if user_specified:
        check_block_size(preset, block_size)
    return preset.tile_size


MIN_CUDA_CAPABILITY = (8, 0)  # the kernels' fp16/bf16 tensor-core dots (Ampere and newer)


SPECULATIVE_METHODS = ("ngram",)  # drafts without a draft model: its layers would need KVarN pages too


def check_model(cache_dtype: str, dtype: torch.dtype, head_size: int, mla: tuple[int, int] | None,
                speculative: str | None, device: str = "cpu", capability: tuple[int, int] | None = None,
                hybrid: bool = False) -> None:  # fmt: skip
    """Raise for an engine that a kvarn KV-cache dtype cannot serve, naming what to change.

    ``mla``: an MLA model's (latent dim, rope key dim), None for other models; ``speculative``: the
    speculative decoding method, if any; ``device``: vLLM's device type ("cpu", "cuda", ...);
    ``capability``: the CUDA GPU's (major, minor); ``hybrid``: the model also has Mamba or linear-attention
    layers."""
    preset = get_preset(cache_dtype)
    name = preset.name
    if hybrid:
        # vLLM sizes the attention blocks of such models to hold as many bytes as a Mamba state's page, so a block
        # is no longer one tile (a tiny Jamba: 384 tokens)
        raise ValueError(f"--kv-cache-dtype {name} does not serve hybrid models with Mamba or linear-attention layers "
                         f"yet (vLLM aligns their state pages with the attention blocks): use another --kv-cache-dtype")  # fmt: skip
    if device not in ("cpu", "cuda"):
        raise ValueError(f"--kv-cache-dtype {name} runs on NVIDIA GPUs (CUDA) and CPUs, not on {device}: use "
                         f"another --kv-cache-dtype")  # fmt: skip
    if device == "cuda" and capability is not None and tuple(capability) < MIN_CUDA_CAPABILITY:
        major, minor = capability
        raise ValueError(f"--kv-cache-dtype {name} needs an NVIDIA GPU of compute capability "
                         f"{'.'.join(map(str, MIN_CUDA_CAPABILITY))} or newer (its Triton kernels use fp16/bf16 "
                         f"tensor-core dots); this one is {major}.{minor}: use another --kv-cache-dtype")  # fmt: skip
    if speculative is not None and speculative not in SPECULATIVE_METHODS:
        # draft models and heads (EAGLE, MTP, ...) run attention layers of their own, with their own steps
        raise ValueError(f"--kv-cache-dtype {name} supports speculative decoding with the methods "
                         f"{SPECULATIVE_METHODS}, not {speculative!r}: use \"method\": \"ngram\" in "
                         f"--speculative-config, or another --kv-cache-dtype")  # fmt: skip
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"--kv-cache-dtype {name} serves float16 and bfloat16 models: use --dtype bfloat16 or "
                         f"--dtype float16 (got {dtype})")  # fmt: skip
    if mla is not None:
        if speculative is not None:
            raise ValueError(f"--kv-cache-dtype {name}: KVarN does not combine MLA models with speculative decoding "
                             f"yet (drafts would be written to the latent cache before they are accepted); turn "
                             f"--speculative-config off or use another --kv-cache-dtype")  # fmt: skip
        try:
            preset.latent_layout(*mla)
        except ValueError as e:
            raise ValueError(f"--kv-cache-dtype {name}: this MLA model's latent cache (kv_lora_rank {mla[0]}, "
                             f"qk_rope_head_dim {mla[1]}) does not fit the format: {e}; use another "
                             f"--kv-cache-dtype") from None  # fmt: skip
        return
    if head_size not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"--kv-cache-dtype {name} supports head sizes {SUPPORTED_HEAD_DIMS}; this model's is "
                         f"{head_size}: use another --kv-cache-dtype")  # fmt: skip


def check_layer(cache_dtype: str, *, decoder: bool, alibi: bool, soft_cap: bool, sinks: bool, shares_kv: bool,
                sliding_window: int | None, mla: bool = False) -> None:  # fmt: skip
    """Raise for an attention layer the KVarN backend cannot serve (checked as vLLM builds each layer)."""
    unsupported = {
        f"sliding-window MLA attention (window {sliding_window})": mla and sliding_window is not None,
        "attention other than decoder self-attention": not decoder,
        "ALiBi slopes": alibi,
        "logits soft-capping": soft_cap,
        "attention sinks": sinks,
        "KV-cache sharing between layers": shares_kv,
    }
    found = [what for what, present in unsupported.items() if present]
    if found:
        raise ValueError(f"--kv-cache-dtype {get_preset(cache_dtype).name}: the KVarN vLLM backend does not support "
                         f"{', '.join(found)} yet; serve this model with another --kv-cache-dtype")  # fmt: skip
