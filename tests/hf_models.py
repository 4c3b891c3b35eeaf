"""Tiny random transformers models for the integration tests (real modeling code, random weights)."""

import torch
import transformers

COMMON = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 4096}  # fmt: skip
ARCHS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {}),
    # sliding window on every layer, smaller than the sequences of the tests
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": 96}),
    # sliding and global layers, MQA
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
               {"sliding_window": 96, "layer_types": ["sliding_attention", "full_attention"],
                "num_key_value_heads": 1}),
}  # fmt: skip


def tiny_model(arch: str = "llama", dtype=torch.float32, **overrides):
    config_cls, model_cls, extra = ARCHS[arch] if arch in ARCHS else PARTLY_ATTENTION[arch]
    torch.manual_seed(0)
    config = config_cls(**{**COMMON, **extra, **overrides})
    return model_cls(config).to(dtype).eval()


# Models where only some layers hold a KV cache the kvarn backend can serve (tests/test_backend.py)
PARTLY_ATTENTION = {
    # hybrid: gated-delta-net linear attention + full attention
    "qwen3next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM,
                  {"layer_types": ["linear_attention", "full_attention"], "num_experts": 4, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64, "linear_num_value_heads": 4,
                   "linear_num_key_heads": 2, "linear_key_head_dim": 32, "linear_value_head_dim": 32}),
    # hybrid: Mamba + attention (layer 1), head_dim = hidden / heads = 64
    "jamba": (transformers.JambaConfig, transformers.JambaForCausalLM,
              {"hidden_size": 256, "attn_layer_period": 2, "attn_layer_offset": 1, "num_experts": 1,
               "mamba_d_state": 16, "mamba_expand": 2}),
    # MLA: the cache holds the compressed latent, K/V are projections of it
    "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM,
                    {"num_key_value_heads": 4, "q_lora_rank": None, "kv_lora_rank": 64, "qk_nope_head_dim": 128,
                     "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 4, "num_experts_per_tok": 2,
                     "moe_intermediate_size": 64, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}),
    # hybrid: Mamba layers, the second also running the shared attention block
    "zamba2": (transformers.Zamba2Config, transformers.Zamba2ForCausalLM,
               {"layers_block_type": ["mamba", "hybrid"], "mamba_d_state": 16, "attention_head_dim": 64}),
    # decode positions computed from the attention mask's cumsum (an unbacked token count in the graph)
    "opt": (transformers.OPTConfig, transformers.OPTForCausalLM,
            {"hidden_size": 256, "ffn_dim": 256, "word_embed_proj_dim": 256}),
    # layers 2 and 3 read layers 0 and 1's caches (KV sharing); sliding layers of head dim 64, full ones of 128
    "gemma4": (transformers.Gemma4TextConfig, transformers.Gemma4ForCausalLM,
               {"num_hidden_layers": 4, "global_head_dim": 128, "sliding_window": 96, "num_kv_shared_layers": 2,
                "layer_types": ["sliding_attention", "full_attention"] * 2, "hidden_size_per_layer_input": 16,
                "vocab_size_per_layer_input": 512}),
    # layer 0 attends within chunks of 160 tokens, layer 1 to everything
    "llama4": (transformers.Llama4TextConfig, transformers.Llama4ForCausalLM,
               {"num_local_experts": 4, "num_experts_per_tok": 1, "attention_chunk_size": 160,
                "intermediate_size_mlp": 256, "no_rope_layers": [1, 0], "interleave_moe_layer_step": 1}),
}  # fmt: skip
