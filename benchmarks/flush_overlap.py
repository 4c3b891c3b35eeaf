"""What does a tile's quantization cost a model's decode step if it runs beside the next layer's matmuls? (a probe;
needs a GPU)

Why: a completed tile is quantized by one program per tile half whose dependent chain is ~80-99 us (session 23's
clock probe; ``decode_step.py``'s "one" case: +77-99 us per layer whatever the batch), where issue 2 asks <= 5% of
an 8K decode step's attention. No program makes that chain 50x shorter, and beside the attention, which fills the
GPU, a kernel costs its latency (``flush_beside.py``, session 35). But a decoder layer is its attention and its
matmuls, and at decode batch sizes the matmuls are bound by reading their weights, not by SMs: the 16 SMs a
sequence's flush holds (8 KV heads x keys and values, one program an SM) may cost them little. This probe times a
step of ``--layers`` decoder layers shaped like Qwen3-8B (hidden 4096, 32 query / 8 KV heads, head_dim 128, MLP
12,288; fp16 weights of their own per layer, norms left out) and the lm_head (151,936 x 4096), each layer's
attention ``kvarn::attend_and_append`` at batch x context, with sequence 0 completing a tile in every layer:

    none        no sequence completes a tile (the baseline)
    inline      the op quantizes sequence 0's tile in line (the package's default)
    deferred    the op defers it (``defer_flush``: ``kvarn_compile.deferred_flush``, a FLUSH launch for each
                ``GROUP`` layers' calls, each launch joining the one two before it), the last ones joined after the
                lm_head
    deferred-none   the op deferring as in "deferred", no sequence completing a tile: what the deferral's launches
                (the staging, and flush launches whose programs find nothing to do) cost a step against none's
    deferred-lag3, deferred-none-lag3   as "deferred", "deferred-none" with ``deferred_flush.LAG`` 3
    deferred-2  as "deferred" with two sequences completing a tile (the first and last): 18% of the steps of a
                staggered batch of 128
    deferred-3  as "deferred" with three sequences completing a tile (the first, middle and last), which a staggered
                batch of 128 does in 6.1% of its steps (three or more in 8%): deferred since session 54 (a call's
                tiles beyond ``quantize_store.DEFERRED_MOST``, 2 until then, are a burst, quantized in line)
    deferred-g1, deferred-none-g1   as "deferred", "deferred-none" with ``deferred_flush.GROUP`` 1: a FLUSH launch for
                each layer (the package before session 48), where the package's serves GROUP layers; -g8, -g16: 8 or
                16 layers' calls a launch
    deferred-hi, deferred-none-hi   the flush stream of high priority (CUDA's scheduler places its programs first)
    in-line-g4, in-line-none-g4, in-line-g16, in-line-none-g16   as "deferred", "deferred-none" with GROUP 4 or 16 and
                the FLUSH launch on the stream that defers (in line, after the 4th / 16th call's STAGE): no side
                stream, so no branch in the step's graph; a flushing step waits for the flush's chain once a launch,
                not once a layer as "inline" does
    staged-none the op's STAGE launch alone (its FLUSH launch and the joins left out: wrong where a tile completes,
                so only in a step where none does): what the deferral's staging costs against the in-line kernel
    beside      the op as in none; sequence 0's tile quantized by the append kernel (a batch of that one sequence,
                on a cache of its own) on a side stream forked after the op and joined before the next layer's
                attention (the last layer's: after the lm_head)
    beside-2    the same, joined two layers later
    norm-1w-2   instead of the append kernel, a stand-in of little footprint: 8 normalisation iterations of each
                of the sequence's 16 tile halves (8 KV heads x keys, values) in a one-warp program each
                (``flush_beside.phase``, 16:128:1; no rounding, flips nor stores), joined two layers later
    norm-4w-2   the same in 4-warp programs
    tiny-N      the op as in none; a one-program kernel (16 floats incremented) forked onto the side stream after the
                attention of every N-th layer (1, 4, 16) and joined two forks later (the last after the lm_head): a
                graph of deferred-none's shape with a kernel that is nothing, to tell the multi-stream graph's own cost
                from the FLUSH kernel's
    tiny-4-soon the same after every 4th layer, joined at the next layer
    tiny-last   the same after the last layer's attention only, joined after the lm_head
    wide-4      as tiny-4 with a kernel of 128 light programs (64K floats incremented), as many as an empty FLUSH
                launch of 4 layers had heavy ones until session 54 (255 registers, 32 KB of shared memory; 64 since)
    attention   the layers' ops of "none" alone: the denominator of issue 2's target

With ``--graphs a-step`` also (session 56: a probe of a FLUSH graph of its own, which a server would replay on a
side stream beside its next step's graph, so that the step's graph holds no branch; benchmarks/NOTES.md session 53):

    side-tiny   none's step graph, and after each replay a graph of one tiny kernel replayed on a side stream,
                beside the next step's replay; a step's replay first waits for the side graph of the step two
                before it: what a second graph a step costs against the branch in deferred-none's graph
    side-wide   the same with a graph of ``--layers`` / 4 wide kernels (as many as the FLUSH launches of a step
                that flushes nothing, of ~128 light programs each)
    side-flush  the same with a graph of every layer's flush of sequence 0's tile (the append kernel on a cache of
                its own, as in "beside"): a flushing step's flushes beside the next step, against "deferred"
    side-deferred, side-deferred-none   the op deferring as in "deferred", "deferred-none", its FLUSH launches (for
                ``deferred_flush.GROUP`` layers' calls each) in the side graph instead of the step's: the design itself,
                timed (not correct: the next step's STAGE rewrites the snapshots its FLUSH launches read, and reads
                the pages they write)

A variant's cost is its step minus none's, also as a share of attention. Medians of CUDA-graph replays, the
variants in turn, ``--rounds`` times; the median of the rounds. ``--graphs a-step`` times each step's own graph
replayed in a row (as a server replays it) instead of a graph of many steps. With ``--timeline VARIANT ...``: also
the kernels of one replay of each at the ``--timeline-shapes`` (B8/8K).

    python benchmarks/flush_overlap.py --out DIR [--layers 4] [--rounds 3] [--shapes 8x8192,...]
        [--costs inline deferred ...] [--timeline beside beside-2 ...] [--timeline-shapes 8x8192,...]
        [--graphs unrolled|a-step]

Writes DIR/results.json, DIR/results.md, DIR/flush_overlap.png (and DIR/timeline.md).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import pathlib
import statistics
from collections.abc import Callable
from typing import NamedTuple
from unittest import mock

import torch
import torch.nn.functional as F
from attention import HKV, HQ, D, bench, filled_cache  # benchmarks/attention.py
from decode_step import kernel_table, op_step, replay_kernels, step_inputs
from flush_beside import Phase, phase
from result_files import write_results
from tqdm import tqdm

from kvarn_compile import deferred_flush, get_preset
from kvarn_compile.kernels import quantize_store
from kvarn_compile.kernels.quantize_store import flush_tiles
from kvarn_compile.ops import triton_append

log = logging.getLogger("kvarn.bench")

SHAPES = ((1, 8192), (8, 8192), (32, 8192), (8, 32768), (128, 2048))
HIDDEN, MLP, VOCAB = HQ * D, 12288, 151936  # Qwen3-8B
PHASE_1W, PHASE_4W = Phase(16, warps=1), Phase(16, warps=4)  # 8 normalisation iterations, a program per tile half


class Layer:
    """One decoder layer's weights, its cache, and its attention's inputs (``decode_step.step_inputs``) for the
    cases "none", "one", "two" and "three"; ``flush`` quantizes sequence 0's completed tile alone, on a one-slot
    cache of its own; ``normalise(spec)`` runs ``flush_beside.phase`` on that sequence's 16 tile halves (8 KV heads x
    keys, values)."""

    def __init__(self, batch: int, context: int, preset) -> None:
        def weight(n_in, n_out):
            return torch.randn(n_in, n_out, device="cuda", dtype=torch.float16) * n_in**-0.5

        self.w_qkv, self.w_o = weight(HIDDEN, (HQ + 2 * HKV) * D), weight(HIDDEN, HIDDEN)
        self.w_gate_up, self.w_down = weight(HIDDEN, 2 * MLP), weight(MLP, HIDDEN)
        self.cache = filled_cache(batch, context, preset)
        self.inputs = {case: step_inputs(batch, context, case, preset) for case in ("none", "one", "two", "three")}
        self.attend = {(case, defer): op_step(self.cache, inputs, preset, defer)
                       for case, inputs in self.inputs.items() for defer in (False, True)}  # fmt: skip
        alone = filled_cache(1, context, preset)
        k, v = (torch.randn(1, HKV, D, device="cuda", dtype=torch.float16) for _ in range(2))
        one = torch.zeros(1, dtype=torch.int32, device="cuda")
        start = torch.full((1,), context + preset.tile_size - 1, dtype=torch.int32, device="cuda")
        qsl = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
        self.flush_args = (k, v, *alone.tensors(), one, start, qsl, preset, 1)
        self.tiles = torch.randn(2 * HKV, preset.tile_size, D, device="cuda", dtype=torch.float16)
        self.log_tok = torch.zeros(self.tiles.shape[:2], device="cuda")
        self.log_chan = torch.zeros(2 * HKV, D, device="cuda")
        self.counts = torch.zeros(16, device="cuda")
        self.wide_counts = torch.zeros(64 * 1024, device="cuda")  # torch's elementwise kernel: ~128 programs

    def out(self, case: str) -> torch.Tensor:
        return self.inputs[case][3]

    def flush(self) -> None:
        triton_append(*self.flush_args, rotated_kv=True)

    def normalise(self, spec: Phase) -> None:
        phase(self.tiles, self.log_tok, self.log_chan, spec)

    def tiny(self) -> None:
        self.counts.add_(1)

    def wide(self) -> None:
        self.wide_counts.add_(1)


class Variant(NamedTuple):
    """A step's attention case ("none", "one", "two" or "three"); the work forked onto the side stream after a layer's
    attention (``beside``; None: nothing forked): after the attention of every ``every``-th layer from layer ``first``
    (negative: from the end), each joined ``span`` layers later (None: ``lag`` x ``every``), before that layer's
    attention (the last ones after the lm_head); whether the op defers its flush, and if so, whether on a stream of high
    priority, whether its FLUSH launch runs at all (``lag`` then the op's ``deferred_flush.LAG``), how many layers'
    calls a launch serves (``group``, ``deferred_flush.GROUP``; None: the package's) and whether it runs in line, on the
    stream that defers (``in_line``)."""

    case: str = "none"
    beside: Callable[[Layer], None] | None = None
    lag: int = 1
    defer: bool = False
    high_priority: bool = False
    flush: bool = True
    group: int | None = None
    in_line: bool = False
    every: int = 1
    first: int = 0
    span: int | None = None


VARIANTS = {
    "none": Variant(),
    "inline": Variant("one"),
    "deferred": Variant("one", lag=2, defer=True),
    "deferred-none": Variant("none", lag=2, defer=True),
    "deferred-lag3": Variant("one", lag=3, defer=True),
    "deferred-none-lag3": Variant("none", lag=3, defer=True),
    "deferred-2": Variant("two", lag=2, defer=True),
    "deferred-3": Variant("three", lag=2, defer=True),
    **{
        f"deferred{case}-g{group}": Variant(kind, lag=2, defer=True, group=group)
        for group in (1, 8, 16)
        for case, kind in (("", "one"), ("-none", "none"))
    },
    **{
        f"in-line{case}-g{group}": Variant(kind, lag=2, defer=True, group=group, in_line=True)
        for group in (4, 16)
        for case, kind in (("", "one"), ("-none", "none"))
    },
    "deferred-hi": Variant("one", lag=2, defer=True, high_priority=True),
    "deferred-none-hi": Variant("none", lag=2, defer=True, high_priority=True),
    "staged-none": Variant("none", lag=2, defer=True, flush=False),
    "beside": Variant(beside=Layer.flush),
    "beside-2": Variant(beside=Layer.flush, lag=2),
    "norm-1w-2": Variant(beside=functools.partial(Layer.normalise, spec=PHASE_1W), lag=2),
    "norm-4w-2": Variant(beside=functools.partial(Layer.normalise, spec=PHASE_4W), lag=2),
    **{f"tiny-{every}": Variant(beside=Layer.tiny, lag=2, every=every) for every in (1, 4, 16)},
    "tiny-4-soon": Variant(beside=Layer.tiny, every=4, span=1),
    "tiny-last": Variant(beside=Layer.tiny, first=-1),
    "wide-4": Variant(beside=Layer.wide, lag=2, every=4),
}


COSTS = list(VARIANTS)[1:]  # each against "none"


@functools.cache
def high_priority_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device, priority=-1)


def caller_stream(device: torch.device) -> torch.cuda.Stream:
    """``deferred_flush.flush_stream`` for the in-line variants: the stream that defers."""
    return torch.cuda.current_stream(device)


caller_stream.cache_clear = lambda: None  # (``defer`` clears flush_stream's cache where it finds the caller's stream)


def deferral(variant: Variant):
    """``kvarn_compile.deferred_flush`` set up as ``variant`` asks while a step runs (and is captured): the probe's
    knobs, patched into the module (restored on exit), which the op reads at each call."""
    knobs = {"LAG": variant.lag}
    if variant.group is not None:
        knobs["GROUP"] = variant.group
    if variant.high_priority:
        knobs["flush_stream"] = high_priority_stream
    if variant.in_line:  # in line on purpose: the package's warning that a flush runs in line does not apply
        knobs |= {"flush_stream": caller_stream, "_warn_in_line": lambda device: None}
    if variant.flush:
        return mock.patch.multiple(deferred_flush, **knobs)
    # the calls kept for a side graph's FLUSH launches (side-deferred), their snapshots allocated once, outside the
    # step graph's capture (one there may share a block with an earlier kernel's temporary, which the next replay
    # rewrites while the side graph still reads it: session 56's B32 run)
    knobs["defer"] = COLLECTED.append
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.multiple(deferred_flush, **knobs))
    stack.enter_context(mock.patch.object(quantize_store, "snapshot_for", persistent_snapshot))
    return stack


COLLECTED = []  # the calls the op deferred in the last step of a variant whose FLUSH launches are left out
SNAPSHOTS = {}  # a call's slots (address) -> (the slots, kept alive; its snapshot), allocated at the first (eager) step
allocate_snapshot = quantize_store.snapshot_for


def persistent_snapshot(slots: torch.Tensor) -> torch.Tensor:
    if slots.data_ptr() not in SNAPSHOTS:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("a snapshot for new slots in a capture: run the step once before capturing it")
        SNAPSHOTS[slots.data_ptr()] = (slots, allocate_snapshot(slots))
    return SNAPSHOTS[slots.data_ptr()][1]


def model_step(layers: list[Layer], lm_head: torch.Tensor, x0: torch.Tensor, variant: Variant, side) -> None:
    """One decode step of the layers and the lm_head (``VARIANTS``)."""
    COLLECTED.clear()
    with deferral(variant) if variant.defer else contextlib.nullcontext():
        _model_step(layers, lm_head, x0, variant, side)


def _model_step(layers: list[Layer], lm_head: torch.Tensor, x0: torch.Tensor, variant: Variant, side) -> None:
    main = torch.cuda.current_stream()
    pending = []  # (the layer to join it at, an event) of the side stream's work not joined yet, oldest first
    first = variant.first % len(layers)
    span = variant.span if variant.span is not None else variant.lag * variant.every
    x = x0
    for i, layer in enumerate(layers):
        torch.matmul(x, layer.w_qkv)  # its time is the point: the attention's inputs stay fixed
        while pending and pending[0][0] <= i:
            main.wait_event(pending.pop(0)[1])
        layer.attend[variant.case, variant.defer]()
        if variant.beside is not None and i >= first and (i - first) % variant.every == 0:
            side.wait_stream(main)
            with torch.cuda.stream(side):
                variant.beside(layer)
                pending.append((i + span, torch.cuda.Event()))
                pending[-1][1].record()
        x = x + layer.out(variant.case).view(x.shape[0], HIDDEN) @ layer.w_o
        gate, up = (x @ layer.w_gate_up).chunk(2, dim=-1)
        x = x + (F.silu(gate) * up) @ layer.w_down
    torch.matmul(x, lm_head)
    if variant.beside is not None:
        main.wait_stream(side)
    deferred_flush.join_flushes()  # the op's own deferred flushes ("deferred"), before the step (a graph) ends


def model(batch: int, context: int, preset, n_layers: int) -> tuple[list[Layer], torch.Tensor]:
    """The layers and the step's input hidden state x0 [batch, HIDDEN]."""
    layers = [Layer(batch, context, preset) for _ in range(n_layers)]
    return layers, torch.randn(batch, HIDDEN, device="cuda", dtype=torch.float16)


def lm_head() -> torch.Tensor:
    return torch.randn(HIDDEN, VOCAB, device="cuda", dtype=torch.float16) * HIDDEN**-0.5


def attention_only(layers: list[Layer]) -> None:
    for layer in layers:
        layer.attend["none", False]()


def replayed(step, replays: int = 100, repeats: int = 5) -> float:
    """Ms of a step captured in a CUDA graph of its own and replayed ``replays`` times in a row, as a server replays
    its step's graph (``bench`` times a graph of many steps in a row instead): the median of ``repeats`` means, each
    with the host's launches of the replays (which queue ahead of the GPU)."""
    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / replays)
    return statistics.median(times)


def tiny_kernel(layers: list[Layer]) -> None:
    layers[0].tiny()


def wide_kernels(layers: list[Layer]) -> None:
    """As many as the FLUSH launches of a step, one every ``deferred_flush.GROUP`` layers."""
    for layer in layers[:: deferred_flush.GROUP]:
        layer.wide()


def flushes(layers: list[Layer]) -> None:
    """Every layer's flush of sequence 0's tile, one after another (``Layer.flush``)."""
    for layer in layers:
        layer.flush()


def flush_collected(layers: list[Layer]) -> None:
    """The FLUSH launches of the calls the step's op deferred (``COLLECTED``), ``deferred_flush.GROUP`` a launch."""
    for i in range(0, len(COLLECTED), deferred_flush.GROUP):
        flush_tiles(COLLECTED[i : i + deferred_flush.GROUP], deferred_flush.GROUP)


class SideGraph(NamedTuple):
    """A variant that replays a graph of its own beside the next step's: the step's variant, the side graph's work."""

    step: Variant
    work: Callable[[list[Layer]], None]


SIDE_GRAPHS = {
    "side-tiny": SideGraph(VARIANTS["none"], tiny_kernel),
    "side-wide": SideGraph(VARIANTS["none"], wide_kernels),
    "side-flush": SideGraph(VARIANTS["none"], flushes),
    "side-deferred": SideGraph(Variant("one", lag=2, defer=True, flush=False), flush_collected),
    "side-deferred-none": SideGraph(Variant("none", lag=2, defer=True, flush=False), flush_collected),
}


def replayed_beside(step, beside, replays: int = 100, repeats: int = 5) -> float:
    """As ``replayed``, with a second graph (of ``beside``) replayed on a side stream after each replay of the step's
    graph, beside the next one; a step's replay first waits for the side graph of the step two before it (so that
    at most one runs beside a step: what the step after a flushing one would wait on, its pages)."""
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    graphs = []
    for work in (step, beside):
        work()
        graphs.append(torch.cuda.CUDAGraph())
        with torch.cuda.graph(graphs[-1]):
            work()
        graphs[-1].replay()  # (side-deferred's side graph reads what the step's graph writes)
        torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    stepped, done = [torch.cuda.Event() for _ in range(2)], [torch.cuda.Event() for _ in range(2)]
    times = []
    for _ in range(repeats):
        start.record()
        for r in range(replays):
            if r >= 2:
                main.wait_event(done[r % 2])  # (recorded after side graph r - 2)
            graphs[0].replay()
            stepped[r % 2].record(main)
            side.wait_event(stepped[r % 2])
            with torch.cuda.stream(side):
                graphs[1].replay()
                done[r % 2].record(side)
        main.wait_stream(side)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / replays)
    return statistics.median(times)


def run(preset, n_layers: int, rounds: int, variants: list[str], shapes=SHAPES, timer=bench) -> list[dict]:
    if timer is bench and any(name in SIDE_GRAPHS for name in variants):
        raise SystemExit(f"{', '.join(SIDE_GRAPHS)} replay a graph of their own beside the step's: --graphs a-step")
    head, side = lm_head(), torch.cuda.Stream()
    rows = []
    for batch, context in tqdm(shapes, desc="shapes"):
        layers, x0 = model(batch, context, preset, n_layers)
        steps = {name: functools.partial(model_step, layers, head, x0, VARIANTS[name], side)
                 for name in variants if name not in SIDE_GRAPHS}  # fmt: skip
        steps["attention"] = functools.partial(attention_only, layers)
        for name in (name for name in variants if name in SIDE_GRAPHS):
            step = functools.partial(model_step, layers, head, x0, SIDE_GRAPHS[name].step, side)
            steps[name] = functools.partial(replayed_beside, step, functools.partial(SIDE_GRAPHS[name].work, layers))
        times = {name: [] for name in steps}
        for _ in range(rounds):
            for name, step in steps.items():
                times[name].append(step() if name in SIDE_GRAPHS else timer(step))
        row = {"batch": batch, "context": context, **{f"{n}_ms": statistics.median(t) for n, t in times.items()},
               "rounds": times}  # fmt: skip
        rows.append(row)
        log.info("%s", {k: v for k, v in row.items() if k != "rounds"})
        del layers, steps
        torch.cuda.empty_cache()
    return rows


def timeline(preset, n_layers: int, variants: list[str], shapes) -> str:
    """Markdown: the kernels of one replay of each variant's step (``decode_step.replay_kernels``) at each shape."""
    head, lines = lm_head(), []
    for batch, context in shapes:
        layers, x0 = model(batch, context, preset, n_layers)
        for name in variants:
            step = functools.partial(model_step, layers, head, x0, VARIANTS[name], torch.cuda.Stream())
            lines += kernel_table(replay_kernels(step), f"{name}, B{batch} / {context}")
        del layers
        torch.cuda.empty_cache()
    return "\n".join(lines)


def parse_shapes(text: str) -> list[tuple[int, int]]:
    return [tuple(int(n) for n in shape.split("x")) for shape in text.split(",")]


def timed_costs(rows: list[dict]) -> list[str]:
    return [v for v in [*COSTS, *SIDE_GRAPHS] if f"{v}_ms" in rows[0]]


def markdown(rows: list[dict], title: str) -> str:
    costs_run = timed_costs(rows)
    lines = [title, "", "| batch | context | attention (ms) | none (ms) | " + " | ".join(
        f"{v}: +us, % of attention" for v in costs_run) + " |", "|---" * (4 + len(costs_run)) + "|"]  # fmt: skip
    for r in rows:
        costs = [(r[f"{v}_ms"] - r["none_ms"]) * 1e3 for v in costs_run]
        lines.append(f"| {r['batch']} | {r['context']} | {r['attention_ms']:.4f} | {r['none_ms']:.4f} | "
                     + " | ".join(f"{c:+.1f} us, {c / (r['attention_ms'] * 10):+.1f}%" for c in costs) + " |")  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: pathlib.Path, title: str) -> None:
    from plots import save, subplots

    fig, ax = subplots(1, 1, figsize=(8, 3.5))
    names = [f"B{r['batch']}/{r['context'] // 1024}K" for r in rows]
    costs_run = timed_costs(rows)
    width = 0.8 / len(costs_run)
    for i, v in enumerate(costs_run):
        shares = [(r[f"{v}_ms"] - r["none_ms"]) / r["attention_ms"] * 100 for r in rows]
        ax.bar([j + (i - (len(costs_run) - 1) / 2) * width for j in range(len(rows))], shares, width, label=v)
    ax.axhline(5, color="k", lw=0.8, ls="--", label="issue 2's 5%")
    ax.set_xticks(range(len(rows)), names, fontsize=8)
    ax.set_ylabel("step cost of one completing tile\n(% of the layers' attention)")
    ax.legend(fontsize=8)
    save(fig, path, title.split(";")[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--preset", default="kvarn_k4v2_g128")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--costs",
        nargs="+",
        choices=[*COSTS, *SIDE_GRAPHS],
        default=COSTS,
        metavar="VARIANT",
        help=f"the variants timed beside none (default: all of {', '.join(COSTS)}; with --graphs a-step also "
        f"{', '.join(SIDE_GRAPHS)})",
    )
    parser.add_argument(
        "--timeline",
        nargs="*",
        choices=list(VARIANTS),
        metavar="VARIANT",
        help="also the kernels of one step of each (at the --timeline-shapes)",
    )
    parser.add_argument(
        "--timeline-shapes",
        type=parse_shapes,
        default=[(8, 8192)],
        help="BATCHxCONTEXT shapes of the timelines, comma-separated (default 8x8192)",
    )
    parser.add_argument("--shapes", help="only these BATCHxCONTEXT shapes, comma-separated (e.g. 8x8192,32x8192)")
    parser.add_argument(
        "--graphs",
        choices=["unrolled", "a-step"],
        default="unrolled",
        help="time a graph of many steps in a row (triton's do_bench_cudagraph, the default) or a step's own graph "
        "replayed many times in a row, as a server replays it",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    if not torch.cuda.is_available():
        raise SystemExit("flush_overlap.py times CUDA kernels: it needs a GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    preset = get_preset(args.preset)
    title = (f"A {args.layers}-layer Qwen3-8B-shaped decode step with sequences completing tiles, {preset.name}, "
             f"{torch.cuda.get_device_name()}; median ms (CUDA graphs: {args.graphs})")  # fmt: skip
    if args.timeline:
        (args.out / "timeline.md").write_text(timeline(preset, args.layers, args.timeline, args.timeline_shapes))
    shapes = parse_shapes(args.shapes) if args.shapes else SHAPES
    timer = bench if args.graphs == "unrolled" else replayed
    rows = run(preset, args.layers, args.rounds, ["none", *args.costs], shapes, timer)
    write_results(args.out, {"title": title, "rows": rows}, markdown(rows, title))
    plot(rows, args.out / "flush_overlap.png", title)


if __name__ == "__main__":
    main()
