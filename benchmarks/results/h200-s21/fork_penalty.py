"""Session 21, for one device call: why forking a decode step's append before its attention (``first`` in
overlap_variants.py) costs ~13 us when no tile completes, although the append alone takes ~4 us. Variants of one
layer's decode step ("none" and "one" cases), medians of CUDA-graph replays, side by side:

    in_order       the package                    first        the append on a side stream, forked first
    first_noop     a one-element add forked first instead of the append (the fork and join alone)
    in_order_1s    in_order, the attention's exact split on the main stream (no side stream at all)
    first_1s       first, the attention's exact split on the main stream (one side stream: the append's)

    (cd benchmarks && PYTHONPATH=$PWD/..:$PWD python results/h200-s21/fork_penalty.py --out DIR)
"""

import argparse
import functools
import json
import logging
import pathlib

import overlap_variants as ov
import torch
from attention import bench, filled_cache
from decode_step import step_inputs

from kvarn_compile import get_preset
from kvarn_compile.kernels import paged_attention

log = logging.getLogger("kvarn.bench")
SHAPES = ((8, 8192), (256, 1536))


def step(name, side, scratch, *inputs):
    attend, append = ov.parts(*inputs)
    main = torch.cuda.current_stream()
    if name.startswith("in_order"):
        attend()
        append()
        return
    side.wait_stream(main)
    with torch.cuda.stream(side):
        scratch.add_(1) if name == "first_noop" else append()
    attend()
    if name == "first_noop":
        append()
    main.wait_stream(side)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=pathlib.Path, required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    args.out.mkdir(parents=True, exist_ok=True)
    preset = get_preset("kvarn_k4v2_g128")
    side, scratch = torch.cuda.Stream(), torch.zeros(1, device="cuda")
    exact_stream = paged_attention._exact_part_stream
    names = ("in_order", "first", "first_noop", "in_order_1s", "first_1s")
    rows = []
    for batch, context in SHAPES:
        cache = filled_cache(batch, context, preset)
        for case in ("none", "one"):
            inputs = step_inputs(batch, context, case, preset)
            q, k, v, out, slots, start, qsl = inputs
            row = {"batch": batch, "context": context, "case": case}
            for name in names:
                one_side = name.endswith("_1s")
                paged_attention._exact_part_stream = (
                    (lambda d: torch.cuda.current_stream()) if one_side else exact_stream
                )
                row[name] = bench(
                    functools.partial(
                        step,
                        name.removesuffix("_1s"),
                        side,
                        scratch,
                        q,
                        k,
                        v,
                        out,
                        cache.tensors(),
                        slots,
                        start,
                        qsl,
                        preset,
                    )
                )
            paged_attention._exact_part_stream = exact_stream
            rows.append(row)
            log.info("%s", row)
        del cache
    lines = [
        f"{torch.cuda.get_device_name()}, one layer's decode step (k4v2_g128, 32/8 heads, D 128, fp16), ms",
        "",
        "| batch | context | case | " + " | ".join(names) + " |",
        "|---" * (3 + len(names)) + "|",
    ]
    lines += [
        f"| {r['batch']} | {r['context']} | {r['case']} | " + " | ".join(f"{r[n]:.4f}" for n in names) + " |"
        for r in rows
    ]
    (args.out / "fork_penalty.md").write_text("\n".join(lines) + "\n")
    (args.out / "fork_penalty.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
