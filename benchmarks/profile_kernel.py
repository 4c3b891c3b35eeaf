"""Launch the decode attention kernels a few times at one size, for a profiler (ncu) to pick one launch.

A decode step launches the Gluon kernel over the quantized tiles (``_decode_attention_kernel``) and the
Triton kernel for the exact part (``_paged_attention_kernel``, the whole step where the Gluon one does not
serve the configuration; it also merges the partials where ``merge_in_exact_split``, else ``combine_splits`` does):

    ncu --clock-control none -k regex:_decode_attention_kernel -s 2 -c 1 --set full \
        python benchmarks/profile_kernel.py --batch 8 --context 32768

``--flush`` launches the append of a decode step in which every sequence completes a tile instead (the
``_quantize_store_kernel``: normalise, round and pack each completed tile; the flush column of attention.py).
"""

from __future__ import annotations

import argparse

import torch
from attention import HKV, HQ, D, filled_cache

from kvarn_compile import get_preset
from kvarn_compile.kernels.paged_attention import paged_attention
from kvarn_compile.kernels.rotate import rotated_to


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--preset", default="kvarn_k4v2_g128")
    parser.add_argument("--launches", type=int, default=4)
    parser.add_argument("--flush", action="store_true", help="the append kernel of a tile flush instead")
    args = parser.parse_args()
    preset = get_preset(args.preset)
    b, ctx = args.batch, args.context
    cache = filled_cache(b, ctx, preset)
    q = rotated_to(torch.randn(b, HQ, D, device="cuda", dtype=torch.float16), torch.float32)
    k, v = (torch.randn(b, HKV, D, device="cuda", dtype=torch.float16) for _ in range(2))
    slots = torch.arange(b, dtype=torch.int32, device="cuda")
    start = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
    qsl = torch.arange(b + 1, dtype=torch.int32, device="cuda")
    completing = torch.full((b,), ctx + preset.tile_size - 1, dtype=torch.int32, device="cuda")
    for _ in range(args.launches):
        if args.flush:  # the same cache state each time: the append leaves the tile's page rewritten alike
            torch.ops.kvarn.append(k, v, *cache.tensors(), slots, completing, qsl, preset.name, 1)
        else:
            paged_attention(q, k, v, *cache.tensors()[:4], slots, start, qsl, preset, D**-0.5, True, 0, 1)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
