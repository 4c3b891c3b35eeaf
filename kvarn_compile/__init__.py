"""kvarn-compile: the KVarN KV-cache format (Hadamard rotation, variance normalisation, 4-bit keys and
2-bit values per 128-token tile) as a paged cache, PyTorch reference math and fused Triton kernels.

Layers, each importing only the ones before it (pyproject's import-linter contracts, tests/test_layers.py):
``presets`` (names, byte layout) -> ``reference`` (the math in PyTorch) -> ``methods`` (KVarN presets and
baselines as tile roundtrips) -> ``paged`` (the paged cache and its reference ops; ``paged_latent``: MLA's
latent cache) -> ``kernels`` (Triton and Gluon) -> ``deferred_flush`` -> ``ops`` (torch.library ops: CPU runs
the reference, CUDA the kernels; ``latent_ops``: MLA's latent cache) -> ``passes`` (find attention sites in
Dynamo graphs, rewrite them onto the ops) -> ``backend`` (``torch.compile(backend="kvarn")``) ->
``integrations`` (transformers, vLLM) -> ``cli`` (``kvarn-compile demo / eval / plan / inspect``).
"""

from . import latent_ops, ops
from .ops import attention, store
from .paged import Batch, KVarNCache
from .passes.vllm_hook import VLLMHookPass
from .presets import DEFAULT_PRESET, NAMED_PRESETS, Preset, get_preset

__all__ = [
    "DEFAULT_PRESET",
    "NAMED_PRESETS",
    "Batch",
    "KVarNCache",
    "Preset",
    "attention",
    "get_preset",
    "latent_ops",
    "ops",
    "store",
    "vllm_pass",
]  # fmt: skip
__version__ = "0.1.0"

# vLLM's --compilation-config hook: '{"inductor_passes": {"post_grad_custom_post_pass": "kvarn_compile.vllm_pass"}}'
# (vLLM looks the name up in this package's namespace; ``passes.vllm_hook`` says what it does)
vllm_pass = VLLMHookPass()
