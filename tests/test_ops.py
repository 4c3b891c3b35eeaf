"""The registered ops: schema, fake implementations (torch.library.opcheck), and clear errors on bad input."""

import collections
import contextlib
import copy

import pytest
import torch
from cache_model import CacheModel, dense_attention
from torch.library import opcheck

from kvarn_compile import Batch, KVarNCache, attention, get_preset, store
from kvarn_compile.reference import rotate


def filled_with(preset="kvarn_k4v2_g32", slots=2, max_len=256, hkv=2, d=64, dtype=torch.float16, sink=False):
    """A cache whose slot 0 holds 70 tokens and slot 1 30, and the k, v [100, Hkv, D] stored (slot 0's first)."""
    cache = KVarNCache.allocate(slots, max_len, hkv, d, preset=preset, dtype=dtype, keep_first_tile=sink)
    k, v = torch.randn(100, hkv, d).to(dtype), torch.randn(100, hkv, d).to(dtype)
    store(cache, k, v, Batch.from_lengths([0, 1], [0, 0], [70, 30]))
    return cache, k, v


def filled(**kwargs):
    return filled_with(**kwargs)[0]


@contextlib.contextmanager
def raises_writing_nothing(cache, error, match):
    """``pytest.raises``, and every tensor of ``cache`` as it was before."""
    before = [t.clone() for t in cache.tensors()]
    with pytest.raises(error, match=match):
        yield
    for a, b in zip(before, cache.tensors(), strict=True):
        assert torch.equal(a, b)


def decode_args(cache, hq=4):
    hkv, d, dtype = cache.exact_k.shape[1], cache.exact_k.shape[-1], cache.exact_k.dtype
    q, k, v = (torch.randn(2, h, d).to(dtype) for h in (hq, hkv, hkv))
    pages, exact_k, exact_v, table, _ = cache.tensors()
    return q, k, v, pages, exact_k, exact_v, table, torch.tensor([0, 1], dtype=torch.int32), cache.seq_lens.clone()


@pytest.mark.parametrize("sink", [False, True])
def test_opcheck_all_ops(sink):
    cache = filled(sink=sink)
    q, k, v, pages, exact_k, exact_v, table, slots, start = decode_args(cache)
    opcheck(torch.ops.kvarn.decode_attention, (q, k, v, pages, exact_k, exact_v, table, slots, start,
                                               "kvarn_k4v2_g32", 0.125, 0))  # fmt: skip
    batch = Batch.from_lengths([0, 1], start.tolist(), [3, 0])
    q3, k3, v3 = torch.randn(3, 4, 64).half(), torch.randn(3, 2, 64).half(), torch.randn(3, 2, 64).half()
    opcheck(torch.ops.kvarn.chunk_attention, (q3, k3, v3, pages, exact_k, exact_v, table, *batch[:3],
                                              "kvarn_k4v2_g32", 0.125, False, 16, 3))  # fmt: skip
    opcheck(torch.ops.kvarn.append, (k3, v3, *cache.tensors(), *batch[:3], "kvarn_k4v2_g32", 3))
    out = torch.empty(3, 4, 64, dtype=torch.float16)
    for rotated in (False, True):  # rotated: q may come in float32
        q_in = q3.float() if rotated else q3
        opcheck(torch.ops.kvarn.attend_and_append, (q_in, k3, v3, out, *cache.tensors(), *batch[:3], "kvarn_k4v2_g32",
                                                    0.125, True, 0, 3, rotated))  # fmt: skip


def test_append_mutates_only_what_it_declares():
    def mutated(op):
        return {a.name for a in op.default._schema.arguments if a.alias_info is not None and a.alias_info.is_write}

    assert mutated(torch.ops.kvarn.append) == {"pages", "exact_k", "exact_v", "seq_lens"}
    assert mutated(torch.ops.kvarn.attend_and_append) == {"out", "pages", "exact_k", "exact_v", "seq_lens"}
    for op in (torch.ops.kvarn.decode_attention, torch.ops.kvarn.chunk_attention):
        assert not any(a.alias_info is not None for a in op.default._schema.arguments)


def test_decode_op_against_the_cache_model():
    """The decode op (one token per sequence: it builds query_start_loc itself) with a window and a scale of
    its own, against dense attention over what the cache model says each slot holds."""
    preset = get_preset("kvarn_k4v2_g32")
    cache, model = KVarNCache.allocate(2, 256, 2, 64, preset=preset), CacheModel(preset, torch.float16)
    k, v = torch.randn(100, 2, 64).half(), torch.randn(100, 2, 64).half()
    store(cache, k, v, Batch.from_lengths([0, 1], [0, 0], [70, 30]))
    model.store(0, 0, k[:70], v[:70])
    model.store(1, 0, k[70:], v[70:])
    q, kn, vn = torch.randn(2, 4, 64).half(), torch.randn(2, 2, 64).half(), torch.randn(2, 2, 64).half()
    slots = torch.tensor([0, 1], dtype=torch.int32)
    out = torch.ops.kvarn.decode_attention(q, kn, vn, *cache.tensors()[:4], slots, cache.seq_lens.clone(),
                                           "kvarn_k4v2_g32", 0.1, 40)  # fmt: skip
    for i, length in enumerate((70, 30)):
        k_seen, v_seen = model.seen(i, length)
        keys = torch.cat([k_seen, model._exact(kn[i : i + 1].float())])
        values = torch.cat([v_seen, model._exact(vn[i : i + 1].float())])
        want = dense_attention(q[i : i + 1], keys, values, length, 0.1, window=40)
        torch.testing.assert_close(out[i : i + 1].double(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("causal, window", [(True, 0), (True, 16), (False, 0)])
@pytest.mark.parametrize("rotated", [False, True])
def test_attend_and_append_equals_the_two_ops(rotated, causal, window):
    """One prefill chunk crossing a tile edge and a decode row: same output and same cache as chunk_attention
    followed by append, causal or not, with a window or not; also when given q (float32), k, v already rotated
    (``rotated``: vLLM's hook)."""
    fused = filled()
    apart = copy.deepcopy(fused)
    batch = Batch.from_lengths([0, 1], [70, 30], [40, 1])
    q, k, v = torch.randn(41, 4, 64).half(), torch.randn(41, 2, 64).half(), torch.randn(41, 2, 64).half()
    args = ("kvarn_k4v2_g32", 0.125, causal, window, batch.max_query_len)
    out = torch.full((41, 4, 64), float("nan"), dtype=torch.float16)
    given = (rotate(q.float()), rotate(k.float()).half(), rotate(v.float()).half()) if rotated else (q, k, v)
    torch.ops.kvarn.attend_and_append(*given, out, *fused.tensors(), *batch[:3], *args, rotated)
    want = torch.ops.kvarn.chunk_attention(q, k, v, *apart.tensors()[:4], *batch[:3], *args)
    torch.ops.kvarn.append(k, v, *apart.tensors(), *batch[:3], "kvarn_k4v2_g32", batch.max_query_len)
    assert torch.equal(out, want)
    for a, b in zip(fused.tensors(), apart.tensors()):
        assert torch.equal(a, b)
    assert fused.seq_lens.tolist() == [110, 31]


def test_attend_and_append_checks_out():
    """``out`` of the shape and dtype the attention gives, in memory of its own: the kernels write it before the
    append reads k and v."""
    cache = filled()
    q, k, v, *_, slots, start = decode_args(cache)
    qsl = torch.arange(3, dtype=torch.int32)
    wide = torch.randn(2, 4, 64).half()
    for out, k_in, message in [(torch.empty(2, 4, 32).half(), k, r"out must be torch.float16 \[2, 4, 64\]"),
                               (wide, wide[:, :2], "out must not share memory with q, k, v"),
                               (torch.empty(2, 4, 64).half(), k.to("meta"), "takes every tensor on one device")]:  # fmt: skip
        with raises_writing_nothing(cache, ValueError, message):
            torch.ops.kvarn.attend_and_append(q, k_in, v, out, *cache.tensors(), slots, start, qsl, "kvarn_k4v2_g32",
                                              0.125, True, 0, 1)  # fmt: skip


def test_compiles_without_graph_breaks():
    cache = filled()
    q, k, v, pages, exact_k, exact_v, table, slots, start = decode_args(cache)

    def step(q, k, v):
        return torch.ops.kvarn.decode_attention(q, k, v, pages, exact_k, exact_v, table, slots, start,
                                                "kvarn_k4v2_g32", 0.125, 0) * 2  # fmt: skip

    eager = step(q, k, v)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v)
    assert torch.equal(eager, compiled)


def test_decode_steps_share_one_query_start_loc(monkeypatch):
    """kvarn::decode_attention's query_start_loc (one token per sequence) is a view of one tensor per device,
    longer when a batch outgrows it, so a step launches nothing to make it."""
    from kvarn_compile import ops

    monkeypatch.setattr(ops, "_TOKEN_ROWS", {})
    cpu = torch.device("cpu")
    first = ops.one_token_each(3, cpu)
    assert torch.equal(first, torch.arange(4, dtype=torch.int32))
    assert ops.one_token_each(7, cpu).data_ptr() == first.data_ptr(), "the same tensor, no new one per step"
    long = ops.one_token_each(5000, cpu)
    assert torch.equal(long, torch.arange(5001, dtype=torch.int32))
    assert ops.one_token_each(2, cpu).data_ptr() == long.data_ptr()
    assert torch.equal(first, torch.arange(4, dtype=torch.int32)), "the shorter one stays (a graph may read it)"
    assert ops._TOKEN_ROWS[cpu][0].data_ptr() == first.data_ptr()


# ----------------------------------------------------------------------------------------------------
# Bad input: a clear error, nothing written
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("start, tokens", [(70, 60), (2**31 - 2, 3)], ids=["past the end", "past int32's end"])
def test_positions_past_capacity_raise_and_write_nothing(start, tokens):
    """Ends past the capacity, also where start + tokens would wrap in int32 (the positions' dtype)."""
    cache = filled(max_len=128)  # 4 tiles of 32 per slot
    k, v = torch.randn(tokens, 2, 64).half(), torch.randn(tokens, 2, 64).half()
    with raises_writing_nothing(cache, ValueError, "capacity of 128 tokens"):
        torch.ops.kvarn.append(k, v, *cache.tensors(), *Batch.from_lengths([0], [start], [tokens])[:3],
                               "kvarn_k4v2_g32", tokens)  # fmt: skip


_BAD_CALL_ON_GPU = """
import sys, torch
from kvarn_compile import KVarNCache
cache = KVarNCache.allocate(2, 128, 2, 64, preset="kvarn_k4v2_g32", device="cuda")
n = int(sys.argv[4])  # the second sequence's new tokens, for a call that says max_query_len=1
q, k, v = (torch.randn(1 + n, h, 64, device="cuda", dtype=torch.float16) for h in (4, 2, 2))
slots = torch.tensor([0, int(sys.argv[2])], dtype=torch.int32, device="cuda")
start = torch.tensor([0, int(sys.argv[3])], dtype=torch.int32, device="cuda")
qsl = torch.tensor([0, 1, 1 + n], dtype=torch.int32, device="cuda")
if n > 1 and sys.argv[1] == "attention":
    torch.ops.kvarn.chunk_attention(q, k, v, *cache.tensors()[:4], slots, start, qsl, "kvarn_k4v2_g32", 0.125, True, 0,
                                    1)
elif sys.argv[1] == "attention":
    torch.ops.kvarn.decode_attention(q, k, v, *cache.tensors()[:4], slots, start, "kvarn_k4v2_g32", 0.125, 0)
elif sys.argv[1] == "gluon decode":  # the Gluon kernel alone (g128): the op's exact part would stop it too
    from kvarn_compile import get_preset
    from kvarn_compile.kernels.decode_attention import decode_attention
    cache = KVarNCache.allocate(2, 128, 2, 64, preset="kvarn_k4v2_g128", device="cuda")
    parts = (torch.empty(2, 4, 3, 64, device="cuda"), torch.empty(2, 4, 3, 2, device="cuda"))
    pages, _, _, table, _ = cache.tensors()
    decode_attention(q.float(), pages, table, slots, start, qsl, *parts, get_preset("kvarn_k4v2_g128"), 0.125, 0, 2,
                     2, 2, False)
elif sys.argv[1] == "latent attention":  # start_pos as kv_lens (the latent cache holds no token: 0 is in range)
    from kvarn_compile.paged_latent import LatentCache
    latent = LatentCache.allocate(2, 128, 64, 32, "kvarn_k4v2_g32", torch.float16, device="cuda")
    torch.ops.kvarn.latent_attention(q, q[..., :32].contiguous(), *latent.tensors(), slots, start, qsl, "kvarn_k4v2_g32", 0.125, 1)
else:
    torch.ops.kvarn.append(k, v, *cache.tensors(), slots, start, qsl, "kvarn_k4v2_g32", 1)
torch.cuda.synchronize()
print("no error")
"""


# past the capacity, negative, no such slot; and 3 new tokens where max_query_len says 1 (not for the Gluon
# kernel alone, which reads one query a sequence: its op's exact part checks that). The latent kernel reads
# kv_lens, not positions: no such slot, kv_lens past what the slot holds, and the token count, one fault a call.
_BAD_CALLS = [
    (op, *bad) for op in ("attention", "append", "gluon decode") for bad in ((1, 128, 1), (1, -1, 1), (2, 5, 1))
]
_BAD_CALLS += [
    ("attention", 1, 5, 3),
    ("append", 1, 5, 3),
    ("latent attention", 2, 0, 1),
    ("latent attention", 1, 5, 1),
    ("latent attention", 1, 0, 3),
]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernels' own checks run on a GPU")
@pytest.mark.parametrize("op, slot, start, tokens", _BAD_CALLS)
def test_bad_positions_and_slots_stop_the_kernels_on_a_gpu(op, slot, start, tokens):
    """On CUDA the values are never read on the host: the kernels themselves stop, naming the problem (past
    the capacity, negative, no such slot, more new tokens than the call's max_query_len of 1, whose grid
    would drop the tokens past it)."""
    import subprocess
    import sys

    ran = subprocess.run([sys.executable, "-c", _BAD_CALL_ON_GPU, op, str(slot), str(start), str(tokens)],
                         capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert ran.returncode != 0 and "no error" not in ran.stdout, ran.stdout + ran.stderr
    out = ran.stdout + ran.stderr
    assert "KVarN: a slot out of range" in out, out  # (with tokens=3 the call's only fault is its token count)


@pytest.mark.parametrize(
    "change, error, message",
    [
        (lambda a: a.update(q=a["q"].float()), TypeError, "q is torch.float32 but the cache holds torch.float16"),
        (lambda a: a.update(k=a["k"][:, :1]), ValueError, r"k must be \[tokens, 2, 64\]"),
        (lambda a: a.update(q=a["q"][:, :3]), ValueError, r"a multiple of 2"),
        (lambda a: a.update(slots=a["slots"].long()), ValueError, "slots must be a 1-D int32 tensor"),
        (lambda a: a.update(slots=torch.tensor([0, 5], dtype=torch.int32)), ValueError, r"slots must be in \[0, 2\)"),
        (lambda a: a.update(start=torch.tensor([0, -1], dtype=torch.int32)), ValueError, "start_pos must be >= 0"),
        (lambda a: a.update(start=torch.tensor([0, 2**31 - 1], dtype=torch.int32)), ValueError, "capacity of 256"),
        (lambda a: a.update(k=a["k"].to("meta")), ValueError, "kvarn::decode_attention takes every tensor on one"),
        (lambda a: a.update(preset="kvarn_k4v3_g32"), ValueError, "not a KVarN preset name"),
        (lambda a: a.update(preset="kvarn_k4v2_g64"), ValueError, "stores tiles of 64 tokens"),
        (lambda a: a.update(pages=a["pages"][:, :, :-16]), ValueError, r"pages must be uint8 \[num_pages, 2, "),
        (lambda a: a.update(window=-3), ValueError, "window must be >= 0"),
        (lambda a: a.update(scale=float("nan")), ValueError, "the softmax scale must be a finite number, got nan"),
    ],
)
def test_bad_attention_input(change, error, message):
    cache = filled()
    q, k, v, pages, exact_k, exact_v, table, slots, start = decode_args(cache)
    args = {"q": q, "k": k, "v": v, "pages": pages, "exact_k": exact_k, "exact_v": exact_v, "table": table,
            "slots": slots, "start": start, "preset": "kvarn_k4v2_g32", "scale": 0.125, "window": 0}  # fmt: skip
    change(args)
    with pytest.raises(error, match=message):
        torch.ops.kvarn.decode_attention(*args.values())


@pytest.mark.parametrize(
    "seq_lens, message",
    [
        (torch.zeros(2, dtype=torch.float32), r"seq_lens must be int32 \[2\]"),
        (torch.zeros(1, 2, dtype=torch.int32), r"seq_lens must be int32 \[2\]"),
        (torch.zeros(7, dtype=torch.int32), r"seq_lens must be int32 \[2\]"),
    ],
)
def test_bad_seq_lens_raise_and_write_nothing(seq_lens, message):
    """append writes each sequence's length into seq_lens [slots]: a tensor of another shape or dtype would take
    the write somewhere else (on CUDA, past its end)."""
    cache = filled()
    pages, exact_k, exact_v, table, _ = cache.tensors()
    k, v = torch.randn(3, 2, 64).half(), torch.randn(3, 2, 64).half()
    with raises_writing_nothing(cache, ValueError, message):
        torch.ops.kvarn.append(k, v, pages, exact_k, exact_v, table, seq_lens, *Batch.from_lengths([0], [70], [3])[:3],
                               "kvarn_k4v2_g32", 3)  # fmt: skip


def test_tokens_with_max_query_len_zero_raise_on_every_device():
    """The launchers return before any kernel for max_query_len 0, so no kernel could stop such a call: the
    host checks it (host integers, no sync) on every device, also where it reads none of the batch's values (a
    batch on the meta device takes the path of a CUDA one)."""
    from kvarn_compile import ops

    cache = filled()
    k, v = torch.randn(3, 2, 64).half(), torch.randn(3, 2, 64).half()
    batch = Batch.from_lengths([0], [70], [3])[:3]
    with raises_writing_nothing(cache, ValueError, "3 tokens but max_query_len=0"):
        torch.ops.kvarn.append(k, v, *cache.tensors(), *batch, "kvarn_k4v2_g32", 0)
    with pytest.raises(ValueError, match="3 tokens but max_query_len=0"):
        ops.check_batch(*(t.to("meta") for t in batch), 3, 0, 2, None)


def test_a_tile_without_a_page_raises():
    """A completed tile whose page-table entry is not a page (-1) is an error on the host, not a write into the
    page that index wraps to (another slot's), and it comes before any sequence of the call is stored."""
    cache = filled()
    cache.page_table[0, 2] = -1  # slot 0 holds 70 tokens (32-token tiles): 30 more complete its tile 2
    k, v = torch.randn(32, 2, 64).half(), torch.randn(32, 2, 64).half()
    with raises_writing_nothing(cache, ValueError, "slot 0 completes tile 2 but its page table gives page -1"):
        store(cache, k, v, Batch.from_lengths([1, 0], [30, 70], [2, 30]))  # (slot 1's first: its tile 0 is fine)


@pytest.mark.parametrize(
    "slot, start, tokens, held",
    [(0, 72, 1, 70), (0, 40, 3, 70), (1, 31, 5, 30)],
    ids=["a gap", "a rewind into a quantized tile", "one row missing"],
)
def test_appends_that_do_not_continue_their_slot_raise_and_write_nothing(slot, start, tokens, held):
    """A start inside a tile needs the tile's earlier rows from the slot's exact current tile: past what the slot
    holds (a gap: stale rows) or before its current tile (rows of a later tile), an error of the ``store`` helper,
    not a quantized tile or a history made of another tile's tokens (slot 0 holds 70 tokens in 32-token tiles,
    slot 1 holds 30). (The ops themselves take one lengths tensor that vLLM shares among its layers.)"""
    cache = filled()
    k, v = torch.randn(tokens, 2, 64).half(), torch.randn(tokens, 2, 64).half()
    with raises_writing_nothing(
        cache, ValueError, f"starts at position {start} in slot {slot}, which holds {held} tokens"
    ):
        store(cache, k, v, Batch.from_lengths([slot], [start], [tokens]))


@pytest.mark.parametrize("start, tokens", [(66, 2), (70, 30), (64, 1), (32, 40), (0, 5)])
def test_appends_that_continue_rewind_within_or_start_a_tile_store_what_the_reference_does(start, tokens):
    """What the check lets through: continuing (70), rewinding within the current tile (66, 64: its rows are still
    held), and any start at a tile's first row (32, 0: a prefix cache's pages, a new sequence), which reads no
    held rows; each stores what a cache filled with the same tokens in one call holds: its quantized tiles' bytes
    and its current tile's exact rows."""
    cache, k_held, v_held = filled_with()
    k, v = torch.randn(tokens, 2, 64).half(), torch.randn(tokens, 2, 64).half()
    store(cache, k, v, Batch.from_lengths([0], [start], [tokens]))
    end = start + tokens
    assert int(cache.seq_lens[0]) == end
    fresh = KVarNCache.allocate(2, 256, 2, 64, preset="kvarn_k4v2_g32")
    k_all, v_all = torch.cat([k_held[:start], k]), torch.cat([v_held[:start], v])  # slot 0's tokens, in order
    store(fresh, k_all, v_all, Batch.from_lengths([0], [0], [end]))
    for tile in range(end // 32):
        assert torch.equal(cache.pages[cache.page_table[0, tile]], fresh.pages[fresh.page_table[0, tile]]), tile
    rows = end % 32
    assert torch.equal(cache.exact_k[0, :, 0, :rows], fresh.exact_k[0, :, 0, :rows])
    assert torch.equal(cache.exact_v[0, :, 0, :rows], fresh.exact_v[0, :, 0, :rows])


def test_a_rewind_into_a_tile_the_slot_completed_raises():
    """A call that completes a tile quantizes the rows it brings straight into the tile's page: the slot's exact
    tile never held them. A start inside such a tile (the slot holds exactly to its end) would read zeros or
    stale rows as its earlier rows."""
    cache = KVarNCache.allocate(2, 128, 2, 64, preset="kvarn_k4v2_g32")
    store(cache, torch.randn(64, 2, 64).half(), torch.randn(64, 2, 64).half(), Batch.from_lengths([0], [0], [64]))
    q, k, v = torch.randn(1, 4, 64).half(), torch.randn(1, 2, 64).half(), torch.randn(1, 2, 64).half()
    message = "starts at position 40 in slot 0, which holds 64 tokens"
    with raises_writing_nothing(cache, ValueError, message):
        store(cache, k, v, Batch.from_lengths([0], [40], [1]))
    with pytest.raises(ValueError, match=message):
        attention(cache, q, k, v, Batch.decode(torch.tensor([0]), torch.tensor([40])))


def test_a_ring_cache_refuses_a_rewind_whose_window_reaches_a_reused_page():
    """A sliding-window cache reuses a slot's pages in turn (a ring of 2 for a window of 45 in 32-token tiles): a
    rewind to a tile's first row whose window reaches a tile whose page a later tile took is an error; one whose
    window reaches only live pages attends as a cache holding just the tokens before it."""
    cache = KVarNCache.allocate(1, 256, 2, 64, preset="kvarn_k4v2_g32", window=45)
    k_all, v_all = torch.randn(200, 2, 64).half(), torch.randn(200, 2, 64).half()
    store(cache, k_all, v_all, Batch.from_lengths([0], [0], [200]))
    q, k, v = torch.randn(1, 4, 64).half(), torch.randn(1, 2, 64).half(), torch.randn(1, 2, 64).half()
    with pytest.raises(ValueError, match=r"the window \(45\) reaches a tile whose page a later tile took"):
        attention(cache, q, k, v, Batch.decode(torch.tensor([0]), torch.tensor([64])), window=45)
    fresh = KVarNCache.allocate(1, 256, 2, 64, preset="kvarn_k4v2_g32", window=45)
    store(fresh, k_all[:192], v_all[:192], Batch.from_lengths([0], [0], [192]))
    batch = Batch.decode(torch.tensor([0]), torch.tensor([192]))  # its window reaches tiles 4 and 5: live
    torch.testing.assert_close(attention(cache, q, k, v, batch, window=45), attention(fresh, q, k, v, batch, window=45))


def test_one_slot_twice_in_an_append_raises():
    cache = filled()
    k, v = torch.randn(2, 2, 64).half(), torch.randn(2, 2, 64).half()
    with raises_writing_nothing(cache, ValueError, "a slot takes new tokens from one sequence of a call"):
        store(cache, k, v, Batch.from_lengths([0, 0], [70, 70], [1, 1]))


def test_attention_past_what_a_slot_holds_raises():
    """The attention ops take no lengths (a sequence's history is [0, start_pos) of its slot); the helper, which
    has the cache, checks that the slot holds it."""
    cache = filled()
    q, k, v = torch.randn(1, 4, 64).half(), torch.randn(1, 2, 64).half(), torch.randn(1, 2, 64).half()
    with pytest.raises(ValueError, match="starts at position 40 in slot 1, which holds 30 tokens"):
        attention(cache, q, k, v, Batch.decode(torch.tensor([1]), torch.tensor([40])))  # rows 30..39: never stored


def test_a_history_tile_without_a_page_raises():
    """Attention reads a page-table entry of each quantized tile of the history: one that is not a page (-1) is
    an error, not a read of the page that index wraps to (another slot's)."""
    cache = filled()
    cache.page_table[0, 1] = -1
    q, k, v = torch.randn(1, 4, 64).half(), torch.randn(1, 2, 64).half(), torch.randn(1, 2, 64).half()
    with pytest.raises(ValueError, match="slot 0 reads tile 1 but its page table gives page -1"):
        attention(cache, q, k, v, Batch.decode(torch.tensor([0]), torch.tensor([70])))


def test_attention_helper_checks_the_batch_before_the_decode_route():
    """The decode op rebuilds query_start_loc (one token per sequence): the helper checks the batch's own."""
    cache = filled()
    q, k, v, *_, slots, start = decode_args(cache)
    batch = Batch(slots, start, torch.tensor([0, 0, 2], dtype=torch.int32), 1)
    with pytest.raises(ValueError, match="more than max_query_len=1 tokens"):
        attention(cache, q, k, v, batch)


def test_unsupported_head_dim_and_dtype_at_allocation():
    with pytest.raises(ValueError, match=r"head_dim in \(64, 128, 192, 256, 512\)"):
        KVarNCache.allocate(1, 128, 1, 80)
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        KVarNCache.allocate(1, 128, 1, 64, dtype=torch.float32)
    with pytest.raises(ValueError, match="max_seq_len > 0 tokens per slot, got -5"):
        KVarNCache.allocate(1, -5, 1, 64)


def test_attention_helper_picks_decode_or_chunk():
    """One token per sequence and max_query_len 1: the decode op; the same tokens said to be up to 2 a
    sequence: the chunk op. Both give the same output."""
    cache = filled()
    q, k, v, *_, slots, start = decode_args(cache)
    outs = []
    for batch, op in ((Batch.decode(slots, start), "kvarn::decode_attention"),
                      (Batch(slots, start, torch.arange(3, dtype=torch.int32), 2), "kvarn::chunk_attention")):  # fmt: skip
        with torch.profiler.profile() as prof:
            outs.append(attention(cache, q, k, v, batch))
        ran = {e.name for e in prof.events() if e.name.startswith("kvarn::")}
        assert ran == {op}, ran
    assert torch.equal(*outs)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launches: Hopper and later")  # fmt: skip
@pytest.mark.parametrize("form", ["full", "whole tiles", "halves"])
def test_small_decode_step_replays_in_a_cuda_graph(monkeypatch, form):
    """A small decode step captured once, replayed with a fresh q, k, v each step, gives what the same step gives
    launched eagerly. Where its Gluon programs would fill the GPU ("full": told so, ``leaves_half_the_slots``), the
    kernel, launched as a programmatic dependent of the q rotation (``decode_attention.starts_during_rotation``),
    copies its first tile before the rotation ends but reads q only after it (a q read too early would be the previous
    step's; the eager step runs without that dependency). Where they leave half the GPU free, whole tiles a program
    or halves (``tile_parts``): no rotation launch, the Gluon programs and the merging exact split rotate the replay's
    q themselves (eager and replayed steps run the same launches)."""
    from kvarn_compile.kernels import decode_attention

    preset, d = "kvarn_k4v2_g128", 128
    cache = KVarNCache.allocate(3, 1024, 2, d, preset=preset, dtype=torch.float16, device="cuda")
    k, v = (torch.randn(1129, 2, d, device="cuda", dtype=torch.float16) for _ in range(2))
    store(cache, k, v, Batch.from_lengths([0, 1, 2], [0, 0, 0], [700, 300, 129], device="cuda"))
    slots = torch.arange(3, dtype=torch.int32, device="cuda")
    start = cache.seq_lens.clone()
    q, k, v = (torch.randn(3, h, d, device="cuda", dtype=torch.float16) for h in (8, 2, 2))
    launched = []  # the Gluon launches' (pdl, rotate_q, parts) arguments
    launch = decode_attention.decode_attention
    monkeypatch.setattr(decode_attention, "decode_attention",
                        lambda *a, pdl, rotate_q, parts, **k: launched.append((pdl, rotate_q, parts))
                        or launch(*a, pdl=pdl, rotate_q=rotate_q, parts=parts, **k))  # fmt: skip
    if form == "full":
        monkeypatch.setattr(decode_attention, "leaves_half_the_slots", lambda programs, resident: False)
    if form == "whole tiles":
        monkeypatch.setattr(decode_attention, "tile_parts", lambda *args: 1)

    def step(pdl: bool) -> torch.Tensor:
        monkeypatch.setattr(decode_attention, "PDL_MOST_TILES", 10**6 if pdl else 0)
        return torch.ops.kvarn.decode_attention(q, k, v, *cache.tensors()[:4], slots, start, preset, d**-0.5, 0)

    step(True)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(True)
    for _ in range(4):
        q.normal_(), k.normal_(), v.normal_()
        graph.replay()
        torch.testing.assert_close(out, step(False), atol=1e-3, rtol=1e-3)
    full, parts = form == "full", 2 if form == "halves" else 1
    assert launched == [(full, not full, parts)] * 2 + [(False, not full, parts)] * 4, launched


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("fused", [False, True])
def test_decode_step_replays_in_a_cuda_graph(fused):
    """append + attention of a decode step (the two ops, or attend_and_append) captured once, replayed over
    steps that cross a tile edge; compared with the two ops run eagerly."""
    preset = "kvarn_k4v2_g32"
    cache = KVarNCache.allocate(2, 256, 2, 64, preset=preset, device="cuda")
    eager = KVarNCache.allocate(2, 256, 2, 64, preset=preset, device="cuda")
    slots = torch.arange(2, dtype=torch.int32, device="cuda")
    start = torch.tensor([29, 60], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(2, h, 64, device="cuda", dtype=torch.float16) for h in (4, 2, 2))
    qsl = torch.arange(3, dtype=torch.int32, device="cuda")

    def step(c):
        out = torch.ops.kvarn.decode_attention(q, k, v, *c.tensors()[:4], slots, start, preset, 0.125, 0)
        torch.ops.kvarn.append(k, v, *c.tensors(), slots, start, qsl, preset, 1)
        return out

    def fused_step(c):
        out = torch.empty_like(q)
        torch.ops.kvarn.attend_and_append(q, k, v, out, *c.tensors(), slots, start, qsl, preset, 0.125, True, 0, 1)
        return out

    captured = fused_step if fused else step
    captured(cache)  # compile the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = captured(cache)
    for _ in range(6):  # positions 29..35 and 60..66: both slots complete a tile on the way
        q.normal_(), k.normal_(), v.normal_()
        graph.replay()
        torch.testing.assert_close(out, step(eager), atol=1e-3, rtol=1e-3)
        start += 1
    assert cache.seq_lens.tolist() == eager.seq_lens.tolist() == [35, 66]
    assert torch.equal(cache.pages, eager.pages)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="side streams and CUDA graphs need a GPU")
@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("slow", ["stage", "flush"])
@pytest.mark.parametrize("group", [1, 4])
def test_deferred_flushes_write_what_in_line_ones_do(monkeypatch, graph, slow, group):
    """Decode steps of four layers that defer their tiles' quantization (``deferred_flush``), over steps in which one,
    two, three or four sequences complete a tile (up to DEFERRED_MOST, a FLUSH program's tiles in turn), or five (a
    burst: more than DEFERRED_MOST, quantized in line): captured in one CUDA graph and replayed, the last layer not
    deferring (it joins the rest, as vLLM's last layer does), or eagerly, every layer deferring, each FLUSH launch
    serving ``group`` layers' calls and joined by the launch two later or by a layer's next step, and the step's start
    positions moved on while flushes are still pending (they read a snapshot). With the flushes slowed down (a missing
    join would let a later call read a page not yet written) or the stagings (a flush not ordered after its staging
    would read rows not yet staged): the outputs, lengths, pages and current rows of in-line steps."""
    from kvarn_compile import deferred_flush
    from kvarn_compile.kernels import quantize_store as qs

    defer, stage, flush = deferred_flush.defer, qs.quantize_store, deferred_flush.flush_tiles
    deferred, launches = [], []

    def counted(call):
        deferred.append(call.pages.data_ptr())
        defer(call)

    def slowed_stage(*args, part=qs.WHOLE, snapshot=None):  # ~5 ms of spinning on its stream ahead of the part
        if part is qs.STAGE and slow == "stage":
            torch.cuda._sleep(10**7)
        stage(*args, part=part, snapshot=snapshot)

    def slowed_flush(calls, width):
        launches.append(len(calls))
        if slow == "flush":
            torch.cuda._sleep(10**7)
        flush(calls, width)

    monkeypatch.setattr(deferred_flush, "GROUP", group)
    monkeypatch.setattr(deferred_flush, "defer", counted)
    monkeypatch.setattr(qs, "quantize_store", slowed_stage)
    monkeypatch.setattr(deferred_flush, "flush_tiles", slowed_flush)
    preset = "kvarn_k4v2_g32"
    layers, inline = ([KVarNCache.allocate(16, 256, 2, 64, preset=preset, device="cuda") for _ in range(4)]
                      for _ in range(2))  # fmt: skip
    slots = torch.arange(16, dtype=torch.int32, device="cuda")  # (at least deferred_flush.SMALLEST_BATCH)
    # sequence 2 completes a tile at step 2; 0, 3, 4, 5 and 6 at step 3 (a burst); 1 and 7 at step 4; 8-11 at step 5;
    # 12-14 at step 6; 15 at none (a sequence completes a tile at step s where its start is 32 - s modulo 32)
    start = torch.tensor([29, 60, 94, 125, 157, 189, 221, 28, 27, 59, 91, 123, 26, 58, 90, 100], dtype=torch.int32,
                         device="cuda")  # fmt: skip
    tiles_by_step = collections.Counter(32 - p % 32 for p in start.tolist() if 32 - p % 32 <= 6)
    assert tiles_by_step == {2: 1, 3: 5, 4: 2, 5: 4, 6: 3}, "the schedule above"
    assert qs.DEFERRED_MOST.value == 4, "the steps above: 5 tiles a burst, 4 and 3 deferred"
    lengths = (start + 6).tolist()
    q, k, v = (torch.randn(16, h, 64, device="cuda", dtype=torch.float16) for h in (4, 2, 2))
    qsl = torch.arange(17, dtype=torch.int32, device="cuda")
    deferring = 3 if graph else 4

    def step(caches, defer):
        outs = [torch.empty_like(q) for _ in caches]
        for i, (c, out) in enumerate(zip(caches, outs, strict=True)):
            torch.ops.kvarn.attend_and_append(q, k, v, out, *c.tensors(), slots, start, qsl, preset, 0.125, True, 0, 1,
                                              False, defer and i < deferring)  # fmt: skip
        return outs

    outs = step(layers, True)  # (compiles the kernels outside a capture)
    assert deferred == [c.pages.data_ptr() for c in layers[:deferring]]
    # a launch for each group of calls; the rest (of the three a captured step defers) launched by the last layer
    assert launches == [group] * (deferring // group) + [deferring % group] * (deferring % group > 0)
    kept = 0 if graph else min(deferring // group, deferred_flush.LAG) * group + deferring % group
    assert deferred_flush.pending() == kept, "joined by the last layer, or by the launch LAG launches later"
    if graph:
        replay = torch.cuda.CUDAGraph()
        with torch.cuda.graph(replay):
            outs = step(layers, True)
        assert deferred_flush.pending() == 0
    for _ in range(6):
        q.normal_(), k.normal_(), v.normal_()
        want = step(inline, False)  # (a call that does not defer joins every pending flush: first)
        if graph:
            replay.replay()
        else:
            outs = step(layers, True)
        start += 1  # eagerly, flushes of the step are still pending here
        for got, w in zip(outs, want, strict=True):
            torch.testing.assert_close(got, w, atol=1e-3, rtol=1e-3)
    deferred_flush.join_flushes()
    torch.cuda.synchronize()
    for c, w in zip(layers, inline, strict=True):
        assert c.seq_lens.tolist() == w.seq_lens.tolist() == lengths
        assert torch.equal(c.pages, w.pages)
        for slot, n in enumerate(lengths):  # the current tile's rows (a deferred step also leaves the completing
            # row of the tile before in the buffer, where an in-line one leaves what was there)
            assert torch.equal(c.exact_k[slot, :, 0, : n % 32], w.exact_k[slot, :, 0, : n % 32])
            assert torch.equal(c.exact_v[slot, :, 0, : n % 32], w.exact_v[slot, :, 0, : n % 32])
    if not graph:
        out = torch.empty_like(q)
        torch.ops.kvarn.attend_and_append(q, k, v, out, *layers[0].tensors(), slots, start, qsl, preset, 0.125, True,
                                          0, 1, False, True)  # fmt: skip
        assert deferred_flush.pending() == 1
        torch.ops.kvarn.decode_attention(q, k, v, *layers[0].tensors()[:4], slots, start + 1, preset, 0.125, 0)
        assert deferred_flush.pending() == 0, "a call on the cache joins the flush it deferred (launching it first)"
        torch.ops.kvarn.attend_and_append(q[:7], k[:7], v[:7], out[:7], *layers[0].tensors(), slots[:7], start[:7],
                                          qsl[:8], preset, 0.125, True, 0, 1, False, True)  # fmt: skip
        assert deferred_flush.pending() == 0, "fewer sequences than SMALLEST_BATCH quantize in line"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="side streams need a GPU")
def test_a_flush_launched_from_another_stream_waits_for_every_staging(monkeypatch):
    """Four layers deferring into one FLUSH launch, the first two called on a side stream whose STAGEs are slowed
    down (~50 ms of spinning ahead of each), the last two on the current stream, whose call launches the FLUSH: the
    launch must wait for the side stream's STAGEs too (``deferred_flush.defer`` makes the flush stream wait for each),
    or it quantizes rows not staged yet (or staged a step before: so the pages are compared after every step).
    Over steps in which one or two sequences complete a tile: the outputs, lengths and pages of in-line steps."""
    from kvarn_compile import deferred_flush
    from kvarn_compile.kernels import quantize_store as qs

    stage = qs.quantize_store

    def slowed_stage(*args, part=qs.WHOLE, snapshot=None):
        if part is qs.STAGE and torch.cuda.current_stream() == side:
            torch.cuda._sleep(10**8)
        stage(*args, part=part, snapshot=snapshot)

    monkeypatch.setattr(deferred_flush, "GROUP", 4)
    monkeypatch.setattr(qs, "quantize_store", slowed_stage)
    preset = "kvarn_k4v2_g32"
    layers, inline = ([KVarNCache.allocate(8, 256, 2, 64, preset=preset, device="cuda") for _ in range(4)]
                      for _ in range(2))  # fmt: skip
    # (torch hands out its streams from a pool of 32 a priority, round robin: a stream of the flush stream's priority
    # could be the flush stream itself, which orders FLUSH after every STAGE of its own and would hide a missing wait)
    side, main = torch.cuda.Stream(priority=-1), torch.cuda.current_stream()
    assert side != deferred_flush.flush_stream(layers[0].pages.device)
    slots = torch.arange(8, dtype=torch.int32, device="cuda")  # (deferred_flush.SMALLEST_BATCH)
    # sequence 2 completes a tile at step 2, 0 at step 3, 1 and 7 at step 4
    start = torch.tensor([29, 60, 94, 130, 161, 193, 200, 28], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(8, h, 64, device="cuda", dtype=torch.float16) for h in (4, 2, 2))
    qsl = torch.arange(9, dtype=torch.int32, device="cuda")

    def attend(cache, defer):
        out = torch.empty_like(q)
        torch.ops.kvarn.attend_and_append(q, k, v, out, *cache.tensors(), slots, start, qsl, preset, 0.125, True, 0,
                                          1, False, defer)  # fmt: skip
        return out

    for _ in range(6):
        q.normal_(), k.normal_(), v.normal_()
        want = [attend(c, False) for c in inline]
        side.wait_stream(main)
        with torch.cuda.stream(side):
            outs = [attend(c, True) for c in layers[:2]]
        assert deferred_flush.pending() == 2, "staged, not launched"
        outs += [attend(c, True) for c in layers[2:]]  # the fourth call launches the FLUSH from this stream
        main.wait_stream(side)
        deferred_flush.join_flushes()
        start += 1
        for got, w in zip(outs, want, strict=True):
            torch.testing.assert_close(got, w, atol=1e-3, rtol=1e-3)
        for c, w in zip(layers, inline, strict=True):
            assert torch.equal(c.pages, w.pages)
    for c, w in zip(layers, inline, strict=True):
        assert c.seq_lens.tolist() == w.seq_lens.tolist() == start.tolist()


@pytest.fixture
def fresh_flush_stream():
    """``deferred_flush.flush_stream`` picked anew (it is cached by device), and again after the test, as its warning."""
    from kvarn_compile import deferred_flush

    assert deferred_flush.pending() == 0
    deferred_flush.flush_stream.cache_clear()
    deferred_flush._warn_in_line.cache_clear()
    yield deferred_flush.flush_stream
    deferred_flush.flush_stream.cache_clear()
    deferred_flush._warn_in_line.cache_clear()


class StandInStream:
    """A stream whose handle is a name, waiting for nothing; two of one handle compare unequal (as a pool stream and
    an ExternalStream of its handle do in torch)."""

    def __init__(self, cuda_stream: str):
        self.cuda_stream = cuda_stream

    def wait_stream(self, other):
        pass


def test_the_flush_stream_is_not_the_callers_stream(monkeypatch, fresh_flush_stream):
    """torch hands out streams round robin from a pool: the flush stream skips the one the caller runs on, where the
    deferred flushes would run in line (a pool of three stand-in streams whose next is the caller's; a fresh object
    for the caller's own, as an ExternalStream of the same handle would be)."""
    handed = iter(map(StandInStream, ["caller's", "second", "third"]))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: StandInStream("caller's"))
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: next(handed))
    assert fresh_flush_stream(torch.device("cuda", 0)).cuda_stream == "second"


@pytest.mark.parametrize("pending", [None, "staged", "launched"])
def test_a_caller_on_the_flush_stream_gets_another_or_a_warning(monkeypatch, caplog, fresh_flush_stream, pending):
    """A caller that later runs on the stream picked as the flush stream (a capture's stream, say) would have its
    flushes in line: with no flush pending the deferral takes another stream; with one pending (staged, or launched
    on the old one) it goes on there, in line, and says so once."""
    from types import SimpleNamespace

    from kvarn_compile import deferred_flush

    device = torch.device("cuda", 0)
    current = StandInStream("caller's")
    handed = iter(map(StandInStream, ["second", "third"]))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: next(handed))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(deferred_flush, "_staged", [])
    monkeypatch.setattr(deferred_flush, "_launched", collections.deque())
    monkeypatch.setattr(deferred_flush, "_staged_captured", False)
    monkeypatch.setattr(deferred_flush, "GROUP", 8)  # (nothing launched here: the calls are stand-ins)
    call = SimpleNamespace(pages=SimpleNamespace(device=device), launch_key=lambda: ())
    if pending == "staged":
        deferred_flush.defer(call)
    current = fresh_flush_stream(device)  # the caller moves onto the flush stream ("second")
    if pending == "launched":
        deferred_flush._launched.append(deferred_flush._Launched(device, frozenset(), None, False))
    for _ in range(2):
        deferred_flush.defer(call)
    assert caplog.text.count("it runs in line there") == (pending is not None)
    assert fresh_flush_stream(device).cuda_stream == ("third" if pending is None else "second")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs torch's CUDA stream pool")
def test_the_flush_stream_skips_the_callers_stream_in_torchs_pool(fresh_flush_stream):
    """The same with torch's own pool, positioned so that its next stream is the one the caller runs on."""
    mine, n = torch.cuda.Stream(), 1
    while torch.cuda.Stream() != mine:  # the pool's size: the next stream is the one after mine
        n += 1
        assert n <= 1024, "torch's stream pool no longer hands its streams out round robin"
    for _ in range(n - 1):
        torch.cuda.Stream()
    with torch.cuda.stream(mine):  # (handles compared, as the deferral does)
        assert fresh_flush_stream(mine.device).cuda_stream != mine.cuda_stream


@pytest.mark.parametrize("captured, capturing", [(False, True), (True, False), (True, "another")])
@pytest.mark.parametrize("launched", [False, True])
def test_a_flush_deferred_across_a_capture_boundary_is_refused(monkeypatch, captured, capturing, launched):
    """A deferred flush staged or launched outside a CUDA-graph capture and launched or joined inside one (a forward
    that raised before its last layer joined, then a capture), the other way round, or in another capture than its
    own (one that raised: the flush stream, which joins a capture with each deferred call, is in none) cannot be
    ordered by CUDA: a clear error, not a launch or join that orders nothing, and the staged calls dropped with it."""
    from types import SimpleNamespace

    from kvarn_compile import deferred_flush

    device = torch.device("cuda", 0)
    monkeypatch.setattr(deferred_flush, "_launched", deferred_flush.collections.deque())
    monkeypatch.setattr(deferred_flush, "_staged", [])
    if launched:
        deferred_flush._launched.append(deferred_flush._Launched(device, frozenset(), None, captured))
    else:  # (never launched: the check comes first)
        deferred_flush._staged.append(SimpleNamespace(pages=SimpleNamespace(device=device)))
        monkeypatch.setattr(deferred_flush, "_staged_captured", captured)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: bool(capturing))
    monkeypatch.setattr(deferred_flush, "_flush_stream_capturing", lambda device: False)
    message = "capture that has ended" if capturing == "another" else "is joined (in|out)side"
    with pytest.raises(RuntimeError, match=message):
        deferred_flush.join_flushes()
    assert deferred_flush.pending() == 0
