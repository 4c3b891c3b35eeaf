"""A/B of decode-attention kernel variants: the package's kernel against copies of it, same inputs, one run.

Each variant is a file with a ``paged_attention`` launcher like ``kvarn_compile/kernels/paged_attention.py``
(a copy with its relative imports made absolute), or a dotted module name, e.g. a patched copy of the kernels
subpackage (``bash benchmarks/patched_kernels.sh PATCH b`` makes ``kvarn_compile/kernels_b``, named
``kvarn_compile.kernels_b.paged_attention``: its relative imports keep working), optionally with launch settings:

    python benchmarks/attention_ab.py --out ab.json VARIANT.py[:num_warps=4,num_stages=2] ...

``package:SETTINGS`` is the package's kernel with other launch settings (e.g. ``package:num_splits=64``).
With ``--combine`` the variants are ``combine_splits`` modules instead (e.g. ``kvarn_compile.kernels_b.combine_splits``),
timed on the package attention kernel's partials of each shape (merge and rotation back, as the op runs them).

For each shape (batch x context, 32 query / 8 KV heads, --head-dim (128), --preset (kvarn_k4v2_g128), one new
token per sequence) it prints the attention kernels' median time (from rotated inputs to the merged output) in
CUDA-graph replays and the largest difference of the output from the package kernel's. Without a GPU it runs a small shape under
TRITON_INTERPRET=1 and only compares (a variant's inline PTX then falls back to Triton ops).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

from attention import HKV, HQ, D, bench, filled_cache, kvarn_bytes  # benchmarks/attention.py

from kvarn_compile import Batch, KVarNCache, get_preset, store
from kvarn_compile.kernels import combine_splits as package_combine
from kvarn_compile.kernels import paged_attention as package_kernel
from kvarn_compile.kernels.rotate import rotated_to

GPU = torch.cuda.is_available()
SHAPES = (
    ((8, 32768), (32, 8192), (128, 2048), (1, 32768), (256, 1536), (8, 131072), (1, 2048), (8, 2048))
    if GPU
    else ((2, 700),)
)


def load_variant(spec: str, package=package_kernel):
    """'path.py[:key=value,...]', 'dotted.module[:...]' or 'package[:...]' -> (name, module, launch settings)."""
    path, _, settings = spec.partition(":")
    name = (pathlib.Path(path).stem if path.endswith(".py") else path) + (f"[{settings}]" if settings else "")
    if path == "package":
        module = package
    elif not path.endswith(".py"):
        module = importlib.import_module(path)
    else:
        module_spec = importlib.util.spec_from_file_location(f"variant_{len(name)}_{abs(hash(spec))}", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    kwargs = {k: int(v) for k, v in (item.split("=") for item in settings.split(",") if item)}
    return name, module, kwargs


def inputs(batch: int, context: int, preset, head_dim: int):
    device = "cuda" if GPU else "cpu"
    if GPU:
        cache = filled_cache(batch, context, preset, head_dim=head_dim)
    else:
        cache = KVarNCache.allocate(batch, context + preset.tile_size, HKV, head_dim, preset=preset)
        k = torch.randn(batch * context, HKV, head_dim, dtype=torch.float16)
        k[..., 5] *= 10
        store(cache, k, torch.randn_like(k), Batch.from_lengths(list(range(batch)), [0] * batch, [context] * batch))
    q, k, v = (torch.randn(batch, h, head_dim, device=device, dtype=torch.float16) for h in (HQ, HKV, HKV))
    rotated = rotated_to(q, torch.float32), rotated_to(k, k.dtype), rotated_to(v, v.dtype)
    slots = torch.arange(batch, dtype=torch.int32, device=device)
    start = torch.full((batch,), context, dtype=torch.int32, device=device)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
    return cache, (*rotated, *cache.tensors()[:4], slots, start, qsl, preset, head_dim**-0.5, True, 0, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variants", nargs="*", help="VARIANT.py[:num_warps=N,num_stages=N]")
    parser.add_argument("--out", type=pathlib.Path, required=True, help="JSON file for the results")
    parser.add_argument("--preset", default="kvarn_k4v2_g128", help="the cache's preset name")
    parser.add_argument("--head-dim", type=int, default=D, help="query, key and value head dim")
    parser.add_argument("--combine", action="store_true", help="the variants are combine_splits modules")
    args = parser.parse_args()
    preset = get_preset(args.preset)
    package = package_combine if args.combine else package_kernel
    variants = [("package", package, {})] + [load_variant(spec, package) for spec in args.variants]
    rows = []
    for batch, context in SHAPES:
        torch.manual_seed(0)
        cache, call = inputs(batch, context, preset, args.head_dim)
        row, reference = {"batch": batch, "context": context}, None
        partials = package_kernel.paged_partials(*call)
        merged = torch.empty(batch, HQ, args.head_dim, device=call[0].device, dtype=torch.float16)
        for name, module, kwargs in variants:

            def run(module=module, kwargs=kwargs, call=call, partials=partials, merged=merged):
                if args.combine:
                    return module.combine_splits(*partials, merged, True, **kwargs)
                return module.paged_attention(*call, **kwargs)

            out = run().float()
            reference = out if reference is None else reference
            row[f"{name} max_diff"] = (out - reference).abs().max().item()
            if GPU:
                row[f"{name} ms"] = bench(run)
                row[f"{name} TB/s"] = kvarn_bytes(batch, context, preset, args.head_dim) / row[f"{name} ms"] / 1e9
        rows.append(row)
        print(json.dumps(row), flush=True)
        del cache
    args.out.write_text(json.dumps(rows, indent=1))
    if GPU:
        names = [name for name, _, _ in variants]
        print("| batch | context | " + " | ".join(f"{n} ms (max diff)" for n in names) + " |")
        print("|---|---|" + "---|" * len(names))
        for r in rows:
            cells = " | ".join(f"{r[f'{n} ms']:.4f} ({r[f'{n} max_diff']:.1e})" for n in names)
            print(f"| {r['batch']} | {r['context']} | {cells} |")


if __name__ == "__main__":
    sys.exit(main())
