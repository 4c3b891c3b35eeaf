"""Decode attention on the GPU: KVarN (kvarn::decode_attention) vs the fastest fp16 attention there.

For batch x context (32 query / 8 KV heads, head_dim 128, one new token per sequence), times with CUDA
graphs (triton.testing.do_bench_cudagraph, median):
  - fp16 torch SDPA with the flash and cuDNN backends (GQA through enable_gqa), and vLLM's FlashAttention 3
    over a paged cache of 16-token blocks, as vLLM's decode calls it (``flash_attn_varlen_func`` with a block
    table, fa_version=3), where vLLM is installed;
  - kvarn: the whole op (validation, rotations, attention kernels, merge) and the attention kernels with their
    merge on rotated inputs (``paged_attention``; before session 27 the kernel column left the combine out);
  - effective bandwidth: the bytes each must read / its time;
  - the append cost of a decode step, without and with a tile flush (every sequence completes a tile).
Writes results.json, results.md and speedup.png to --out.

    python benchmarks/attention.py --out /tmp/bench [--preset kvarn_k4v2_g128] [--quick]
    python benchmarks/attention.py --out /tmp/bench --append-only   # the append / flush columns alone
    python benchmarks/attention.py --out /tmp/bench --sweep-exact   # the exact part's programs, past tile boundaries
    python benchmarks/attention.py --out /tmp/bench --sweep-halves --table 32768   # splits of tiles in halves
    python benchmarks/attention.py --out /tmp/bench --no-cold-l2   # the same caches every call (warm L2), as the
                                                                   # tables before session 53 were timed
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import logging
import pathlib
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
from result_files import write_results
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm import tqdm

from kvarn_compile import Batch, KVarNCache, get_preset, store
from kvarn_compile.kernels.paged_attention import paged_attention
from kvarn_compile.kernels.rotate import rotated_to
from kvarn_compile.ops import triton_attention
from kvarn_compile.paged import attention_reference

log = logging.getLogger("kvarn.bench")
HQ, HKV, D = 32, 8, 128
BATCHES = (1, 8, 32, 128)
CONTEXTS = (2048, 8192, 32768, 131072)
MAX_TOKENS = 4 * 2**20  # batch x context cap: 17 GB of fp16 KV
BASELINES = ("flash_ms", "cudnn_ms", "fa3_ms")
MOST_COPIES = 128  # of a timed call's inputs, for --cold-l2 (l2_copies): 3x the L2 down to 1.2 MB a copy


FA3_BLOCK = 16  # vLLM's default block size


@functools.cache
def fa3():
    """vLLM's FlashAttention ``flash_attn_varlen_func``, or None (logged once) without vLLM."""
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except ImportError as e:
        log.warning("no FA3 baseline (vLLM's flash attention does not import: %s)", e)
        return None
    return flash_attn_varlen_func


def bench(fn) -> float:
    """Median milliseconds of fn replayed in a CUDA graph."""
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def l2_copies(nbytes: int, cold: bool) -> int:
    """How many copies of a timed call's inputs (``nbytes`` read a call) the timing rotates through (``rotating``).
    Without ``cold``, one: the graph replays the same call back to back, and a working set smaller than the GPU's L2
    (an H100's 50 MB: kvarn's at B1/32K or B8/2K, where fp16's is not) is read from L2 after the first
    call. With ``cold``, copies that together hold 3x the L2 (at most ``MOST_COPIES``): each call reads from HBM, as
    a model's decode step does (it reads a layer's cache once, the other layers' caches and weights in between).
    (Each copy is a whole cache: with ``--table``, as wide as the table, more than it reads.)"""
    if not cold:
        return 1
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    return max(1, min(MOST_COPIES, -(-3 * l2 // nbytes)))


def rotating(calls: list[Callable]) -> Callable:
    """A call that runs the next of ``calls`` each time, round and round: do_bench_cudagraph captures its calls
    unrolled into one graph, so each replayed call reads another copy of the inputs than the calls beside it (copy
    i again len(calls) calls later)."""
    turn = itertools.cycle(calls)
    return lambda: next(turn)()


def filled_cache(batch: int, context: int, preset, device="cuda", head_dim: int = D,
                 capacity: int | None = None) -> KVarNCache:  # fmt: skip
    """A cache holding ``context`` tokens per slot: real quantized tiles (a pool of 64 made by the append
    kernel, repeated over all pages) and a random current tile. Its page tables are ``capacity`` tokens wide, by
    default the tiles up to the one a step at position ``context`` writes: the same for every context of a tile.

    Why it matters: the decode launch splits by the page table's width (no host sync on the lengths), so a table one
    tile wider changes a batch-1 step's launch. NOTE (H100, benchmarks/results/gpu-s44/h100-timeline): with capacity
    context + G, as here until session 44, a context past a tile boundary got an 18-tile table at 2K (17 whole-tile
    splits: no half tiles, a rotation launch) and its step took 2.5 us more, which sessions 42-43 took for the cost
    of the current tile's rows."""
    g = preset.tile_size
    capacity = (context // g + 1) * g if capacity is None else capacity
    if capacity <= context:
        raise ValueError(f"capacity {capacity} holds no room for a step at position {context}")
    cache = KVarNCache.allocate(batch, capacity, HKV, head_dim, preset=preset, device=device)
    pool = KVarNCache.allocate(1, 64 * g, HKV, head_dim, preset=preset, device=device)
    k = torch.randn(64 * g, HKV, head_dim, device=device, dtype=torch.float16)
    k[..., 5] *= 10
    store(pool, k, torch.randn_like(k), Batch.from_lengths([0], [0], [64 * g], device=device))
    reps = -(-cache.pages.shape[0] // 64)
    cache.pages.copy_(pool.pages.repeat(reps, 1, 1)[: cache.pages.shape[0]])
    cache.exact_k.normal_()
    cache.exact_v.normal_()
    cache.seq_lens.fill_(context)
    return cache


def kvarn_bytes(batch: int, context: int, preset, head_dim: int = D) -> int:
    """The bytes a decode step at position ``context`` must read of a ``filled_cache`` (every complete tile
    quantized, the first too): the complete tiles' records, the current tile's fp16 rows and the new token's."""
    g = preset.tile_size
    full, rest = divmod(context, g)
    return batch * HKV * (full * preset.bytes_per_tile(head_dim) + (rest + 1) * head_dim * 2 * 2)


def check_against_reference(preset) -> float:
    """Largest |kernel - reference| of a small decode step (the benchmark refuses to time a wrong kernel)."""
    cache = filled_cache(2, 1000, preset)
    q, k, v = (torch.randn(2, h, D, device="cuda", dtype=torch.float16) for h in (HQ, HKV, HKV))
    slots = torch.arange(2, dtype=torch.int32, device="cuda")
    start = torch.full((2,), 1000, dtype=torch.int32, device="cuda")
    got = torch.ops.kvarn.decode_attention(q, k, v, *cache.tensors()[:4], slots, start, preset.name, D**-0.5, 0)
    batch = Batch.decode(slots.cpu(), start.cpu())
    want = attention_reference(q.cpu(), k.cpu(), v.cpu(), *(t.cpu() for t in cache.tensors()[:4]), *batch[:3],
                               preset, D**-0.5)  # fmt: skip
    return (got.cpu().float() - want.float()).abs().max().item()


def fp16_baselines(q: torch.Tensor, context: int, fp16_bytes: int, cold: bool) -> dict:
    """Times of torch SDPA's flash and cuDNN backends (and FA3 where vLLM is installed) over an fp16 cache
    of ``context`` + 1 tokens (``cold``: ``l2_copies``)."""
    batch, copies = q.shape[0], l2_copies(fp16_bytes, cold)
    caches = [torch.randn(2, batch, HKV, context + 1, D, device="cuda", dtype=torch.float16) for _ in range(copies)]
    q4 = q[:, :, None, :]
    row = {"fp16_copies": copies}
    sdpa = rotating([functools.partial(F.scaled_dot_product_attention, q4, kf, vf, enable_gqa=True)
                     for kf, vf in caches])  # fmt: skip
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                row[f"{name}_ms"] = bench(sdpa)
            row[f"{name}_tbs"] = fp16_bytes / row[f"{name}_ms"] / 1e9
        except RuntimeError as e:  # a backend that refuses this shape
            log.warning("fp16 %s: batch %d context %d: %s", name, batch, context, str(e).splitlines()[0])
    if fa3() is not None:  # vLLM's paged layout: blocks [N, FA3_BLOCK, Hkv, D], a block table per sequence
        del caches, sdpa
        blocks = -(-(context + 1) // FA3_BLOCK)
        paged = [torch.randn(2, batch * blocks, FA3_BLOCK, HKV, D, device="cuda", dtype=torch.float16)
                 for _ in range(copies)]  # fmt: skip
        table = torch.arange(batch * blocks, dtype=torch.int32, device="cuda").view(batch, blocks)
        lens = torch.full((batch,), context + 1, dtype=torch.int32, device="cuda")
        cu_q = torch.arange(batch + 1, dtype=torch.int32, device="cuda")

        def call(kc, vc):
            return fa3()(q, kc, vc, max_seqlen_q=1, cu_seqlens_q=cu_q, max_seqlen_k=context + 1, seqused_k=lens,
                         causal=True, block_table=table, fa_version=3)  # fmt: skip

        try:
            row["fa3_ms"] = bench(rotating([functools.partial(call, kc, vc) for kc, vc in paged]))
            row["fa3_tbs"] = fp16_bytes / row["fa3_ms"] / 1e9
            # the same numbers as SDPA on this cache (a baseline that skipped work would look fast)
            kc, vc = paged[0]
            out = call(kc, vc)
            k_seq, v_seq = (c.view(batch, -1, HKV, D)[:, : context + 1].transpose(1, 2) for c in (kc, vc))
            ref = F.scaled_dot_product_attention(q4, k_seq, v_seq, enable_gqa=True)[:, :, 0]
            row["fa3_max_diff"] = (out.float() - ref.float()).abs().max().item()
        except (RuntimeError, TypeError) as e:
            log.warning("fp16 FA3: batch %d context %d: %s", batch, context, str(e).splitlines()[0])
    return row


def run_config(batch: int, context: int, preset, table: int | None, cold: bool) -> dict:
    """One row of the table; ``table``: the page tables' width in tokens (``filled_cache``'s capacity); ``cold``:
    the timed calls read copies of the caches in turn (``l2_copies``)."""
    row = {"batch": batch, "context": context}
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.float16)
    k_new, v_new = (torch.randn(batch, HKV, D, device="cuda", dtype=torch.float16) for _ in range(2))
    scale = D**-0.5

    # fp16 baselines: the context plus the new token, [B, H, L, D]
    fp16_bytes = batch * (context + 1) * HKV * D * 2 * 2
    row.update(fp16_baselines(q, context, fp16_bytes, cold))

    nbytes = kvarn_bytes(batch, context, preset)
    caches = [filled_cache(batch, context, preset, capacity=table) for _ in range(l2_copies(nbytes, cold))]
    row["table_tiles"], row["kvarn_copies"] = caches[0].page_table.shape[1], len(caches)
    slots = torch.arange(batch, dtype=torch.int32, device="cuda")
    start = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    q_rot, k_rot, v_rot = rotated_to(q, torch.float32), rotated_to(k_new, k_new.dtype), rotated_to(v_new, v_new.dtype)
    for column, op, args in (
        ("kvarn_ms", torch.ops.kvarn.decode_attention, (q, k_new, v_new, slots, start, preset.name, scale, 0)),
        ("kvarn_unchecked_ms", triton_attention, (q, k_new, v_new, slots, start, qsl, preset, scale, True, 0, 1)),
        ("kvarn_kernel_ms", paged_attention, (q_rot, k_rot, v_rot, slots, start, qsl, preset, scale, True, 0, 1)),
    ):  # args: the op's arguments but the cache's pages, exact k, exact v and page table, which go after q, k, v
        row[column] = bench(rotating([functools.partial(op, *args[:3], *c.tensors()[:4], *args[3:]) for c in caches]))
    row["kvarn_tbs"] = nbytes / row["kvarn_ms"] / 1e9
    row["kvarn_kernel_tbs"] = nbytes / row["kvarn_kernel_ms"] / 1e9
    best = min(row.get(k, float("inf")) for k in BASELINES)
    row["speedup"] = best / row["kvarn_ms"]
    row["kernel_speedup"] = best / row["kvarn_kernel_ms"]

    row.update(append_costs(caches, k_new, v_new, context, preset))
    del caches
    torch.cuda.empty_cache()
    return row


def append_costs(caches: list[KVarNCache], k_new: torch.Tensor, v_new: torch.Tensor, context: int, preset) -> dict:
    """kvarn::append of one decode step in the tile of position ``context``: no tile completes (append_ms: the
    tile's row 5) / every sequence completes one (flush_ms: its last row); on each of ``caches`` in turn
    (``rotating``). k_new, v_new [B, Hkv, D]."""
    batch = k_new.shape[0]
    slots = torch.arange(batch, dtype=torch.int32, device="cuda")
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    tile_start = context // preset.tile_size * preset.tile_size
    costs = {}
    for name, pos in (("append_ms", tile_start + 5), ("flush_ms", tile_start + preset.tile_size - 1)):
        start_pos = torch.full((batch,), pos, dtype=torch.int32, device="cuda")
        costs[name] = bench(rotating([functools.partial(torch.ops.kvarn.append, k_new, v_new, *c.tensors(), slots,
                                                        start_pos, qsl, preset.name, 1) for c in caches]))  # fmt: skip
    return costs


def append_only(preset, out: pathlib.Path, context: int = 8192) -> None:
    """The append columns alone (at 8K context; they do not depend on it), for work on the append kernel."""
    rows = []
    for batch in tqdm(BATCHES, desc="append"):
        cache = filled_cache(batch, context, preset)
        k, v = (torch.randn(batch, HKV, D, device="cuda", dtype=torch.float16) for _ in range(2))
        rows.append({"batch": batch, "context": context, **append_costs([cache], k, v, context, preset)})
        log.info("batch %d: append %.4f ms, flush %.4f ms", batch, rows[-1]["append_ms"], rows[-1]["flush_ms"])
        del cache
    (out / "append.json").write_text(json.dumps(rows, indent=1))


SWEEP_SHAPES = (
    (1, 32768),
    (1, 131072),
    (8, 32768),
    (8, 131072),
    (32, 8192),
    (32, 32768),
    (32, 131072),
    (128, 8192),
    (128, 32768),
    (256, 1536),
)  # (batch, context); the last is a vLLM burst's decode step
SWEEP_SPLITS = (1, 2, 4, 6, 8, 9, 12, 16, 24, 32, 33, 48, 64, 96, 128)
# programs of a decode step's exact part (1: one takes the new token and all of a sequence's kept rows; X: the first
# the new token, X - 1 runs of the kept rows; the last to finish merges); at contexts 0, 64 and 125 rows past a tile
# boundary
SWEEP_EXACT_PARTS = (1, 2, 3, 5, 9)
EXACT_SHAPES = ((1, 2048), (1, 2112), (1, 2173), (1, 8317), (8, 8192), (8, 8256), (8, 8317), (32, 8317), (128, 2173))


def picked_launch(preset, q, cache, slots, start, qsl) -> tuple[int, int]:
    """The splits and the programs per tile the launcher picks for this decode step (``decode_attention.decode_splits``
    with a merging decode step's merge step: the step's exact part merges where its programs are at most
    ``paged_attention.MERGE_MOST_PROGRAMS_PER_SM`` an SM, batch <= 33 here; the halves' mark assumes it does)."""
    from kvarn_compile.kernels.decode_attention import decode_splits
    from kvarn_compile.kernels.paged_attention import merge_step_for

    pages, exact_k, _, table, _ = cache.tensors()
    return decode_splits(q.float(), pages, table, slots, start, qsl, preset, HKV, exact_k.shape[0],
                         exact_k.shape[2] == 2, merge_step_for(HQ // HKV, D))  # fmt: skip


def picked_splits(preset, q, cache, slots, start, qsl) -> int:
    """The number of splits the launcher picks for this decode step (``picked_launch``)."""
    return picked_launch(preset, q, cache, slots, start, qsl)[0]


def picked_half_splits(preset, q, cache, slots, start, qsl) -> int | None:
    """The launcher's splits where it takes tiles in halves, else None (it picks none of the halves' sweep)."""
    splits, parts = picked_launch(preset, q, cache, slots, start, qsl)
    return splits if parts == 2 else None


def picked_exact_parts(preset, q, cache, slots, start, qsl) -> int:
    """The exact part's programs the launcher picks for this decode step (``paged_attention.exact_parts_for``)."""
    from kvarn_compile.kernels.paged_attention import exact_parts_for
    from kvarn_compile.kernels.tile_math import multiprocessors

    kept = cache.exact_k.shape[2] * preset.tile_size
    return exact_parts_for(1, slots.numel() * HKV, multiprocessors(q.device), kept)


class Sweep(NamedTuple):
    """A launch option of triton_attention swept: its values, the launcher's pick (None: none of them), the plot's x
    label, and options held fixed meanwhile."""

    option: str
    values: tuple[int, ...]
    picker: Callable
    label: str
    fixed: dict


# by the results' name
SWEEPS = {
    "sweep": Sweep("num_splits", SWEEP_SPLITS, picked_splits, "splits per sequence", {}),
    # every split's tiles in halves, two programs a tile (``decode_attention.tile_parts``), however many tiles a split
    "sweep-halves": Sweep(
        "num_splits", SWEEP_SPLITS, picked_half_splits, "splits per sequence, tiles in halves", {"tile_parts": 2}
    ),
    "sweep-exact": Sweep(
        "exact_parts", SWEEP_EXACT_PARTS, picked_exact_parts, "programs of the exact part per sequence", {}
    ),
}


def sweep_launch(preset, out: pathlib.Path, shapes, sweep: str = "sweep", table: int | None = None) -> None:
    """Time the op without its checks (rotation, attention kernels, merge) over a launch option (``SWEEPS``: the
    number of splits of a sequence's tiles, whole or in halves, or of programs of its exact part) at each (batch,
    context) of ``shapes``, beside the value the launcher picks and the fastest fp16 of the same shape. Writes
    NAME.md, NAME.json and NAME.png (NAME: ``sweep``). ``table``: the page tables' width (``filled_cache``)."""
    from kvarn_compile.kernels.decode_attention import supports

    option, values, picker, label, fixed = SWEEPS[sweep]
    if not supports(preset, HQ // HKV, D, D):
        raise SystemExit(f"the sweeps time the Gluon decode kernel's steps, which does not serve {preset.name}")
    rows = []
    for batch, context in tqdm(shapes, desc=f"{sweep} shapes"):
        q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.float16)
        fp16 = fp16_baselines(q, context, batch * (context + 1) * HKV * D * 4, cold=False)  # (the sweeps are warm)
        best = min(fp16.get(k, float("inf")) for k in BASELINES)
        cache = filled_cache(batch, context, preset, capacity=table)
        k, v = (torch.randn(batch, HKV, D, device="cuda", dtype=torch.float16) for _ in range(2))
        slots = torch.arange(batch, dtype=torch.int32, device="cuda")
        start = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        picked = picker(preset, q, cache, slots, start, qsl)
        most = cache.page_table.shape[1] if option == "num_splits" else float("inf")
        for value in sorted({x for x in values if x <= most} | ({picked} - {None})):
            ms = bench(functools.partial(triton_attention, q, k, v, *cache.tensors()[:4], slots, start, qsl, preset,
                                         D**-0.5, True, 0, 1, **{option: value}, **fixed))  # fmt: skip
            rows.append({"batch": batch, "context": context, option: value, "picked": value == picked, "ms": ms,
                         "tbs": kvarn_bytes(batch, context, preset) / ms / 1e9, "vs_best_fp16": best / ms})  # fmt: skip
        del cache
        torch.cuda.empty_cache()
    lines = [f"| batch | context | {option} | op w/o checks ms | TB/s | vs best fp16 |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['context']} | {r[option]}{' (picked)' if r['picked'] else ''} | {r['ms']:.4f} "
              f"| {r['tbs']:.2f} | {r['vs_best_fp16']:.2f}x |" for r in rows]  # fmt: skip
    (out / f"{sweep}.md").write_text("\n".join(lines) + "\n")
    (out / f"{sweep}.json").write_text(json.dumps(rows, indent=1))
    plot_sweep(rows, option, label, out / f"{sweep}.png")
    print("\n".join(lines))


def plot_sweep(rows: list[dict], option: str, label: str, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for batch, context in dict.fromkeys((r["batch"], r["context"]) for r in rows):  # the swept shapes, in order
        mine = [r for r in rows if (r["batch"], r["context"]) == (batch, context)]
        line = ax.plot([r[option] for r in mine], [r["vs_best_fp16"] for r in mine], marker=".",
                       label=f"B{batch} {context}")  # fmt: skip
        picked = [(r[option], r["vs_best_fp16"]) for r in mine if r["picked"]]
        if picked:  # (none in a sweep of a form the launcher did not pick: the halves' in a wide table)
            ax.plot(*zip(*picked), "o", mfc="none", ms=10, color=line[0].get_color())
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"{label} (circled: the launcher's pick)")
    ax.set_ylabel("speed vs the fastest fp16 (op w/o checks)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def profile_op(preset, out: pathlib.Path) -> None:
    """GPU time of each kernel the decode op launches (batch 1 and 8, 8K context), to place the overhead."""
    from torch.profiler import ProfilerActivity, profile

    report = []
    for batch in (1, 8):
        cache = filled_cache(batch, 8192, preset)
        q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.float16)
        k, v = (torch.randn(batch, HKV, D, device="cuda", dtype=torch.float16) for _ in range(2))
        slots = torch.arange(batch, dtype=torch.int32, device="cuda")
        start = torch.full((batch,), 8192, dtype=torch.int32, device="cuda")
        args = (q, k, v, *cache.tensors()[:4], slots, start, preset.name, D**-0.5, 0)
        for _ in range(3):
            torch.ops.kvarn.decode_attention(*args)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                torch.ops.kvarn.decode_attention(*args)
            torch.cuda.synchronize()
        report.append(f"batch {batch}, 8K context, 20 calls:\n" + prof.key_averages().table(
            sort_by="cuda_time_total", row_limit=15))  # fmt: skip
    (out / "profile.txt").write_text("\n".join(report))
    print("\n".join(report))


def markdown(rows: list[dict], device: str, preset: str, table: int | None, cold: bool) -> str:
    width = f"page tables {table} tokens wide" if table else "page tables as wide as each step needs"
    l2 = "copies of the caches in turn (cold L2)" if cold else "the same caches every call (warm L2)"
    lines = [
        (
            f"Decode attention, {preset}, {HQ} query / {HKV} KV heads, head_dim {D}, fp16, {device}, {width}, {l2}; "
            "median ms (CUDA graphs); TB/s = bytes that must be read / time."
        ),
        "",
        (
            "| batch | context | fp16 flash | fp16 cuDNN | fp16 FA3 | kvarn op | op w/o checks | kvarn kernel "
            "| op TB/s | kernel TB/s | op vs best fp16 | kernel vs best fp16 | append | flush |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [str(r["batch"]), str(r["context"])]
        cells += [f"{r[k]:.4f}" if k in r else "n/a" for k in
                  (*BASELINES, "kvarn_ms", "kvarn_unchecked_ms", "kvarn_kernel_ms")]  # fmt: skip
        cells += [f"{r['kvarn_tbs']:.2f}", f"{r['kvarn_kernel_tbs']:.2f}", f"{r['speedup']:.2f}x",
                  f"{r['kernel_speedup']:.2f}x", f"{r['append_ms']:.4f}", f"{r['flush_ms']:.4f}"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: pathlib.Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["kernel_speedup"] for r in rows], 0.4, label="kvarn attention kernels + merge")
    ax.bar([i + 0.2 for i in x], [r["speedup"] for r in rows], 0.4, label="kvarn op (rotations, checks, combine)")
    ax.axhline(1.0, color="grey", lw=1)
    ax.axhline(3.0, color="tab:red", lw=1, ls="--", label="target 3x")
    ax.set_xticks(list(x), [f"B{r['batch']}\n{r['context'] // 1024}K" for r in rows], fontsize=8)
    ax.set_ylabel("speedup vs fastest fp16")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench-out")
    parser.add_argument("--preset", default="kvarn_k4v2_g128")
    parser.add_argument("--quick", action="store_true", help="batch 8 at 8K and 32K only")
    parser.add_argument("--shapes", help="only these BATCHxCONTEXT shapes, comma-separated (e.g. 1x2048,8x32768); "
                        "with --sweep(-only), the sweep's shapes")  # fmt: skip
    parser.add_argument("--sweep", action="store_true", help="also time the op over its number of splits")
    parser.add_argument("--sweep-only", action="store_true", help="only the splits sweep")
    parser.add_argument(
        "--sweep-halves",
        action="store_true",
        help="only the splits sweep with every tile in halves (two programs a tile)",
    )
    parser.add_argument("--sweep-exact", action="store_true", help="only the sweep over the programs of a decode "
                        "step's exact part (the current tile's rows), at contexts past tile boundaries")  # fmt: skip
    parser.add_argument("--table", type=int, help="page tables this many tokens wide (as a server's max_model_len "
                        "makes vLLM's block tables), not just the tiles each step needs")  # fmt: skip
    parser.add_argument("--cold-l2", action=argparse.BooleanOptionalAction, default=True, help="each timed call of "
                        "the table reads another copy of the caches than the calls beside it, from HBM, as a model's "
                        "step does (l2_copies; not the sweeps); --no-cold-l2: the same caches every call (warm L2: "
                        "a working set under the L2 is read from it)")  # fmt: skip
    parser.add_argument("--profile", action="store_true", help="also list the op's GPU kernels (torch.profiler)")
    parser.add_argument("--append-only", action="store_true", help="only the append / flush columns (append.json)")
    parser.add_argument("--unchecked", action="store_true", help="time even a kernel that disagrees with the "
                        "reference: for a probe that drops work on purpose to time a floor, never for a result")  # fmt: skip
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    preset = get_preset(args.preset)
    device = torch.cuda.get_device_name()
    error = check_against_reference(preset)
    log.info("kernel vs reference, max abs error: %.2e", error)
    if error > 5e-2 and not args.unchecked:
        raise SystemExit(f"the kernel disagrees with the reference (max abs error {error:.3g}): not timing it")
    if args.append_only:
        append_only(preset, out)
        return
    shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes.split(",")] if args.shapes else None
    if args.sweep_exact:
        sweep_launch(preset, out, shapes or EXACT_SHAPES, "sweep-exact", args.table)
        return
    if args.sweep_halves:
        sweep_launch(preset, out, shapes or SWEEP_SHAPES, "sweep-halves", args.table)
        return
    if args.sweep or args.sweep_only:
        sweep_launch(preset, out, shapes or SWEEP_SHAPES, table=args.table)
        if args.sweep_only:
            return
    configs = [(b, c) for b in BATCHES for c in CONTEXTS if b * c <= MAX_TOKENS]
    if args.quick:
        configs = [(8, 8192), (8, 32768)]
    elif shapes:
        configs = shapes
    rows = [run_config(b, c, preset, args.table, args.cold_l2) for b, c in tqdm(configs, desc="configs")]
    table = markdown(rows, device, preset.name, args.table, args.cold_l2)
    write_results(out, {"device": device, "preset": preset.name, "cold_l2": args.cold_l2, "rows": rows}, table)
    plot(rows, out / "speedup.png", f"KVarN {preset.name} decode attention vs the fastest fp16, {device}")
    # After the timed rows: the profiler leaves CUPTI attached, and rows timed after it ran slow, the op more than
    # cuDNN (NOTE, H200, benchmarks/results/h200-s28/call5: B1/2K op 0.0118 / cuDNN 0.0092 ms in the table, 0.0096 /
    # 0.0081 in the A/B runs of the same call; the README tables of sessions 26-28 showed the same).
    if args.profile:
        profile_op(preset, out)


if __name__ == "__main__":
    main()
