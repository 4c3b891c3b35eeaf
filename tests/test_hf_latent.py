"""MLA models in transformers on the KVarN latent cache (``integrations.hf_latent``): a tiny DeepSeek-V2 with
random weights at DeepSeek's latent sizes (kv_lora_rank 512 + rope 64)."""

import pytest
import torch

from kvarn_compile.integrations.hf_latent import LatentKVarNCache, LatentSession
from kvarn_compile.presets import get_preset
from kvarn_compile.reference import dequantize_latent_records, quantize_latent_records, rotate

transformers = pytest.importorskip("transformers")

CONFIG = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 4, "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64,
          "qk_nope_head_dim": 64, "v_head_dim": 64, "vocab_size": 512, "max_position_embeddings": 1024,
          "first_k_dense_replace": 2, "n_routed_experts": 4, "moe_intermediate_size": 128}  # fmt: skip


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = transformers.DeepseekV2Config(**CONFIG)
    return transformers.DeepseekV2ForCausalLM(config).to(torch.bfloat16).eval()


def chunked_logprobs(model, preset, ids, chunk):
    """Log-probabilities [T, vocab] of a LatentSession fed ``ids`` [1, T] in chunks, then one token at a time."""
    session = LatentSession(model, preset, max_seq_len=512)
    prompt = ids.shape[1] - 20
    out = [session.forward(ids[:, i : min(i + chunk, prompt)]) for i in range(0, prompt, chunk)]
    out += [session.forward(ids[:, i : i + 1]) for i in range(prompt, ids.shape[1])]
    return torch.cat(out, 1)[0].float().log_softmax(-1), session


def test_latent_cache_follows_the_model_as_closely_as_its_bits_allow(model):
    """Chunks of 48 tokens (starting mid-tile), then decode across tile boundaries: an 8-bit latent is within
    bf16 rounding of the plain model, the 4-bit one several times further (0.0155 and 0.082 in log-probability,
    5.3x, 2026-12-06; 0.03 is about twice bf16's rounding there), and the cache holds what the layout says."""
    ids = torch.randint(0, CONFIG["vocab_size"], (1, 300), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model(ids).logits[0].float().log_softmax(-1)
    near, _ = chunked_logprobs(model, "kvarn_k8v8_g64", ids, 48)
    far, session = chunked_logprobs(model, "kvarn_k4v2_g128", ids, 48)
    near_error, far_error = (near - plain).abs().max(), (far - plain).abs().max()
    assert near_error < 0.03 and far_error > 4 * near_error, (near_error, far_error)
    layout = get_preset("kvarn_k4v2_g128").latent_layout(512, 64)
    held = 2 * (2 * layout.nbytes + (300 - 256) * (512 + 64) * 2)  # 2 layers: 2 tiles + the current one exact
    assert session.kv_bytes() == held


def test_decode_reads_the_tile_it_completes_quantized(model):
    """vLLM's MLA order: the write comes first, so the token that completes a tile sees that tile quantized
    (itself included), while a chunk sees its own tokens exactly."""
    cache = LatentKVarNCache(model.config, "kvarn_k4v2_g64", max_seq_len=256)
    layer = cache.layers[0]
    c, rope = torch.randn(1, 1, 64, 512).bfloat16(), torch.randn(1, 1, 64, 64).bfloat16()
    seen_c, seen_r = layer.update(c[:, :, :60], rope[:, :, :60])
    assert torch.equal(seen_c, c[:, :, :60]) and torch.equal(seen_r, rope[:, :, :60])  # a chunk: itself, exact
    layer.update(c[:, :, 60:63], rope[:, :, 60:63])
    seen_c, seen_r = layer.update(c[:, :, 63:], rope[:, :, 63:])  # one token completes the tile
    # the tile as the cache quantizes it: from its rotated latents rounded to bf16
    layout = get_preset("kvarn_k4v2_g64").latent_layout(512, 64)
    records = quantize_latent_records(rotate(c[0, 0].float()).bfloat16(), rope[0, 0], "kvarn_k4v2_g64")
    want_c, _ = dequantize_latent_records(records, layout, torch.bfloat16)
    assert seen_c.shape == (1, 1, 64, 512) and torch.equal(seen_r[0, 0], rope[0, 0])
    assert torch.equal(seen_c[0, 0], rotate(want_c).bfloat16())
    assert (seen_c[0, 0] - c[0, 0]).float().norm() > 0.05 * c.float().norm()  # 4-bit, not exact


def test_generate_with_the_latent_cache(model):
    ids = torch.randint(0, CONFIG["vocab_size"], (1, 150), generator=torch.Generator().manual_seed(2))
    plain = model.generate(ids, max_new_tokens=12, do_sample=False)
    cache = LatentKVarNCache(model.config, "kvarn_k8v8_g64", max_seq_len=512)
    kvarn = model.generate(ids, max_new_tokens=12, do_sample=False, past_key_values=cache)
    assert torch.equal(kvarn, plain)  # an 8-bit latent: greedy tokens unchanged on this model
    assert cache.get_seq_length() == 150 + 11


def test_models_without_a_latent_are_refused():
    config = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2)
    with pytest.raises(ValueError, match="use KVSession"):
        LatentKVarNCache(config)
    with pytest.raises(ValueError, match="latent dim"):
        LatentKVarNCache(transformers.DeepseekV2Config(**{**CONFIG, "kv_lora_rank": 576}))


def feed(model, cache, ids):
    """Logits [B, vocab] of the token after ``ids`` [B, T], fed to ``cache`` at its current length."""
    start = cache.get_seq_length()
    positions = torch.arange(start, start + ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        return model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True).logits[:, -1]


def test_reordered_rows_continue_as_the_reordered_sequences_would(model):
    """What beam search (reorder_cache), input expansion (batch_repeat_interleave) and contrastive search
    (batch_select_indices) do to the rows: each leaves a cache that continues exactly as one fed the rows'
    sequences in the new order, past two quantized tiles (g64, 150 tokens)."""
    ids = torch.randint(0, CONFIG["vocab_size"], (3, 151), generator=torch.Generator().manual_seed(3))
    cases = [("reorder_cache", torch.tensor([2, 0, 0])), ("batch_repeat_interleave", 2),
             ("batch_select_indices", torch.tensor([2, 1]))]  # fmt: skip
    for method, argument in cases:
        cache = LatentKVarNCache(model.config, "kvarn_k4v2_g64", max_seq_len=256)
        feed(model, cache, ids[:, :150])
        getattr(cache, method)(argument)
        rows = torch.arange(3).repeat_interleave(argument) if method == "batch_repeat_interleave" else argument
        fresh = LatentKVarNCache(model.config, "kvarn_k4v2_g64", max_seq_len=256)
        feed(model, fresh, ids[rows, :150])
        got, want = feed(model, cache, ids[rows, 150:]), feed(model, fresh, ids[rows, 150:])
        assert torch.equal(got, want), method
        assert cache.nbytes() == fresh.nbytes()
    with pytest.raises(ValueError, match=r"values in \[0, 2\)"):
        cache.reorder_cache(torch.tensor([0, 5]))  # the last case left 2 rows


def test_beam_search_with_the_latent_cache(model):
    """Beam search through transformers' generate, which reorders the cache's rows every step: an 8-bit
    latent gives the plain model's beams on this model (as greedy decoding does above)."""
    ids = torch.randint(0, CONFIG["vocab_size"], (1, 120), generator=torch.Generator().manual_seed(4))
    kwargs = {"max_new_tokens": 12, "num_beams": 3, "do_sample": False}
    plain = model.generate(ids, **kwargs)
    cache = LatentKVarNCache(model.config, "kvarn_k8v8_g64", max_seq_len=256)
    assert torch.equal(model.generate(ids, past_key_values=cache, **kwargs), plain)


def test_crop_removes_rows_of_the_current_tile_only(model):
    """``crop`` within the current tile: the cache continues as one that never held those rows; into a quantized
    tile it refuses, since those rows are gone."""
    ids = torch.randint(0, CONFIG["vocab_size"], (1, 140), generator=torch.Generator().manual_seed(5))
    cache = LatentKVarNCache(model.config, "kvarn_k4v2_g64", max_seq_len=256)
    feed(model, cache, ids[:, :135])
    cache.crop(-5)
    fresh = LatentKVarNCache(model.config, "kvarn_k4v2_g64", max_seq_len=256)
    feed(model, fresh, ids[:, :130])
    assert cache.get_seq_length() == 130
    assert torch.equal(feed(model, cache, ids[:, 135:]), feed(model, fresh, ids[:, 135:]))
    with pytest.raises(ValueError, match="quantized tiles of 64"):
        cache.crop(-20)  # 135 -> 115: tile 1 (64-127) was quantized
    cache.crop(132)  # a positive count is the length to keep (transformers' older convention): 130 + 2 fed after
    fresh = LatentKVarNCache(model.config, "kvarn_k4v2_g64", max_seq_len=256)
    feed(model, fresh, ids[:, :130])
    feed(model, fresh, ids[:, 135:137])
    assert torch.equal(feed(model, cache, ids[:, 137:]), feed(model, fresh, ids[:, 137:]))
    with pytest.raises(ValueError, match="cannot crop"):
        cache.crop(150)  # longer than it holds
    assert not cache.layers[0].is_croppable  # so transformers 5.2x refuses assisted decoding before it starts
