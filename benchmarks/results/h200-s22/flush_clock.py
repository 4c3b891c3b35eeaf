"""For a later device call (prepared in session 21 for the kernel of then, ported to session 22's; not run yet):
where one flush program's ~0.08 ms goes, phase by phase, from SM clock stamps written by the append kernel of a
copy patched with next-flush-clock.patch (clock64 after the gather, after each pass of the normalisation and its
update, after each imbalance, each flip round and the stores; globaltimer at the start and the end, to turn
cycles into time). The stamps add barriers: compare the probe's total with the flush column.

    bash benchmarks/patched_repo.sh /tmp/repo-clock benchmarks/results/h200-s22/next-flush-clock.patch
    cd /tmp/repo-clock/benchmarks && PYTHONPATH=/tmp/repo-clock:$PWD python3 results/h200-s22/flush_clock.py --out DIR

Writes DIR/flush_clock.md and .json: per batch and program kind (keys, values), medians over programs, in us
(an iteration: the first pass over the tile and the update it feeds, the second pass, the imbalance, the
choice of the best iterate; the keys have no flip rounds, and their "stores" include their rounding to codes).
"""

import logging

import torch
from attention import HKV, D, filled_cache
from result_files import out_dir, write_table

from kvarn_compile import get_preset
from kvarn_compile.kernels import quantize_store as qs
from kvarn_compile.ops import triton_append

log = logging.getLogger("kvarn.bench")
ITERS = 8  # the preset's normalisation iterations: slots 2 + 4 * it .. 5 + 4 * it


def phases(row: list[int]) -> dict[str, float]:
    """One program's stamps -> phase durations in us (cycles scaled by the program's globaltimer span)."""
    us_per_cycle = (row[63] - row[62]) / 1000 / max(row[60] - row[0], 1)
    out = {
        "total": (row[60] - row[0]) * us_per_cycle,
        "gather": (row[61] - row[0]) * us_per_cycle,
        "first imbalance": (row[1] - row[61]) * us_per_cycle,
    }
    names = ("first pass + update", "second pass", "imbalance", "best so far")
    prev = row[1]
    for it in range(ITERS):
        for k, name in enumerate(names):
            out[name] = out.get(name, 0.0) + (row[2 + 4 * it + k] - prev) * us_per_cycle / ITERS
            prev = row[2 + 4 * it + k]
    rounds = [t for t in row[43:59] if t]
    if rounds:  # values
        out["rtn"] = (row[42] - prev) * us_per_cycle
        out["flip rounds"] = float(len(rounds))
        out["flip round"] = (rounds[-1] - row[42]) * us_per_cycle / len(rounds)
        prev = rounds[-1]
    out["stores"] = (row[60] - prev) * us_per_cycle
    return out


def main() -> None:
    out = out_dir(__doc__)
    preset = get_preset("kvarn_k4v2_g128")
    context, results = 8192, []
    for batch in (1, 32):
        cache = filled_cache(batch, context, preset)
        k, v = (torch.randn(batch, HKV, D, device="cuda", dtype=torch.float16) for _ in range(2))
        slots = torch.arange(batch, dtype=torch.int32, device="cuda")
        qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        start = torch.full((batch,), context + preset.tile_size - 1, dtype=torch.int32, device="cuda")
        programs = batch * 2 * HKV  # one tile per sequence: grid (batch, 1, 2 * HKV)
        qs.STAMPS = torch.zeros(programs * qs.SLOTS, dtype=torch.int64, device="cuda")
        for _ in range(3):  # the first compiles; the last is read
            qs.STAMPS.zero_()
            triton_append(k, v, *cache.tensors(), slots, start, qsl, preset, 1, rotated_kv=True)
        torch.cuda.synchronize()
        rows = qs.STAMPS.view(programs, qs.SLOTS).tolist()
        for kind, parity in (("keys", 0), ("values", 1)):
            per = [phases(r) for p, r in enumerate(rows) if p % 2 == parity]
            med = {name: sorted(p[name] for p in per)[len(per) // 2] for name in per[0]}
            results.append({"batch": batch, "kind": kind, **med})
            log.info("%s", results[-1])
    title = (f"{torch.cuda.get_device_name()}: one flush program's phases (k4v2_g128, D {D}; medians over programs, "
             "us; per iteration: the mean of 8)")  # fmt: skip
    columns = {n: n for n in results[1]}  # the values' phases: the keys' and the flip rounds
    write_table(out, "flush_clock", title, results, columns, digits=2)


if __name__ == "__main__":
    main()
