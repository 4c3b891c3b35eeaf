"""KVarN in stock vLLM: the ``vllm.general_plugins`` entry point ``kvarn``.

After ``pip install kvarn-compile[vllm]``, every vLLM process loads ``register`` before it parses its
arguments, so

    vllm serve MODEL --kv-cache-dtype kvarn_k4v2_g128 --block-size 128
    LLM(MODEL, kv_cache_dtype="kvarn_k4v2_g128", block_size=128)

serve attention from KVarN pages (``attention.KVarNAttentionBackend``); vLLM's block manager counts
their bytes, so it reports and schedules ~4.7x the tokens of an fp16 cache. Models whose KV-cache dtype
is not a kvarn preset are served as before (vLLM splits their graphs at the hook's op too, which they do not
hold); on a vLLM version the plugin does not support, ``register`` raises in every engine.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(f"vllm.{__name__}")  # vLLM's handler and level apply


def register() -> None:
    """The plugin (idempotent: vLLM calls it in every process, sometimes more than once)."""
    from . import compat, hook_op

    version = compat.check_version()
    compat.add_cache_dtypes()
    compat.route_attention()
    compat.attach_latent_impls()
    compat.size_pages(version)
    compat.track_request_slots()
    compat.warm_up_kernels()
    hook_op.register()  # the op of the --compilation-config hook (kvarn_compile.vllm_pass)
    compat.split_at_hook_op()
    logger.debug("KVarN KV-cache dtypes registered with vLLM: %s", ", ".join(compat.CACHE_DTYPES))
