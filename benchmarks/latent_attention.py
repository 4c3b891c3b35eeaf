"""MLA decode attention in latent space on the GPU: KVarN's latent cache (kvarn::latent_attention) vs the same
attention over a bf16 latent cache in torch (two batched GEMMs).

DeepSeek-V2/V3 latent sizes (latent 512, rope 64), one query token per sequence, H query heads (16:
DeepSeek-V2-Lite; 128: V3 on one GPU). The baseline is the same attention over a dense bf16 latent cache
in two batched GEMMs and a softmax (torch SDPA has no fused kernel for 576 / 512 head dims: its math path
ran out of memory at 8 x 32K); no paging. Times with CUDA graphs (median); the kvarn op includes its checks and rotations.
Also the append of a decode step that completes a tile (the flush). Writes results.json / results.md /
speedup.png to --out. ``--sweep`` also times the kernel alone (its launcher, without the op's rotations) for each
launch setting in ``SWEEP`` and the launcher's default (sweep.md / sweep.json).

    cd benchmarks && PYTHONPATH=.. python latent_attention.py --out DIR [--sweep]
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import logging
import pathlib

import torch
from attention import bench
from tqdm import tqdm

from kvarn_compile import Batch, get_preset
from kvarn_compile.paged_latent import LatentCache

log = logging.getLogger("kvarn.bench")
L, R = 512, 64
CONFIGS = [(16, 1, 8192), (16, 8, 8192), (16, 8, 32768), (16, 32, 32768), (128, 8, 8192), (128, 8, 32768)]
SCALE = 192**-0.5  # DeepSeek's softmax scale: (no-rope 128 + rope 64) ** -0.5
# (block_t, num_warps, num_stages) of ``kernels.latent_attention.latent_attention`` tried besides its default
SWEEP = [(32, 8, 3), (64, 4, 3), (128, 4, 2), (32, 4, 2), (64, 8, 3), (16, 4, 3), (64, 4, 2)]
SWEEP_SHAPES = [(16, 1, 8192), (16, 8, 32768), (16, 32, 32768), (128, 8, 32768)]  # (heads, batch, context)


def filled_cache(batch: int, context: int, preset) -> LatentCache:
    """``context`` tokens per slot: a pool of 16 quantized tiles made by the append kernel, repeated."""
    g = preset.tile_size
    cache = LatentCache.allocate(batch, context + g, L, R, preset, torch.bfloat16, "cuda")
    pool = LatentCache.allocate(1, 16 * g, L, R, preset, torch.bfloat16, "cuda")
    c, r = torch.randn(16 * g, L, device="cuda").bfloat16(), torch.randn(16 * g, R, device="cuda").bfloat16()
    batch0 = Batch.from_lengths([0], [0], [16 * g], device="cuda")
    torch.ops.kvarn.latent_append(c, r, *pool.tensors(), *batch0[:3], preset.name, 16 * g)
    reps = -(-cache.pages.shape[0] // 16)
    cache.pages.copy_(pool.pages.repeat(reps, 1)[: cache.pages.shape[0]])
    cache.exact_c.normal_()
    cache.exact_r.normal_()
    cache.seq_lens.fill_(context)
    return cache


def decode_step(heads: int, batch: int, context: int, preset) -> tuple:
    """A decode step's inputs: (cache, q_c [B, H, L], q_r [B, H, R] bf16, slots, kv_lens, query_start_loc)."""
    cache = filled_cache(batch, context, preset)
    q_c = torch.randn(batch, heads, L, device="cuda").bfloat16()
    q_r = torch.randn(batch, heads, R, device="cuda").bfloat16()
    slots = torch.arange(batch, dtype=torch.int32, device="cuda")
    kv_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    return cache, q_c, q_r, slots, kv_lens, qsl


def run(heads: int, batch: int, context: int, preset) -> dict:
    cache, q_c, q_r, slots, kv_lens, qsl = decode_step(heads, batch, context, preset)
    kvarn = bench(functools.partial(torch.ops.kvarn.latent_attention, q_c, q_r, *cache.tensors(), slots, kv_lens, qsl,
                                    preset.name, SCALE, 1))  # fmt: skip
    del cache
    keys = torch.randn(batch, context, L + R, device="cuda").bfloat16()  # [c | rope] per token
    q = torch.cat([q_c, q_r], -1)  # [B, H, L + R]

    def bf16_latent():  # scores, softmax, the p-weighted latent: two batched GEMMs
        return torch.bmm(torch.softmax(torch.bmm(q, keys.transpose(1, 2)) * SCALE, -1), keys[..., :L])

    bf16 = bench(bf16_latent)
    page_bytes = preset.latent_layout(L, R).nbytes / preset.tile_size
    return {"heads": heads, "batch": batch, "context": context, "kvarn_ms": kvarn, "bf16_bmm_ms": bf16,
            "speedup": bf16 / kvarn, "kvarn_tb_s": batch * context * page_bytes / kvarn / 1e9,
            "bf16_tb_s": batch * context * (L + R) * 2 / bf16 / 1e9}  # fmt: skip


def sweep(preset, out: pathlib.Path) -> None:
    """Kernel-only medians (ms) per launch setting, the launcher's default first, then those of ``SWEEP``, on
    each of ``SWEEP_SHAPES``; a setting that does not compile (shared memory) or differs from the default's
    output by more than 1% of its largest entry is reported as such."""
    from kvarn_compile.kernels.latent_attention import latent_attention
    from kvarn_compile.kernels.rotate import rotated_to

    defaults = inspect.signature(latent_attention).parameters
    default = tuple(defaults[name].default for name in ("block_t", "num_warps", "num_stages"))
    settings = [default, *(s for s in SWEEP if s != default)]
    layout = preset.latent_layout(L, R)
    rows = []
    names = [f"t{t}w{w}s{st}" for t, w, st in settings]
    for heads, batch, context in tqdm(SWEEP_SHAPES, desc="sweep shapes"):
        cache, q_c, q_r, slots, kv_lens, qsl = decode_step(heads, batch, context, preset)
        q_c = rotated_to(q_c, torch.float32)  # the kernel takes q_c rotated (the op does this)
        row, first = {"heads": heads, "batch": batch, "context": context}, None
        for block_t, warps, stages in settings:
            fn = functools.partial(latent_attention, q_c, q_r, *cache.tensors(), slots, kv_lens, qsl, layout, SCALE,
                                   1, block_t=block_t, num_warps=warps, num_stages=stages)  # fmt: skip
            name = f"t{block_t}w{warps}s{stages}"
            try:
                got = fn()[0]
                first = got if first is None else first
                err = float((got - first).abs().max() / first.abs().max())
                row[name] = bench(fn) if err < 1e-2 else f"wrong ({err:.2g})"
            except Exception as e:  # noqa: BLE001 - a setting that does not compile is a result of the sweep
                row[name] = f"failed: {type(e).__name__}"
        rows.append(row)
        del cache
        _write_sweep(rows, names, preset, out)  # after each shape: a run cut short keeps what it measured


def _write_sweep(rows: list[dict], names: list[str], preset, out: pathlib.Path) -> None:
    lines = [f"latent attention kernel alone, ms (median, CUDA graphs), {torch.cuda.get_device_name()}, {preset.name}",
             "", "| heads | batch | context | " + " | ".join(names) + " |", "|---" * (3 + len(names)) + "|"]  # fmt: skip
    lines += [f"| {r['heads']} | {r['batch']} | {r['context']} | "
              + " | ".join(f"{r[n]:.4f}" if isinstance(r[n], float) else r[n] for n in names) + " |" for r in rows]  # fmt: skip
    (out / "sweep.md").write_text("\n".join(lines) + "\n")
    (out / "sweep.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(lines))


def flush_ms(batch: int, preset) -> float:
    """A decode step's append when every sequence completes a tile."""
    g = preset.tile_size
    cache = LatentCache.allocate(batch, 2 * g, L, R, preset, torch.bfloat16, "cuda")
    c, r = torch.randn(batch, L, device="cuda").bfloat16(), torch.randn(batch, R, device="cuda").bfloat16()
    slots = torch.arange(batch, dtype=torch.int32, device="cuda")
    start = torch.full((batch,), g - 1, dtype=torch.int32, device="cuda")
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    return bench(functools.partial(torch.ops.kvarn.latent_append, c, r, *cache.tensors(), slots, start, qsl,
                                   preset.name, 1))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="bench-out")
    parser.add_argument("--preset", default="kvarn_k4v2_g128")
    parser.add_argument("--sweep", action="store_true", help="also time the kernel's launch settings")
    parser.add_argument("--sweep-only", action="store_true", help="only the launch-settings sweep")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    preset = get_preset(args.preset)
    if args.sweep or args.sweep_only:
        sweep(preset, out)
        if args.sweep_only:
            return
    rows = [run(h, b, c, preset) for h, b, c in tqdm(CONFIGS, desc="configs")]
    flushes = {b: flush_ms(b, preset) for b in (1, 8, 32)}
    device = torch.cuda.get_device_name()
    (out / "results.json").write_text(json.dumps({"device": device, "preset": preset.name, "rows": rows,
                                                  "flush_ms": flushes}, indent=1))  # fmt: skip
    lines = [f"MLA latent decode attention, {device}, {preset.name}, latent {L} + rope {R}, bf16", "",
             "| heads | batch | context | kvarn ms | bf16 bmm ms | kvarn vs bf16 | kvarn TB/s | bf16 TB/s |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    lines += [f"| {r['heads']} | {r['batch']} | {r['context']} | {r['kvarn_ms']:.3f} | {r['bf16_bmm_ms']:.3f} | "
              f"{r['speedup']:.2f}x | {r['kvarn_tb_s']:.2f} | {r['bf16_tb_s']:.2f} |" for r in rows]  # fmt: skip
    lines += ["", "flush (a decode step's append completing a tile): "
              + ", ".join(f"batch {b} {ms:.3f} ms" for b, ms in flushes.items())]  # fmt: skip
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    from plots import ratio_bars, save, subplots

    fig, ax = subplots(figsize=(8, 3.5))
    ratio_bars(ax, [f"H{r['heads']} B{r['batch']} {r['context'] // 1024}K" for r in rows], [r["speedup"] for r in rows],
               1.0, "bf16 bmm time / kvarn time")  # fmt: skip
    save(fig, out / "speedup.png", f"MLA latent decode attention: {preset.name} vs a bf16 cache, {device}")


if __name__ == "__main__":
    main()
