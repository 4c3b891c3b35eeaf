"""The paged cache's reference ops against a transparent model of what the cache must serve."""

import pytest
import torch
from cache_model import CacheModel, dense_attention, random_call

from kvarn_compile import Batch, KVarNCache, attention, get_preset, store
from kvarn_compile.paged import _grouped_attention, ring_tiles


def run_calls(cache, model, calls, hq, window=0, causal=True, check=True, lengths=None):
    """calls: list of {slot: n_new}; appends random tokens and checks every attention against the model.
    ``lengths`` ({slot: cached tokens}) continues earlier calls; returns it updated."""
    hkv, dk, dv = cache.exact_k.shape[1], cache.exact_k.shape[-1], cache.exact_v.shape[-1]
    dtype = cache.exact_k.dtype
    lengths = {} if lengths is None else lengths
    for call in calls:
        batch, q, k, v = random_call(call, lengths, hq, hkv, dk, dv, dtype)
        slots, starts, counts = list(call), batch.start_pos.tolist(), list(call.values())
        out = attention(cache, q, k, v, batch, scale=dk**-0.5, causal=causal, window=window)
        store(cache, k, v, batch)
        rows = 0
        for slot, start, n in zip(slots, starts, counts):
            model.store(slot, start, k[rows : rows + n], v[rows : rows + n])
            if check and n:
                k_seen, v_seen = model.seen(slot, start)
                fresh_k, fresh_v = model._exact(k[rows : rows + n].float()), model._exact(v[rows : rows + n].float())
                want = dense_attention(q[rows : rows + n], torch.cat([k_seen, fresh_k]), torch.cat([v_seen, fresh_v]),
                                       start, dk**-0.5, causal, window)  # fmt: skip
                torch.testing.assert_close(out[rows : rows + n].double(), want, atol=2e-2, rtol=2e-2)
            lengths[slot] = start + n
            rows += n
        assert cache.seq_lens[slots].tolist() == [lengths[s] for s in slots]
    return lengths


@pytest.mark.parametrize("keep_first_tile", [False, True])
@pytest.mark.parametrize("name", ["kvarn_k4v2_g32", "kvarn_k4v4_g64"])
def test_prefill_chunks_then_decode(name, keep_first_tile):
    preset = get_preset(name)
    cache = KVarNCache.allocate(4, 400, 2, 64, preset=preset, keep_first_tile=keep_first_tile)
    model = CacheModel(preset, torch.float16, keep_first_tile)
    calls = [{0: 70, 2: 5, 3: 0}, {0: 1, 2: 100}, {0: 129, 2: 27}, {0: 1, 2: 1}, {0: 1, 2: 1, 1: 33}]
    run_calls(cache, model, calls, hq=6)


def test_chunking_does_not_change_what_is_stored():
    preset = get_preset("kvarn_k4v2_g32")
    one, many = (KVarNCache.allocate(1, 256, 2, 64, preset=preset) for _ in range(2))
    k, v = torch.randn(200, 2, 64).half(), torch.randn(200, 2, 64).half()
    store(one, k, v, Batch.from_lengths([0], [0], [200]))
    start = 0
    for n in (1, 30, 2, 64, 33, 70):
        store(many, k[start : start + n], v[start : start + n], Batch.from_lengths([0], [start], [n]))
        start += n
    assert torch.equal(one.pages, many.pages) and torch.equal(one.seq_lens, many.seq_lens)
    for a, b in ((one.exact_k, many.exact_k), (one.exact_v, many.exact_v)):
        assert torch.equal(a[..., : 200 % 32, :], b[..., : 200 % 32, :])


def test_position_zero_starts_a_new_sequence():
    preset = get_preset("kvarn_k4v2_g32")
    cache = KVarNCache.allocate(2, 256, 1, 64, preset=preset)
    model = CacheModel(preset, torch.float16)
    lengths = run_calls(cache, model, [{0: 150, 1: 40}], hq=2)
    assert lengths == {0: 150, 1: 40}
    before = cache.pages[cache.page_table[1].long()].clone()
    k, v = torch.randn(10, 1, 64).half(), torch.randn(10, 1, 64).half()
    store(cache, k, v, Batch.from_lengths([0], [0], [10]))  # slot 0 starts over
    model.store(0, 0, k, v)
    assert cache.seq_lens.tolist() == [10, 40]
    assert torch.equal(cache.pages[cache.page_table[1].long()], before)  # the other slot is untouched
    q = torch.randn(1, 2, 64).half()
    kn, vn = torch.randn(1, 1, 64).half(), torch.randn(1, 1, 64).half()
    out = attention(cache, q, kn, vn, Batch.decode(torch.tensor([0]), torch.tensor([10])))
    k_seen, v_seen = model.seen(0, 10)
    keys = torch.cat([k_seen, model._exact(kn.float())])
    values = torch.cat([v_seen, model._exact(vn.float())])
    want = dense_attention(q, keys, values, 10, 64**-0.5)
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("window, causal", [(40, True), (0, False), (50, False)])
def test_masks(window, causal):
    preset = get_preset("kvarn_k4v2_g32")
    cache = KVarNCache.allocate(2, 256, 2, 64, preset=preset)
    model = CacheModel(preset, torch.float16)
    run_calls(cache, model, [{0: 90, 1: 10}, {0: 50, 1: 1}, {0: 1, 1: 1}], hq=4, window=window, causal=causal)


def test_a_sliding_window_never_reads_the_pages_before_it():
    """vLLM frees the pages of tiles wholly before a sliding window: attention must not read them (a freed
    page holds anything; here NaN scales, which would poison the output through 0 * NaN)."""
    preset = get_preset("kvarn_k4v2_g32")
    cache = KVarNCache.allocate(1, 256, 2, 64, preset=preset)
    model = CacheModel(preset, torch.float16)
    lengths = run_calls(cache, model, [{0: 90}], hq=4, window=40)
    cache.pages[int(cache.page_table[0, 0])] = 255  # tile 0 (positions 0-31) is before every window from now on
    run_calls(cache, model, [{0: 1}, {0: 5}], hq=4, window=40, lengths=lengths)


# (window, pages a slot): a query reaches back W - 1 positions, over at most ceil((W - 1) / 32) complete 32-token tiles
# (its own tile is exact); 34 and 66 are the first windows that need one page more
WINDOW_PAGES = [(1, 1), (31, 1), (32, 1), (33, 1), (34, 2), (45, 2), (64, 2), (65, 2), (66, 3)]


@pytest.mark.parametrize("window, pages", WINDOW_PAGES)
@pytest.mark.parametrize("keep_first_tile", [False, True])
def test_a_sliding_window_cache_keeps_only_the_pages_its_window_reaches(window, pages, keep_first_tile):
    """With ``window``, each slot holds ``ring_tiles`` pages (tile i in page i % R), fewer than the 13 its
    length needs; prefills complete more tiles than the ring holds (later ones take the pages of earlier
    ones), chunks and decodes wrap around it, and every output is what the whole history gives. The windows
    include the first ones that need a page more (one page fewer fails there)."""
    preset = get_preset("kvarn_k4v2_g32")
    cache = KVarNCache.allocate(2, 400, 2, 64, preset=preset, keep_first_tile=keep_first_tile, window=window)
    ring = ring_tiles(window, 32)
    assert ring == pages and cache.pages.shape[0] == 2 * ring
    assert cache.page_table[1].tolist() == [ring + i % ring for i in range(13)]
    model = CacheModel(preset, torch.float16, keep_first_tile)
    calls = [{0: 150, 1: 20}, {0: 1, 1: 40}, {0: 37, 1: 1}, {0: 100, 1: 130}, {0: 1, 1: 1}, {0: 1, 1: 1}]
    run_calls(cache, model, calls, hq=4, window=window)


def test_a_sliding_window_cache_refuses_wider_attention():
    cache = KVarNCache.allocate(1, 256, 2, 64, preset="kvarn_k4v2_g32", window=45)
    q, k, v = torch.randn(1, 2, 64).half(), torch.randn(1, 2, 64).half(), torch.randn(1, 2, 64).half()
    batch = Batch.decode(torch.tensor([0]), torch.tensor([0]))
    for window in (0, 46):
        with pytest.raises(ValueError, match="sliding windows of up to 45 tokens"):
            attention(cache, q, k, v, batch, window=window)
    with pytest.raises(ValueError, match="window must be >= 0"):
        KVarNCache.allocate(1, 256, 2, 64, window=-1)


def test_mla_head_dims_and_bf16():
    preset = get_preset("kvarn_k4v2_g32")
    cache = KVarNCache.allocate(2, 128, 1, 192, head_dim_v=128, preset=preset, dtype=torch.bfloat16)
    model = CacheModel(preset, torch.bfloat16)
    run_calls(cache, model, [{0: 40, 1: 70}, {0: 1, 1: 1}], hq=4)


@pytest.mark.parametrize("hq, hkv, n, length", [(32, 8, 1, 2048), (9, 3, 5, 700), (4, 4, 5, 750), (16, 2, 3, 300),
                                                (64, 4, 1, 129), (4, 2, 1, 64)])  # fmt: skip
def test_grouped_attention_rounds_as_a_copy_per_query_head(hq, hkv, n, length):
    """The reference's GQA (each KV head's query heads batched over its keys, no copy per query head) gives bit for
    bit what attending over a copy of the keys and values per query head gives. The vLLM tests compare engines with
    this reference near fp16 ties, where a product that rounds otherwise (the group's queries as rows of one
    matrix, session 37) moved a token past its bound."""
    torch.manual_seed(hq * length + n)
    q, k, v = torch.randn(hq, n, 128), torch.randn(hkv, length, 128), torch.randn(hkv, length, 128)
    visible = torch.arange(length)[None, :] <= length - n + torch.arange(n)[:, None]  # causal over the last n
    got = _grouped_attention(q, k, v, visible, 128**-0.5)
    k_copy, v_copy = (x.repeat_interleave(hq // hkv, 0) for x in (k, v))
    scores = (q @ k_copy.transpose(1, 2)) * 128**-0.5
    assert torch.equal(got, scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v_copy)
