"""The KVarN cache ops, registered with torch.library as ``torch.ops.kvarn.*``.

    kvarn::append            store new tokens: stage them, quantize every tile they complete
    kvarn::decode_attention  one new query token per sequence: q [B, Hq, Dk] -> [B, Hq, Dv]
    kvarn::chunk_attention   any number per sequence (prefill, chunked prefill): q [T, Hq, Dk] -> [T, Hq, Dv]
    kvarn::attend_and_append chunk_attention into a given ``out``, then append: one call per layer and step
                             (validated once; on CUDA the fresh k/v are rotated once for both, and a decode
                             step's tile quantizations may run on a side stream: ``deferred_flush``)

Contract (``paged`` has the shape legend): attention runs on the cache as it was before the call's
tokens plus their fresh k/v, then ``append`` stores them. CPU runs the PyTorch reference; CUDA the
Triton kernels (Hadamard rotations, fused kernels). On CUDA nothing here reads a device value on
the host, so every op can be captured in a CUDA graph; a slot out of range or positions past a slot's
capacity stop the kernels there (a Python error on CPU), and nothing is written outside a slot's pages. That
a call continues what its slots hold is checked by the helpers ``store`` and ``attention`` on a CPU cache
(``check_history``), and CPU reads check their page-table entries; on CUDA neither is checked (a wrong history
or page entry reads wrong data).
"""

from __future__ import annotations

import math

import torch

from . import deferred_flush
from .kernels.rotate import rotated_many
from .paged import SUPPORTED_DTYPES, Batch, KVarNCache, append_reference, attention_reference, history_gaps
from .presets import Preset, get_preset
from .reference import hadamard


# ----------------------------------------------------------------------------------------------------
# Validation (host metadata only: shapes, dtypes, devices; values only for CPU tensors)
# ----------------------------------------------------------------------------------------------------
def expect(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def check_one_device(op: str, *args) -> None:
    """What an op's fake implementation checks of a call: the dispatcher sends every call with a tensor on the meta
    device to it, not to the op and its checks, so a real call with one meta tensor among its inputs (a model
    partly on the meta device) would do nothing and say nothing."""
    devices = sorted({str(a.device) for a in args if isinstance(a, torch.Tensor)})
    expect(len(devices) <= 1, f"kvarn::{op} takes every tensor on one device, got tensors on {devices}")


def _check_cache(preset: Preset, pages, exact_k, exact_v, page_table, seq_lens=None) -> None:
    """The cache tensors' shapes, dtypes and devices (``seq_lens`` where the op takes it)."""
    expect(exact_k.dim() == 5 and exact_v.dim() == 5,
            f"exact_k/exact_v must be [slots, kv_heads, 1 or 2, tile, head_dim], got {tuple(exact_k.shape)} "
            f"and {tuple(exact_v.shape)}")  # fmt: skip
    slots, hkv, e, g, dk = exact_k.shape
    expect(
        tuple(exact_v.shape[:4]) == (slots, hkv, e, g),
        f"exact_v {tuple(exact_v.shape)} does not match exact_k {tuple(exact_k.shape)}",
    )
    expect(e in (1, 2), f"exact_k dim 2 must be 1 (current tile) or 2 (also the first tile), got {e}")
    expect(g == preset.tile_size, f"{preset.name} stores tiles of {preset.tile_size} tokens, the cache holds {g}")
    if exact_k.dtype not in SUPPORTED_DTYPES or exact_v.dtype != exact_k.dtype:
        raise TypeError(f"exact_k/exact_v must both be float16 or bfloat16, got {exact_k.dtype}/{exact_v.dtype}")
    layout = preset.layout(dk, exact_v.shape[-1])
    expect(pages.dtype == torch.uint8 and pages.dim() == 3 and tuple(pages.shape[1:]) == (hkv, layout.nbytes),
            f"pages must be uint8 [num_pages, {hkv}, {layout.nbytes}] for {preset.name} with head dims "
            f"{dk}/{exact_v.shape[-1]}, got {pages.dtype} {tuple(pages.shape)}")  # fmt: skip
    expect(
        page_table.dtype == torch.int32 and page_table.dim() == 2 and page_table.shape[0] == slots,
        f"page_table must be int32 [{slots}, max_tiles], got {page_table.dtype} {tuple(page_table.shape)}",
    )
    tensors = [("pages", pages), ("exact_k", exact_k), ("exact_v", exact_v), ("page_table", page_table)]
    if seq_lens is not None:
        expect(seq_lens.dtype == torch.int32 and tuple(seq_lens.shape) == (slots,),
               f"seq_lens must be int32 [{slots}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")  # fmt: skip
        tensors.append(("seq_lens", seq_lens))
    for name, t in tensors:
        expect(t.is_contiguous(), f"{name} must be contiguous")
        expect(t.device == exact_k.device, f"{name} is on {t.device} but exact_k is on {exact_k.device}")


def check_batch(slots, start_pos, query_start_loc, num_tokens: int, max_query_len: int, num_slots: int,
                 capacity: int | None, start_name: str = "start_pos", device: torch.device | None = None) -> None:  # fmt: skip
    """Shapes, dtypes and (given ``device``, the cache's) the device of a call's batch (``paged.Batch``); on
    CPU also its values: slots in [0, num_slots), ``start_pos`` + new tokens within ``capacity`` tokens per
    slot (unless None)."""
    for name, t in (("slots", slots), (start_name, start_pos), ("query_start_loc", query_start_loc)):
        expect(t.dtype == torch.int32 and t.dim() == 1, f"{name} must be a 1-D int32 tensor, got {t.dtype} "
                f"{tuple(t.shape)}")  # fmt: skip
        expect(device is None or t.device == device, f"{name} is on {t.device} but the cache is on {device}")
    expect(start_pos.numel() == slots.numel() and query_start_loc.numel() == slots.numel() + 1,
            f"expected slots [B], {start_name} [B], query_start_loc [B+1], got {slots.numel()}, {start_pos.numel()}, "
            f"{query_start_loc.numel()}")  # fmt: skip
    # host integers, so on every device (the kernels' grids cover max_query_len tokens per sequence; with 0 the
    # launchers return before any kernel could check)
    expect(max_query_len > 0 or num_tokens == 0, f"{num_tokens} tokens but max_query_len={max_query_len}")
    if slots.device.type == "cpu":  # values are on the host: check them all, precisely
        new = query_start_loc[1:] - query_start_loc[:-1]
        end = start_pos.long() + new  # (in int32 an end past 2**31 - 1 would wrap and pass)
        expect(
            bool((slots >= 0).all() and (slots < num_slots).all()),
            f"slots must be in [0, {num_slots}), got {slots.tolist()}",
        )
        expect(
            bool((new >= 0).all()) and int(query_start_loc[0]) == 0 and int(query_start_loc[-1]) == num_tokens,
            f"query_start_loc must rise from 0 to {num_tokens} tokens, got {query_start_loc.tolist()}",
        )
        expect(bool((new <= max_query_len).all()), f"a sequence has more than max_query_len={max_query_len} tokens")
        expect(bool((start_pos >= 0).all()), f"{start_name} must be >= 0, got {start_pos.tolist()}")
        expect(
            capacity is None or bool((end <= capacity).all()),
            f"positions beyond the cache capacity of {capacity} tokens per slot: ends {end.tolist()}",
        )
    # On CUDA the values stay on the device (no host sync): every kernel checks its sequences' slots, positions
    # (the latent attention: kv_lens) and token counts (tile_math.check_sequence stops it, naming them) and
    # masks every write past the slot's pages.


def check_history(cache: KVarNCache, batch: Batch, num_tokens: int, writes: bool) -> None:
    """For the helpers below: ``check_batch`` of ``batch`` (``num_tokens`` rows) against ``cache``, then, on a CPU
    cache (values on the host), that each sequence with new tokens finds the history it reads in its slot
    (``paged.history_gaps``): a start at a tile's first row is taken (a new sequence, or one whose earlier tiles'
    pages come from elsewhere: a prefix cache). ``writes``: the call appends, so its sequences with new tokens must
    be in distinct slots.

    Not in the ops: their callers may share one ``seq_lens`` among the caches of every layer (vLLM: a layer then
    sees the length the layer before it wrote) and send padding rows to one scratch slot, many at once."""
    slots, start_pos, query_start_loc = batch[:3]
    check_batch(slots, start_pos, query_start_loc, num_tokens, batch.max_query_len,
                *_slots_and_capacity(cache.exact_k, cache.page_table), device=cache.exact_k.device)  # fmt: skip
    if slots.device.type != "cpu" or cache.seq_lens.device.type != "cpu":
        return
    g = cache.preset.tile_size
    rows = ((query_start_loc[1:] - query_start_loc[:-1]) > 0).nonzero()[:, 0]
    slot, start = slots[rows].long(), start_pos[rows]
    held = cache.seq_lens[slot]
    inside, reused = history_gaps(cache, start, held)
    inside_why = (
        "a start inside a tile continues the tile the slot holds (it must hold {p} to {last} tokens), "
        "else it starts a tile (a multiple of {g})"
    )
    reused_why = "the window ({window}) reaches a tile whose page a later tile took (a ring of pages)"
    for bad, why in ((inside, inside_why), (reused, reused_why)):
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            p = int(start[i])
            raise ValueError(f"sequence {int(rows[i])} starts at position {p} in slot {int(slot[i])}, which holds "
                             f"{int(held[i])} tokens: " + why.format(p=p, last=(p // g + 1) * g - 1, g=g,
                                                                     window=cache.window))  # fmt: skip
    expect(not writes or slot.unique().numel() == slot.numel(),
           f"the call appends to slots {slot.tolist()}: a slot takes new tokens from one sequence of a call")  # fmt: skip


def _slots_and_capacity(exact_k, page_table) -> tuple[int, int]:
    """Slots of a K/V cache, and tokens one slot holds."""
    return exact_k.shape[0], page_table.shape[1] * exact_k.shape[3]


def _check_qkv(q, k, v, exact_k, exact_v, rotated: bool = False) -> None:
    """``rotated``: q, k, v come rotated, q possibly in float32 (vLLM's compiled graph rotates them)."""
    hkv, dk, dv = exact_k.shape[1], exact_k.shape[-1], exact_v.shape[-1]
    if q is not None:
        expect(
            q.dim() == 3 and q.shape[-1] == dk and q.shape[1] % hkv == 0,
            f"q must be [tokens, q_heads (a multiple of {hkv}), {dk}], got {tuple(q.shape)}",
        )
        expect(q.shape[0] == k.shape[0], f"q has {q.shape[0]} tokens but k has {k.shape[0]}")
    expect(k.dim() == 3 and tuple(k.shape[1:]) == (hkv, dk), f"k must be [tokens, {hkv}, {dk}], got {tuple(k.shape)}")
    expect(
        v.dim() == 3 and tuple(v.shape) == (k.shape[0], hkv, dv),
        f"v must be [{k.shape[0]}, {hkv}, {dv}], got {tuple(v.shape)}",
    )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t is not None:
            check_input(name, t, exact_k, float32_ok=rotated and name == "q")


def check_input(name: str, t: torch.Tensor, cache: torch.Tensor, float32_ok: bool = False) -> None:
    """An input of a call: in the cache's dtype (or float32 where ``float32_ok``), on its device, with a
    contiguous last dim."""
    if t.dtype != cache.dtype and not (float32_ok and t.dtype == torch.float32):
        raise TypeError(f"{name} is {t.dtype} but the cache holds {cache.dtype}")
    expect(t.device == cache.device, f"{name} is on {t.device} but the cache is on {cache.device}")
    expect(t.stride(-1) == 1, f"{name} must have a contiguous last dim")


# ----------------------------------------------------------------------------------------------------
# kvarn::append
# ----------------------------------------------------------------------------------------------------
@torch.library.custom_op("kvarn::append", mutates_args=("pages", "exact_k", "exact_v", "seq_lens"))
def append(
    k: torch.Tensor,
    v: torch.Tensor,
    pages: torch.Tensor,
    exact_k: torch.Tensor,
    exact_v: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    slots: torch.Tensor,
    start_pos: torch.Tensor,
    query_start_loc: torch.Tensor,
    preset: str,
    max_query_len: int,
) -> None:
    """Store k [T, Hkv, Dk], v [T, Hkv, Dv] (not rotated) at each sequence's start_pos."""
    _append(append_reference, k, v, pages, exact_k, exact_v, page_table, seq_lens, slots, start_pos,
            query_start_loc, preset, max_query_len)  # fmt: skip


@append.register_kernel("cuda")
def _(*args) -> None:
    _append(triton_append, *args)


def _append(run, k, v, pages, exact_k, exact_v, page_table, seq_lens, slots, start_pos, query_start_loc, preset,
            max_query_len) -> None:  # fmt: skip
    """Validate the arguments of kvarn::append, then store with ``run`` (the reference or the kernels)."""
    p = get_preset(preset)
    _check_cache(p, pages, exact_k, exact_v, page_table, seq_lens)
    _check_qkv(None, k, v, exact_k, exact_v)
    check_batch(slots, start_pos, query_start_loc, k.shape[0], max_query_len, *_slots_and_capacity(exact_k, page_table),
                device=exact_k.device)  # fmt: skip
    run(k, v, pages, exact_k, exact_v, page_table, seq_lens, slots, start_pos, query_start_loc, p, max_query_len)


def triton_append(k, v, pages, exact_k, exact_v, page_table, seq_lens, slots, start_pos, query_start_loc,
                  preset: Preset, max_query_len: int, rotated_kv: bool = False,
                  defer_flush: bool = False) -> None:  # fmt: skip
    """The CUDA path of kvarn::append, unvalidated: rotate (unless ``rotated_kv``), then the fused
    quantize-and-store kernel; ``defer_flush`` (single-token calls of at least ``deferred_flush.SMALLEST_BATCH``
    sequences, else ignored): the quantization of the tiles the rows complete on the flush stream
    (``deferred_flush``). A call that does not defer joins every pending flush."""
    from .kernels.quantize_store import STAGE, Flush, quantize_store, snapshot_for

    deferred_flush.join_cache(pages)
    if not rotated_kv:
        k, v = rotated_many([k, v], [k.dtype, v.dtype])
    cache = (pages, exact_k, exact_v, page_table, seq_lens)
    batch = (slots, start_pos, query_start_loc)
    if defer_flush and max_query_len == 1 and slots.numel() >= deferred_flush.SMALLEST_BATCH:
        snapshot = snapshot_for(slots)  # what FLUSH reads of the batch: the caller may rewrite it before FLUSH runs
        quantize_store(k, v, *cache, *batch, preset, 1, part=STAGE, snapshot=snapshot)
        deferred_flush.defer(Flush(pages, exact_k, exact_v, page_table, snapshot, preset))
        return
    quantize_store(k, v, *cache, *batch, preset, max_query_len)
    deferred_flush.join_flushes()


@append.register_fake
def _(*args, **kwargs) -> None:
    check_one_device("append", *args, *kwargs.values())


# ----------------------------------------------------------------------------------------------------
# kvarn::chunk_attention and kvarn::decode_attention
# ----------------------------------------------------------------------------------------------------
def _check_attention(q, k, v, pages, exact_k, exact_v, page_table, slots, start_pos, query_start_loc, preset,
                     scale, window, max_query_len, rotated: bool = False, seq_lens=None) -> Preset:  # fmt: skip
    p = get_preset(preset)
    _check_cache(p, pages, exact_k, exact_v, page_table, seq_lens)
    _check_qkv(q, k, v, exact_k, exact_v, rotated)
    check_batch(slots, start_pos, query_start_loc, q.shape[0], max_query_len, *_slots_and_capacity(exact_k, page_table),
                device=exact_k.device)  # fmt: skip
    expect(window >= 0, f"window must be >= 0 (0: no sliding window), got {window}")
    expect(math.isfinite(scale), f"the softmax scale must be a finite number, got {scale}")
    return p


def _attention(q, k, v, pages, exact_k, exact_v, page_table, slots, start_pos, query_start_loc, preset, scale,
               causal, window, max_query_len):  # fmt: skip
    p = _check_attention(q, k, v, pages, exact_k, exact_v, page_table, slots, start_pos, query_start_loc, preset,
                         scale, window, max_query_len)  # fmt: skip
    run = triton_attention if q.is_cuda else attention_reference
    return run(q, k, v, pages, exact_k, exact_v, page_table, slots, start_pos, query_start_loc, p, scale, causal,
               window, max_query_len)  # fmt: skip


def triton_attention(q, k, v, pages, exact_k, exact_v, page_table, slots, start_pos, query_start_loc,
                     preset: Preset, scale: float, causal: bool, window: int, max_query_len: int,
                     num_splits: int | None = None, out: torch.Tensor | None = None,
                     rotated: bool = False, tile_parts: int | None = None,
                     exact_parts: int | None = None) -> torch.Tensor:  # fmt: skip
    """The CUDA path of the attention ops, unvalidated: rotate in, attention kernels, merge, rotate back.
    The result goes to ``out`` ([T, Hq, Dv], last dim contiguous) when given; ``rotated``: q, k and v come
    rotated (``rotated_many``: q to fp32, k and v in their dtype). ``num_splits``, ``tile_parts``, ``exact_parts``:
    as ``paged_attention.paged_partials`` (None: chosen there).

    ``paged_attention`` rotates q, k and v (so that a decode step's attention kernel may start during that
    launch); the output is rotated back by the combine, or in a small decode step by each program for its own
    partial before the exact split merges them (``paged_attention``'s module docstring). q is
    rotated by its own launch, not in the attention kernels, except in the small steps whose Gluon programs leave
    half the GPU free (``decode_attention.leaves_half_the_slots``), where each kernel rotates it by butterflies in
    registers and the step has no rotation launch (not so in ``attend_and_append``, whose one launch rotates k and v
    for the append too). NOTE (H200, benchmarks/NOTES.md) elsewhere the in-kernel q rotation made every program
    slower, in the Triton kernel twice (B8/32K 0.198 -> 0.350 ms, v4 and v12) and in the Gluon one (one mma per key
    field: the op at B8/32K 0.0867 -> 0.0985 ms, B1/2K 0.0123 -> 0.0165; benchmarks/results/h200-s25/rotq,
    tried-rotq.patch).
    """
    from .kernels.paged_attention import paged_attention

    deferred_flush.join_cache(pages)
    return paged_attention(q.float() if rotated else q, k, v, pages, exact_k, exact_v, page_table, slots, start_pos,
                           query_start_loc, preset, scale, causal, window, max_query_len, out,
                           num_splits=num_splits, rotated=rotated, tile_parts=tile_parts,
                           exact_parts=exact_parts)  # fmt: skip


def prepare_constants(head_dim_k: int, head_dim_v: int, dtype: torch.dtype, device: torch.device) -> None:
    """Create the cached rotation blocks and, on a GPU, the decode merge's counts
    (``paged_attention.merge_counts``) the CUDA path uses, now, outside any CUDA graph: made first during a
    CUDA-graph warm-up they would live in the graph's memory pool (Inductor's CUDA graph trees refuse that). Also the
    deferred flushes' stream, whose first request creates torch's pool of streams (CUDA calls best made outside a
    capture)."""
    for d in {head_dim_k, head_dim_v}:
        hadamard(d, torch.float32, device)
    device = torch.device(device)
    if device.type == "cuda":
        from .kernels.paged_attention import merge_counts

        merge_counts(device)
        deferred_flush.flush_stream(device)


@torch.library.custom_op("kvarn::chunk_attention", mutates_args=())
def chunk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pages: torch.Tensor,
    exact_k: torch.Tensor,
    exact_v: torch.Tensor,
    page_table: torch.Tensor,
    slots: torch.Tensor,
    start_pos: torch.Tensor,
    query_start_loc: torch.Tensor,
    preset: str,
    scale: float,
    causal: bool,
    window: int,
    max_query_len: int,
) -> torch.Tensor:
    """q [T, Hq, Dk] with fresh k [T, Hkv, Dk], v [T, Hkv, Dv] over the cache -> [T, Hq, Dv]."""
    return _attention(q, k, v, pages, exact_k, exact_v, page_table, slots, start_pos, query_start_loc, preset,
                      scale, causal, window, max_query_len)  # fmt: skip


@chunk_attention.register_fake
def _(q, k, v, pages, exact_k, exact_v, *args) -> torch.Tensor:
    check_one_device("chunk_attention", q, k, v, pages, exact_k, exact_v, *args)
    return q.new_empty(q.shape[0], q.shape[1], exact_v.shape[-1])


_TOKEN_ROWS: dict[torch.device, list[torch.Tensor]] = {}  # arange(n) per device, for one_token_each


def one_token_each(batch: int, device: torch.device) -> torch.Tensor:
    """query_start_loc of ``batch`` sequences with one token each (sequence b's at row b): arange(batch + 1), as a
    view of a tensor made once per device, so a call launches nothing for it. NOTE (H200, benchmarks/NOTES.md,
    session 24): the arange was the ~1 us between the op and the op without its checks in CUDA-graph replays.
    A longer one is made when a batch outgrows it (never under CUDA-graph capture, which would fill it only when
    replayed); the shorter ones stay alive, since a captured graph may read one."""
    made = _TOKEN_ROWS.setdefault(device, [])
    if not made or made[-1].numel() <= batch:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return torch.arange(batch + 1, dtype=torch.int32, device=device)
        length = max(batch + 1, 2 * made[-1].numel() if made else 4096)
        made.append(torch.arange(length, dtype=torch.int32, device=device))
    return made[-1][: batch + 1]


@torch.library.custom_op("kvarn::decode_attention", mutates_args=())
def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pages: torch.Tensor,
    exact_k: torch.Tensor,
    exact_v: torch.Tensor,
    page_table: torch.Tensor,
    slots: torch.Tensor,
    start_pos: torch.Tensor,
    preset: str,
    scale: float,
    window: int,
) -> torch.Tensor:
    """One new token per sequence: q [B, Hq, Dk], k [B, Hkv, Dk], v [B, Hkv, Dv] -> [B, Hq, Dv]."""
    query_start_loc = one_token_each(q.shape[0], q.device)
    return _attention(q, k, v, pages, exact_k, exact_v, page_table, slots, start_pos, query_start_loc, preset,
                      scale, True, window, 1)  # fmt: skip


@decode_attention.register_fake
def _(q, k, v, pages, exact_k, exact_v, *args) -> torch.Tensor:
    check_one_device("decode_attention", q, k, v, pages, exact_k, exact_v, *args)
    return q.new_empty(q.shape[0], q.shape[1], exact_v.shape[-1])


# ----------------------------------------------------------------------------------------------------
# kvarn::attend_and_append
# ----------------------------------------------------------------------------------------------------
@torch.library.custom_op("kvarn::attend_and_append", mutates_args=("out", "pages", "exact_k", "exact_v", "seq_lens"))
def attend_and_append(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    pages: torch.Tensor,
    exact_k: torch.Tensor,
    exact_v: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    slots: torch.Tensor,
    start_pos: torch.Tensor,
    query_start_loc: torch.Tensor,
    preset: str,
    scale: float,
    causal: bool,
    window: int,
    max_query_len: int,
    rotated: bool = False,
    defer_flush: bool = False,
) -> None:
    """``out`` [T, Hq, Dv] = chunk_attention(q, k, v, ...); then append(k, v, ...): what one attention layer
    does in a serving step. ``rotated``: q, k and v come rotated (q may be float32), as vLLM's compiled
    graph gives them with the ``kvarn_compile.vllm_pass`` hook; the output is not rotated either way.
    ``defer_flush`` (CUDA, calls of one token a sequence and at least ``deferred_flush.SMALLEST_BATCH`` sequences):
    the tiles the tokens complete are quantized on a side stream, one launch for the calls of several layers, joined
    later (``deferred_flush``: a CUDA-graph capture must reach a call that does not defer, or
    ``deferred_flush.join_flushes``, before it ends); the CPU quantizes in line, with the same result. NOTE (vLLM
    0.23 on the H200, benchmarks/results/h200-vllm-steps): the two ops apart launched ~34 kernels per layer and
    decode step, most of them tiny (two validations, k and v rotated twice, a copy into vLLM's output)."""
    p = _check_attention(q, k, v, pages, exact_k, exact_v, page_table, slots, start_pos, query_start_loc, preset,
                         scale, window, max_query_len, rotated, seq_lens)  # fmt: skip
    expect(out.shape == (q.shape[0], q.shape[1], exact_v.shape[-1]) and out.dtype == k.dtype
            and out.device == q.device and out.stride(-1) == 1,
            f"out must be {k.dtype} [{q.shape[0]}, {q.shape[1]}, {exact_v.shape[-1]}] with a contiguous last dim, "
            f"got {out.dtype} {tuple(out.shape)}")  # fmt: skip
    storage = out.untyped_storage().data_ptr()  # (the kernels write out before the append reads k and v)
    expect(all(t.untyped_storage().data_ptr() != storage for t in (q, k, v)), "out must not share memory with q, k, v")
    args = (pages, exact_k, exact_v, page_table)
    batch = (slots, start_pos, query_start_loc)
    if not q.is_cuda:
        out.copy_(attention_reference(q, k, v, *args, *batch, p, scale, causal, window, max_query_len, rotated))
        append_reference(k, v, *args, seq_lens, *batch, p, max_query_len, rotated)
        return
    triton_attend_and_append(q, k, v, out, *args, seq_lens, *batch, p, scale, causal, window, max_query_len,
                             rotated, defer_flush)  # fmt: skip


def triton_attend_and_append(q, k, v, out, pages, exact_k, exact_v, page_table, seq_lens, slots, start_pos,
                             query_start_loc, preset: Preset, scale: float, causal: bool, window: int,
                             max_query_len: int, rotated: bool = False, defer_flush: bool = False) -> None:  # fmt: skip
    """The CUDA path of kvarn::attend_and_append, unvalidated: q, k and v rotated in one launch, k and v once
    for both kernels (unless they come ``rotated``, with q)."""
    if not rotated:
        q, k, v = rotated_many([q, k, v], [torch.float32, k.dtype, v.dtype])
    args = (pages, exact_k, exact_v, page_table)
    batch = (slots, start_pos, query_start_loc)
    triton_attention(q, k, v, *args, *batch, preset, scale, causal, window, max_query_len, out=out, rotated=True)
    triton_append(k, v, *args, seq_lens, *batch, preset, max_query_len, rotated_kv=True, defer_flush=defer_flush)


@attend_and_append.register_fake
def _(*args, **kwargs) -> None:
    check_one_device("attend_and_append", *args, *kwargs.values())


# ----------------------------------------------------------------------------------------------------
# Convenience wrappers over a KVarNCache and a Batch
# ----------------------------------------------------------------------------------------------------
def store(cache: KVarNCache, k: torch.Tensor, v: torch.Tensor, batch: Batch) -> None:
    """Append k [T, Hkv, Dk], v [T, Hkv, Dv] to ``cache`` at the positions ``batch`` gives."""
    check_history(cache, batch, k.shape[0], writes=True)
    torch.ops.kvarn.append(k, v, *cache.tensors(), *batch[:3], cache.preset.name, batch.max_query_len)


def attention(
    cache: KVarNCache,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: Batch,
    scale: float | None = None,
    causal: bool = True,
    window: int = 0,
) -> torch.Tensor:
    """Attention of q [T, Hq, Dk] over ``cache`` plus the fresh k, v (call ``store`` afterwards)."""
    cache.check_window(window)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    pages, exact_k, exact_v, page_table, _ = cache.tensors()
    # the decode op rebuilds query_start_loc (one token per sequence): the batch's own is checked here first; and
    # the ops take no lengths (a history is [0, start_pos) of a slot): the cache's are checked here
    check_history(cache, batch, q.shape[0], writes=False)
    if batch.max_query_len == 1 and causal and q.shape[0] == batch.slots.numel():
        return torch.ops.kvarn.decode_attention(q, k, v, pages, exact_k, exact_v, page_table, batch.slots,
                                                batch.start_pos, cache.preset.name, scale, window)  # fmt: skip
    return torch.ops.kvarn.chunk_attention(q, k, v, pages, exact_k, exact_v, page_table, *batch[:3], cache.preset.name,
                                           scale, causal, window, batch.max_query_len)  # fmt: skip
