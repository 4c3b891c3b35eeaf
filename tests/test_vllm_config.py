"""Start-up checks of the vLLM plugin (pure Python: run without vLLM)."""

import pytest
import torch

from kvarn_compile.integrations.vllm.config import check_layer, check_model, serving_block_size

LAYER = {"decoder": True, "alibi": False, "soft_cap": False, "sinks": False, "shares_kv": False,
         "sliding_window": None}  # fmt: skip


def test_block_size_is_the_tile_and_a_given_one_must_match():
    assert serving_block_size("kvarn_k4v2_g64", 128, user_specified=False) == 64
    assert serving_block_size("kvarn_k4v2_g128", 128, user_specified=True) == 128
    with pytest.raises(ValueError, match="use --block-size 128"):
        serving_block_size("kvarn_k4v2_g128", 16, user_specified=True)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"speculative": "eagle"}, r"methods \('ngram',\), not 'eagle'"),
        ({"mla": (512, 64), "speculative": "ngram"}, "MLA models with speculative decoding"),
        ({"mla": (576, 64)}, r"kv_lora_rank 576, qk_rope_head_dim 64\) does not fit .* latent dim"),
        ({"dtype": torch.float32}, "use --dtype bfloat16 or --dtype float16"),
        ({"head_size": 80}, r"supports head sizes \(64, 128, 192, 256, 512\)"),
        ({"device": "cuda", "capability": (7, 5)}, "compute capability 8.0 or newer .* this one is 7.5"),
        ({"device": "xpu"}, "NVIDIA GPUs \\(CUDA\\) and CPUs, not on xpu"),
        ({"hybrid": True}, "hybrid models with Mamba or linear-attention layers"),
    ],
)
def test_models_it_cannot_serve_fail_naming_the_fix(changes, message):
    good = {"dtype": torch.bfloat16, "head_size": 128, "mla": None, "speculative": None}
    check_model("kvarn_k4v2_g128", **good)
    check_model("kvarn_k4v2_g128", **{**good, "head_size": 576, "mla": (512, 64)})  # DeepSeek-V2/V3
    check_model("kvarn_k4v2_g128", **{**good, "head_size": 576, "mla": (512, 64)}, device="cuda", capability=(9, 0))
    check_model("kvarn_k4v2_g128", **{**good, "speculative": "ngram"})
    check_model("kvarn_k4v2_g128", **good, device="cuda", capability=(9, 0))  # an H100/H200
    check_model("kvarn_k4v2_g128", **good, device="cuda", capability=(8, 0))  # an A100: the oldest it serves
    with pytest.raises(ValueError, match=message):
        check_model("kvarn_k4v2_g128", **{**good, **changes})


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"alibi": True}, "ALiBi slopes"),
        ({"soft_cap": True}, "logits soft-capping"),
        ({"sinks": True}, "attention sinks"),
        ({"shares_kv": True}, "KV-cache sharing"),
        ({"decoder": False}, "other than decoder self-attention"),
        ({"sliding_window": 4096, "mla": True}, "sliding-window MLA attention"),
    ],
)
def test_layers_it_cannot_serve_fail_naming_what(changes, message):
    check_layer("kvarn_k4v2_g128", **LAYER)
    check_layer("kvarn_k4v2_g128", **{**LAYER, "sliding_window": 4096})
    check_layer("kvarn_k4v2_g128", **{**LAYER, "mla": True})  # MLA without a window is served
    with pytest.raises(ValueError, match=message):
        check_layer("kvarn_k4v2_g128", **{**LAYER, **changes})
