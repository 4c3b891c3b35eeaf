"""MLA's latent cache: the tile layout, the reference math, and the kvarn::latent_* ops against an oracle
built from the tile roundtrip, with random chunkings (hypothesis), untouched slots and bad input."""

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.library import opcheck

import kvarn_compile  # noqa: F401  (registers the ops)
from kvarn_compile.paged import Batch
from kvarn_compile.paged_latent import LatentCache, gather_latents
from kvarn_compile.presets import get_preset
from kvarn_compile.reference import (
    dequantize_latent_records,
    latent_roundtrip,
    pack_latent,
    quantize_keys,
    quantize_latent,
    quantize_latent_records,
    rotate,
    unpack_latent,
)

PRESET = "kvarn_k4v2_g32"  # small tiles: several per sequence at test sizes
L, R, H = 64, 32, 4


def test_layout_bytes_at_deepseek_sizes():
    layout = get_preset("kvarn_k4v2_g128").latent_layout(512, 64)
    # 4-bit latent codes + per-channel scale and zero + per-token scale + bf16 rope key
    assert layout.nbytes == 128 * 512 // 2 + 2 * 2 * 512 + 2 * 128 + 2 * 128 * 64 == 51_456
    assert layout.nbytes / 128 == 402  # the fork's bytes per token; bf16 caches 1,152
    assert get_preset("kvarn_k4v4_g128").latent_layout(512, 64) == layout  # the latent takes the key bits
    for preset in ("kvarn_k4v2_g64", "kvarn_k8v4_g32", "kvarn_k2v2_g256"):
        layout = get_preset(preset).latent_layout(256, 32)
        assert layout.nbytes % 16 == 0 and 0 <= layout.nbytes - layout.used_bytes < 16


# 192: a head dim the dense kernels take, but not a power of two, which the latent attention kernel's fields need
@pytest.mark.parametrize("latent, rope, message", [(576, 64, "latent dim"), (192, 64, r"latent dims .* in \(64, 128, 256, 512\)"),
                                                   (512, 48, "rope key dims")])  # fmt: skip
def test_unsupported_dims_name_the_supported_ones(latent, rope, message):
    with pytest.raises(ValueError, match=message):
        get_preset("kvarn_k4v2_g128").latent_layout(latent, rope)


def test_latent_records_of_other_shapes_are_refused():
    """The records' helpers take whole tiles of the preset, rope keys as a record stores them."""
    preset, c = get_preset("kvarn_k4v2_g32"), torch.randn(2, 32, 64)
    records = quantize_latent_records(c, torch.randn(2, 32, 32, dtype=torch.float16), preset)
    assert records.shape == (2, preset.latent_layout(64, 32).nbytes)
    for rope in (torch.randn(2, 32, 32), torch.randn(2, 16, 32, dtype=torch.float16)):  # fp32; 16 tokens
        with pytest.raises((TypeError, ValueError), match="float16 or bfloat16|must be tiles"):
            quantize_latent_records(c, rope, preset)
    with pytest.raises(ValueError, match="must be tiles"):  # a 64-token tile under a g32 preset
        quantize_latent_records(torch.randn(64, 64), torch.randn(64, 32, dtype=torch.float16), preset)
    with pytest.raises(ValueError, match="float16 or bfloat16 rope key"):
        dequantize_latent_records(records, preset.latent_layout(64, 32), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_latent_is_quantized_as_keys_and_the_rope_key_kept(dtype):
    torch.manual_seed(0)
    c = torch.randn(3, 128, 512, dtype=dtype) * torch.linspace(0.1, 4, 512).to(dtype)  # uneven channels
    rope = torch.randn(3, 128, 64, dtype=dtype)
    c_hat, rope_hat = latent_roundtrip(c, rope, "kvarn_k4v2_g128")
    assert c_hat.dtype == dtype and c_hat.shape == c.shape
    assert torch.equal(rope_hat, rope)
    error = (c_hat.float() - c.float()).norm() / c.float().norm()
    assert 0.01 < error < 0.12  # 4-bit (an 8-bit latent is 20x closer, below)
    c8, _ = latent_roundtrip(c, rope, "kvarn_k8v2_g128")
    assert (c8.float() - c.float()).norm() / c.float().norm() < error / 10
    preset = get_preset("kvarn_k4v2_g128")
    tile = quantize_latent(rotate(c.float()), rope, preset)
    keys = quantize_keys(rotate(c.float()), 4, preset.iterations, preset.patience)
    for got, want in zip(tile[:4], keys):
        assert torch.equal(got, want)
    back = unpack_latent(pack_latent(tile, preset.latent_layout(512, 64)), preset.latent_layout(512, 64), dtype)
    for got, want in zip(back, tile):
        assert torch.equal(got, want)


def oracle(c, rope, q_c, q_r, scale, length, stored, g):
    """Attention of one sequence's queries over its first ``length`` of ``stored`` tokens, from the tile
    math alone (no pages, slots or chunks): the cache holds rotated latents in its dtype; tiles complete in
    it are quantized from those, the rest read as held."""
    layout = get_preset(PRESET).latent_layout(c.shape[-1], rope.shape[-1])
    held = rotate(c.float()).to(c.dtype)
    full = stored // g
    c_seen, r_seen = [held[full * g :].float()], [rope[full * g :].float()]
    if full:
        records = quantize_latent_records(
            held[: full * g].view(full, g, -1), rope[: full * g].view(full, g, -1), PRESET
        )
        c_hat, r_hat = dequantize_latent_records(records, layout, rope.dtype)
        c_seen.insert(0, c_hat.flatten(0, 1))
        r_seen.insert(0, r_hat.flatten(0, 1))
    c_all, r_all = rotate(torch.cat(c_seen)[:length]), torch.cat(r_seen)[:length]
    scores = (q_c.float() @ c_all.T + q_r.float() @ r_all.T) * scale
    return scores.softmax(-1) @ c_all, scores.logsumexp(-1)


def chunked_store(cache, streams, slots, chunkings):
    """Append each sequence's (c, rope) stream in the given chunk sizes, all sequences in each call."""
    done = [0] * len(streams)
    for step in range(max(len(ch) for ch in chunkings)):
        sizes = [ch[step] if step < len(ch) else 0 for ch in chunkings]
        c = torch.cat([s[0][d : d + n] for s, d, n in zip(streams, done, sizes)])
        rope = torch.cat([s[1][d : d + n] for s, d, n in zip(streams, done, sizes)])
        batch = Batch.from_lengths(slots, done, sizes)
        torch.ops.kvarn.latent_append(c, rope, *cache.tensors(), *batch[:3], PRESET, batch.max_query_len)
        done = [d + n for d, n in zip(done, sizes)]


def random_chunks(draw_sizes: list[int], total: int) -> list[int]:
    out, left = [], total
    for size in draw_sizes:
        if left == 0:
            break
        out.append(min(size, left))
        left -= out[-1]
    return [*out, left] if left else out


@settings(max_examples=12, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 110), min_size=1, max_size=3),
    sizes=st.lists(st.integers(1, 70), min_size=1, max_size=4),
    dtype=st.sampled_from([torch.float16, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
@example(lengths=[0, 1, 40], sizes=[7], dtype=torch.float16, seed=0)  # reads of no tokens, every run
def test_ops_match_the_tile_roundtrip_for_any_chunking(lengths, sizes, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    streams = [(torch.randn(n, L, generator=g).to(dtype), torch.randn(n, R, generator=g).to(dtype)) for n in lengths]
    slots = list(range(len(lengths)))[::-1]  # sequence b in slot B-1-b
    cache = LatentCache.allocate(4, 128, L, R, PRESET, dtype)
    chunked_store(cache, streams, slots, [random_chunks(sizes, n) for n in lengths])
    one_call = LatentCache.allocate(4, 128, L, R, PRESET, dtype)
    chunked_store(one_call, streams, slots, [[n] for n in lengths])
    assert torch.equal(cache.pages, one_call.pages)  # a tile's bytes do not depend on how it arrived
    assert cache.seq_lens[slots].tolist() == lengths
    # decode-like (all stored tokens) and context-like (a prefix) reads, two queries per sequence
    kv_lens = [[n, n // 2] for n in lengths]
    q_c = torch.randn(2 * len(lengths), H, L, generator=g).to(dtype)
    q_r = torch.randn(2 * len(lengths), H, R, generator=g).to(dtype)
    for which in range(2):
        rows = torch.arange(which, 2 * len(lengths), 2)
        batch = Batch.decode(torch.tensor(slots), torch.zeros(len(lengths), dtype=torch.int32))
        lens = torch.tensor([k[which] for k in kv_lens], dtype=torch.int32)
        out, lse = torch.ops.kvarn.latent_attention(q_c[rows], q_r[rows], *cache.tensors(), batch.slots, lens,
                                                    batch.query_start_loc, PRESET, 0.1, 1)  # fmt: skip
        assert out.dtype == dtype and lse.dtype == torch.float32
        for b, (c, rope) in enumerate(streams):
            if lens[b] == 0:
                assert torch.equal(out[b], torch.zeros_like(out[b])) and (lse[b] == float("-inf")).all()
                continue
            want, want_lse = oracle(c, rope, q_c[rows[b]], q_r[rows[b]], 0.1, int(lens[b]), lengths[b], 32)
            assert torch.allclose(out[b].float(), want, atol=0.01, rtol=0.01), (b, (out[b].float() - want).abs().max())
            assert torch.allclose(lse[b], want_lse, atol=1e-4)


def test_context_read_and_exact_chunk_merge_to_full_attention():
    """How vLLM uses the lse: a prefill chunk attends to its context from the cache and to its own tokens
    exactly; merged by log-sum-exp, that is attention over both."""
    torch.manual_seed(1)
    cache = LatentCache.allocate(1, 256, L, R, PRESET, torch.bfloat16)
    c, rope = torch.randn(100, L).bfloat16(), torch.randn(100, R).bfloat16()
    batch = Batch.from_lengths([0], [0], [100])
    torch.ops.kvarn.latent_append(c, rope, *cache.tensors(), *batch[:3], PRESET, 100)
    q_c, q_r = torch.randn(1, H, L).bfloat16(), torch.randn(1, H, R).bfloat16()
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    context, lse_ctx = torch.ops.kvarn.latent_attention(q_c, q_r, *cache.tensors(), batch.slots,
                                                        torch.tensor([64], dtype=torch.int32), qsl, PRESET, 0.1, 1)  # fmt: skip
    full, lse_full = torch.ops.kvarn.latent_attention(q_c, q_r, *cache.tensors(), batch.slots,
                                                      torch.tensor([100], dtype=torch.int32), qsl, PRESET, 0.1, 1)  # fmt: skip
    # the last 36 tokens as the cache holds them (tile 2 quantized, 96..99 exact), read back not rotated
    c_all, r_all = gather_latents(*cache.tensors()[:4], 0, 100, 100, get_preset(PRESET))
    c_read, r_read = rotate(c_all[64:]), r_all[64:]
    scores = (q_c[0].float() @ c_read.T + q_r[0].float() @ r_read.T) * 0.1
    lse_chunk = scores.logsumexp(-1)
    merged_lse = torch.logaddexp(lse_ctx[0], lse_chunk)
    merged = (context[0].float() * (lse_ctx[0] - merged_lse).exp()[:, None]
              + (scores.softmax(-1) @ c_read) * (lse_chunk - merged_lse).exp()[:, None])  # fmt: skip
    assert torch.allclose(merged_lse, lse_full[0], atol=1e-4)
    assert torch.allclose(merged, full[0].float(), atol=2e-2)


def test_append_touches_only_its_slots_pages():
    torch.manual_seed(2)
    cache = LatentCache.allocate(3, 128, L, R, PRESET, torch.float16)
    cache.pages.fill_(7)
    cache.exact_c.fill_(3)
    cache.exact_r.fill_(3)
    before = [t.clone() for t in cache.tensors()]
    c, rope = torch.randn(70, L).half(), torch.randn(70, R).half()
    batch = Batch.from_lengths([1], [0], [70])
    torch.ops.kvarn.latent_append(c, rope, *cache.tensors(), *batch[:3], PRESET, 70)
    pages, exact_c, exact_r = cache.tensors()[:3]
    own = cache.page_table[1].long()
    others = torch.ones(pages.shape[0], dtype=torch.bool)
    others[own] = False
    assert torch.equal(pages[others], before[0][others])
    assert torch.equal(pages[own[2:]], before[0][own[2:]])  # tiles 2, 3 of the slot: not reached
    assert all(not torch.equal(pages[page], before[0][page]) for page in own[:2])  # tiles 0, 1: each written
    for now, was in ((exact_c, before[1]), (exact_r, before[2])):
        assert torch.equal(now[[0, 2]], was[[0, 2]])
    assert cache.seq_lens.tolist() == [0, 70, 0]


def test_opcheck():
    cache = LatentCache.allocate(2, 128, L, R, PRESET, torch.bfloat16)
    c, rope = torch.randn(40, L).bfloat16(), torch.randn(40, R).bfloat16()
    batch = Batch.from_lengths([0, 1], [0, 0], [35, 5])
    opcheck(torch.ops.kvarn.latent_append, (c, rope, *cache.tensors(), *batch[:3], PRESET, 35))
    torch.ops.kvarn.latent_append(c, rope, *cache.tensors(), *batch[:3], PRESET, 35)
    q_c, q_r = torch.randn(40, H, L).bfloat16(), torch.randn(40, H, R).bfloat16()
    opcheck(torch.ops.kvarn.latent_attention, (q_c, q_r, *cache.tensors(), batch.slots,
                                               torch.tensor([35, 3], dtype=torch.int32), batch.query_start_loc,
                                               PRESET, 0.1, 35))  # fmt: skip


def bad_calls():
    """(what, call) pairs with one thing wrong each, and the error message they must give."""
    cache = LatentCache.allocate(2, 64, L, R, PRESET, torch.bfloat16)
    c, rope = torch.randn(3, L).bfloat16(), torch.randn(3, R).bfloat16()
    b = Batch.from_lengths([0], [0], [3])

    def append(c=c, rope=rope, slots=b.slots, start=b.start_pos, seq_lens=cache.seq_lens):
        return lambda: torch.ops.kvarn.latent_append(c, rope, *cache.tensors()[:4], seq_lens, slots, start,
                                                     b.query_start_loc, PRESET, 3)  # fmt: skip

    def attend(kv_lens, latent=L, scale=0.1, seq_lens=cache.seq_lens):
        q_c = torch.randn(3, H, latent).bfloat16()
        return lambda: torch.ops.kvarn.latent_attention(q_c, torch.randn(3, H, R).bfloat16(), *cache.tensors()[:4],
                                                        seq_lens, b.slots, torch.tensor(kv_lens, dtype=torch.int32),
                                                        b.query_start_loc, PRESET, scale, 3)  # fmt: skip

    strided = torch.zeros(4, dtype=torch.int32)[::2]  # [2], not contiguous
    on_meta = torch.zeros(2, dtype=torch.int32, device="meta")  # (the dispatcher takes such a call to the fake)

    return [
        (append(c=c.float()), TypeError, "c is torch.float32 but the cache holds torch.bfloat16"),
        (append(rope=rope[:, :16]), ValueError, r"rope must be \[3, 32\]"),
        (append(slots=torch.tensor([2], dtype=torch.int32)), ValueError, r"slots must be in \[0, 2\)"),
        (append(start=torch.tensor([62], dtype=torch.int32)), ValueError, "beyond the cache capacity of 64"),
        (attend([0], scale=float("inf")), ValueError, "the softmax scale must be a finite number, got inf"),
        (attend([1]), ValueError, "must not exceed the tokens the slots hold"),
        (attend([0], latent=2 * L), ValueError, r"q_c must be \[\*, \*, 64\]"),
        (append(start=torch.tensor([2**31 - 2], dtype=torch.int32)), ValueError, "beyond the cache capacity of 64"),
        (append(seq_lens=strided), ValueError, "seq_lens must be contiguous"),
        (attend([0], seq_lens=strided), ValueError, "seq_lens must be contiguous"),
        (append(seq_lens=on_meta), ValueError, r"kvarn::latent_append takes every tensor on one device"),
        (attend([0], seq_lens=on_meta), ValueError, r"kvarn::latent_attention takes every tensor on one device"),
    ]


@pytest.mark.parametrize("index", range(len(bad_calls())))
def test_bad_input_gets_a_clear_error(index):
    call, error, message = bad_calls()[index]
    with pytest.raises(error, match=message):
        call()


# ----------------------------------------------------------------------------------------------------
# The Triton kernels against the reference (on the GPU, or on the CPU under TRITON_INTERPRET=1)
# ----------------------------------------------------------------------------------------------------
SENTINEL_BYTE = 0xA5


@pytest.mark.parametrize(
    ("preset", "latent", "rope", "heads", "dtype"),
    [("kvarn_k4v2_g32", 64, 32, 4, torch.bfloat16), ("kvarn_k2v2_g32", 128, 64, 20, torch.float16),
     ("kvarn_k8v4_g64", 64, 32, 16, torch.float16)],
)  # fmt: skip
def test_kernels_match_the_reference(preset, latent, rope, heads, dtype):
    """Appends in chunks that start mid-tile and complete tiles (and decode steps), then decode-like and
    context-like reads: the same cache bytes up to rounding, nothing written outside the completed tiles and
    the current ones, the same outputs and log-sum-exps."""
    from conftest import KERNEL_DEVICE, assert_few_flipped

    from kvarn_compile.kernels.latent_attention import latent_attention
    from kvarn_compile.kernels.quantize_store import latent_store
    from kvarn_compile.kernels.rotate import rotated_to

    p = get_preset(preset)
    g = p.tile_size
    layout = p.latent_layout(latent, rope)
    caches = []
    for device in ("cpu", KERNEL_DEVICE):
        cache = LatentCache.allocate(3, 4 * g, latent, rope, p, dtype, device)
        cache.pages.fill_(SENTINEL_BYTE)
        cache.exact_c.fill_(-7)
        cache.exact_r.fill_(-7)
        caches.append(cache)
    gen = torch.Generator().manual_seed(3)
    lengths = {0: 0, 2: 0}
    for sizes in ([g + 5, 0], [g - 3, 2 * g + 1], [1, 1], [1, 1]):  # slot 0, slot 2
        c = torch.randn(sum(sizes), latent, generator=gen).to(dtype) * torch.linspace(0.2, 3, latent).to(dtype)
        r = torch.randn(sum(sizes), rope, generator=gen).to(dtype)
        batch = Batch.from_lengths([0, 2], [lengths[0], lengths[2]], sizes)
        ref, ker = caches
        torch.ops.kvarn.latent_append(c, r, *ref.tensors(), *batch[:3], p.name, batch.max_query_len)
        dev = [x.to(KERNEL_DEVICE) for x in (c, r, *batch[:3])]
        latent_store(rotated_to(dev[0], dtype), dev[1], *ker.tensors(), *dev[2:], p, batch.max_query_len)
        lengths = {0: lengths[0] + sizes[0], 2: lengths[2] + sizes[1]}
    ref, ker = caches[0], [t.cpu() for t in caches[1].tensors()]
    assert torch.equal(ref.seq_lens, ker[4]) and ref.seq_lens.tolist() == [lengths[0], 0, lengths[2]]
    torch.testing.assert_close(ker[1], ref.exact_c, atol=2e-2, rtol=2e-2)  # rotated: up to its rounding
    assert torch.equal(ker[2], ref.exact_r)
    written = torch.zeros(ref.pages.shape[0], dtype=torch.bool)
    for slot, length in lengths.items():
        written[ref.page_table[slot, : length // g].long()] = True
    assert (ker[0][~written] == SENTINEL_BYTE).all() and (ref.pages[~written] == SENTINEL_BYTE).all()
    (c_ref, r_ref), (c_ker, r_ker) = (dequantize_latent_records(x[written], layout, dtype) for x in (ref.pages, ker[0]))
    assert torch.equal(r_ref, r_ker)
    per_tile = (c_ref - c_ker).flatten(1).norm(dim=-1) / c_ref.flatten(1).norm(dim=-1)
    assert_few_flipped(per_tile)

    # attention on the kernel's cache, against the reference on the same bytes
    ker_cache = LatentCache(p, *[t.to(KERNEL_DEVICE) for t in ker])
    same = LatentCache(p, *ker)
    kv_lens = torch.tensor([lengths[0], lengths[2] - 7], dtype=torch.int32)  # a decode, a context read
    qsl = torch.tensor([0, 1, 4], dtype=torch.int32)
    q_c = torch.randn(4, heads, latent, generator=gen).to(dtype)
    q_r = torch.randn(4, heads, rope, generator=gen).to(dtype)
    slots = torch.tensor([0, 2], dtype=torch.int32)
    want, want_lse = torch.ops.kvarn.latent_attention(q_c, q_r, *same.tensors(), slots, kv_lens, qsl, p.name, 0.1, 3)
    dev = [x.to(KERNEL_DEVICE) for x in (q_c, q_r, slots, kv_lens, qsl)]
    for block_t in (16, 32, 64):  # the launch settings benchmarks/latent_attention.py --sweep tries
        out, lse = latent_attention(
            rotated_to(dev[0], torch.float32), dev[1], *ker_cache.tensors(), *dev[2:], layout, 0.1, 3, block_t=block_t
        )
        torch.testing.assert_close(rotate(out.cpu()), want.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse.cpu(), want_lse, atol=2e-3, rtol=1e-3)
