"""When each program of a batch-1 decode step's exact part reaches each phase (timing only, needs a GPU and the
package with stamps.patch applied: the exact programs write %globaltimer at their start, after q's rotation, after
their kept rows, after their partial, after storing it, after counting, after the merger's wait for the Gluon kernel
and after its merge; the patched kernel is never landed).

    PYTHONPATH=ROOT python stamps.py --out DIR     (ROOT: the patched copy; run from ROOT/benchmarks)

Writes DIR/stamps.md: per context (0 / 64 / 125 rows held), the medians over 60 CUDA-graph replays of each phase's
time in ns from the earliest exact program's start, for the merging program and for the slowest other one; and
DIR/timeline.md: the kernels of one replay of three steps in a row (torch.profiler, as decode_step.py --timeline).
Without the patch (the package as it is) only the timeline.
"""

import argparse
import functools
import pathlib
import statistics

import torch
from attention import HKV, HQ, D, bench, filled_cache  # benchmarks/attention.py
from decode_step import kernel_table, replay_kernels

from kvarn_compile import get_preset
from kvarn_compile.kernels import paged_attention

PHASES = ("start", "q rotated", "kept rows", "partial", "stored", "counted", "waited", "merged")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=pathlib.Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    preset = get_preset("kvarn_k4v2_g128")
    lines = ["| context | program | live | " + " | ".join(PHASES) + " | op ms |", "|---" * (len(PHASES) + 4) + "|"]
    timeline = []
    for context in (2048, 2112, 2173):
        cache = filled_cache(1, context, preset)
        q, k, v = (torch.randn(1, h, D, device="cuda", dtype=torch.float16) for h in (HQ, HKV, HKV))
        slots = torch.zeros(1, dtype=torch.int32, device="cuda")
        start = torch.full((1,), context, dtype=torch.int32, device="cuda")

        step = functools.partial(torch.ops.kvarn.decode_attention, q, k, v, *cache.tensors()[:4], slots, start,
                                 preset.name, D**-0.5, 0)  # fmt: skip

        op_ms = bench(step)
        timeline += kernel_table(replay_kernels(lambda step=step: [step() for _ in range(3)]), f"context {context}")
        if not hasattr(paged_attention, "stamps"):
            continue
        graph = torch.cuda.CUDAGraph()
        step()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            step()
        stamps = paged_attention.stamps(q.device)
        merger, other = [], []
        for _ in range(60):
            stamps.zero_()
            graph.replay()
            torch.cuda.synchronize()
            rows = stamps[: HKV * 16].view(HKV, 16, 16).cpu()
            for h in range(HKV):
                live = rows[h, :, 0] != 0
                t0 = rows[h, live, 0].min()
                rel = [(e, [(rows[h, e, f] - t0).item() if rows[h, e, f] else None for f in range(8)])
                       for e in range(16) if live[e]]  # fmt: skip
                merger += [r for e, r in rel if rows[h, e, 8] == rows[h, e, 9] - 1]
                others = [r for e, r in rel if rows[h, e, 8] != rows[h, e, 9] - 1]
                if others:
                    other.append(max(others, key=lambda r: r[5]))
            live_n = int(rows[0, 0, 9])
        for name, runs in (("merger", merger), ("slowest other", other)):
            if not runs:
                continue
            med = [statistics.median(r[f] for r in runs if r[f] is not None) if any(r[f] is not None for r in runs)
                   else None for f in range(8)]  # fmt: skip
            cells = " | ".join("-" if m is None else f"{m:.0f}" for m in med)
            lines.append(f"| {context} | {name} | {live_n} | {cells} | {op_ms:.4f} |")
        print("\n".join(lines[-2:]), flush=True)
    (args.out / "stamps.md").write_text("\n".join(lines) + "\n")
    (args.out / "timeline.md").write_text("\n".join(timeline) + "\n")
    print("\n".join(timeline))


if __name__ == "__main__":
    main()
