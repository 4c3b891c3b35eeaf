"""Prepared for the next device call (session 22, not run): with session 22's flush (1,120 instructions per
normalisation iteration instead of 1,931; 128 registers at 16 warps against 255 at 8), does a flush program of 16
warps finish sooner when few sequences complete a tile in a step, as in serving whose requests arrive at
different times (the staggered burst: ~2 of 256 per step)? On the previous kernel 16 warps were slower at every
batch, batch 1 included (0.110 -> 0.162 ms; batch 32 0.37 -> 0.60: results/h200-combine-s18/call2/append-w16.txt),
so expect the same unless the shorter chain changed what bounds it; the 4 / 8 knobs are the surer gain.

The append kernel of one decode step at 8K context (k4v2_g128, 8 KV heads, D 128, inputs rotated), with 0, 2 or
all of the batch's sequences completing a tile, at 8 and 16 warps, and with the preset's knobs at 8 / 16 (the
package) and 4 / 8 (normalisation iterations / flip rounds; as accurate on SmolLM2: results/smollm2-eval-knobs).
Medians of CUDA-graph replays. From benchmarks/, PYTHONPATH = the repository and benchmarks/:

    python3 results/h200-s22/next_flush_warps.py --out DIR

Writes DIR/flush_warps.md and .json (~1-2 min on an H200).
"""

import dataclasses
import functools
import logging

import torch
from attention import HKV, D, bench, filled_cache
from result_files import out_dir, write_table

from kvarn_compile import get_preset
from kvarn_compile.kernels import quantize_store
from kvarn_compile.ops import triton_append

log = logging.getLogger("kvarn.bench")
KNOBS = ((8, 16), (4, 8))  # (iterations, flip rounds)


class Warps:
    """Stands in for the append kernel: kernel[grid](...) launched with ``warps`` warps."""

    def __init__(self, kernel, warps: int):
        self.kernel, self.warps = kernel, warps

    def __getitem__(self, grid):
        launch = self.kernel[grid]
        return lambda *args, **kwargs: launch(*args, **{**kwargs, "num_warps": self.warps})


def main() -> None:
    out = out_dir(__doc__)
    base = get_preset("kvarn_k4v2_g128")
    kernel = quantize_store._quantize_store_kernel
    context, rows = 8192, []
    for batch in (1, 8, 256):
        cache = filled_cache(batch, context, base)
        k, v = (torch.randn(batch, HKV, D, device="cuda", dtype=torch.float16) for _ in range(2))
        slots = torch.arange(batch, dtype=torch.int32, device="cuda")
        qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        for flushing in sorted({0, min(2, batch), batch}):
            start = torch.full((batch,), context + 5, dtype=torch.int32, device="cuda")
            start[:flushing] = context + base.tile_size - 1  # these sequences complete a tile
            for warps in (8, 16):
                for iters, flips in KNOBS if flushing else KNOBS[:1]:
                    preset = dataclasses.replace(base, iterations=iters, value_flips=flips)
                    quantize_store._quantize_store_kernel = Warps(kernel, warps)
                    try:
                        ms = bench(functools.partial(triton_append, k, v, *cache.tensors(), slots, start, qsl, preset, 1,
                                                     rotated_kv=True))  # fmt: skip
                    finally:
                        quantize_store._quantize_store_kernel = kernel
                    rows.append({"batch": batch, "flushing": flushing, "warps": warps, "iterations": iters,
                                 "flips": flips, "ms": ms})  # fmt: skip
                    log.info("%s", rows[-1])
        del cache
    title = (f"{torch.cuda.get_device_name()}: the append kernel of one decode step at {context} tokens (k4v2_g128, "
             f"{HKV} KV heads, D {D}, inputs rotated), median ms of CUDA-graph replays")  # fmt: skip
    columns = {"batch": "batch", "flushing": "sequences completing a tile", "warps": "warps", "iterations": "iterations",
               "flips": "flip rounds", "ms": "ms"}  # fmt: skip
    write_table(out, "flush_warps", title, rows, columns)


if __name__ == "__main__":
    main()
