"""Every Triton kernel against the PyTorch reference (on the GPU, or on the CPU under TRITON_INTERPRET=1).

Both paths start from identical caches filled with a sentinel, run the same calls, and must agree on:
the attention output, the lengths, the exact buffers (up to rounding), the quantized tiles (read back, within
quantization noise: the kernels may pick another normalisation iterate in a near-tie), and every byte
that the calls must not touch (other slots, pages past the written tiles).
"""

import collections
import random

import pytest
import torch
import triton
import triton.language as tl
from cache_model import random_call
from conftest import KERNEL_DEVICE, assert_few_flipped
from hypothesis import given, settings
from hypothesis import strategies as st

from kvarn_compile import Batch, KVarNCache, get_preset
from kvarn_compile.kernels.quantize_store import _balance, _balance_roundings
from kvarn_compile.kernels.rotate import hadamard_blocks, rotate_rows, rotated_many
from kvarn_compile.kernels.tile_math import live_splits, multiprocessors, quantized_tiles, splits_by_waves
from kvarn_compile.ops import triton_append, triton_attend_and_append, triton_attention
from kvarn_compile.paged import append_reference, attention_reference
from kvarn_compile.reference import (
    IMBALANCE_MARGIN,
    _imbalance,
    balance,
    balance_roundings,
    dequantize_records,
    rotate,
    rotation_block,
    rtn,
)

SENTINEL_BYTE = 0xA5


def sentinel_cache(preset, slots, max_len, hkv, dk, dv, dtype, sink, device, ring_window=0):
    cache = KVarNCache.allocate(slots, max_len, hkv, dk, dv, preset, dtype, device, sink, ring_window)
    cache.pages.fill_(SENTINEL_BYTE)
    cache.exact_k.fill_(-7.0)
    cache.exact_v.fill_(-7.0)
    return cache


def compare_caches(ref, ker, lengths, preset):
    """Equal exact buffers (where written), lengths and read-back tiles; untouched bytes untouched."""
    ker = [t.cpu() for t in ker.tensors()]
    pages_r, exact_k_r, exact_v_r, table, lens_r = ref.tensors()
    pages_k, exact_k_k, exact_v_k, _, lens_k = ker
    assert torch.equal(lens_r, lens_k)
    # written rows agree up to the rounding of the rotation; unwritten rows keep the sentinel (-7)
    torch.testing.assert_close(exact_k_k, exact_k_r, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(exact_v_k, exact_v_r, atol=1e-2, rtol=1e-2)
    layout = preset.layout(exact_k_r.shape[-1], exact_v_r.shape[-1])
    g = preset.tile_size
    written = torch.zeros(pages_r.shape[0], dtype=torch.bool)
    first = 1 if exact_k_r.shape[2] == 2 else 0
    for slot, length in lengths.items():
        written[table[slot, first : length // g].long()] = True
    assert (pages_k[~written] == SENTINEL_BYTE).all(), "the kernel wrote outside the tiles it completed"
    assert (pages_r[~written] == SENTINEL_BYTE).all()
    if written.any():
        (kr, vr), (kk, vk) = (dequantize_records(p[written], layout) for p in (pages_r, pages_k))
        for a, b in ((kr, kk), (vr, vk)):
            per_tile = (a - b).flatten(2).norm(dim=-1) / b.flatten(2).norm(dim=-1)
            assert_few_flipped(per_tile)


def run_both(preset, calls, *, hq=4, hkv=2, dk=64, dv=None, dtype=torch.float16, sink=False, window=0,
             causal=True, max_len=256, slots=3, num_splits=None, exact_parts=None, fused=False, ring=False,
             rotated=False):  # fmt: skip
    """Reference and kernels side by side over ``calls``; ``fused``: the kernels' path of
    kvarn::attend_and_append instead of the two ops' paths; ``rotated``: that path given q (float32), k, v
    rotated, as vLLM's graph gives them with the hook; ``ring``: caches with only the pages the window
    reaches (``KVarNCache.allocate(window=...)``)."""
    preset = get_preset(preset)
    dv = dk if dv is None else dv
    ring_window = window if ring else 0
    ref = sentinel_cache(preset, slots, max_len, hkv, dk, dv, dtype, sink, "cpu", ring_window)
    ker = sentinel_cache(preset, slots, max_len, hkv, dk, dv, dtype, sink, KERNEL_DEVICE, ring_window)
    lengths = {}
    for call in calls:
        batch, q, k, v = random_call(call, lengths, hq, hkv, dk, dv, dtype)
        args = (preset, dk**-0.5, causal, window, batch.max_query_len)
        want = attention_reference(q, k, v, *ref.tensors()[:4], *batch[:3], *args)
        dev = [t.to(KERNEL_DEVICE) for t in (q, k, v)]
        dev_batch = [t.to(KERNEL_DEVICE) for t in batch[:3]]
        if fused:
            if rotated:
                dev = [rotate(x.float()).to(torch.float32 if x is dev[0] else dtype) for x in dev]
            got = torch.full((q.shape[0], hq, dv), float("nan"), dtype=dtype, device=KERNEL_DEVICE)
            triton_attend_and_append(*dev, got, *ker.tensors(), *dev_batch, *args, rotated=rotated)
        else:
            got = triton_attention(*dev, *ker.tensors()[:4], *dev_batch, *args, num_splits=num_splits,
                                   exact_parts=exact_parts)  # fmt: skip
            triton_append(*dev[1:], *ker.tensors(), *dev_batch, preset, batch.max_query_len)
        torch.testing.assert_close(got.cpu().float(), want.float(), atol=2e-2, rtol=2e-2)
        append_reference(k, v, *ref.tensors(), *batch[:3], preset)
        for s, n in call.items():
            lengths[s] = lengths.get(s, 0) + n
        compare_caches(ref, ker, lengths, preset)


def random_calls(seed, slots, max_len, tile):
    """Prefill chunks (some crossing several tiles, some ending on a tile edge), empty entries, decodes."""
    rng = random.Random(seed)
    lengths = dict.fromkeys(range(slots), 0)
    calls = []
    for _ in range(4):
        call = {}
        for s in rng.sample(range(slots), rng.randint(1, slots)):
            room = max_len - lengths[s]
            n = min(room, rng.choice([0, 1, 1, tile - lengths[s] % tile, rng.randint(2, 3 * tile)]))
            call[s] = n
            lengths[s] += n
        calls.append(call)
    calls.append({s: 1 for s in range(slots) if lengths[s] < max_len})  # a decode step
    return calls


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(
    "preset, dk, dv, dtype, sink",
    [
        ("kvarn_k4v2_g32", 64, 64, torch.float16, False),
        ("kvarn_k4v2_g32", 64, 64, torch.bfloat16, True),
        ("kvarn_k2v4_g64", 128, 128, torch.float16, True),
        ("kvarn_k8v8_g32", 192, 128, torch.bfloat16, False),  # MLA-like head dims
    ],
)
def test_append_and_attention_match_reference(seed, preset, dk, dv, dtype, sink):
    g = get_preset(preset).tile_size
    run_both(preset, random_calls(seed, 3, 4 * g, g), dk=dk, dv=dv, dtype=dtype, sink=sink, max_len=4 * g)


@pytest.mark.parametrize("hq, hkv", [(2, 2), (6, 2), (8, 1), (4, 1)])
def test_gqa_mqa_groups(hq, hkv):
    calls = [{0: 70, 1: 33}, {0: 1, 1: 1}, {1: 40}]
    run_both("kvarn_k4v2_g32", calls, hq=hq, hkv=hkv, slots=2)


@pytest.mark.parametrize("fused", [False, True])
def test_a_sequence_without_new_tokens_changes_nothing(fused):
    """A sequence of a call with no new tokens (a padding row) leaves its slot as it was, whatever its start
    position says: the append kernel once wrote that position as the slot's length."""
    preset = get_preset("kvarn_k4v2_g32")
    k, v = torch.randn(41, 2, 64).half(), torch.randn(41, 2, 64).half()
    fill, call = Batch.from_lengths([0], [0], [40]), Batch.from_lengths([0, 1], [3, 0], [0, 1])
    caches = [sentinel_cache(preset, 2, 128, 2, 64, 64, torch.float16, False, d) for d in ("cpu", KERNEL_DEVICE)]
    for cache in caches:
        dev = cache.pages.device
        for batch, rows in ((fill, slice(0, 40)), (call, slice(40, 41))):
            args = (*cache.tensors(), *(t.to(dev) for t in batch[:3]), preset, batch.max_query_len)
            if cache is caches[0]:
                append_reference(k[rows], v[rows], *args)
            elif fused:
                out = torch.empty(rows.stop - rows.start, 4, 64, dtype=torch.float16, device=dev)
                q = torch.randn(out.shape, dtype=torch.float16).to(dev)
                triton_attend_and_append(q, k[rows].to(dev), v[rows].to(dev), out, *args[:-1], 0.125, True, 0,
                                         batch.max_query_len)  # fmt: skip
            else:
                triton_append(k[rows].to(dev), v[rows].to(dev), *args)
    assert caches[0].seq_lens.tolist() == [40, 1]
    compare_caches(caches[0], caches[1], {0: 40, 1: 1}, preset)


@pytest.mark.parametrize("sink, fused", [(False, False), (True, True)])
def test_decode_sized_calls_quantize_the_tiles_they_complete(sink, fused):
    """Decode-sized calls (<= DECODE_ROWS tokens a sequence: their rows staged in a [DECODE_ROWS, D] block) complete
    tiles anywhere in the batch, by 1 to 16 tokens, some running on into the next tile, beside sequences that
    complete none and a padding row."""
    g = 32
    fill = {0: g - 1, 1: g - 16, 2: 5, 3: g - 3, 4: 2 * g - 1, 5: 10, 6: g - 1}
    step = {0: 1, 1: 16, 2: 1, 3: 9, 4: 1, 5: 0, 6: 3}  # 0, 1, 3, 4 and 6 complete a tile; 3 and 6 run on
    run_both("kvarn_k4v2_g32", [fill, step, dict.fromkeys(range(7), 1)], slots=7, max_len=4 * g, sink=sink,
             fused=fused)  # fmt: skip


@pytest.mark.parametrize("sink, hkv, block, burst, layers", [(False, 2, 128, False, 1), (True, 1, 4, False, 2),
                                                             (False, 2, 4, True, 2), (True, 2, 128, True, 1)])  # fmt: skip
def test_a_decode_append_staged_then_flushed_is_the_whole_append(monkeypatch, sink, hkv, block, burst, layers):
    """The two launches a deferred flush splits a single-token append into (``quantize_store``'s parts): STAGE writes
    each row to the exact buffer, the completing row too, and a snapshot of the metadata; FLUSH then quantizes the
    completed tiles from the exact buffer and the snapshot alone (its k and v, the batch's tensors and the page table
    are poisoned here, as a caller may rewrite them before FLUSH runs), each program the completed tiles of its call in
    turn (found over blocks of ``block`` sequences; here DEFERRED_MOST of them in a step), or none in a burst (more than
    DEFERRED_MOST tiles), which STAGE quantizes in line. One FLUSH launch serves the calls of ``layers`` caches, its
    pointer tuples one entry wider than the calls: the first call again, as a deferral pads them (``flush_tiles``), or a
    decoy, a cache of its own with the last call's snapshot, whose programs must write nothing (a kernel that ignored
    the launch's count of calls would quantize into it). Together: the reference's append on each cache (the sink tile
    kept exact where a sequence completes its first tile)."""
    from kvarn_compile.kernels import quantize_store as qs

    monkeypatch.setattr(qs, "SEQUENCE_BLOCK", block)
    g, preset = 32, get_preset("kvarn_k4v2_g32")
    # 1, 3, 5 and 7 complete a tile in the decode step (blocks of 4 sequences: two of them), as many as FLUSH takes;
    # in a burst 0 too, one more
    fill = {0: g - 1 - (not burst), 1: 2 * g - 1, 2: 5, 3: g - 1, 4: 0, 5: 3 * g - 1, 6: 2 * g, 7: 3 * g - 1}
    completing = (0, 1, 3, 5, 7) if burst else (1, 3, 5, 7)
    assert len(completing) == qs.DEFERRED_MOST.value + burst, "a burst is one tile more than FLUSH takes"
    refs = [sentinel_cache(preset, 8, 4 * g, hkv, 64, 64, torch.float16, sink, "cpu") for _ in range(layers)]
    kers = [sentinel_cache(preset, 8, 4 * g, hkv, 64, 64, torch.float16, sink, KERNEL_DEVICE) for _ in range(layers)]
    decoy = sentinel_cache(preset, 8, 4 * g, hkv, 64, 64, torch.float16, sink, KERNEL_DEVICE)
    lengths = {}
    for call in (fill, {s: 1 for s in range(8) if s != 4} | {4: 0}):  # 4 pads the decode step
        flushes, tables = [], []
        for ref, ker in zip(refs, kers, strict=True):
            batch, _, k, v = random_call(call, lengths, 2, hkv, 64, 64, torch.float16)
            append_reference(k, v, *ref.tensors(), *batch[:3], preset)
            dev_batch = [t.to(KERNEL_DEVICE) for t in batch[:3]]
            k_rot, v_rot = rotated_many([k.to(KERNEL_DEVICE), v.to(KERNEL_DEVICE)], [k.dtype, v.dtype])
            if batch.max_query_len > 1:
                qs.quantize_store(k_rot, v_rot, *ker.tensors(), *dev_batch, preset, batch.max_query_len)
                continue
            pages, snapshot = ker.pages.clone(), qs.snapshot_for(dev_batch[0])
            qs.quantize_store(k_rot, v_rot, *ker.tensors(), *dev_batch, preset, 1, part=qs.STAGE, snapshot=snapshot)
            assert torch.equal(ker.pages, pages) != burst, "STAGE quantizes the tiles of a burst, and only those"
            for row, (s, p) in enumerate(zip(batch.slots.tolist(), batch.start_pos.tolist(), strict=True)):
                if call[s]:  # the row is staged where the tile's rows are, also where it completes the tile
                    for exact, x in ((ker.exact_k, k_rot), (ker.exact_v, v_rot)):
                        assert torch.equal(exact[s, :, 0, p % g].cpu(), x[row].cpu())
                if call[s] and p % g == g - 1:  # a completing row, which the reference leaves out of the buffer
                    ref.exact_k[s, :, 0, p % g], ref.exact_v[s, :, 0, p % g] = k_rot[row].cpu(), v_rot[row].cpu()
            k_rot.fill_(float("nan")), v_rot.fill_(float("nan"))
            tables.append(ker.page_table.clone())
            ker.page_table.fill_(-1)  # (restored below)
            for t in dev_batch:  # other slots, positions one on, other query rows
                t.copy_(t.flip(0) + 1)
            flushes.append(qs.Flush(ker.pages, ker.exact_k, ker.exact_v, ker.page_table, snapshot, preset))
        if flushes:
            pages = [ker.pages.clone() for ker in kers]
            if layers == 1:
                qs.flush_tiles(flushes, width=2)
            else:
                decoy_pages = decoy.pages.clone()
                qs._launch_flush([*flushes, flushes[-1]._replace(pages=decoy.pages)], members=layers)
                assert torch.equal(decoy.pages, decoy_pages), "programs past the launch's calls write nothing"
            for ker, before, table in zip(kers, pages, tables, strict=True):
                assert torch.equal(ker.pages, before) == burst, "FLUSH quantizes the tiles of no burst"
                ker.page_table.copy_(table)
        for s, n in call.items():
            lengths[s] = lengths.get(s, 0) + n
        for ref, ker in zip(refs, kers, strict=True):
            compare_caches(ref, ker, lengths, preset)
    assert tuple(s for s in range(8) if s != 4 and lengths[s] % g == 0) == completing, "the schedule above"


def test_a_flush_launch_takes_calls_that_share_its_kernel():
    """``flush_tiles``: 1 to ``width`` calls of one launch key, with STAGE's snapshots; else a clear error."""
    from kvarn_compile.kernels import quantize_store as qs

    preset = get_preset("kvarn_k4v2_g32")
    cache, wider = (sentinel_cache(preset, 2, n, 1, 64, 64, torch.float16, False, KERNEL_DEVICE) for n in (64, 128))
    snapshot = qs.snapshot_for(torch.zeros(2, dtype=torch.int32, device=KERNEL_DEVICE))
    call = qs.Flush(cache.pages, cache.exact_k, cache.exact_v, cache.page_table, snapshot, preset)
    with pytest.raises(ValueError, match="takes 1 to 1 calls, got 2"):
        qs.flush_tiles([call, call], width=1)
    with pytest.raises(ValueError, match="takes 1 to 4 calls, got 0"):
        qs.flush_tiles([], width=4)
    with pytest.raises(ValueError, match="page-table width"):
        qs.flush_tiles([call, call._replace(page_table=wider.page_table)])
    with pytest.raises(ValueError, match="reads the snapshots STAGE wrote"):
        qs.flush_tiles([call._replace(snapshot=snapshot[:, :4])])


def test_the_stage_part_is_for_single_token_calls_with_a_snapshot():
    from kvarn_compile.kernels import quantize_store as qs

    preset = get_preset("kvarn_k4v2_g32")
    cache = sentinel_cache(preset, 1, 64, 1, 64, 64, torch.float16, False, KERNEL_DEVICE)
    k = torch.zeros(2, 1, 64, dtype=torch.float16, device=KERNEL_DEVICE)
    two, one = ([t.to(KERNEL_DEVICE) for t in Batch.from_lengths([0], [0], [n])[:3]] for n in (2, 1))
    with pytest.raises(ValueError, match="single-token calls, got max_query_len 2"):
        qs.quantize_store(k, k, *cache.tensors(), *two, preset, 2, part=qs.STAGE, snapshot=qs.snapshot_for(two[0]))
    with pytest.raises(ValueError, match="writes a snapshot"):
        qs.quantize_store(k[:1], k[:1], *cache.tensors(), *one, preset, 1, part=qs.STAGE)
    with pytest.raises(ValueError, match="FLUSH launches through flush_tiles"):
        qs.quantize_store(k[:1], k[:1], *cache.tensors(), *one, preset, 1, part=qs.FLUSH,
                          snapshot=qs.snapshot_for(one[0]))  # fmt: skip


@pytest.mark.long
@pytest.mark.parametrize(
    "num_splits, hq, exact_parts",
    [(1, 4, 1), (3, 4, 1), (8, 4, 1), (40, 4, 1), (20, 32, 1), (16, 32, 1), (24, 32, 1), (100, 4, 1),
     # the kept rows over programs of their own (runs of 32 rows, a g32 tile: with 3, one of them empty; with 5, three)
     (3, 4, 3), (8, 4, 5), (16, 32, 2), (21, 32, 2), (95, 4, 2), (1, 4, None)],
)  # fmt: skip
def test_split_k_and_combine(monkeypatch, num_splits, hq, exact_parts):
    """Split contexts merged by the combine kernel (the prefill calls; decode steps of more than MERGE_MOST_PARTS
    partials a row: 101, 97) or, on the CPU (and on the GPU after the Gluon kernel), by the decode step's exact
    part's last program to finish: at once, or in steps where more partials than a step and its tail hold (with 16
    heads per KV head a merge step holds 16 partials and its tail 4: 16 splits and the lone exact program's own, in
    registers, or 16 + the two live exact programs' at once, theirs in the tail; 20 splits and the lone program's own
    (the tail's splits empty: the calls have 3 tiles); 24 + 1 and 21 + 2 in steps). The exact part's programs
    (``exact_parts``; None: the launcher's choice, ``exact_parts_for``): the first takes the fresh tokens, the others
    the kept rows in runs. (Mutations that fail it: the tail's acc left out of the merge.)"""
    from kvarn_compile.kernels import paged_attention as module

    combined = []
    combine = module.combine_splits
    monkeypatch.setattr(module, "combine_splits", lambda *a, **k: combined.append(a[0].shape[2]) or combine(*a, **k))
    calls = [{0: 100, 1: 60}, {0: 1, 1: 1}, {0: 5, 1: 1}]  # g32: 3 tiles + 4 rows, 1 + 28, then steps on them
    run_both("kvarn_k4v2_g32", calls, hq=hq, slots=2, num_splits=num_splits, exact_parts=exact_parts)
    sms = multiprocessors(torch.device(KERNEL_DEVICE))
    decode_parts = num_splits + (exact_parts or module.exact_parts_for(1, 2 * 2, sms, 32))  # 2 sequences x 2 KV heads
    prefill_parts = num_splits + (exact_parts or 1)
    # the interpreter merges in the exact split up to the limit; the GPU only after the Gluon kernel (not g32's)
    decode_merged = KERNEL_DEVICE == "cpu" and decode_parts <= module.MERGE_MOST_PARTS
    want = [prefill_parts] if decode_merged else [prefill_parts, decode_parts]
    assert combined == [*want, prefill_parts]


@pytest.mark.parametrize("preset, exact_parts, window", [
    ("kvarn_k4v2_g32", 2, 0), ("kvarn_k4v2_g32", 3, 0), ("kvarn_k4v2_g32", 4, 0), ("kvarn_k4v2_g32", 7, 0),
    ("kvarn_k4v2_g32", 7, 40), ("kvarn_k4v2_g32", 3, 90),
    ("kvarn_k4v2_g64", 5, 0), ("kvarn_k4v2_g64", 7, 70), ("kvarn_k4v2_g64", 3, 0),
])  # fmt: skip
def test_kept_rows_over_exact_programs(preset, exact_parts, window):
    """A decode step's kept rows (the first tile kept, then the current tile's) in runs of 32 (the kept rows' block
    at head dim 64) over the exact part's programs after the fresh token's. g32 (61 + 1, 32, 20 and 0 kept rows): a
    run per tile, some or all past a sequence's rows (4 programs: the third run empty; 7: three to six empty). g64
    (86 + 1, 64, 100 and 0 kept rows): runs that split the sink and the current tile (5 and 7 programs: runs of 32;
    3: runs of 64, one a tile). Windows that end inside a run. Merged by the last live program to finish (under the
    interpreter; on the GPU by the combine: these presets have no Gluon kernel)."""
    from kvarn_compile.kernels.paged_attention import merge_counts

    g = get_preset(preset).tile_size
    fill = {0: 61, 1: 32, 2: 20} if g == 32 else {0: 150, 1: 64, 2: 100}
    calls = [fill, {0: 1, 1: 1, 2: 1, 3: 1}, {0: 1, 1: 1, 2: 1, 3: 1}]
    run_both(preset, calls, sink=True, window=window, slots=4, exact_parts=exact_parts)
    assert not merge_counts(torch.device(KERNEL_DEVICE)).any(), "a merge left its count set for the next step"


@triton.jit
def _split_tiles_kernel(out_ptr, p0, first_query_pos, window, max_tiles, NSPLIT: tl.constexpr, G: tl.constexpr,
                        E: tl.constexpr):  # fmt: skip
    for split in tl.static_range(NSPLIT):
        lo, hi = quantized_tiles(split, NSPLIT, p0, first_query_pos, window, max_tiles, G, E)
        tl.store(out_ptr + 2 * split, lo)
        tl.store(out_ptr + 2 * split + 1, hi)
    tl.store(out_ptr + 2 * NSPLIT, live_splits(NSPLIT, p0, first_query_pos, window, max_tiles, G, E))


@settings(deadline=None, max_examples=60, derandomize=True)
@given(p0=st.integers(0, 4000), width=st.integers(0, 300), window=st.sampled_from([0, 1, 40, 300, 5000]),
       num_splits=st.sampled_from([1, 2, 3, 7, 16, 64]), sink=st.booleans(),
       later=st.sampled_from([0, 0, 1, 64, 500]))  # fmt: skip
def test_splits_share_the_sequences_own_tiles(p0, width, window, num_splits, sink, later):
    """A sequence's splits take its own complete tiles (past the kept first tile and before the window), in order,
    each once, at most ceil(tiles / splits) a split: however wide its page table (the launch is sized by the width;
    a server's tables are max_model_len wide), so a short sequence's tiles are spread over all of its programs. A
    prefill's later query block (its first query ``later`` tokens past p0) may see none of them through its window.
    ``live_splits`` counts the splits with tiles, which are the first ones (a merge reads only their partials)."""
    g = 32
    max_tiles = p0 // g + 1 + width  # room for the step's token, and `width` tiles more
    out = torch.full((2 * num_splits + 1,), -1, dtype=torch.int32, device=KERNEL_DEVICE)
    _split_tiles_kernel[(1,)](out, p0, p0 + later, window, max_tiles, NSPLIT=num_splits, G=g, E=2 if sink else 1)
    live = out[-1].item()
    out = out[:-1].view(num_splits, 2)
    first = max(1 if sink else 0, (p0 + later - window + 1) // g if window else 0)
    last = max(p0 // g, first)
    ranges = [(lo, hi) for lo, hi in out.cpu().tolist() if lo < hi]
    covered = [t for lo, hi in ranges for t in range(lo, hi)]
    assert covered == list(range(first, last)), f"splits {out.tolist()} cover {covered}, not [{first}, {last})"
    assert all(hi - lo <= -(-(last - first) // num_splits) for lo, hi in ranges)
    assert [lo < hi for lo, hi in out.cpu().tolist()] == [True] * live + [False] * (num_splits - live)


@settings(deadline=None, max_examples=200, derandomize=True)
@given(sequences=st.integers(0, 4096), max_tiles=st.integers(0, 2048), resident=st.integers(1, 2048),
       most=st.integers(1, 256))  # fmt: skip
def test_splits_by_waves_cuts_no_empty_split(sequences, max_tiles, resident, most):
    """Every split the decode launch asks for has tiles where the sequence fills its table (split i then takes the
    tiles [i * per, (i+1) * per), per = ceil(max_tiles / splits); shorter sequences share their own tiles:
    ``test_splits_share_the_sequences_own_tiles``), within the bounds; and no split count costs fewer waves x
    (tiles per program + 1), found here by trying every program length instead."""
    splits = splits_by_waves(sequences, max_tiles, resident, most)
    assert 1 <= splits <= max(1, min(most, max_tiles))
    if max_tiles == 0:
        return
    per = -(-max_tiles // splits)
    assert (splits - 1) * per < max_tiles, f"split {splits - 1} of {splits} would have no tile"
    lengths = [n for n in range(1, max_tiles + 1) if -(-max_tiles // n) <= most]
    best = min((-(-sequences * -(-max_tiles // n) // resident)) * (n + 1) for n in lengths)
    assert (-(-sequences * splits // resident)) * (per + 1) == best


@pytest.mark.parametrize("registers, shared, warps, resident", [(240, 26624, 1, 8), (168, 17408, 1, 12),
                                                               (32, 0, 1, 32), (255, 1024, 8, 1), (64, 0, 4, 8)])  # fmt: skip
def test_resident_programs(monkeypatch, registers, shared, warps, resident):
    """Programs per SM from a compiled kernel's registers (256 a warp at a time), shared memory (+1 KB each)
    and threads, at most 32: the Gluon decode kernel of k4v2_g128 D 128 (224 registers, 26 KB) 8 on an H200."""
    from types import SimpleNamespace

    from kvarn_compile.kernels import tile_math

    h200 = SimpleNamespace(shared_memory_per_multiprocessor=233472, max_threads_per_multi_processor=2048)
    monkeypatch.setattr(tile_math.torch.cuda, "get_device_properties", lambda device: h200)
    compiled = SimpleNamespace(n_regs=registers, metadata=SimpleNamespace(num_warps=warps, shared=shared),
                               _init_handles=lambda: None)  # fmt: skip
    assert tile_math.resident_programs(compiled, torch.device("cuda")) == resident


@pytest.mark.parametrize("batch, context, splits", [(32, 8192, 4), (32, 32768, 4), (32, 131072, 4), (8, 32768, 16),
                                                    (8, 131072, 16), (1, 32768, 86), (1, 131072, 114)])  # fmt: skip
def test_splits_by_waves_on_the_h200(batch, context, splits):
    """The split counts of the fastest decode steps measured, or within 0.3% of them (8 KV heads, 1,056
    resident programs on the H200, a page table one tile wider than the context;
    benchmarks/results/h200-s23/call2/sweep): batch 32 in 4 splits, where the earlier rule took 9 and a third
    wave 18% full. (At most 128 splits, as then; the decode launch now takes at most 64, ``MOST_SPLITS``.)"""
    assert splits_by_waves(batch * 8, context // 128 + 1, 1056, 128) == splits


@pytest.mark.parametrize("max_query_len, batch, kept_rows, parts", [
    (1, 1, 128, 5),  # 8 (sequence, KV head) programs on 132 SMs: the new token's and 4 runs of 32 rows
    (1, 1, 256, 9),  # the first tile kept too: 8 runs
    (1, 2, 256, 8),  # 16 programs: 8 exact ones each, about one per SM in all
    (1, 8, 128, 2),  # 64 programs: 2 each (h100-spread's sweep: 1-5 within 6%)
    (1, 16, 128, 1),  # 128 programs: one each, as from batch 32 (where more only add to the step)
    (1, 32, 128, 1),
    (4, 1, 128, 1),  # prefill and mixed steps keep one
])  # fmt: skip
def test_exact_parts_on_the_h100(max_query_len, batch, kept_rows, parts):
    """The exact part's programs per (sequence, KV head) (8 KV heads, the H100's 132 SMs), the counts
    benchmarks/results/gpu-s43/h100-spread's sweep picked at batch 1, 8 and 32."""
    from kvarn_compile.kernels.paged_attention import exact_parts_for

    assert exact_parts_for(max_query_len, batch * 8, 132, kept_rows) == parts


def test_exact_parts_must_be_positive():
    p = get_preset("kvarn_k4v2_g32")
    cache = KVarNCache.allocate(1, 64, 1, 64, preset=p, device=KERNEL_DEVICE)
    q, k = torch.zeros(1, 1, 64, device=KERNEL_DEVICE), torch.zeros(1, 1, 64, device=KERNEL_DEVICE)
    batch = [t.to(KERNEL_DEVICE) for t in Batch.decode(torch.tensor([0]), torch.tensor([3]))[:3]]
    with pytest.raises(ValueError, match="exact_parts=0: expected at least 1"):
        triton_attention(q, k, k, *cache.tensors()[:4], *batch, p, 0.125, True, 0, 1, exact_parts=0)


@pytest.mark.parametrize("preset, batch, context, splits, most, parts", [
    ("kvarn_k4v2_g128", 1, 2048, 16, 32, 2),  # 256 programs of half a tile, 32 partials a row: one merge step
    ("kvarn_k4v2_g128", 2, 2048, 16, 32, 2),  # 512 programs, at most half of the 1,056 slots
    ("kvarn_k4v2_g128", 4, 2048, 16, 32, 1),  # 1,024
    ("kvarn_k4v2_g128", 1, 8192, 64, 32, 1),  # 128 partials a row
    ("kvarn_k4v2_g128", 1, 2048, 8, 32, 1),  # two tiles a split
    ("kvarn_k4v2_g128", 1, 2048, 16, 0, 1),  # no merge in the exact split
    ("kvarn_k4v2_g64", 1, 1024, 16, 32, 1),  # half a 64-token tile: 8 tokens a 2-bit value field
    ("kvarn_k4v4_g64", 1, 1024, 16, 32, 2),  # 16 tokens a 4-bit field
])  # fmt: skip
def test_tile_parts(preset, batch, context, splits, most, parts):
    """Two programs per tile only where a small step's splits take one tile each, twice their programs fill at most
    half of the slots (1,056 resident on the H200; 8 KV heads) and the merge takes their partials in one step."""
    from kvarn_compile.kernels.decode_attention import tile_parts

    p = get_preset(preset)
    assert tile_parts(p, context // p.tile_size + 1, splits, batch * 8, 1056, most) == parts


@pytest.mark.skipif(KERNEL_DEVICE != "cpu", reason="on the GPU this step runs the Gluon kernel, which takes halves")
def test_tile_parts_need_the_gluon_kernel():
    """Half tiles are the Gluon kernel's: asked of the Triton kernel (here the interpreter's decode step), a clear
    error, not a step that silently takes whole tiles."""
    p = get_preset("kvarn_k4v2_g128")
    cache = KVarNCache.allocate(1, 512, 2, 128, preset=p)
    batch, q, k, v = random_call({0: 1}, {}, 8, 2, 128, 128, torch.float16)
    with pytest.raises(ValueError, match="tile_parts=2 needs the Gluon decode kernel"):
        triton_attention(q, k, v, *cache.tensors()[:4], *batch[:3], p, 128**-0.5, True, 0, 1, tile_parts=2)


def test_decode_splits_compiles_each_specialization_once(monkeypatch):
    """The decode launcher reads the programs an SM holds from the compiled kernel (compiled, not launched, at
    a specialization's first step; stood in for here: the interpreter runs no Gluon) and splits by waves."""
    from kvarn_compile.kernels import decode_attention

    compiled = []
    monkeypatch.setattr(decode_attention._decode_attention_kernel, "warmup",
                        lambda *args, grid, **constants: compiled.append((args, constants)) or len(compiled))  # fmt: skip
    monkeypatch.setattr(decode_attention, "resident_programs", lambda kernel, device: 8)
    monkeypatch.setattr(decode_attention, "_RESIDENT", {})
    for preset, batch, steps in (("kvarn_k4v2_g128", 32, 3), ("kvarn_k4v4_g128", 8, 2)):
        p = get_preset(preset)
        cache = KVarNCache.allocate(batch, 32 * 128, 8, 128, preset=p)
        pages, exact_k, _, table, _ = cache.tensors()
        slots = torch.arange(batch, dtype=torch.int32)
        meta = (slots, torch.full((batch,), 1000, dtype=torch.int32), torch.arange(batch + 1, dtype=torch.int32))
        for _ in range(steps):
            splits, parts = decode_attention.decode_splits(torch.zeros(batch, 32, 128), pages, table, *meta, p, 8,
                                                           batch, exact_k.shape[2] == 2)  # fmt: skip
            assert splits == splits_by_waves(batch * 8, table.shape[1] - 1, 8 * 4, decode_attention.MOST_SPLITS)
            assert parts == 1  # no halves without a merge that takes their partials (most_partials 0)
        args, constants = compiled[-1]
        assert args[6] is torch.float32 and args[7] is torch.float32, "the partials' stand-ins: aligned fp32"
        assert (constants["KB"], constants["VB"], constants["G"], constants["D"]) == (4, p.value_bits, 128, 128)
    assert len(compiled) == 2, "one compile per specialization, none per step"


@pytest.mark.parametrize("tokens, hq, nparts, dv, rotate_back", [(1, 32, 129, 128, True), (3, 6, 2, 64, True),
                                                                  (2, 4, 37, 256, True), (2, 4, 37, 128, False),
                                                                  (0, 8, 5, 128, True), (5, 16, 300, 128, True),
                                                                  (2, 3, 5, 192, True), (1, 2, 3, 512, True),
                                                                  (2, 4, 32, 128, True), (2, 4, 33, 128, True)])  # fmt: skip
@pytest.mark.parametrize("multiprocessors", [1, 10**6])  # programs of 16 rows, programs of one
def test_combine_splits_matches_merge(monkeypatch, multiprocessors, tokens, hq, nparts, dv, rotate_back):
    """The combine kernel alone against the softmax merge in fp32, on random partials: splits past a
    sequence's end (max -inf) anywhere, a row with no visible split at all (output 0), many splits per row
    (the decode kernel's 128 + the exact part), rows that leave a program partly empty, and no rows; both
    launch forms (16 rows a program once the programs fill the SMs, one before; a one-row program of one warp
    up to 32 partials, its limit and one past it: 32, 33); maxima hundreds apart
    from row to row (2^(m - M) under- or overflows unless M is each row's own maximum), and a row's maximum
    past the first pass's first step of splits; the rotation back for every block size, also in rows padded
    past the head dim (192: three blocks of 64 in a row of 256)."""
    from kvarn_compile.kernels import combine_splits as module
    from kvarn_compile.reference import rotate

    monkeypatch.setattr(module, "multiprocessors", lambda device: multiprocessors)
    dv_pad = triton.next_power_of_2(dv)
    acc = torch.randn(tokens, hq, nparts, dv_pad) * 3
    ml = torch.randn(tokens, hq, nparts, 2) * 4
    ml[..., 0] += 500 * torch.randn(tokens, hq, 1)
    ml[..., 1] = ml[..., 1].abs() + 0.5
    ml[..., 0] = ml[..., 0].masked_fill(torch.rand(tokens, hq, nparts) < 0.3, float("-inf"))
    if tokens:
        ml[-1, -1, -1, 0] = ml[-1, -1, :, 0].max() + 300  # the last split (past 256 in the widest case)
        ml[0, 0, :, 0] = float("-inf")
    w = torch.exp2(ml[..., 0] - ml[..., 0].amax(-1, keepdim=True)).nan_to_num(0.0)  # -inf rows: 0
    want = (w[..., None] * acc[..., :dv]).sum(-2) / (w * ml[..., 1]).sum(-1).clamp_min(1e-30)[..., None]
    if rotate_back:
        want = rotate(want.double()).float()
    dev = KERNEL_DEVICE
    out = torch.full((tokens, hq, dv), -7.0, device=dev, dtype=torch.float32)
    module.combine_splits(acc.to(dev), ml.to(dev), out, rotate_back)
    torch.testing.assert_close(out.cpu(), want, atol=1e-4, rtol=1e-4)
    if tokens:
        assert (out[0, 0] == 0).all()


@triton.jit
def _hadamard_blocks_kernel(x_ptr, out_ptr, R: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, R)[:, None] * D + tl.arange(0, D)[None, :]
    tl.store(out_ptr + offs, hadamard_blocks(tl.load(x_ptr + offs), BLOCK))


@pytest.mark.parametrize("rows, dv", [(1, 64), (16, 64), (1, 128), (4, 128), (16, 128), (4, 256), (2, 512), (16, 192)])
def test_hadamard_blocks(rows, dv):
    """The butterflies that rotate q, k, v in (``rotate_rows``) and the outputs and partials back (the combine, the
    small decode step's programs), against the reference's rotation at every block size (192: blocks of 64), with
    channel values 10^4 apart."""
    x = torch.randn(rows, dv) * torch.logspace(-2, 2, dv)[torch.randperm(dv)]
    dv_pad = triton.next_power_of_2(dv)
    padded = torch.nn.functional.pad(x, (0, dv_pad - dv))
    out = torch.empty(rows, dv_pad, device=KERNEL_DEVICE)
    _hadamard_blocks_kernel[(1,)](padded.to(KERNEL_DEVICE), out, rows, dv_pad, rotation_block(dv))
    torch.testing.assert_close(out[:, :dv].cpu(), rotate(x.double()).float(), atol=1e-4, rtol=1e-5)


PATIENCE = get_preset().patience  # the default preset's (k4v2_g128: 2)


@triton.jit
def _balance_kernel(x_ptr, lt_ptr, lc_ptr, D: tl.constexpr, D_PAD: tl.constexpr, G: tl.constexpr,
                    TOKENS_FIRST: tl.constexpr, ITERS: tl.constexpr, PATIENCE: tl.constexpr,
                    PTX: tl.constexpr):  # fmt: skip
    offs_t, offs_d = tl.arange(0, G), tl.arange(0, D_PAD)
    chan_ok = offs_d < D
    x = tl.load(x_ptr + tl.program_id(0) * G * D + offs_t[:, None] * D + offs_d[None, :], mask=chan_ok[None, :],
                other=0.0)  # fmt: skip
    lt, lc = _balance(x, chan_ok, D, G, TOKENS_FIRST, ITERS, PATIENCE, PTX)
    tl.store(lt_ptr + tl.program_id(0) * G + offs_t, lt)
    tl.store(lc_ptr + tl.program_id(0) * D + offs_d, lc, mask=chan_ok)


def kernel_balance(x: torch.Tensor, tokens_first: bool, patience: int = PATIENCE) -> tuple[torch.Tensor, torch.Tensor]:
    """The append kernel's ``_balance`` (at most 8 iterations) on tiles x [tiles, G, D]: (log_tok, log_chan) on the
    CPU."""
    tiles, g, d = x.shape
    lt = torch.zeros(tiles, g, device=KERNEL_DEVICE)
    lc = torch.zeros(tiles, d, device=KERNEL_DEVICE)
    _balance_kernel[(tiles,)](x.to(KERNEL_DEVICE).contiguous(), lt, lc, D=d, D_PAD=triton.next_power_of_2(d), G=g,
                              TOKENS_FIRST=tokens_first, ITERS=8, PATIENCE=patience,
                              PTX=KERNEL_DEVICE == "cuda")  # fmt: skip
    return lt.cpu(), lc.cpu()


@pytest.mark.parametrize("tokens_first", [True, False])
@pytest.mark.parametrize("g, d", [(32, 64), (128, 128), (16, 192)])
def test_balance_matches_reference(g, d, tokens_first):
    """The append kernel's variance normalisation (one std per axis and iteration, never forming the normalised
    tile) gives the reference's log-scales, on tiles with per-token scales, outlier channels, a tile whose stds
    reach the clamps, and means thousands of times their spread: a channel's, one that scales with the tokens
    (centring sums by mean(a) * mean(x) fails there: log-scales off by 1.6e-4) and a token's."""
    tiles = 6
    scale = torch.rand(tiles, g, 1) * 3 + 0.2
    x = torch.randn(tiles, g, d) * scale
    x[:, :, :3] *= 20  # outlier channels
    x[:, :, 5] = 50 + 0.01 * torch.randn(tiles, g)  # an offset channel
    x[:, :, 6] = scale[..., 0] * (300 + 0.01 * torch.randn(tiles, g))  # an offset that scales with the token
    x[:, 7, :] = 50 + 0.01 * torch.randn(tiles, d)  # an offset token
    x[1] *= 1e-4  # a tile whose stds reach the clamps
    lt, lc = kernel_balance(x, tokens_first)
    want_lt, want_lc = balance(x, 8, tokens_first, PATIENCE)
    assert want_lt.abs().amax() > 0.5 and want_lc.abs().amax() > 0.5  # the scales moved
    # fp32 in another order (the reference's own log-scales are ~2e-6 from float64's here)
    torch.testing.assert_close(lt, want_lt, atol=2e-5, rtol=0)
    torch.testing.assert_close(lc, want_lc, atol=2e-5, rtol=0)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    g=st.sampled_from([16, 32, 64]),
    d=st.sampled_from([48, 64, 128]),
    tokens_first=st.booleans(),
    seed=st.integers(0, 2**16),
    level=st.floats(-4, 2),  # the tile's overall scale, 10^level
    offset=st.floats(0, 4),  # a channel's offset, 10^offset times its spread
    scaled_offset=st.booleans(),  # that offset grows with the token's scale
)
def test_balance_matches_reference_on_random_tiles(g, d, tokens_first, seed, level, offset, scaled_offset):
    """The kernel's normalisation against the reference's on tiles of many shapes (padded channels included),
    scales across the clamps and channel offsets up to 10^4 times their spread. Where the log-scales differ,
    the kernel's choice went the other way in a near tie of the imbalance, its iterates did not differ: they
    must be the reference's best iterate over some first iterations, and as balanced as the reference's choice
    but for the margin a new iterate must beat (not the start, nor an early iterate far from the best)."""
    gen = torch.Generator().manual_seed(seed)
    tok_scale = torch.rand(g, 1, generator=gen) * 3 + 0.2
    x = torch.randn(g, d, generator=gen) * tok_scale
    x[:, 1] *= 20  # an outlier channel
    x[:, 2] = (tok_scale[:, 0] if scaled_offset else 1.0) * (10**offset + torch.randn(g, generator=gen))
    x = x * 10**level
    want_lt, want_lc = balance(x, 8, tokens_first, PATIENCE)
    got = [s[0] for s in kernel_balance(x[None], tokens_first)]

    def same(scales):
        return all(torch.allclose(a, b, atol=2e-5, rtol=0) for a, b in zip(got, scales, strict=True))

    def imbalance(log_tok, log_chan):
        return float(_imbalance(x * torch.exp(-log_tok)[:, None] * torch.exp(-log_chan)[None, :]))

    if not same((want_lt, want_lc)):
        assert any(same(balance(x, k, tokens_first)) for k in range(9))
        assert imbalance(*got) <= imbalance(want_lt, want_lc) * (1 + 2 * IMBALANCE_MARGIN)


@pytest.mark.parametrize("patience", [1, 2])
@pytest.mark.parametrize("tokens_first", [True, False])
def test_balance_stops_as_the_reference(tokens_first, patience):
    """The kernel's normalisation ends where the reference's does, tile by tile: on heavy-tailed tiles (Student's
    t, 3 degrees of freedom) that stop at different iterations, some of them where the best of all 8 iterates is
    another one."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(96, 64, 64, generator=gen) / torch.randn(96, 64, 64, 3, generator=gen).square().mean(-1).sqrt()
    want = balance(x, 8, tokens_first, patience)
    full = balance(x, 8, tokens_first)
    assert not all(torch.equal(a, b) for a, b in zip(want, full, strict=True))  # the patience matters here
    got = kernel_balance(x, tokens_first, patience)
    torch.testing.assert_close(got[0], want[0], atol=2e-5, rtol=0)
    torch.testing.assert_close(got[1], want[1], atol=2e-5, rtol=0)


@triton.jit
def _balance_roundings_kernel(codes_ptr, x_ptr, step_ptr, out_ptr, G: tl.constexpr, D: tl.constexpr,
                              BITS: tl.constexpr, FLIPS: tl.constexpr):  # fmt: skip
    tile = tl.program_id(0) * G * D + tl.arange(0, G)[:, None] * D + tl.arange(0, D)[None, :]
    codes = tl.load(codes_ptr + tile)
    step = tl.load(step_ptr + tl.program_id(0) * G + tl.arange(0, G))
    tl.store(out_ptr + tile, _balance_roundings(codes, tl.load(x_ptr + tile), step, BITS, FLIPS))


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("g, d", [(32, 64), (256, 32)])
def test_balanced_roundings_match_reference(bits, g, d):
    """The append kernel's balanced value roundings move the codes the reference moves (same cheapest code
    first, the first of equal costs, the same stop), on tokens of different scales whose codes reach both
    ends of the range, up to tiles of 256 tokens (the kernel's search keys hold 8 bits of token), and on a tile
    of equal tokens, where every round's costs tie."""
    torch.manual_seed(bits)
    tiles = 6
    y = torch.randn(tiles, g, d) * (torch.rand(tiles, g, 1) + 0.5)
    y[0] = y[0, :1]  # equal tokens: each round takes the first of equal costs
    codes, scale, zero = rtn(y, bits, -1)
    x = (y - zero[..., None]) / scale[..., None]
    want = balance_roundings(codes, x, scale, bits, 16)
    out = torch.full((tiles, g, d), -1, dtype=torch.int32, device=KERNEL_DEVICE)
    dev = [t.to(KERNEL_DEVICE).contiguous() for t in (codes.int(), x, scale)]
    _balance_roundings_kernel[(tiles,)](*dev, out, G=g, D=d, BITS=bits, FLIPS=16)
    got = out.cpu()
    assert (got != codes.int()).any()  # something moved
    # the same codes, up to a near-tie of costs in a few channels (fp32 sums in another order; the kernel's
    # costs in fixed point)
    differs = (got != want.int()).any(-2)
    assert differs.float().mean() < 0.02, f"{int(differs.sum())} of {differs.numel()} channels differ"
    assert torch.equal(got[0], want[0].int())  # the ties broken as torch.argmin breaks them


@pytest.mark.parametrize("d", [64, 128, 192, 256, 512])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rotation_kernel_matches_reference(d, dtype):
    """kernels.rotate (one launch for q, k and v) against the reference rotation in fp32: q strided (heads of
    a wider tensor) to fp32, k and v to their dtype; row counts that leave a program partly empty, and none."""
    torch.manual_seed(d)
    q = torch.randn(7, 10, 2, d, dtype=dtype, device=KERNEL_DEVICE)[:, 1:9, 1]  # token and head strides
    k = torch.randn(7, 3, d, dtype=dtype, device=KERNEL_DEVICE)
    k[..., 5] *= 40  # an outlier channel
    v = torch.randn(0, 3, d, dtype=dtype, device=KERNEL_DEVICE)
    outs = rotate_rows([q, k, v], [torch.float32, dtype, dtype])
    for x, out, out_dtype in zip((q, k, v), outs, (torch.float32, dtype, dtype), strict=True):
        want = rotate(x.float().cpu())
        assert out.dtype == out_dtype and out.shape == x.shape and out.is_contiguous()
        # fp32 out: only the order of the fp32 sums differs; half out: one rounding of that
        tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[out_dtype]
        scale = want.abs().amax().item() if want.numel() else 1.0
        torch.testing.assert_close(out.cpu().float(), want.to(out_dtype).float(), rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("window, causal", [(45, True), (0, False), (70, False)])
def test_windows_and_non_causal(window, causal):
    calls = [{0: 150, 1: 20}, {0: 1, 1: 40}, {0: 37, 1: 1}]
    run_both("kvarn_k4v2_g32", calls, slots=2, window=window, causal=causal, num_splits=2)


def run_programs_in_reverse(monkeypatch) -> collections.Counter:
    """Under the interpreter, which runs a launch's programs one by one in grid order, run them in the reverse
    order (a GPU runs them in any order: a kernel must not count on grid order). Returns a count of the programs so
    run ("programs"), for the caller to check that the interpreter still places its programs this way."""
    from triton.runtime.interpreter import interpreter_builder as builder

    in_order = builder.set_grid_idx
    count = collections.Counter()

    def reversed_idx(x, y, z):
        nx, ny, nz = builder.grid_dim
        in_order(nx - 1 - x, ny - 1 - y, nz - 1 - z)
        count["programs"] += 1

    monkeypatch.setattr(builder, "set_grid_idx", reversed_idx)
    return count


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("reverse", [False, True])
def test_sliding_window_ring_of_pages(monkeypatch, fused, reverse):
    """A cache for window 45 with 32-token tiles holds 2 pages per slot, reused in turn; the first call
    completes tiles 0-3 of slot 0, tiles 0 and 2 taking page 0 and tiles 1 and 3 page 1 (the kernel must leave each
    page to the later tile, as the reference's in-order writes do, whichever program runs last: ``reverse`` runs
    the interpreter's programs in reverse grid order, the later tile's first); later calls wrap around the ring
    again."""
    if reverse and KERNEL_DEVICE != "cpu":
        pytest.skip("the program order is the interpreter's to reverse")
    reversed_programs = run_programs_in_reverse(monkeypatch) if reverse else None
    calls = [{0: 150, 1: 20}, {0: 1, 1: 40}, {0: 37, 1: 1}, {0: 70, 1: 100}, {0: 1, 1: 1}]
    run_both("kvarn_k4v2_g32", calls, slots=2, window=45, max_len=320, ring=True, fused=fused)
    assert reversed_programs is None or reversed_programs["programs"] > 0, "no program ran in reverse order"


@pytest.mark.parametrize("window", [33, 65])
def test_sliding_window_of_whole_tiles_plus_one_token(window):
    """A window of k tiles and one token gets a ring of k pages per slot: the decode step that completes a tile
    still attends to the last token of the tile whose page the new tile takes (read before it is overwritten)."""
    calls = [{0: window + 30, 1: 10}, {0: 1, 1: 1}, {0: 1, 1: 1}]  # slot 0 completes tile window // 32 next
    run_both("kvarn_k4v2_g32", calls, slots=2, window=window, max_len=320, ring=True, fused=True)


@pytest.mark.parametrize("rotated", [False, True])
@pytest.mark.parametrize("preset, dk, dv", [("kvarn_k4v2_g32", 64, 64), ("kvarn_k4v4_g32", 128, 256)])
def test_attend_and_append_path(preset, dk, dv, rotated):
    """The fused op's CUDA path (k/v rotated once, the output written in place) matches the reference; head
    dims whose output is rotated back outside the combine kernel (value head dim 256) too; and given inputs
    already rotated (``rotated``), what vLLM's compiled graph passes with the hook."""
    calls = [{0: 70, 1: 33}, {0: 1, 1: 1}, {0: 40, 1: 1}]
    run_both(preset, calls, dk=dk, dv=dv, slots=2, fused=True, rotated=rotated)


def test_g128_default_preset_decode():
    calls = [{0: 300, 1: 128, 2: 0}, {0: 1, 1: 1, 2: 1}]
    run_both("kvarn_k4v2_g128", calls, hq=8, hkv=2, dk=128, max_len=512)


@pytest.mark.skipif(KERNEL_DEVICE == "cpu", reason="Gluon kernels do not run in the Triton interpreter "
                    "(test_kernels_compile compiles this one for sm_90)")  # fmt: skip
@pytest.mark.parametrize(
    "preset, hq, hkv, d, dtype, sink, window, num_splits, tile_parts, parts, rotated, full",
    [  # tile_parts None: the launcher's choice; parts: the programs per tile the launches must have had; full: the
        # launcher told that the Gluon programs fill the GPU (``leaves_half_the_slots``: no halves, a rotation launch)
        # one tile a split, few programs: two programs per tile (decode_attention.tile_parts)
        ("kvarn_k4v2_g128", 8, 2, 128, torch.float16, False, 0, None, None, 2, False, False),
        ("kvarn_k4v2_g128", 16, 2, 128, torch.bfloat16, True, 0, 3, None, 1, False, True),
        ("kvarn_k4v2_g128", 16, 2, 128, torch.bfloat16, True, 0, 3, 2, 2, False, False),  # halves of 3-tile splits
        # more partials than the exact split merges: the exact split beside the Gluon kernel, then the combine
        ("kvarn_k4v2_g128", 8, 2, 128, torch.float16, False, 0, 100, None, 1, False, False),
        # a window
        ("kvarn_k4v2_g128", 2, 2, 64, torch.float16, False, 300, 2, None, 1, False, False),
        ("kvarn_k4v2_g128", 2, 2, 64, torch.float16, False, 300, 2, 2, 2, False, False),
        # a half: 8 tokens a value field
        ("kvarn_k4v2_g64", 12, 3, 256, torch.bfloat16, False, 0, None, None, 1, False, False),
        ("kvarn_k4v2_g64", 32, 2, 128, torch.float16, True, 100, 1, None, 1, False, False),
        ("kvarn_k4v4_g128", 4, 4, 128, torch.float16, False, 0, 5, None, 1, False, True),
        ("kvarn_k4v4_g128", 4, 4, 128, torch.float16, False, 0, 5, 2, 2, False, False),
        ("kvarn_k4v4_g64", 6, 1, 64, torch.bfloat16, True, 0, None, None, 2, False, False),
        ("kvarn_k2v2_g128", 4, 1, 128, torch.float16, False, 0, 2, None, 1, False, False),
        # 256-token tiles at head_dim 64: the staged token scales start at a row of their own
        ("kvarn_k4v2_g256", 4, 2, 64, torch.float16, False, 0, None, None, 2, False, False),
        ("kvarn_k4v2_g256", 4, 2, 64, torch.float16, False, 0, 3, None, 1, False, True),
        # halves: 2-bit keys (four fields a byte), 16 heads a KV head, and q, k, v rotated by the caller
        # (``attend_and_append``: the Gluon programs then take q rotated)
        ("kvarn_k2v2_g128", 4, 1, 128, torch.float16, False, 0, 2, 2, 2, False, False),
        ("kvarn_k4v2_g128", 16, 1, 128, torch.bfloat16, False, 0, 3, 2, 2, False, False),
        ("kvarn_k4v2_g128", 8, 2, 128, torch.float16, False, 0, None, None, 2, True, False),
    ],
)
def test_decode_kernel_matches_reference(monkeypatch, preset, hq, hkv, d, dtype, sink, window, num_splits, tile_parts,
                                         parts, rotated, full):  # fmt: skip
    """GPU decode steps run the Gluon kernel (codes straight into the mma registers) for the quantized
    tiles: outlier channels, sinks, windows, splits, GQA groups 1-16, every tile/value-bits combination it
    serves, whole tiles or halves per program. The oracle is the reference attention over the same cache (the
    kernels' appends): the append's own near-ties with the reference (compare_caches) would otherwise blur a decode
    error. Where the exact split merges, the Gluon programs rotate q themselves (``rotate_q``) unless it comes rotated
    or they fill the GPU (``full``: they then take it from the rotation launch).
    NOTE (H200, benchmarks/results/h200-decode-gluon/diagnose.txt): against the reference's own cache, a
    near-tie tile gave one row 0.06-0.11 off, for the Triton kernel and this one alike."""
    from kvarn_compile.kernels import decode_attention, paged_attention

    launches = []
    launch = decode_attention.decode_attention

    def recorded(*args, **kwargs):
        launches.append((kwargs["parts"], kwargs["rotate_q"], kwargs["rotate_back"]))
        return launch(*args, **kwargs)

    monkeypatch.setattr(decode_attention, "decode_attention", recorded)
    if full:
        monkeypatch.setattr(decode_attention, "leaves_half_the_slots", lambda programs, resident: False)
    p = get_preset(preset)
    cache = sentinel_cache(p, 3, 8 * p.tile_size, hkv, d, d, dtype, sink, KERNEL_DEVICE)
    lengths = {}
    g = p.tile_size
    # the last two decode steps have a sequence with no new token (its row is the next one's, or past the last)
    steps = [{0: 1, 1: 1, 2: 1}] * 3 + [{0: 1, 1: 0, 2: 1}, {0: 1, 1: 1, 2: 0}]
    for call in [{0: 5 * g + 17, 1: 2 * g, 2: g - 1}, *steps]:
        batch, q, k, v = random_call(call, lengths, hq, hkv, d, d, dtype)
        args = (p, d**-0.5, True, window, batch.max_query_len)
        qkv, meta = [t.to(KERNEL_DEVICE) for t in (q, k, v)], [t.to(KERNEL_DEVICE) for t in batch[:3]]
        if batch.max_query_len == 1:
            want = attention_reference(q, k, v, *[t.cpu() for t in cache.tensors()[:4]], *batch[:3], *args)
            inputs = rotated_many(qkv, [torch.float32, dtype, dtype]) if rotated else qkv
            got = triton_attention(*inputs, *cache.tensors()[:4], *meta, *args, num_splits=num_splits,
                                   tile_parts=tile_parts, rotated=rotated)  # fmt: skip
            torch.testing.assert_close(got.cpu().float(), want.float(), atol=1e-2, rtol=1e-2)
        triton_append(*qkv[1:], *cache.tensors(), *meta, p, batch.max_query_len)
        for s, n in call.items():
            lengths[s] = lengths.get(s, 0) + n
    # where the step's exact split merges (its partials rotated back; Hopper on), the Gluon programs rotate q as it
    # came themselves, unless they fill the GPU (no rotation launch: these steps' few programs leave it half free)
    hopper = torch.cuda.get_device_capability()[0] >= 9
    assert 100 > paged_attention.MERGE_MOST_PARTS, "the case of 100 splits is one the exact split does not merge"
    merges = hopper and num_splits != 100
    want = [(parts, merges and not rotated and not full, merges)] * len(steps)
    assert launches == want, f"Gluon launches (parts, rotate_q, merge): {launches}"
    assert not paged_attention.merge_counts(torch.device(KERNEL_DEVICE)).any(), "a merge left its count set"


@pytest.mark.skipif(KERNEL_DEVICE == "cpu", reason="Gluon kernels do not run in the Triton interpreter")
@pytest.mark.parametrize("parts", [1, 2])
def test_merging_decode_launch_stores_only_the_live_partials(parts):
    """In a merging step (partials rotated back) the Gluon programs of splits without tiles store nothing: the exact
    part, which runs beside them, stores its partials from the first empty split's index on (the merge reads the live
    splits' only: ``tile_math.live_splits``), so a store there would race with it. For the combine (no merge) every
    split stores one, empty or not: it reads them all. Sequences of 3 tiles + 5 tokens (3 of 8 splits live) and of 70
    tokens (none), partials filled with NaN beforehand."""
    from kvarn_compile.kernels import decode_attention

    p, d, hkv, splits = get_preset("kvarn_k4v2_g128"), 128, 2, 8
    cache = KVarNCache.allocate(2, 16 * p.tile_size, hkv, d, d, p, torch.float16, KERNEL_DEVICE)
    prefill, _, k, v = random_call({0: 3 * p.tile_size + 5, 1: 70}, {}, 8, hkv, d, d, torch.float16)
    triton_append(k.to(KERNEL_DEVICE), v.to(KERNEL_DEVICE), *cache.tensors(),
                  *[t.to(KERNEL_DEVICE) for t in prefill[:3]], p, prefill.max_query_len)  # fmt: skip
    slots = torch.arange(2, dtype=torch.int32, device=KERNEL_DEVICE)
    start = cache.seq_lens[:2].to(torch.int32)
    qsl = torch.arange(3, dtype=torch.int32, device=KERNEL_DEVICE)
    q = torch.randn(2, 8, d, device=KERNEL_DEVICE)
    nparts = splits * parts + 1  # and the exact part's one
    maxima_sums = []
    for merge in (True, False):
        acc = torch.full((2, 8, nparts, d), float("nan"), device=KERNEL_DEVICE)
        ml = torch.full((2, 8, nparts, 2), float("nan"), device=KERNEL_DEVICE)
        decode_attention.decode_attention(q, cache.pages, cache.page_table, slots, start, qsl, acc, ml, p, d**-0.5, 0,
                                          splits, hkv, 2, False, parts=parts, rotate_back=merge)  # fmt: skip
        written = ~ml[..., 0].isnan()
        want = torch.zeros_like(written)
        want[0, :, : 3 * parts if merge else splits * parts] = True  # sequence 0: 3 tiles, one a split
        want[1, :, : 0 if merge else splits * parts] = True
        assert torch.equal(written, want), f"merge={merge}: partials written {written.int().tolist()}"
        assert ml[0, :, : 3 * parts, 1].gt(0).all(), "a live split's partial has weight"
        maxima_sums.append(ml[0, :, : 3 * parts])
    # the live splits' maxima and sums are the same in both forms (only acc is rotated back in the merging one)
    torch.testing.assert_close(*maxima_sums, atol=1e-6, rtol=1e-6)
