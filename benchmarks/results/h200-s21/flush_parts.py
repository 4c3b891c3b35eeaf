"""Session 21, for one device call: where a tile's flush spends its time. The append kernel of one decode step
in which every sequence completes a tile (the README's flush column), with the preset's normalisation
iterations and value flip rounds varied (8/16 is the package), at batch 1 (one program's chain: latency) and 32
(4 waves of programs: throughput). Medians of CUDA-graph replays (run from benchmarks/, PYTHONPATH = the repo):

    python results/h200-s21/flush_parts.py --out DIR   (PYTHONPATH also holds benchmarks/)
"""

import argparse
import dataclasses
import functools
import json
import logging
import pathlib

import torch
from attention import HKV, D, bench, filled_cache

from kvarn_compile import get_preset
from kvarn_compile.ops import triton_append

log = logging.getLogger("kvarn.bench")
SETTINGS = ((8, 16), (8, 0), (4, 16), (4, 0), (0, 16), (0, 0))  # (iterations, value flips)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=pathlib.Path, required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    args.out.mkdir(parents=True, exist_ok=True)
    base = get_preset("kvarn_k4v2_g128")
    context = 8192
    rows = []
    for batch in (1, 8, 32):
        cache = filled_cache(batch, context, base)
        k, v = (torch.randn(batch, HKV, D, device="cuda", dtype=torch.float16) for _ in range(2))
        slots = torch.arange(batch, dtype=torch.int32, device="cuda")
        qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        for name, pos in (("append", context + 5), ("flush", context + base.tile_size - 1)):
            start = torch.full((batch,), pos, dtype=torch.int32, device="cuda")
            for iters, flips in SETTINGS if name == "flush" else SETTINGS[:1]:
                preset = dataclasses.replace(base, iterations=iters, value_flips=flips)
                ms = bench(
                    functools.partial(
                        triton_append, k, v, *cache.tensors(), slots, start, qsl, preset, 1, rotated_kv=True
                    )
                )
                rows.append({"batch": batch, "step": name, "iterations": iters, "flips": flips, "ms": ms})
                log.info("%s", rows[-1])
        del cache
    lines = [
        (
            f"{torch.cuda.get_device_name()}: the append kernel of one decode step (k4v2_g128, {HKV} KV heads, "
            f"D {D}, fp16, inputs rotated), median ms of CUDA-graph replays"
        ),
        "",
        "| batch | step | iterations | flip rounds | ms |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {r['batch']} | {r['step']} | {r['iterations']} | {r['flips']} | {r['ms']:.4f} |" for r in rows]
    (args.out / "flush_parts.md").write_text("\n".join(lines) + "\n")
    (args.out / "flush_parts.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
