"""How many normalisation iterations real tiles need: the iterate ``reference.balance`` keeps on SmolLM2's keys and
values, with all 8 iterations (the paper and the package) and with a patience: ending after 1 or 2 iterations in a
row that do not lower the imbalance (``benchmarks/results/gpu-s39/patience2.patch``, not in the package). CPU only.

SmolLM2-135M (30 layers, 3 KV heads, head_dim 64) reads ``--spans`` spans of ``--tokens`` tokens of the stdlib
corpus (one every 20,000 tokens); each layer's cached keys and values (after RoPE) are rotated and cut into
128-token tiles, and every tile's normalisation is followed iterate by iterate: its imbalance after each iteration,
the iterate each rule keeps, how many iterations each patience runs, and how much more imbalanced its iterate is
where it disagrees with the full run.

    python benchmarks/normalisation_iterations.py --out DIR [--spans 3] [--tokens 2048]

Writes DIR/iterations.md, DIR/iterations.json (also printed) and DIR/iterations.png.
"""

from __future__ import annotations

import argparse
import collections
import logging
import pathlib

import torch
from plots import save, subplots
from result_files import write_table
from tqdm import tqdm

from kvarn_compile import reference
from kvarn_compile.cli.corpus import stdlib_text
from kvarn_compile.cli.models import load_model

ITERATIONS, G, SPAN_STRIDE = 8, 128, 20000
PATIENCES = (1, 2)


def real_tiles(spans: int, tokens: int) -> dict[str, torch.Tensor]:
    """SmolLM2's rotated key and value tiles [N, G, D] over the corpus spans."""
    lm, tokenizer = load_model("smollm2", torch.device("cpu"), torch.float32)
    ids = tokenizer(stdlib_text(), return_tensors="pt", add_special_tokens=False).input_ids[0]
    tiles = {"keys": [], "values": []}
    for span in tqdm(range(spans), desc="spans"):
        with torch.no_grad():
            cache = lm(ids[None, span * SPAN_STRIDE : span * SPAN_STRIDE + tokens], use_cache=True).past_key_values
        for layer in cache.layers:
            for kind, t in (("keys", layer.keys[0]), ("values", layer.values[0])):  # [H, T, D]
                h, n, d = t.shape
                tiles[kind].append(reference.rotate(t[:, : n // G * G].float()).reshape(h * (n // G), G, d))
    return {kind: torch.cat(parts) for kind, parts in tiles.items()}


def imbalances(x: torch.Tensor, tokens_first: bool) -> torch.Tensor:
    """[N, ITERATIONS + 1]: each tile's imbalance at the start and after each iteration."""
    log_tok, log_chan = x.new_zeros(x.shape[:-1]), x.new_zeros(x.shape[:-2] + x.shape[-1:])
    out = [reference._imbalance(x)]
    for _ in range(ITERATIONS):
        for tokens in (tokens_first, not tokens_first):
            new = reference.normalisation_pass(x, log_tok, log_chan, tokens=tokens)
            log_tok, log_chan = (new, log_chan) if tokens else (log_tok, new)
        out.append(reference._imbalance(reference.normalised(x, log_tok, log_chan)))
    return torch.stack(out, -1)


def kept(imbalance: torch.Tensor, patience: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the iterate each tile keeps, the iterations run) under ``balance``'s rule with ``patience`` (0: none)."""
    best, chosen = imbalance[:, 0], torch.zeros(len(imbalance), dtype=torch.long)
    run, misses = torch.zeros_like(chosen), torch.zeros_like(chosen)
    limit = patience or ITERATIONS + 1
    for i in range(1, ITERATIONS + 1):
        going = misses < limit
        run += going.long()
        better = going & (imbalance[:, i] < best * (1 - reference.IMBALANCE_MARGIN))
        best, chosen = torch.where(better, imbalance[:, i], best), torch.where(better, i, chosen)
        misses = torch.where(better, 0, misses + 1)
    return chosen, run


def analyse(tiles: dict[str, torch.Tensor]) -> tuple[list[dict], dict]:
    rows, histograms = [], {}
    for kind, tokens_first in (("keys", True), ("values", False)):
        imbalance = imbalances(tiles[kind], tokens_first)
        full, _ = kept(imbalance, 0)
        histograms[kind] = {"kept (all 8)": collections.Counter(full.tolist())}
        for patience in PATIENCES:
            early, run = kept(imbalance, patience)
            ratio = imbalance.gather(1, early[:, None])[:, 0] / imbalance.gather(1, full[:, None])[:, 0]
            rows.append({"tiles": kind, "patience": patience, "count": len(full),
                         "same_iterate": (early == full).float().mean().item(), "iterations_run": run.float().mean().item(),
                         "worst_ratio": ratio.max().item(), "mean_ratio": ratio.mean().item(),
                         "median_imbalance": [round(v, 3) for v in imbalance.median(0).values.tolist()]})  # fmt: skip
            histograms[kind][f"run (patience {patience})"] = collections.Counter(run.tolist())
    return rows, histograms


def plot(histograms: dict, path: pathlib.Path) -> None:
    fig, axes = subplots(1, 2, figsize=(10, 3.5))
    for ax, (kind, counts) in zip(axes, histograms.items(), strict=True):
        width = 0.8 / len(counts)
        for i, (label, counter) in enumerate(counts.items()):
            xs = range(ITERATIONS + 1)
            ax.bar([x + (i - (len(counts) - 1) / 2) * width for x in xs], [counter.get(x, 0) for x in xs], width,
                   label=label)  # fmt: skip
        ax.set_title(f"{kind} tiles", fontsize=9)
        ax.set_xlabel("iteration")
    axes[0].set_ylabel("tiles")
    axes[0].legend(fontsize=8)
    save(fig, path, "SmolLM2-135M: the normalisation iterate kept, and the iterations each patience runs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--spans", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=2048)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    args.out.mkdir(parents=True, exist_ok=True)
    rows, histograms = analyse(real_tiles(args.spans, args.tokens))
    title = (f"SmolLM2-135M, {args.spans} spans of {args.tokens} stdlib tokens: the iterate kept with all {ITERATIONS} "
             "iterations against patience 1 and 2 (same iterate: share of tiles; ratio: the kept iterate's imbalance "
             "over the full run's)")  # fmt: skip
    columns = {"tiles": "tiles", "patience": "patience", "count": "count", "same_iterate": "same iterate",
               "iterations_run": "iterations run",
               "worst_ratio": "worst ratio", "mean_ratio": "mean ratio", "median_imbalance": "median imbalance by iteration"}  # fmt: skip
    write_table(args.out, "iterations", title, rows, columns, digits=6)
    plot(histograms, args.out / "iterations.png")


if __name__ == "__main__":
    main()
