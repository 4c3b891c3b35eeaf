"""KV-cache capacity vLLM reports for each KV-cache dtype at the same KV memory (runs on CPU or GPU).

A Llama-shaped model with random weights (2 layers, 4 query / 2 KV heads, head_dim 128 by default) is
saved to a temp directory; one engine per dtype starts with ``kv_cache_memory_bytes`` fixed, and the
capacity is vLLM's own count (``num_gpu_blocks * block_size``, the number it logs as "KV cache size").
Writes results.json / results.md / capacity.png to --out.

    python benchmarks/vllm_capacity.py --out DIR [--head-dim 128] [--kv-memory-mib 256]
        [--dtypes auto kvarn_k4v2_g128 kvarn_k4v2_g64 kvarn_k4v4_g128 kvarn_k4v4_g64]
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import tempfile

import torch
from tqdm import tqdm

log = logging.getLogger("kvarn.bench")

DEFAULT_DTYPES = ["auto", "kvarn_k4v2_g128", "kvarn_k4v2_g64", "kvarn_k4v4_g128", "kvarn_k4v4_g64"]


def save_model(path: pathlib.Path, head_dim: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=head_dim, vocab_size=512, max_position_embeddings=4096)  # fmt: skip
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)


def capacity(model: pathlib.Path, cache_dtype: str, kv_memory: int) -> int:
    from vllm import LLM

    llm = LLM(model=str(model), skip_tokenizer_init=True, kv_cache_dtype=cache_dtype, kv_cache_memory_bytes=kv_memory,
              max_model_len=4096, enforce_eager=True, dtype="bfloat16")  # fmt: skip
    try:
        config = llm.llm_engine.vllm_config.cache_config
        return config.num_gpu_blocks * config.block_size
    finally:
        llm.llm_engine.engine_core.shutdown()


def draw(rows: list[dict], path: pathlib.Path, title: str) -> None:
    from plots import ratio_bars, save, subplots

    fig, ax = subplots(figsize=(7, 3.5))
    base = next((r["tokens"] for r in rows if r["dtype"] == "auto"), rows[0]["tokens"])
    ratio_bars(ax, [r["dtype"] for r in rows], [r["tokens"] for r in rows], base, "KV-cache capacity (tokens)")
    save(fig, path, title)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--kv-memory-mib", type=int, default=256)
    parser.add_argument("--dtypes", nargs="+", default=DEFAULT_DTYPES)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    args.out.mkdir(parents=True, exist_ok=True)
    kv_memory = args.kv_memory_mib << 20
    with tempfile.TemporaryDirectory() as tmp:
        save_model(pathlib.Path(tmp), args.head_dim)
        tokens = {d: capacity(pathlib.Path(tmp), d, kv_memory) for d in tqdm(args.dtypes, desc="engines")}
    base = tokens.get("auto") or next(iter(tokens.values()))
    rows = [{"dtype": d, "tokens": t, "vs_fp16": t / base} for d, t in tokens.items()]
    import vllm

    title = f"vLLM {vllm.__version__}: capacity at {args.kv_memory_mib} MiB of KV memory, head_dim {args.head_dim}"
    (args.out / "results.json").write_text(json.dumps({"title": title, "rows": rows}, indent=1))
    table = ["| KV-cache dtype | capacity (tokens) | vs bf16 |", "|---|---|---|"]
    table += [f"| {r['dtype']} | {r['tokens']:,} | {r['vs_fp16']:.2f}x |" for r in rows]
    (args.out / "results.md").write_text(title + "\n\n" + "\n".join(table) + "\n")
    draw(rows, args.out / "capacity.png", title)
    print("\n".join(table))


if __name__ == "__main__":
    main()
