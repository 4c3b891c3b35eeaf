"""One-off: the decode test's calls, the Gluon path and the Triton-only path, each against the reference."""

import sys

import torch

sys.path.insert(0, "tests")
from cache_model import random_call
from test_kernels import sentinel_cache

from kvarn_compile import get_preset
from kvarn_compile.kernels import decode_attention
from kvarn_compile.ops import triton_append, triton_attention
from kvarn_compile.paged import append_reference, attention_reference

supports = decode_attention.supports
for name, hq, hkv, d, dtype, sink in [
    ("kvarn_k4v2_g128", 8, 2, 128, torch.float16, False),
    ("kvarn_k4v4_g64", 6, 1, 64, torch.bfloat16, True),
]:
    torch.manual_seed(0)
    preset = get_preset(name)
    g = preset.tile_size
    calls = [{0: 5 * g + 17, 1: 2 * g, 2: g - 1}, {0: 1, 1: 1, 2: 1}, {0: 1, 1: 1, 2: 1}, {0: 1, 1: 1, 2: 1}]
    ref = sentinel_cache(preset, 3, 8 * g, hkv, d, d, dtype, sink, "cpu")
    ker = sentinel_cache(preset, 3, 8 * g, hkv, d, d, dtype, sink, "cuda")
    lengths = {}
    for n, call in enumerate(calls):
        batch, q, k, v = random_call(call, lengths, hq, hkv, d, d, dtype)
        args = (preset, d**-0.5, True, 0, batch.max_query_len)
        want = attention_reference(q, k, v, *ref.tensors()[:4], *batch[:3], *args).float()
        dev = [t.cuda() for t in (q, k, v)]
        dev_batch = [t.cuda() for t in batch[:3]]
        row = [name, n]
        for path in ("gluon", "triton"):
            decode_attention.supports = supports if path == "gluon" else (lambda *a: False)
            got = triton_attention(*dev, *ker.tensors()[:4], *dev_batch, *args).cpu().float()
            err = (got - want).abs()
            bad = ~torch.isclose(got, want, atol=2e-2, rtol=2e-2)
            row += [path, f"max {err.max():.4f}", f"bad {int(bad.sum())}", f"rows {bad.any(-1).nonzero().tolist()[:6]}"]
        decode_attention.supports = supports
        print(*row, flush=True)
        triton_append(*dev[1:], *ker.tensors(), *dev_batch, preset, batch.max_query_len)
        append_reference(k, v, *ref.tensors(), *batch[:3], preset)
        for s, c in call.items():
            lengths[s] = lengths.get(s, 0) + c
