"""One attention layer's work in the vLLM backend (kvarn::chunk_attention + kvarn::append, as called: validation,
rotations and kernels), timed on a GPU with CUDA events for a decode batch and a mixed batch (decodes + one
prefill chunk). Qwen3-8B heads (32 query / 8 KV heads, head_dim 128), bf16. It tells launch-bound from
kernel-bound when the vLLM burst is slow.

    python benchmarks/vllm_layer_step.py [--batch 256] [--context 1024] [--prefill 2048]
"""

from __future__ import annotations

import argparse

import torch

from kvarn_compile import ops  # noqa: F401  (registers torch.ops.kvarn)
from kvarn_compile.paged import Batch, KVarNCache

PRESET, HQ, HKV, D, DTYPE = "kvarn_k4v2_g128", 32, 8, 128, torch.bfloat16


def timed(fn, repeats: int = 20) -> float:
    """Median milliseconds of ``fn()`` between two CUDA events (launch gaps included)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def measure(cache: KVarNCache, lengths: list[int], starts: list[int]) -> dict[str, float]:
    t = sum(lengths)
    q = torch.randn(t, HQ, D, dtype=DTYPE, device="cuda")
    k, v = (torch.randn(t, HKV, D, dtype=DTYPE, device="cuda") for _ in range(2))
    batch = Batch.from_lengths(list(range(len(lengths))), starts, lengths, device="cuda")
    pages, exact_k, exact_v, page_table, _ = cache.tensors()
    attention = (q, k, v, pages, exact_k, exact_v, page_table, *batch[:3], PRESET, D**-0.5, True, 0, batch.max_query_len)
    result = {
        "chunk_attention": timed(lambda: torch.ops.kvarn.chunk_attention(*attention)),
        "append": timed(lambda: torch.ops.kvarn.append(k, v, *cache.tensors(), *batch[:3], PRESET, batch.max_query_len)),
    }
    if batch.max_query_len == 1:
        result["decode_attention"] = timed(lambda: torch.ops.kvarn.decode_attention(
            q, k, v, pages, exact_k, exact_v, page_table, batch.slots, batch.start_pos, PRESET, D**-0.5, 0))  # fmt: skip
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--prefill", type=int, default=2048)
    args = parser.parse_args()
    b = args.batch
    cache = KVarNCache.allocate(b + 1, args.context + args.prefill + 128, HKV, D, preset=PRESET, dtype=DTYPE,
                                device="cuda")  # fmt: skip
    runs = {
        "decode": ([1] * b, [args.context] * b),
        "mixed": ([1] * (b - 1) + [args.prefill], [args.context] * (b - 1) + [0]),
    }
    for name, (lengths, starts) in runs.items():
        times = ", ".join(f"{op} {ms:.3f} ms" for op, ms in measure(cache, lengths, starts).items())
        print(f"{name}: batch {b}, {sum(lengths)} tokens, context {args.context}: {times}")


if __name__ == "__main__":
    main()
