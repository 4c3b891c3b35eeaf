"""vLLM's ``--compilation-config`` hook: the Hadamard rotations of q, k and v move into vLLM's compiled graph.

    vllm serve MODEL --kv-cache-dtype kvarn_k4v2_g128 --block-size 128 \\
        --compilation-config '{"inductor_passes": {"post_grad_custom_post_pass": "kvarn_compile.vllm_pass"},
                               "use_inductor_graph_partition": true}'

Without the hook every attention layer of a kvarn engine runs ``vllm.unified_attention_with_output``, and
the KVarN backend rotates q, k and v inside it (one launch per layer and step, ``kernels/rotate.py``; three
GEMMs and casts when the hook was written), outside what Inductor compiles. With it, this post-grad pass
rewrites each of those ops into

    q' = q @ H (float32)    k' = k @ H    v' = v @ H      graph ops: Inductor fuses them with what
                                                          precedes them (RoPE, q/k norms, the casts)
    kvarn::vllm_attention(q', k', v', output, layer_name)  attention + quantize-and-store on rotated inputs

so that the rotation that starts the quantize-and-store is compiled (and captured in CUDA graphs) with the
operations before it. It changes no result beyond the rounding of the fp32 sums.

vLLM sees attention ops in its graph only where it does not split the graph at them: on the CPU always; on a
GPU with ``use_inductor_graph_partition`` (piecewise CUDA graphs kept) or ``splitting_ops: []`` (full graphs
only). A graph without them gets a warning that says so (the hook then does nothing).

This module imports no vLLM: vLLM looks the hook up as an attribute of the top-level package
(``kvarn_compile.vllm_pass``) when it parses its config, and vLLM hashes this class's source for its compile
cache. The op it emits, ``kvarn::vllm_attention``, is registered by the vLLM plugin
(``integrations.vllm.hook_op``), which every kvarn engine loads.

Shape legend (one attention layer, T tokens): query [T, Hq, Dk], key [T, Hkv, Dk], value [T, Hkv, Dv],
output [T, Hq, Dv]; H the [R, R] Hadamard block (``reference.rotation_block``), applied to rows of R.
"""

from __future__ import annotations

import logging
import operator

import torch
from torch import fx
from torch._higher_order_ops.auto_functionalize import auto_functionalized

from ..reference import hadamard, hadamard_signs, rotation_block

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger when vLLM runs it


class VLLMHookPass:
    """The post-grad pass (a callable on an ``fx.Graph``, as vLLM's ``inductor_passes`` takes it). Everything
    it does is in this class: vLLM keys its compile cache on the class's source."""

    rewritten = 0  # attention ops rewritten in this process, by every copy (vLLM deep-copies its config)

    def __init__(self) -> None:
        self._warned = False

    def __call__(self, graph: fx.Graph) -> None:
        attention = getattr(torch.ops.vllm, "unified_attention_with_output", None)
        sites = [n for n in graph.nodes if n.target is auto_functionalized and attention is not None
                 and n.args[0] is attention.default]  # fmt: skip
        if not sites:
            if not self._warned:
                self._warned = True
                ops = {str(n.args[0] if n.target is auto_functionalized else n.target) for n in graph.nodes
                       if n.op == "call_function"}  # fmt: skip
                if any("mla" in op for op in ops):
                    logger.info("KVarN hook: MLA attention is not rewritten by the hook (the KVarN MLA backend "
                                "rotates the latent itself): nothing to do in this graph")  # fmt: skip
                else:
                    logger.warning(
                        "KVarN hook (kvarn_compile.vllm_pass): a compiled graph holds no attention op, so nothing "
                        "is rotated in the graph. On a GPU vLLM splits its graph at the attention ops: add "
                        '"use_inductor_graph_partition": true (or "splitting_ops": []) to --compilation-config. '
                        "(MLA models need neither: the hook never rewrites MLA attention.)"
                    )
            return
        for node in sites:
            self._rewrite(graph, node)
        VLLMHookPass.rewritten += len(sites)
        logger.info("KVarN hook: %d attention ops now take q, k, v rotated in the compiled graph", len(sites))

    def _rewrite(self, graph: fx.Graph, node: fx.Node) -> None:
        kw = node.kwargs
        if kw.get("kv_cache_dummy_dep") is not None:  # a kvarn engine's attention op writes the cache itself
            raise RuntimeError("KVarN hook: vLLM writes this graph's KV cache in an op of its own, which a kvarn "
                               "engine does not: the hook needs --kv-cache-dtype kvarn_* (or leave it out of "
                               "--compilation-config)")  # fmt: skip
        for name in ("output_scale", "output_block_scale"):
            if kw.get(name) is not None:
                raise RuntimeError(f"KVarN hook: an attention op of this graph has {name} set (a fusion of vLLM's "
                                   "that KVarN does not serve): remove it from --compilation-config")  # fmt: skip
        dtype = kw["key"].meta["val"].dtype
        with graph.inserting_before(node):
            q = self._rotated(graph, kw["query"], torch.float32)
            k = self._rotated(graph, kw["key"], dtype)
            v = self._rotated(graph, kw["value"], dtype)
            args = {"query": q, "key": k, "value": v, "output": kw["output"], "layer_name": kw["layer_name"]}
            fused = graph.call_function(auto_functionalized, (torch.ops.kvarn.vllm_attention.default,), args)
        # auto_functionalized returns (op result, *mutated): item 1 is ``output`` for both ops
        output = kw["output"].meta["val"]
        fused.meta["val"] = (None, torch.empty_like(output))
        for user in list(node.users):
            if user.target is not operator.getitem or user.args[1] != 1:
                raise RuntimeError(f"KVarN hook: unexpected use of vLLM's attention op: {user.format_node()}")
            user.replace_input_with(node, fused)
        graph.erase_node(node)

    @staticmethod
    def _rotated(graph: fx.Graph, x: fx.Node, dtype: torch.dtype) -> fx.Node:
        """x [T, H, D] @ blockdiag(H, ..., H) in ``dtype``, with fp32 sums, as graph ops.

        On CUDA, fp16/bf16 rows multiply the +-1 block (exact in fp16/bf16) with an fp32 result, scaled after,
        as ``ops._rotated`` does (NOTE, H200: ~2x faster than the fp32 GEMM); elsewhere an fp32 GEMM, as the
        reference's ``rotate``."""
        val, node, convert = x.meta["val"], VLLMHookPass._node, torch.ops.prims.convert_element_type.default
        r = rotation_block(val.shape[-1])
        aten = torch.ops.aten
        rows = node(graph, aten.reshape.default, (x, [-1, r]), val.reshape(-1, r))
        sums = rows.meta["val"].float()
        if val.is_cuda and val.dtype in (torch.float16, torch.bfloat16):
            signs = VLLMHookPass._constant(graph, hadamard_signs(val.shape[-1], val.dtype, val.device), val)
            product = node(graph, aten.mm.dtype, (rows, signs, torch.float32), sums)
            product = node(graph, aten.mul.Tensor, (product, r**-0.5), sums)
        else:
            h = VLLMHookPass._constant(graph, hadamard(val.shape[-1], torch.float32, val.device), val)
            product = node(graph, aten.mm.default, (node(graph, convert, (rows, torch.float32), sums), h), sums)
        out = node(graph, aten.reshape.default, (product, [-1, *val.shape[1:]]), val.float())
        return out if dtype == torch.float32 else node(graph, convert, (out, dtype), val.to(dtype))

    @staticmethod
    def _node(graph: fx.Graph, target, args: tuple, val: torch.Tensor) -> fx.Node:
        """A call_function node with the fake value Inductor reads (``val``: a tensor of the result's shape)."""
        node = graph.call_function(target, args)
        node.meta["val"] = val
        return node

    @staticmethod
    def _constant(graph: fx.Graph, tensor: torch.Tensor, like: torch.Tensor) -> fx.Node:
        """A get_attr node for ``tensor``, held by the graph's module (one per rotation block, dtype, device);
        its fake value comes from the fake mode of ``like`` (a fake value of the graph)."""
        module = graph.owning_module
        name = f"kvarn_hadamard_{tensor.shape[0]}_{str(tensor.dtype).removeprefix('torch.')}_{tensor.device.type}"
        if not hasattr(module, name):
            module.register_buffer(name, tensor.clone(), persistent=False)
        node = graph.get_attr(name)
        node.meta["val"] = like.fake_mode.from_tensor(tensor)
        return node
