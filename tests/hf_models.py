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
    config_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(0)
    config = config_cls(**{**COMMON, **extra, **overrides})
    return model_cls(config).to(dtype).eval()
