"""End-to-end decode: a Llama-shaped model (random weights) with a transformers StaticCache, compiled
with Inductor (fp16 cache, the baseline) and with backend="kvarn" (KVarN cache), side by side.

Default: Llama-3.2-1B shape (16 layers, 32 query / 8 KV heads, head_dim 64, hidden 2048), fp16, batch
8, decoding at 32K context, CUDA graphs (mode="reduce-overhead"). The context is filled directly (random
keys/values written into the fp16 buffers; the kvarn backend adopts them at its first call, then frees
the fp16 buffers with release_fp16_cache=True). Reports decode tokens/s (median step time over --steps),
KV-cache bytes and peak GPU memory while decoding; writes results.json / results.md / e2e.png to --out.

    python benchmarks/e2e.py --out /tmp/e2e [--batch 8] [--context 32768] [--steps 30]
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import pathlib
import time

import torch
import transformers
from tqdm import tqdm

from kvarn_compile.backend import kvarn_backend, kvarn_cache_of

log = logging.getLogger("kvarn.bench")


def llama(layers: int, device: str) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=262144,
        attn_implementation="sdpa",
    )  # fmt: skip
    with torch.device(device):
        return transformers.LlamaForCausalLM(config).to(torch.float16).eval()


def filled_cache(model, batch: int, context: int, steps: int, device: str) -> transformers.StaticCache:
    c = model.config
    cache = transformers.StaticCache(config=c, max_cache_len=context + steps + 16)
    cache.early_initialization(batch, c.num_key_value_heads, c.head_dim, torch.float16, torch.device(device))
    gen = torch.Generator(device).manual_seed(0)
    for layer in cache.layers:
        layer.keys[:, :, :context].normal_(generator=gen)
        layer.values[:, :, :context].normal_(generator=gen)
        layer.cumulative_length.fill_(context)
    return cache


def kv_bytes(cache: transformers.StaticCache) -> int:
    total = 0
    for layer in cache.layers:
        kvarn = kvarn_cache_of(layer.keys)
        total += kvarn.nbytes if kvarn is not None else layer.keys.nbytes + layer.values.nbytes
    return total


def decode(name: str, model, args, **compile_kwargs) -> dict:
    cache = filled_cache(model, args.batch, args.context, args.warmup + args.steps, args.device)
    fn = torch.compile(model, fullgraph=True, **compile_kwargs)
    token = torch.full((args.batch, 1), 7, device=args.device)
    times = []
    with torch.no_grad():
        for i in tqdm(range(args.warmup + args.steps), desc=name):
            if i == args.warmup:
                torch.cuda.reset_peak_memory_stats() if args.device == "cuda" else None
            start = time.perf_counter()
            fn(token, past_key_values=cache)
            torch.cuda.synchronize() if args.device == "cuda" else None
            times.append(time.perf_counter() - start)
    step = sorted(times[args.warmup :])[args.steps // 2]
    result = {
        "method": name, "step_ms": step * 1e3, "tokens_per_s": args.batch / step, "kv_bytes": kv_bytes(cache),
        "peak_memory_bytes": torch.cuda.max_memory_allocated() if args.device == "cuda" else None,
    }  # fmt: skip
    log.info("%s", result)
    del cache, fn
    gc.collect()
    torch.cuda.empty_cache() if args.device == "cuda" else None
    torch._dynamo.reset()
    return result


def plot(results: list[dict], path: pathlib.Path) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    names = [r["method"] for r in results]
    axes[0].bar(names, [r["tokens_per_s"] for r in results], color=["grey", "tab:blue"])
    axes[0].set_ylabel("decode tokens/s")
    axes[1].bar(names, [r["kv_bytes"] / 2**30 for r in results], color=["grey", "tab:blue"])
    axes[1].set_ylabel("KV cache (GiB)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--preset", default="kvarn_k4v2_g128")
    parser.add_argument("--mode", default="reduce-overhead", help="torch.compile mode of both runs")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    model = llama(args.layers, args.device)
    results = [
        decode("fp16 (inductor)", model, args, backend="inductor", mode=args.mode),
        # the callable, not "kvarn": the same backend, also where the package is not pip-installed
        decode(args.preset, model, args, backend=kvarn_backend, options={
            "preset": args.preset, "release_fp16_cache": True, "cudagraphs": args.mode == "reduce-overhead"}),
    ]  # fmt: skip
    base, kv = results
    summary = {"speedup": kv["tokens_per_s"] / base["tokens_per_s"], "kv_reduction": base["kv_bytes"] / kv["kv_bytes"]}
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    (args.out / "results.json").write_text(json.dumps({"device": device, "args": {k: str(v) for k, v in
                                                       vars(args).items()}, "results": results, **summary}, indent=1))  # fmt: skip
    lines = [f"{device}, batch {args.batch}, context {args.context}, {args.layers} layers, mode {args.mode}", "",
             "| method | step ms | tokens/s | KV GiB | peak GiB |", "|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        peak = f"{r['peak_memory_bytes'] / 2**30:.2f}" if r["peak_memory_bytes"] else "-"
        lines.append(
            f"| {r['method']} | {r['step_ms']:.2f} | {r['tokens_per_s']:.0f} | {r['kv_bytes'] / 2**30:.2f} | {peak} |"
        )
    lines.append(f"\nspeedup {summary['speedup']:.2f}x, KV memory {summary['kv_reduction']:.2f}x less")
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    plot(results, args.out / "e2e.png")
    log.info("\n".join(lines))


if __name__ == "__main__":
    main()
