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
STAGE; it quantizes a burst of more than DEFERRED_MOST completed tiles in line), and leaves the completed tiles to a
FLUSH launch (``quantize_store.flush_tiles``) on the flush stream, after the staging. The caller may rewrite the call's
slots, start positions, query rows and page table as soon as the call returns; the cache's own tensors are the
flush's until it is joined. One FLUSH launch serves GROUP deferring calls (a model's consecutive layers): most steps
complete no tile, and in those the launch, finding nothing, is the deferral's cost (~1-5 us a launch with its fork
and join, benchmarks/NOTES.md session 47), so GROUP layers pay it once. The calls wait, staged, until GROUP of them
(of one ``Flush.launch_key``) are, or until one of them is joined: until then not even ``torch.cuda.synchronize()``
makes their pages final; a join does. A launched flush is then joined (the current stream waits for it):
- before any later CUDA call of the ops on the same cache (``join_cache``): the layer's next step;
- by the launch ``LAG`` launches later, so that at most LAG launches run beside the model's layers;
- by a call that does not defer, and by ``join_flushes()``.
A CUDA-graph capture must join what it deferred before it ends (CUDA refuses a capture with work left on another
stream, and the flush stream joins the capture with each deferring call, so a call left staged counts): vLLM's plugin
has the model's last KVarN layer not defer.
"""

from __future__ import annotations

import collections
import functools
import logging
from typing import NamedTuple

import torch

from .kernels.quantize_store import Flush, flush_tiles

log = logging.getLogger("kvarn.deferred_flush")

LAG = 2  # a FLUSH launch joins the one LAG launches before it (benchmarks/NOTES.md session 46)
# Deferring calls a FLUSH launch serves. NOTE (H100, benchmarks/results/gpu-s49/h100-verify, 36 Qwen3-8B-shaped layers,
# B8/8K): a step flushing one tile +185 us with 4 a launch, +355 / +385 with 8 / 16 (their flushes run past the
# matmuls they are launched beside); a step flushing none +87 / +73 / +84.
GROUP = 4
# Calls of fewer sequences quantize in line: a flush every 128 steps of one sequence costs its steps little amortised,
# and the deferral's two launches cost every step. NOTE (H100, benchmarks/results/gpu-s46/h100-defer2,
# flush_overlap.py, 4 Qwen3-8B-shaped layers): at B1/8K a step with nothing to flush +11 us deferring, against 2.5 us
# a step that the in-line flush costs amortised; at B8/8K deferring saved more than it cost.
SMALLEST_BATCH = 8


class _Launched(NamedTuple):
    """A FLUSH launch not joined yet: the pages' addresses of its calls' caches, the event recorded on the flush stream
    after it, and whether it was launched in a CUDA-graph capture."""

    device: torch.device
    pages: frozenset[int]
    done: torch.cuda.Event
    captured: bool


_staged: list[Flush] = []  # deferring calls staged, their FLUSH not launched yet, oldest first
_staged_captured = False  # whether they were staged in a CUDA-graph capture
_launched: collections.deque[_Launched] = collections.deque()  # oldest first


@functools.cache
def flush_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream the flushes of ``device`` run on. torch hands its streams out of a pool, 32 a priority, round
    robin, so a new one may be the stream the caller runs on (vLLM's is one of the pool too), where the flushes would
    run in line: the first one that is not the current stream (``defer`` picks again where the caller moves onto it
    with no flush pending)."""
    current = torch.cuda.current_stream(device)
    stream = torch.cuda.Stream(device)
    while stream.cuda_stream == current.cuda_stream:  # (handles: an ExternalStream of a pool stream compares unequal)
        stream = torch.cuda.Stream(device)
    return stream


@functools.cache
def _warn_in_line(device: torch.device) -> None:
    log.warning("KVarN: a tile quantization deferred on %s's flush stream, which is also the caller's current stream "
                "(torch's pool hands out the same streams again) while flushes are pending on it: it runs in line "
                "there, at the in-line cost; join the deferred flushes (kvarn_compile.deferred_flush.join_flushes()) "
                "before moving to another stream", device)  # fmt: skip


def defer(call: Flush) -> None:
    """Leave the tiles of a call whose STAGE ran (on the current stream) to a FLUSH launch on the flush stream, with
    the GROUP - 1 deferring calls before or after it."""
    global _staged_captured
    device = call.pages.device
    if _staged:
        _check_capture(_staged_captured, device)
        if _staged[0].launch_key() != call.launch_key():
            _launch_staged()
    if not _staged:
        _staged_captured = torch.cuda.is_current_stream_capturing()
    current = torch.cuda.current_stream(device)
    if flush_stream(device).cuda_stream == current.cuda_stream:  # the caller moved onto it (a capture's stream, say)
        if _staged or _launched:
            _warn_in_line(device)
        else:  # nothing on it yet: another one
            flush_stream.cache_clear()
    # The flush stream waits for the STAGE now, on the stream it ran on (the launch may come from a call on another
    # stream), and so joins a capture at once: CUDA refuses a capture that ends with a call staged, not launched.
    flush_stream(device).wait_stream(current)
    _staged.append(call)
    if len(_staged) == GROUP:
        _launch_staged()


def join_cache(pages: torch.Tensor) -> None:
    """Make the current stream wait for the flushes still pending on the cache of ``pages``."""
    key = pages.data_ptr()
    if any(call.pages.device == pages.device and call.pages.data_ptr() == key for call in _staged):
        _launch_staged()
    for item in [item for item in _launched if item.device == pages.device and key in item.pages]:
        _launched.remove(item)
        _wait(item)


def join_flushes() -> None:
    """Make the current stream wait for every pending flush."""
    if _staged:
        _launch_staged()
    while _launched:
        _wait(_launched.popleft())


def pending() -> int:
    """How many deferring calls' flushes are not joined yet (staged or launched)."""
    return len(_staged) + sum(len(item.pages) for item in _launched)


def _launch_staged() -> None:
    """The FLUSH launch of the staged calls, on the flush stream (which waits for their STAGEs since ``defer``) after
    the work queued so far on the current stream too; first join the launch LAG launches old."""
    calls = list(_staged)
    _staged.clear()  # (first: calls that cannot be launched are dropped with the error below, not left to fail again)
    device = calls[0].pages.device
    _check_capture(_staged_captured, device)
    while len(_launched) >= LAG:
        _wait(_launched.popleft())
    side = flush_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        flush_tiles(calls, GROUP)
    for call in calls:  # their memory must outlive the flush (the caching allocator: not reused before it ends)
        for t in (call.pages, call.exact_k, call.exact_v, call.snapshot):
            t.record_stream(side)
    done = torch.cuda.Event()
    done.record(side)
    _launched.append(_Launched(device, frozenset(call.pages.data_ptr() for call in calls), done, _staged_captured))


def _wait(item: _Launched) -> None:
    _check_capture(item.captured, item.device)
    torch.cuda.current_stream(item.device).wait_event(item.done)


def _check_capture(captured: bool, device: torch.device) -> None:
    """A deferred flush staged or launched in a CUDA-graph capture (``captured``) or outside one is launched or joined
    the same way, and one of a capture in that capture: CUDA cannot order a capture's work after work outside it, nor
    the other way round, and a flush of a capture that ended (one that raised) would read what only its graph writes."""
    capturing = torch.cuda.is_current_stream_capturing()
    if captured != capturing:
        raise RuntimeError("KVarN: a tile quantization deferred " + ("inside" if captured else "outside") + " a "
                           "CUDA-graph capture is joined " + ("outside" if captured else "inside") + " one: join "
                           "every deferred flush (kvarn_compile.deferred_flush.join_flushes()) before a capture begins "
                           "and before it ends")  # fmt: skip
    if captured and not _flush_stream_capturing(device):  # the flush stream joined its capture when it was deferred
        raise RuntimeError("KVarN: a tile quantization deferred in a CUDA-graph capture that has ended (one that "
                           "raised) is joined in another: its tiles are not quantized; join every deferred flush "
                           "(kvarn_compile.deferred_flush.join_flushes()) before a capture ends")  # fmt: skip


def _flush_stream_capturing(device: torch.device) -> bool:
    """Whether the flush stream of ``device`` is part of the current capture (it joins one with each deferred call)."""
    with torch.cuda.stream(flush_stream(device)):
        return torch.cuda.is_current_stream_capturing()
