"""GPU determinism of attend_and_append: 4 sequences prefilled in one call, then decode steps."""

import sys

import torch

sys.path.insert(0, ".")
import kvarn_compile.ops  # registers the ops
from kvarn_compile.paged import Batch, KVarNCache

INTERP = False


def run(device, lengths=(300, 7, 129, 128), steps=12, hq=4, hkv=2, d=64, dtype=torch.float16):
    g = torch.Generator().manual_seed(0)
    cache = KVarNCache.allocate(5, 1024, hkv, d, dtype=dtype, device=device)
    outs = []
    batch = Batch.from_lengths(list(range(len(lengths))), [0] * len(lengths), list(lengths), device=device)
    pos = list(lengths)
    for step in range(steps + 1):
        T = batch.query_start_loc[-1].item()
        q, k, v = (torch.randn(T, h, d, generator=g).to(dtype).to(device) for h in (hq, hkv, hkv))
        out = torch.empty(T, hq, d, dtype=dtype, device=device)
        if INTERP:
            kvarn_compile.ops.triton_attend_and_append(
                q,
                k,
                v,
                out,
                *cache.tensors()[:4],
                cache.seq_lens,
                *batch[:3],
                cache.preset,
                d**-0.5,
                True,
                0,
                batch.max_query_len,
            )
        else:
            torch.ops.kvarn.attend_and_append(
                q,
                k,
                v,
                out,
                *cache.tensors()[:4],
                cache.seq_lens,
                *batch[:3],
                cache.preset.name,
                d**-0.5,
                True,
                0,
                batch.max_query_len,
            )
        outs.append(out.float().cpu())
        batch = Batch.decode(torch.arange(len(lengths), device=device), torch.tensor(pos, device=device))
        pos = [p + 1 for p in pos]
    return outs


if __name__ == "__main__":
    dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    if dev == "interp":
        INTERP, dev = True, "cpu"
    a, b = run(dev), run(dev)
    INTERP = False
    ref = run("cpu")
    for i, (x, y, r) in enumerate(zip(a, b, ref)):
        print(f"step {i}: run-to-run max diff {(x - y).abs().max():.3e}, vs cpu reference {(x - r).abs().max():.3e}")
