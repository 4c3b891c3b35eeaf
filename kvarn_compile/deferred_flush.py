"""Decode steps' tile quantizations deferred to a side stream: ``kvarn::attend_and_append(..., defer_flush=True)``.

Why: quantizing a completed tile (a "flush") is a chain of dependent steps in one program per tile half and KV head
(normalisation iterations, flip rounds), ~65-85 us however many sequences complete a tile. In line, the step waits
for it: in a server's staggered batches (a sequence completes a tile every 128 of its steps, each in a step of its
own) that is 13.6% of an 8K step's attention at batch 8 and 18.8% at batch 32, amortised (H100,
benchmarks/NOTES.md session 42). The step's attention does not need the flushed page (a tile completed by a step's
token is read exact in that step: ``tile_math.quantized_tiles`` takes the tiles before the token's), only the
layer's next step does, so the flush can run beside the model's next layers, whose matmuls leave SMs to spare
(session 39: ~12-18 us of the 4-layer step a flush beside them, against ~85 in line).

A deferring call (CUDA, single-token rows of at least SMALLEST_BATCH sequences) stages its rows on the current
stream, the row that completes a tile too, with a snapshot of the metadata the flush needs (``kernels.quantize_store``'s
STAGE; it quantizes a burst of more than DEFERRED_MOST completed tiles in line), and quantizes the completed tiles
from the exact buffer on the flush stream, after the staging (FLUSH). The caller may rewrite the call's slots, start
positions, query rows and page table as soon as the call returns; the cache's own tensors are the flush's until it
is joined. That flush is then joined (the current stream waits for it):
- before any later CUDA call of the ops on the same cache (``join_cache``): the layer's next step;
- by a deferring call ``LAG`` calls later, so that at most LAG flushes run beside the model's layers;
- by a call that does not defer, and by ``join_flushes()``.
A CUDA-graph capture must join what it deferred before it ends (CUDA refuses a capture with work left on another
stream): vLLM's plugin has the model's last KVarN layer not defer.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Sequence

import torch

LAG = 2  # a deferring call joins the flush deferred LAG calls before it (benchmarks/NOTES.md session 46)
# Calls of fewer sequences quantize in line: a flush every 128 steps of one sequence costs its steps little amortised,
# and the deferral's two launches cost every step. NOTE (H100, benchmarks/results/gpu-s46/h100-defer2,
# flush_overlap.py, 4 Qwen3-8B-shaped layers): at B1/8K a step with nothing to flush +11 us deferring, against 2.5 us
# a step that the in-line flush costs amortised; at B8/8K deferring saved more than it cost.
SMALLEST_BATCH = 8

# (device, pages' address, event recorded on the flush stream after the flush, whether recorded in a CUDA-graph
# capture), oldest first
_pending: collections.deque[tuple[torch.device, int, torch.cuda.Event, bool]] = collections.deque()


@functools.cache
def flush_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream the flushes of ``device`` run on."""
    return torch.cuda.Stream(device)


def defer(pages: torch.Tensor, flush: Callable[[], None], reads: Sequence[torch.Tensor]) -> None:
    """Run ``flush`` (launches that write ``pages`` and read ``reads``) on the flush stream, after the work queued
    so far on the current stream, and leave it pending; first join the flushes LAG calls old."""
    while len(_pending) >= LAG:
        _wait(*_pending.popleft())
    main, side = torch.cuda.current_stream(pages.device), flush_stream(pages.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        flush()
    for t in reads:  # their memory must outlive the flush (the caching allocator: not reused before it ends)
        t.record_stream(side)
    done = torch.cuda.Event()
    done.record(side)
    _pending.append((pages.device, pages.data_ptr(), done, torch.cuda.is_current_stream_capturing()))


def join_cache(pages: torch.Tensor) -> None:
    """Make the current stream wait for the flushes still pending on the cache of ``pages``."""
    key = (pages.device, pages.data_ptr())
    for item in [item for item in _pending if item[:2] == key]:
        _pending.remove(item)
        _wait(*item)


def join_flushes() -> None:
    """Make the current stream wait for every pending flush."""
    while _pending:
        _wait(*_pending.popleft())


def pending() -> int:
    """How many deferred flushes are not joined yet."""
    return len(_pending)


def _wait(device: torch.device, _: int, done: torch.cuda.Event, captured: bool) -> None:
    if captured != torch.cuda.is_current_stream_capturing():  # CUDA cannot order a capture after work outside it
        raise RuntimeError("KVarN: a tile quantization deferred " + ("inside" if captured else "outside") + " a CUDA-"
                           "graph capture is joined " + ("outside" if captured else "inside") + " one: join every "
                           "deferred flush (kvarn_compile.deferred_flush.join_flushes()) before a capture begins and "
                           "before it ends")  # fmt: skip
    torch.cuda.current_stream(device).wait_event(done)
