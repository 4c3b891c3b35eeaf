"""One attention layer's work in the vLLM backend (kvarn::chunk_attention + kvarn::append), timed on a GPU for a
decode batch and for a mixed batch (decodes + one prefill chunk), Qwen3-8B heads (32 q / 8 KV, D 128), bf16.

    python benchmarks/vllm_layer_step.py [--batch 256] [--context 1024] [--prefill 2048]
"""

from __future__ import annotations

import argparse

import torch

from kvarn_compile import ops  # noqa: F401  (registers torch.ops.kvarn)
from kvarn_compile.paged import Batch, KVarNCache


def timed(fn, repeats: int = 20) -> float:
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--prefill", type=int, default=2048)
    args = parser.parse_args()
    hq, hkv, d, dtype = 32, 8, 128, torch.bfloat16
    cache = KVarNCache.allocate(args.batch + 1, args.context + args.prefill + 128, hkv, d, preset="kvarn_k4v2_g128",
                                dtype=dtype, device="cuda")  # fmt: skip
    b = args.batch
    for name, lengths in (("decode", [1] * b), ("mixed", [1] * (b - 1) + [args.prefill])):
        t = sum(lengths)
        q = torch.randn(t, hq, d, dtype=dtype, device="cuda")
        k = torch.randn(t, hkv, d, dtype=dtype, device="cuda")
        v = torch.randn(t, hkv, d, dtype=dtype, device="cuda")
        starts = [args.context] * (b - 1) + [args.context if name == "decode" else 0]
        batch = Batch.from_lengths(list(range(b)), starts, lengths, device="cuda")
        args_ = (q, k, v, *cache.tensors()[:4], *batch[:3], "kvarn_k4v2_g128", d**-0.5, True, 0, batch.max_query_len)
        attn = timed(lambda: torch.ops.kvarn.chunk_attention(*args_))
        append = timed(lambda: torch.ops.kvarn.append(k, v, *cache.tensors(), *batch[:3], "kvarn_k4v2_g128",
                                                      batch.max_query_len))  # fmt: skip
        line = f"{name}: batch {b}, {t} tokens, max_query_len {batch.max_query_len}: chunk_attention {attn:.3f} ms"
        if name == "decode":
            dec = timed(lambda: torch.ops.kvarn.decode_attention(q, k, v, *cache.tensors()[:4], batch.slots,
                                                                 batch.start_pos, "kvarn_k4v2_g128", d**-0.5, 0))  # fmt: skip
            line += f", decode_attention {dec:.3f} ms"
        ref = timed(lambda: torch.nn.functional.scaled_dot_product_attention(
            q[:1].expand(b, -1, -1)[:, :, None].transpose(1, 2).reshape(b, hq, 1, d),
            torch.randn(b, hkv, args.context, d, dtype=dtype, device="cuda"),
            torch.randn(b, hkv, args.context, d, dtype=dtype, device="cuda"), enable_gqa=True))  # fmt: skip
        print(f"{line}, append {append:.3f} ms; (bf16 SDPA decode at this context, incl. randn: {ref:.3f} ms)")


if __name__ == "__main__":
    main()
