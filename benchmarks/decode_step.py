"""One attention layer's decode step as vLLM runs it, with and without tiles completing in it (needs a GPU).

``kvarn::attend_and_append`` (rotations, attention, combine, then quantize-and-store) against the same steps one
after the other ("in order": ``rotated_many``, ``triton_attention``, ``triton_append``), side by side in one run,
medians of CUDA-graph replays, at each batch x context (32 query / 8 KV heads, head_dim 128, fp16,
--preset) for four steps: no sequence completes a tile ("none"), the first one does ("one": in serving that
does not start every request together, some sequence completes a tile in most steps), the last one does ("last":
a grid in batch order reaches it last), every one does ("all": a burst of equal prompts). A completed tile is
quantized by one program (~0.1 ms on the H200 whatever the batch: the README's flush column), so "one" costs as
much as "all" up to a batch that fills the GPU with them.

    python benchmarks/decode_step.py --out DIR [--preset kvarn_k4v2_g128] [--held 5]
    python benchmarks/decode_step.py --out DIR --timeline [none|one|last|all]  # when each kernel of a step runs
    python benchmarks/decode_step.py --out DIR --compare NAME=RUN_DIR ...   # runs side by side (no GPU)

Writes DIR/results.json, DIR/results.md and DIR/decode_step.png; with ``--timeline`` DIR/timeline.md instead: each
kernel's start and end in one replay of the step's CUDA graph (torch.profiler), from the first kernel's start, to see
which of the step's kernels run beside each other and which ends last.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import pathlib

import torch
from attention import HKV, HQ, D, bench, filled_cache  # benchmarks/attention.py
from result_files import write_results
from tqdm import tqdm

from kvarn_compile import get_preset
from kvarn_compile.kernels.rotate import rotated_many
from kvarn_compile.ops import triton_append, triton_attention

log = logging.getLogger("kvarn.bench")

SHAPES = ((1, 2048), (1, 8192), (8, 8192), (8, 32768), (32, 8192), (128, 2048), (256, 1536))  # the last: the burst's
CASES = ("none", "one", "last", "all")


def step_inputs(batch: int, context: int, case: str, preset, held: int = 5):
    """(q, k, v, out, slots, start_pos, query_start_loc) of a decode step at ``context`` tokens per sequence, in
    which ``case`` of the sequences complete a tile (``CASES``, "two": the first and last, or "three": the first, middle
    and last); the others hold ``held`` exact rows of their current tile."""
    g = preset.tile_size
    completing = {"none": [], "one": [0], "last": [batch - 1], "two": [0, batch - 1],
                  "three": [0, batch // 2, batch - 1], "all": list(range(batch))}[case]  # fmt: skip
    if len(set(completing)) != len(completing):
        raise ValueError(f"case {case!r} needs a batch of at least {len(completing)} sequences, got {batch}")
    start = torch.full((batch,), context + held, dtype=torch.int32, device="cuda")
    start[completing] = context + g - 1  # the step's token is the tile's last
    q, k, v = (torch.randn(batch, h, D, device="cuda", dtype=torch.float16) for h in (HQ, HKV, HKV))
    out = torch.empty_like(q)
    slots = torch.arange(batch, dtype=torch.int32, device="cuda")
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    return q, k, v, out, slots, start, qsl


def op_step(cache, inputs, preset, defer_flush: bool = False):
    """The op's decode step on ``inputs`` (``step_inputs``), a call of no arguments."""
    q, k, v, out, slots, start, qsl = inputs
    return functools.partial(torch.ops.kvarn.attend_and_append, q, k, v, out, *cache.tensors(), slots, start, qsl,
                             preset.name, D**-0.5, True, 0, 1, False, defer_flush)  # fmt: skip


def in_order(q, k, v, out, cache_tensors, slots, start, qsl, preset) -> None:
    """The step's launches one after the other on one stream."""
    pages, exact_k, exact_v, page_table, seq_lens = cache_tensors
    q, k, v = rotated_many([q, k, v], [torch.float32, k.dtype, v.dtype])
    triton_attention(q, k, v, pages, exact_k, exact_v, page_table, slots, start, qsl, preset, D**-0.5, True, 0, 1,
                     out=out, rotated=True)  # fmt: skip
    triton_append(k, v, pages, exact_k, exact_v, page_table, seq_lens, slots, start, qsl, preset, 1, rotated_kv=True)


def run(preset, held: int) -> list[dict]:
    rows = []
    for batch, context in tqdm(SHAPES, desc="shapes"):
        cache = filled_cache(batch, context, preset)
        tensors = cache.tensors()
        for case in CASES:
            inputs = step_inputs(batch, context, case, preset, held)
            q, k, v, out, slots, start, qsl = inputs
            op = op_step(cache, inputs, preset)
            steps = functools.partial(in_order, q, k, v, out, tensors, slots, start, qsl, preset)
            rows.append({"batch": batch, "context": context, "case": case, "in_order_ms": bench(steps),
                         "op_ms": bench(op)})  # fmt: skip
            log.info("%s", rows[-1])
        del cache
        torch.cuda.empty_cache()
    return rows


def replay_kernels(step) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of each kernel of one replay of ``step`` captured in a CUDA graph, from the first
    kernel's start, as torch.profiler (CUPTI) records them; [] if it recorded none."""
    from torch.profiler import ProfilerActivity, profile

    bench(step)  # compiled and warm
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA)  # fmt: skip
    t0 = kernels[0][0] if kernels else 0.0
    return [(a - t0, b - t0, name) for a, b, name in kernels]


def kernel_table(kernels: list[tuple[float, float, str]], heading: str) -> list[str]:
    """Markdown lines: ``heading``, then one row per kernel of ``replay_kernels``."""
    if not kernels:
        return [f"{heading}: the profiler recorded no kernel in the graph's replay", ""]
    lines = [f"{heading} (us from the first kernel's start)", "", "| kernel | start | end | duration |",
             "|---|---|---|---|"]  # fmt: skip
    return lines + [f"| {name[:60]} | {a:.1f} | {b:.1f} | {b - a:.1f} |" for a, b, name in kernels] + [""]


def timeline(preset, case: str, held: int) -> str:
    """Markdown: per shape, the kernels of one replay of the step's CUDA graph (``case`` of the sequences
    completing a tile, the others holding ``held`` exact rows) with their start and end in us from the first one's
    start."""
    lines = []
    for batch, context in tqdm(SHAPES, desc="shapes"):
        cache = filled_cache(batch, context, preset)
        kernels = replay_kernels(op_step(cache, step_inputs(batch, context, case, preset, held), preset))
        lines += kernel_table(kernels, f"B{batch} / {context} tokens")
        del cache
        torch.cuda.empty_cache()
    return "\n".join(lines)


def markdown(rows: list[dict], title: str) -> str:
    lines = [title, "", "| batch | context | tiles completing | in order (ms) | op (ms) | op / in order |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    lines += [f"| {r['batch']} | {r['context']} | {r['case']} | {r['in_order_ms']:.4f} | {r['op_ms']:.4f} | "
              f"{r['op_ms'] / r['in_order_ms']:.2f} |" for r in rows]  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: pathlib.Path, title: str) -> None:
    from plots import save, subplots

    fig, axes = subplots(1, len(CASES), figsize=(4 * len(CASES), 3.5), sharey=True)
    for ax, case in zip(axes, CASES, strict=True):
        group = [r for r in rows if r["case"] == case]
        names = [f"B{r['batch']}/{r['context'] // 1024}K" for r in group]
        x = range(len(group))
        ax.bar([i - 0.2 for i in x], [r["in_order_ms"] for r in group], 0.4, label="in order")
        ax.bar([i + 0.2 for i in x], [r["op_ms"] for r in group], 0.4, label="kvarn::attend_and_append")
        ax.set_xticks(list(x), names, rotation=30, fontsize=8)
        ax.set_title(f"tiles completing: {case}", fontsize=9)
    axes[0].set_ylabel("ms per layer and step")
    axes[0].legend(fontsize=8)
    save(fig, path, title)


def compare(runs: dict[str, pathlib.Path], out: pathlib.Path, tile: int) -> None:
    """Several runs' op times side by side (out/compare.md, out/compare.png): per shape and case, and two expected
    steps over a tile's ``tile`` steps. "mix": the batch's sequences each complete a tile with probability 1 / ``tile``
    per step (positions spread evenly, as in vLLM serving that does not start every request together): P(none) =
    (1 - 1/tile)^batch of the steps cost "none", the rest "one" (two or more completing cost about one's: their
    programs run in one wave). "sync": all complete in the same step, once in ``tile`` steps (a batch decoding in
    lockstep, as transformers' static cache does): "none" + ("all" - "none") / tile."""
    from plots import save, subplots

    ms = {name: {(r["batch"], r["context"], r["case"]): r["op_ms"] for r in json.loads((d / "results.json").read_text())
                 ["rows"]} for name, d in runs.items()}  # fmt: skip
    first = next(iter(ms.values()))
    shapes = sorted({key[:2] for key in first})
    cases = [c for c in CASES if any(key[2] == c for key in first)] + ["mix", "sync"]
    for table in ms.values():
        for b, c in shapes:
            p_none = (1 - 1 / tile) ** b
            table[b, c, "mix"] = p_none * table[b, c, "none"] + (1 - p_none) * table[b, c, "one"]
            table[b, c, "sync"] = table[b, c, "none"] + (table[b, c, "all"] - table[b, c, "none"]) / tile
    names = list(runs)
    legend = f"mix: (1 - 1/{tile})^batch x none + the rest x one; sync: none + (all - none) / {tile}"
    lines = [f"op ms per layer and step; {legend}", "",
             "| batch | context | case | " + " | ".join(names) + " |", "|---" * (3 + len(names)) + "|"]  # fmt: skip
    lines += [f"| {b} | {c} | {case} | " + " | ".join(f"{ms[n].get((b, c, case), float('nan')):.4f}" for n in names)
              + " |" for b, c in shapes for case in cases]  # fmt: skip
    (out / "compare.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    fig, axes = subplots(1, len(cases), figsize=(4 * len(cases), 3.5))
    width = 0.8 / len(names)
    for ax, case in zip(axes, cases, strict=True):
        lowest = 1.0
        for i, name in enumerate(names):  # each shape's time over the first run's, so that all shapes read alike
            ratios = [ms[name].get((b, c, case), float("nan")) / first[b, c, case] for b, c in shapes]
            ax.bar([j + (i - (len(names) - 1) / 2) * width for j in range(len(shapes))], ratios, width, label=name)
            lowest = min([lowest, *(r for r in ratios if not math.isnan(r))])
        ax.set_xticks(range(len(shapes)), [f"B{b}/{c / 1024:g}K" for b, c in shapes], rotation=30, fontsize=8)
        ax.set_ylim(min(0.8, 0.9 * lowest), None)  # close runs stay readable; far ones stay in the frame
        ax.set_title(f"tiles completing: {case}", fontsize=9)
    axes[0].set_ylabel(f"op time / {names[0]}'s")
    axes[0].legend(fontsize=8)
    save(fig, out / "compare.png", f"One layer's decode step: {', '.join(names)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--preset", default="kvarn_k4v2_g128")
    parser.add_argument(
        "--held",
        type=int,
        default=5,
        help="exact rows of their current tile the sequences that complete none hold (default 5)",
    )
    parser.add_argument(
        "--timeline",
        nargs="?",
        const="none",
        choices=CASES,
        help="each kernel's start and end in one step (of this case; default none), instead",
    )
    parser.add_argument(
        "--compare",
        nargs="+",
        metavar="NAME=DIR",
        help="runs' results.json side by side (compare.md, compare.png), instead; needs no GPU",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.compare:
        runs = dict(run.split("=", 1) for run in args.compare)
        compare({name: pathlib.Path(d) for name, d in runs.items()}, args.out, get_preset(args.preset).tile_size)
        return
    if not torch.cuda.is_available():
        raise SystemExit("decode_step.py times CUDA kernels: it needs a GPU")
    preset = get_preset(args.preset)
    if not 0 <= args.held <= preset.tile_size - 2:
        raise SystemExit(f"--held must be in [0, {preset.tile_size - 2}] (a step's token must not complete the tile)")
    if args.timeline:
        title = (
            f"One layer's decode step's kernels, tiles completing: {args.timeline}, {preset.name}, "
            f"{torch.cuda.get_device_name()}; {args.held} exact rows held"
        )
        text = f"{title}\n\n{timeline(preset, args.timeline, args.held)}"
        (args.out / "timeline.md").write_text(text)
        print(text)
        return
    rows = run(preset, args.held)
    title = (f"One layer's decode step, {preset.name}, {HQ} query / {HKV} KV heads, head_dim {D}, fp16, "
             f"{torch.cuda.get_device_name()}; {args.held} exact rows held; median ms (CUDA graphs)")  # fmt: skip
    write_results(args.out, {"title": title, "rows": rows}, markdown(rows, title))
    plot(rows, args.out / "decode_step.png", title)


if __name__ == "__main__":
    main()
