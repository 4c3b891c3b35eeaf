"""A burst of requests on a GPU through vLLM, one engine per KV-cache dtype, side by side in one run.

Default (issue 5): a Qwen3-8B-shaped config with dummy weights, bf16, gpu_memory_utilization 0.35, 256
prompts of 512 random tokens, 2,048 output tokens each (ignore_eos), all submitted at once: more KV than
a bf16 or fp8 cache holds. Per dtype: vLLM's capacity ("KV cache size", num_gpu_blocks * block_size),
output tokens/s (all output tokens / wall time of ``LLM.generate``), and the time of the two 8-token requests
each workload sends first, outside the timing (on an engine's first workload: what its first users wait).
``--workloads burst short`` also runs the not capacity-bound case (128 prompts of 512 in + 512 out, other
prompts) on the same engines, after the burst: one engine start per dtype (~2 minutes each on the H200) serves
both; ``staggered`` is the burst with prompts of 385-512 tokens (``workloads``). A kvarn dtype with "+hook"
also takes the ``--compilation-config`` hook. Writes results.json, results.md and one PNG per workload to --out.

    python benchmarks/vllm_burst.py --out DIR [--dtypes auto fp8 kvarn_k4v2_g128 kvarn_k4v2_g128+hook] [--prompts 256]
        [--input-len 512] [--output-len 2048] [--workloads burst short staggered]
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import tempfile
import time

import torch
from tqdm import tqdm

log = logging.getLogger("kvarn.bench")

QWEN3_8B = {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960}  # fmt: skip
CAPTURE_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]  # fewer than vLLM's 51: engine start in ~2 min


def save_config(path: pathlib.Path) -> None:
    from transformers import Qwen3Config

    Qwen3Config(**QWEN3_8B, torch_dtype="bfloat16", architectures=["Qwen3ForCausalLM"]).save_pretrained(path)


# "+hook" after a kvarn dtype: the engine also takes the --compilation-config hook (README), as one would pass it
HOOK = {
    "inductor_passes": {"post_grad_custom_post_pass": "kvarn_compile.vllm_pass"},
    "use_inductor_graph_partition": True,
}


def make_llm(model: pathlib.Path, spec: str, args):
    """The engine of one run (``spec``: a KV-cache dtype, a kvarn one optionally "+hook"): the burst's settings
    (dummy weights, bf16, fewer CUDA-graph sizes)."""
    cache_dtype, _, variant = spec.partition("+")
    kvarn = cache_dtype.startswith("kvarn_")
    if variant not in ("", "hook") or (variant and not kvarn):
        raise ValueError(f"{spec}: a KV-cache dtype, or a kvarn one with +hook")
    from vllm import LLM

    from kvarn_compile import get_preset

    return LLM(model=str(model), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
               kv_cache_dtype=cache_dtype, gpu_memory_utilization=args.gpu_memory_utilization,
               max_model_len=args.input_len + args.output_len, seed=0,
               compilation_config={"cudagraph_capture_sizes": CAPTURE_SIZES, **(HOOK if variant else {})},
               **({"max_num_seqs": args.max_num_seqs} if args.max_num_seqs else {}),
               **({"block_size": get_preset(cache_dtype).tile_size} if kvarn else {}))  # fmt: skip


def random_prompts(lengths: list[int], seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(0, 32000, (n,), generator=g).tolist()} for n in lengths]


SHORT_PROMPTS = 128  # 128 x (512 + 512) tokens fit every cache here (bf16: ~232K tokens): not capacity-bound


STAGGER = 128  # the staggered prompts are 0 .. STAGGER - 1 tokens shorter: the default preset's tile


def workloads(args) -> dict[str, tuple[list[int], int, int]]:
    """name -> (input tokens of each prompt, output tokens, prompt seed) of the workloads asked for. Each has
    prompts of its own, so a later one finds nothing of an earlier one in the prefix cache. "staggered" is the
    burst with prompts of input_len - i % STAGGER tokens: the burst's prompts all complete a KVarN tile in the
    same decode steps (few steps quantize tiles, the others none); these complete tiles in every step, as
    requests that do not arrive together do."""
    if "staggered" in args.workloads and args.input_len < STAGGER:
        raise SystemExit(f"--workloads staggered needs --input-len >= {STAGGER} (its prompts are up to "
                         f"{STAGGER - 1} tokens shorter), got {args.input_len}")  # fmt: skip
    burst = [args.input_len] * args.prompts
    table = {"burst": (burst, args.output_len, 0), "short": ([512] * SHORT_PROMPTS, 512, 1),
             "staggered": ([n - i % STAGGER for i, n in enumerate(burst)], args.output_len, 2)}  # fmt: skip
    return {name: table[name] for name in args.workloads}


def capacity(llm) -> int:
    """vLLM's KV capacity in tokens (the "GPU KV cache size" it logs)."""
    config = llm.llm_engine.vllm_config.cache_config
    return config.num_gpu_blocks * config.block_size


def run(model: pathlib.Path, spec: str, args) -> list[dict]:
    """One engine (``make_llm``): each workload's prompts submitted at once, timed; one row per workload."""
    from vllm import SamplingParams

    llm = make_llm(model, spec, args)
    try:
        rows = []
        for name, (input_lens, output_len, seed) in workloads(args).items():
            prompts = random_prompts(input_lens, seed)
            # two requests of 8 tokens before the timing: on a fresh engine, what its first users wait (anything
            # compiled at the first request shows here)
            warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
            start = time.perf_counter()
            llm.generate(random_prompts(input_lens[:2], seed + 100), warm, use_tqdm=False)
            warm_seconds = time.perf_counter() - start
            params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            shortest, longest = min(input_lens), max(input_lens)
            rows.append({"workload": name, "prompts": len(input_lens), "output_len": output_len, "dtype": spec,
                         "input_len": longest if shortest == longest else f"{shortest}-{longest}",
                         "capacity": capacity(llm), "output_tokens": tokens, "seconds": elapsed,
                         "tokens_per_s": tokens / elapsed, "warm_up_requests_s": warm_seconds})  # fmt: skip
            log.info("%s", rows[-1])  # in the log as soon as it is measured: a cut-off run keeps it
        return rows
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        torch.cuda.empty_cache()


def draw(rows: list[dict], path: pathlib.Path, title: str) -> None:
    from plots import ratio_bars, save, subplots

    fig, axes = subplots(1, 2, figsize=(10, 3.5))
    base = baseline(rows)
    for ax, key, label in ((axes[0], "capacity", "KV capacity (tokens)"), (axes[1], "tokens_per_s", "output tokens/s")):
        ratio_bars(ax, [r["dtype"] for r in rows], [r[key] for r in rows], base[key], label)
    save(fig, path, title)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--dtypes", nargs="+", default=["auto", "fp8", "kvarn_k4v2_g128"])
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=2048)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.35)
    parser.add_argument("--max-num-seqs", type=int, default=None, help="vLLM's default when not given")
    parser.add_argument("--workloads", nargs="+", choices=("burst", "short", "staggered"), default=["burst"],
                        help="burst: --input-len + --output-len; short: 512 + 512, not capacity-bound; staggered: "
                             "the burst with prompts 0-127 tokens shorter (tiles complete in every step)")  # fmt: skip
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        save_config(pathlib.Path(tmp))
        rows = []
        for d in tqdm(args.dtypes, desc="engines"):
            rows += run(pathlib.Path(tmp), d, args)
            (args.out / "partial.json").write_text(json.dumps(rows, indent=1))  # survives a cut-off run
    import vllm

    title = (f"vLLM {vllm.__version__}, {torch.cuda.get_device_name()}: Qwen3-8B shape (dummy weights), "
             f"gpu_memory_utilization {args.gpu_memory_utilization}, max_num_seqs "
             f"{args.max_num_seqs or 'default'}")  # fmt: skip
    print(write_report(rows, title, args.out))


def baseline(rows: list[dict]) -> dict:
    """The row ratios are taken against: the fp16/bf16 cache ("auto") when it ran, else the first."""
    return next((r for r in rows if r["dtype"] == "auto"), rows[0])


def write_report(rows: list[dict], title: str, out: pathlib.Path) -> str:
    """results.json, results.md and WORKLOAD.png in ``out``; returns the markdown tables, one per workload."""
    (out / "results.json").write_text(json.dumps({"title": title, "rows": rows}, indent=1))
    tables = []
    for name in dict.fromkeys(r.get("workload", "burst") for r in rows):  # rows of older runs: one burst
        group = [r for r in rows if r.get("workload", "burst") == name]
        base, first = baseline(group), group[0]
        heading = (f"{name}: {first.get('prompts', '?')} prompts x ({first.get('input_len', '?')} in + "
                   f"{first.get('output_len', '?')} out)")  # fmt: skip
        vs = f"vs {base['dtype']}"
        columns = f"| KV-cache dtype | capacity (tokens) | {vs} | output tokens/s | {vs} | 2 requests before it (s) |"
        table = [heading, "", columns, "|---|---|---|---|---|---|"]
        table += [f"| {r['dtype']} | {r['capacity']:,} | {r['capacity'] / base['capacity']:.2f}x | "
                  f"{r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / base['tokens_per_s']:.2f}x | "
                  f"{r.get('warm_up_requests_s', float('nan')):.2f} |" for r in group]  # fmt: skip
        tables.append("\n".join(table))
        draw(group, out / f"{name}.png", f"{title}\n{heading}")
    (out / "results.md").write_text(title + "\n\n" + "\n\n".join(tables) + "\n")
    return "\n\n".join(tables)


if __name__ == "__main__":
    main()
