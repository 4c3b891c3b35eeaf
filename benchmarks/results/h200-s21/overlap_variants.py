"""Session 21, for one device call: where the +13 us of session 20's overlapped decode step ("none" case) comes
from, and which fork order keeps the "one" case's gain. Each variant is one layer's decode step (or a part of
it), medians of CUDA-graph replays, side by side in one run (run from benchmarks/, PYTHONPATH = the repository):

    attention  rotation + attention (+ combine)          append  rotation + append
    in_order   both, one stream (the package)            first   append forked before the attention (the patch)
    first_hi   as first, side stream of highest priority after   append forked after the attention's launches

    python results/h200-s21/overlap_variants.py --out DIR   (PYTHONPATH also holds benchmarks/)
"""

import argparse
import functools
import json
import logging
import pathlib

import torch
from attention import HKV, HQ, D, bench, filled_cache
from decode_step import step_inputs
from tqdm import tqdm

from kvarn_compile import get_preset
from kvarn_compile.ops import rotated_many, triton_append, triton_attention

log = logging.getLogger("kvarn.bench")
SHAPES = ((1, 2048), (8, 8192), (8, 32768), (32, 8192), (256, 1536))


def parts(q, k, v, out, tensors, slots, start, qsl, preset):
    pages, exact_k, exact_v, page_table, seq_lens = tensors
    q, k, v = rotated_many([q, k, v], [torch.float32, k.dtype, v.dtype])
    attend = functools.partial(
        triton_attention,
        q,
        k,
        v,
        pages,
        exact_k,
        exact_v,
        page_table,
        slots,
        start,
        qsl,
        preset,
        D**-0.5,
        True,
        0,
        1,
        out=out,
        rotated=True,
    )
    append = functools.partial(
        triton_append,
        k,
        v,
        pages,
        exact_k,
        exact_v,
        page_table,
        seq_lens,
        slots,
        start,
        qsl,
        preset,
        1,
        rotated_kv=True,
    )
    return attend, append


def variant(name, side_streams, *inputs):
    attend, append = parts(*inputs)
    if name == "attention":
        attend()
    elif name == "append":
        append()
    elif name == "in_order":
        attend()
        append()
    else:
        side = side_streams[name]
        main = torch.cuda.current_stream()
        if name == "after":
            attend()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            append()
        if name != "after":
            attend()
        main.wait_stream(side)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=pathlib.Path, required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    args.out.mkdir(parents=True, exist_ok=True)
    preset = get_preset("kvarn_k4v2_g128")
    least, greatest = torch.cuda.Stream.priority_range()
    side_streams = {
        "first": torch.cuda.Stream(),
        "after": torch.cuda.Stream(),
        "first_hi": torch.cuda.Stream(priority=greatest),
    }
    names = ("attention", "append", "in_order", "first", "first_hi", "after")
    rows = []
    for batch, context in tqdm(SHAPES, desc="shapes"):
        cache = filled_cache(batch, context, preset)
        tensors = cache.tensors()
        for case in ("none", "one"):
            q, k, v, out, slots, start, qsl = step_inputs(batch, context, case, preset)
            row = {"batch": batch, "context": context, "case": case}
            for name in names:
                row[name] = bench(
                    functools.partial(variant, name, side_streams, q, k, v, out, tensors, slots, start, qsl, preset)
                )
            rows.append(row)
            log.info("%s", row)
        del cache
        torch.cuda.empty_cache()
    lines = [
        (
            f"{torch.cuda.get_device_name()}, one layer's decode step, k4v2_g128, {HQ}/{HKV} heads, D {D}, fp16; "
            f"median ms of CUDA-graph replays; stream priorities {least}..{greatest}"
        ),
        "",
        "| batch | context | case | " + " | ".join(names) + " |",
        "|---" * (3 + len(names)) + "|",
    ]
    lines += [
        f"| {r['batch']} | {r['context']} | {r['case']} | " + " | ".join(f"{r[n]:.4f}" for n in names) + " |"
        for r in rows
    ]
    (args.out / "variants.md").write_text("\n".join(lines) + "\n")
    (args.out / "variants.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
