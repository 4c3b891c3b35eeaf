"""The transformers integration: sessions on real modeling code (tiny random models) against transformers' own
forward, the paged KVarN cache against the dense simulation of the same method, and bad use."""

import pytest
import torch
import transformers

from kvarn_compile.integrations.hf import DenseKV, KVSession, PagedKV, _attention, stored_bytes
from kvarn_compile.methods import get_method
from tests.hf_models import ARCHS, tiny_model

T = 300  # two full 128-token tiles and a partial one
# CUDA runs the Triton kernels for real (no interpreter: too slow for whole models)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def feed(session, ids, chunk):
    session.reset()
    return torch.cat([session.forward(ids[:, i : i + chunk]) for i in range(0, ids.shape[1], chunk)], 1)


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("chunk", [1, 128, T])
def test_exact_cache_matches_transformers(arch, chunk):
    """An unquantized store at the model dtype reproduces the model's own forward (masks, windows, GQA/MQA,
    scaling) whatever the chunking."""
    model = tiny_model(arch)
    ids = torch.randint(0, 512, (2, T if chunk > 1 else 100))  # decode: past the 96-token windows
    with torch.no_grad():
        expected = model(ids).logits
    got = feed(KVSession(model, lambda: DenseKV("fp16", torch.float32)), ids, chunk)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("preset", ["kvarn_k4v2_g128", "kvarn_k4v4_g64"])
@pytest.mark.parametrize("sink", [True, False])
@pytest.mark.parametrize("device", DEVICES)
def test_paged_cache_matches_its_simulation(arch, preset, sink, device):
    """The real paged cache (kvarn:: ops: the reference on CPU, the Triton kernels on CUDA) and DenseKV
    running the same method give the same logits, up to fp16 rounding of q and of the attention output (a
    small fraction of the quantization effect)."""
    model = tiny_model(arch, dtype=torch.float32 if device == "cpu" else torch.float16).to(device)
    ids = torch.randint(0, 512, (2, T), device=device)
    g = get_method(preset).tile_size
    exact = feed(KVSession.for_method(model, "fp16"), ids, g)
    paged = feed(KVSession.for_method(model, preset, max_seq_len=512, keep_first_tile=sink), ids, g)
    dense = feed(KVSession.for_method(model, preset, keep_first_tile=sink, paged=False), ids, g)
    exact, paged, dense = (x.float() for x in (exact, paged, dense))
    effect = (dense - exact).abs().max()
    assert effect > 1e-3  # the quantized history changes the logits ...
    # ... and both caches change them the same way. NOTE: balanced value roundings shrink this tiny random
    # model's effect ~10x (its attention is diffuse: 0.076 -> 0.008 with k4v2_g128), while the rounding gap
    # between the two stays ~1e-3; half the effect is still a tighter bound than a tenth of the old one.
    # On the CPU (a float32 model, the reference ops) the gap measured 8e-4 to 3.7e-3 over these cases (2026-12-06),
    # also where the effect is ~0.4 (gemma3): a fixed bound there as well.
    bound = min(0.5 * effect, 1e-2) if device == "cpu" else 0.5 * effect
    assert (paged - dense).abs().max() < bound
    tile = slice(0, g) if sink else slice(0, 1)  # the first tile sees no quantized history: exact
    tol = 2e-3 if device == "cpu" else 1e-2  # CPU: 2e-4 to 5.4e-4 measured; CUDA: an fp16 model
    torch.testing.assert_close(paged[:, tile], exact[:, tile], atol=tol, rtol=tol)


def test_bf16_model_on_the_paged_cache():
    """A bf16 model: bf16 exact rows, and its quantized tile (tile 1: tile 0 is the kept sink) read as the dense
    simulation of the method reads it, up to bf16 rounding (measured: gap 0.023 against an effect of 0.107)."""
    model = tiny_model("qwen3", dtype=torch.bfloat16)
    ids = torch.randint(0, 512, (1, T))
    session = KVSession.for_method(model, "kvarn_k4v2_g128", max_seq_len=512)
    out = feed(session, ids, 128)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    cache = session.stores[0].cache
    assert cache.exact_k.dtype == torch.bfloat16 and cache.pages.any()  # a tile was quantized
    dense = feed(KVSession.for_method(model, "kvarn_k4v2_g128", paged=False), ids, 128).float()
    exact = feed(KVSession.for_method(model, "fp16"), ids, 128).float()
    effect = (dense - exact).abs().max()
    assert effect > 1e-2 and (out.float() - dense).abs().max() < 0.5 * effect


@pytest.mark.parametrize("arch", ["jamba", "qwen3next", "zamba2"])
def test_models_with_recurrent_layers_are_refused(arch):
    """Mamba mixers and gated delta nets keep a state from one forward to the next in transformers' cache, which a
    session runs without: until 2026-12-07 their layers restarted at every call (0.13-1.16 off in logits after a
    chunk and a few single tokens, nothing quantized). Refused, saying what to use instead."""
    with pytest.raises(ValueError, match="keeps a recurrent state in .*(Mamba|DeltaNet).*backend='kvarn'"):
        KVSession(tiny_model(arch), lambda: DenseKV("fp16", torch.float32))


@pytest.mark.parametrize("method", ["kvarn_k4v2_g128", "kivi2"])
def test_a_dense_store_leaves_the_model_s_tensors_alone(method):
    """``DenseKV`` quantizes its completed tiles in place: in a copy of what the layer gave it. Until 2026-12-07 a
    half-precision model's k / v were kept as they came (``.to`` of the same dtype copies nothing) and quantized under
    the layer: eval's "recorded" accumulation read its exact twin's tiles quantized, and Gemma4's KV-shared layers
    read the sharing layer's quantized keys in a prefill."""
    store = DenseKV(method, torch.float16, keep_first_tile=False)
    q, k, v = (torch.randn(1, 2, 128, 64, dtype=torch.float16) for _ in range(3))
    k0, v0 = k.clone(), v.clone()
    store.attend(q, k, v, 0.125, True, 0)
    assert store.quantized == 128 and not torch.equal(store.k, k0)  # the tile was quantized, in the store
    assert torch.equal(k, k0) and torch.equal(v, v0)


def test_generate_and_bytes():
    model = tiny_model()
    prompt = torch.randint(0, 512, (2, 250))
    session = KVSession.for_method(model, "kvarn_k4v2_g128", max_seq_len=512, keep_first_tile=True)
    tokens, _ = session.generate(prompt, 10)
    assert tokens.shape == (2, 10) and session.position == 260
    # 260 tokens: tile 0 exact (sink), tile 1 quantized, 4 tokens in the current tile; 2 layers x 2 rows x 2 heads
    m = get_method("kvarn_k4v2_g128")
    per_row_head = (128 + 4) * 128 * 2 + 128 * m.bytes_per_token(64, 64)
    assert session.kv_bytes() == 2 * 2 * 2 * per_row_head
    assert stored_bytes(m, True, 260, 4, 64, 64, 2) == 2 * 2 * per_row_head
    # the same tokens through the dense simulation cost the same bytes
    dense = KVSession.for_method(model, "kvarn_k4v2_g128", paged=False)
    dense.generate(prompt, 10)
    assert dense.kv_bytes() == session.kv_bytes()
    fp16 = KVSession.for_method(model, "fp16")
    fp16.generate(prompt, 10)
    assert fp16.kv_bytes() == 2 * 2 * 2 * 260 * 128 * 2


def test_bad_use_raises():
    model = tiny_model()
    ids = torch.randint(0, 512, (2, 8))
    session = KVSession.for_method(model, "kvarn_k4v2_g128", max_seq_len=128)
    with pytest.raises(ValueError, match="attention mask"), session.active():
        model(input_ids=ids, attention_mask=torch.ones(2, 1, 8, 8, dtype=torch.bool), use_cache=False)
    padded = torch.ones(2, 8, dtype=torch.long)
    padded[1, :3] = 0  # (transformers would drop a 2-D mask for an attention without its own mask builder)
    with pytest.raises(ValueError, match="padded batches"), session.active():
        model(input_ids=ids, attention_mask=padded, use_cache=False)
    llama4 = transformers.Llama4TextConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                                           intermediate_size_mlp=256, num_hidden_layers=2, num_attention_heads=4,
                                           num_key_value_heads=2, head_dim=32, attention_chunk_size=16)  # fmt: skip
    with pytest.raises(ValueError, match="chunked-attention layers"):
        KVSession.for_method(transformers.Llama4ForCausalLM(llama4), "fp16", 128, paged=False)
    attn = model.model.layers[0].self_attn
    q, k = torch.randn(2, 4, 8, 64), torch.randn(2, 2, 8, 64)
    with pytest.raises(ValueError, match="softcap"), session.active():  # e.g. Gemma2: never silently dropped
        _attention(attn, q, k, k, None, softcap=30.0)
    with pytest.raises(RuntimeError, match="KVSession"):
        model(input_ids=ids, use_cache=False)  # attn_implementation is "kvarn" but no session is active
    session.forward(ids)
    with pytest.raises(ValueError, match="sequences"):
        session.forward(ids[:1])
    with pytest.raises(ValueError, match="8 \\+ 128 tokens per row exceed this session's max_seq_len=128"):
        session.forward(torch.randint(0, 512, (2, 128)))
    short = KVSession.for_method(model, "kvarn_k4v2_g128", max_seq_len=100)  # the cache holds a whole tile: 128
    with pytest.raises(ValueError, match="0 \\+ 120 tokens per row exceed this session's max_seq_len=100"):
        short.forward(torch.randint(0, 512, (2, 120)))
    with pytest.raises(ValueError, match="unknown KV method"):
        KVSession.for_method(model, "int3")
    with pytest.raises(TypeError, match="float16 or bfloat16"):  # float32 caches are not a KVarN format
        PagedKV("kvarn_k4v2_g128", torch.float32, 128).attend(
            *(torch.randn(1, 2, 4, 64) for _ in range(3)), 0.1, True, 0
        )
