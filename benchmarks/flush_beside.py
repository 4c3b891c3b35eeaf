"""Can a tile's quantization run beside the decode step, in phases, for (almost) free? (a probe; needs a GPU)

Why: a flush (the append of a step in which sequences complete a tile) quantizes each completed tile in one
program whose dependent chain is ~80 us (session 23's clock probe: 8 normalisation iterations x ~4.5 us, up to 16
flip rounds x 2.6 us), 2.7x an 8K decode step at batch 8; issue 2 asks for <= 5%. No kernel of one step can make
that chain 50x shorter, so the design this probe weighs takes it off the step's path: a completed tile stays fp16
for some steps while small programs quantize it a phase per step, on a side stream beside the step. That is only
free if those programs fit on SMs the decode kernel fills (8 one-warp programs of 240 registers and ~26 KB of
shared memory per SM: 61,440 of 65,536 registers), i.e. one warp of <= 128 registers and a few KB of shared
memory each, and if the cycles they issue do not slow the decode kernel's warps much.

What it times (32 query / 8 KV heads, head_dim 128, fp16, CUDA-graph medians, one process): one layer's decode
step with no tile completing (``kvarn::attend_and_append``, as ``decode_step.py``), a phase alone (one program of
one or a few warps per (sequence, KV head, keys or values): ``--phases``, each so many normalisation passes, a
token pass then a channel pass and so on (two make an iteration), or a slice of a token pass (its first rows), of
a 128 x 128 fp16 tile read from memory in chunks of 8 rows a warp, state in fp32 log-scales, as
``reference.balance`` computes them), the step
and the phase on a side stream forked before it and joined after it ("beside"), and one after the other ("in
order"). The phase's result is checked against ``reference`` before anything is timed.

    python benchmarks/flush_beside.py --out DIR [--phases 1:128:1 2:128:1 4:128:1 1:16:1 1:128:4]
    TRITON_INTERPRET=1 python benchmarks/flush_beside.py --check-only    # the phase kernel against the reference

Writes DIR/results.json, DIR/results.md and DIR/flush_beside.png.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import pathlib
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from result_files import write_results
from tqdm import tqdm

from kvarn_compile import get_preset, reference
from kvarn_compile.kernels.quantize_store import _clamp_std, _log_step, _spread
from kvarn_compile.kernels.tile_math import interpreting

log = logging.getLogger("kvarn.bench")

SHAPES = ((1, 2048), (8, 8192), (8, 32768), (32, 8192), (128, 2048))


@triton.jit
def _phase_kernel(x_ptr, lt_ptr, lc_ptr, G: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr,
                  PASSES: tl.constexpr, ROWS: tl.constexpr, PTX: tl.constexpr):  # fmt: skip
    """PASSES passes of the normalisation (tokens first: a token pass, a channel pass, ...; two make an iteration)
    of tile x [G, D] (fp16) with log-scales lt [G], lc [D] (fp32, updated in place), the tile read CHUNK rows at a
    time so that one warp holds little of it; a token pass covers the first ROWS rows (ROWS < G: a slice of a pass,
    a finer phase). As the append kernel (``quantize_store._balance``): a token's std is exp(-lt) times that of
    x[t] * exp(-lc), a channel's exp(-lc) times that of x[:, d] * exp(-lt)."""
    tile = tl.program_id(0)
    x_ptr += tile * G * D
    lt_ptr += tile * G
    lc_ptr += tile * D
    cols = tl.arange(0, D)
    for p in tl.static_range(PASSES):
        lc = tl.load(lc_ptr + cols)
        if p % 2 == 0:  # token pass: rows whole in a chunk
            for c in range(0, ROWS, CHUNK):
                rows = c + tl.arange(0, CHUNK)
                lt = tl.load(lt_ptr + rows)
                spread = _spread(tl.load(x_ptr + rows[:, None] * D + cols[None, :]).to(tl.float32), lc, 1, D)
                tl.store(lt_ptr + rows, _log_step(lt, _clamp_std(tl.exp(-lt) * spread), PTX))
        else:  # channel pass over the chunks, two-pass like the reference: the mean first, then the deviations
            total = tl.zeros([D], tl.float32)
            for c in range(0, G, CHUNK):
                rows = c + tl.arange(0, CHUNK)
                a = tl.exp(-tl.load(lt_ptr + rows))
                total += tl.sum(tl.load(x_ptr + rows[:, None] * D + cols[None, :]).to(tl.float32) * a[:, None], 0)
            mean = total / G
            squares = tl.zeros([D], tl.float32)
            for c in range(0, G, CHUNK):
                rows = c + tl.arange(0, CHUNK)
                a = tl.exp(-tl.load(lt_ptr + rows))
                dev = tl.load(x_ptr + rows[:, None] * D + cols[None, :]).to(tl.float32) * a[:, None] - mean[None, :]
                squares += tl.sum(dev * dev, 0)
            tl.store(lc_ptr + cols, _log_step(lc, _clamp_std(tl.exp(-lc) * tl.sqrt(squares / (G - 1))), PTX))
        tl.debug_barrier()  # the new log-scales, written by other lanes, are read by the next pass


class Phase(NamedTuple):
    """One phase's work per tile: ``passes`` normalisation passes, a token pass over the first ``rows`` rows, by
    programs of ``warps`` warps reading ``chunk`` rows a warp at a time, compiled to at most ``maxnreg`` registers
    a thread (0: the compiler's choice). Command line: passes:rows:warps[:chunk[:maxnreg]]."""

    passes: int
    rows: int = 128
    warps: int = 1
    chunk: int = 8
    maxnreg: int = 0

    @staticmethod
    def parse(text: str) -> Phase:
        spec = Phase(*map(int, text.split(":")))
        if spec.rows % (spec.chunk * spec.warps) or not 0 < spec.rows <= 128:
            raise argparse.ArgumentTypeError(f"rows must be a multiple of chunk x warps up to 128, got {text}")
        return spec

    def __str__(self) -> str:
        return ":".join(map(str, self))


def phase(x: torch.Tensor, lt: torch.Tensor, lc: torch.Tensor, spec: Phase):
    """x [N, G, D] fp16 tiles, lt [N, G] and lc [N, D] fp32 (updated in place): ``spec``'s work on each tile, one
    program per tile. Returns the compiled kernel (its registers)."""
    n, g, d = x.shape
    limit = {"maxnreg": spec.maxnreg} if spec.maxnreg and not interpreting() else {}
    return _phase_kernel[(n,)](x, lt, lc, g, d, spec.chunk * spec.warps, spec.passes, spec.rows, not interpreting(),
                               num_warps=spec.warps, num_stages=1, **limit)  # fmt: skip


def phase_reference(x: torch.Tensor, spec: Phase) -> tuple[torch.Tensor, torch.Tensor]:
    """The same work from zero log-scales, by ``reference.normalisation_pass``."""
    x = x.float()
    lt, lc = x.new_zeros(x.shape[:-1]), x.new_zeros(x.shape[:-2] + x.shape[-1:])
    for p in range(spec.passes):
        if p % 2 == 0:
            lt = torch.cat([reference.normalisation_pass(x, lt, lc, tokens=True)[..., : spec.rows],
                            lt[..., spec.rows :]], -1)  # fmt: skip
        else:
            lc = reference.normalisation_pass(x, lt, lc, tokens=False)
    return lt, lc


def check_phase(device: str, spec: Phase, tiles: int = 3) -> float:
    """Largest |kernel - reference| of the log-scales on random tiles with outlier channels and tokens."""
    x = torch.randn(tiles, 128, 128, device=device) * torch.rand(tiles, 1, 128, device=device) * 4
    x[:, :, 5] *= 30
    x[:, 7, :] *= 10
    x = x.half()
    lt, lc = torch.zeros(tiles, 128, device=device), torch.zeros(tiles, 128, device=device)
    phase(x, lt, lc, spec)
    want_t, want_c = phase_reference(x.cpu(), spec)
    return max((lt.cpu() - want_t).abs().max().item(), (lc.cpu() - want_c).abs().max().item())


def run(preset, phases: list[Phase], priority: int) -> tuple[list[dict], dict]:
    from attention import HKV, D, bench, filled_cache  # benchmarks/attention.py
    from decode_step import op_step, step_inputs

    rows, kernels = [], {}
    side = torch.cuda.Stream(priority=priority)
    for batch, context in tqdm(SHAPES, desc="shapes"):
        cache = filled_cache(batch, context, preset)
        step = op_step(cache, step_inputs(batch, context, "none", preset), preset)
        x = torch.randn(batch * HKV * 2, preset.tile_size, D, device="cuda", dtype=torch.float16)
        lt = torch.zeros(x.shape[:2], device="cuda")
        lc = torch.zeros(x.shape[0], D, device="cuda")
        row = {"batch": batch, "context": context, "step_ms": bench(step)}
        for n in phases:
            work = functools.partial(phase, x, lt, lc, n)
            kernels[n] = work()

            def beside(work=work, step=step):
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    work()
                step()
                torch.cuda.current_stream().wait_stream(side)

            def in_order(work=work, step=step):
                step()
                work()

            row[f"phase{n}_ms"] = bench(work)
            row[f"beside{n}_ms"] = bench(beside)
            row[f"in_order{n}_ms"] = bench(in_order)
        rows.append(row)
        log.info("%s", row)
        del cache
        torch.cuda.empty_cache()
    meta = {str(n): {"registers": k.n_regs, "spills": k.n_spills, "shared_bytes": k.metadata.shared}
            for n, k in kernels.items()}  # fmt: skip
    return rows, meta


def markdown(rows: list[dict], phases: list[Phase], title: str, meta: dict) -> str:
    head = "| batch | context | step (ms) |"
    for n in phases:
        head += f" phase {n} alone | beside | in order | beside - step (% of step) |"
    lines = [title, "phases: passes:rows:warps (normalisation passes, rows of a token pass, warps a program)", "", head,
             "|" + "---|" * (3 + 4 * len(phases))]  # fmt: skip
    for r in rows:
        line = f"| {r['batch']} | {r['context']} | {r['step_ms']:.4f} |"
        for n in phases:
            extra = r[f"beside{n}_ms"] - r["step_ms"]
            line += (f" {r[f'phase{n}_ms']:.4f} | {r[f'beside{n}_ms']:.4f} | {r[f'in_order{n}_ms']:.4f} | "
                     f"{extra * 1e3:+.1f} us ({100 * extra / r['step_ms']:+.1f}%) |")  # fmt: skip
        lines.append(line)
    lines += ["", f"phase kernel per phase: {json.dumps(meta)}"]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], phases: list[Phase], path: pathlib.Path, title: str) -> None:
    from plots import save, subplots

    fig, ax = subplots(figsize=(7, 3.5))
    names = [f"B{r['batch']}/{r['context'] // 1024}K" for r in rows]
    width = 0.8 / (1 + 2 * len(phases))
    bars = [("step", "step_ms")]
    for n in phases:
        bars += [(f"phase {n} alone", f"phase{n}_ms"), (f"step + phase {n} beside", f"beside{n}_ms")]
    for i, (label, key) in enumerate(bars):
        ax.bar([j + (i - len(bars) / 2) * width for j in range(len(rows))], [r[key] for r in rows], width, label=label)
    ax.set_xticks(range(len(rows)), names, fontsize=8)
    ax.set_ylabel("ms per layer and step")
    ax.legend(fontsize=7)
    save(fig, path, title)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path)
    parser.add_argument("--preset", default="kvarn_k4v2_g128")
    parser.add_argument(
        "--phases",
        type=Phase.parse,
        nargs="+",
        default=[Phase(1), Phase(2), Phase(4)],
        help="passes:rows:warps of each phase timed: normalisation passes (two make an iteration), rows of a token "
        "pass (fewer than the tile's: a slice of one), warps a program (default: 1:128:1 2:128:1 4:128:1)",
    )
    parser.add_argument("--side-priority", type=int, default=0,
                        help="the side stream's priority (0: the default, as the step's; -1 or less: higher, its "
                        "programs dispatched before the step's waiting ones)")  # fmt: skip
    parser.add_argument("--check-only", action="store_true", help="check the phase kernel and stop (CPU: interpreter)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for n in args.phases:
        error = check_phase(device, n)
        log.info("phase kernel, phase %s: max |kernel - reference| of the log-scales %.2e", n, error)
        if error > 1e-3:
            raise SystemExit(f"the phase kernel disagrees with the reference ({error:.2e}): not timing it")
    if args.check_only:
        return
    if device != "cuda" or args.out is None:
        raise SystemExit("timing needs a GPU and --out")
    args.out.mkdir(parents=True, exist_ok=True)
    preset = get_preset(args.preset)
    rows, meta = run(preset, args.phases, args.side_priority)
    title = (f"Decode step with a quantization phase beside it (side stream priority {args.side_priority}), "
             f"{preset.name}, 32 query / 8 KV heads, D 128, fp16, "
             f"{torch.cuda.get_device_name()}; median ms (CUDA graphs)")  # fmt: skip
    write_results(
        args.out, {"title": title, "rows": rows, "phase_kernel": meta}, markdown(rows, args.phases, title, meta)
    )
    plot(rows, args.phases, args.out / "flush_beside.png", title)


if __name__ == "__main__":
    main()
