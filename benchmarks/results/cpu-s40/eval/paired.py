"""KL to fp16 of the package against patience2.patch on held-out spans, span by span and pooled, with a 95% interval
of the pooled relative change from a paired bootstrap over blocks of 64 positions (the per-position KLs of
`kvarn-compile eval --json`, so that neighbouring, correlated positions resample together).

    python paired.py DIR [DIR ...]   # folders of package-OFFSET.json / patience2-OFFSET.json; prints markdown
    python paired.py DIR --other nopatience --methods kvarn_k4v2_g64   # package-* against nopatience-* (session 41)
"""

import argparse
import json
import pathlib

import numpy as np

BLOCK = 64


def main(dirs: list[str], other: str, methods: list[str]) -> None:
    rng = np.random.default_rng(0)
    spans = {}
    for d in map(pathlib.Path, dirs):
        for f in sorted(d.glob("package-*.json")):
            pair = f.with_name(f.name.replace("package-", f"{other}-"))
            if pair.exists():
                spans[int(f.stem.split("-")[1])] = (json.loads(f.read_text()), json.loads(pair.read_text()))
    print(f"| offset | method | package KL | {other} KL | change |\n|---|---|---|---|---|")
    for off in sorted(spans):
        a, b = spans[off]
        for ra, rb in zip(a["results"], b["results"]):
            print(
                f"| {off} | {ra['method']} | {ra['kl']:.6f} | {rb['kl']:.6f} | {100 * (rb['kl'] / ra['kl'] - 1):+.2f}% |"
            )
    print(f"\n{len(spans)} spans pooled, paired bootstrap over blocks of {BLOCK} positions (5,000 resamples):\n")
    print(f"| method | package KL | {other} KL | change | 95% interval |\n|---|---|---|---|---|")
    for m in methods:
        blocks = []
        for a, b in spans.values():
            x, y = np.array(a["kl_by_position"][m]), np.array(b["kl_by_position"][m])
            n = len(x) // BLOCK * BLOCK
            blocks.append(np.stack([x[:n].reshape(-1, BLOCK).sum(1), y[:n].reshape(-1, BLOCK).sum(1)], 1))
        xy = np.concatenate(blocks)
        picks = rng.integers(0, len(xy), (5000, len(xy)))
        ratios = xy[picks, 1].sum(1) / xy[picks, 0].sum(1) - 1
        lo, hi = np.percentile(ratios, [2.5, 97.5]) * 100
        mean = xy.sum(0) / sum(len(a["kl_by_position"][m]) // BLOCK * BLOCK for a, _ in spans.values())
        print(
            f"| {m} | {mean[0]:.6f} | {mean[1]:.6f} | {100 * (xy[:, 1].sum() / xy[:, 0].sum() - 1):+.2f}% | "
            f"{lo:+.1f} to {hi:+.1f}% |"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dirs", nargs="+")
    parser.add_argument("--other", default="patience2", help="the other runs' file prefix")
    parser.add_argument("--methods", nargs="+", default=["kvarn_k4v2_g128", "kvarn_k4v4_g128"])
    args = parser.parse_args()
    main(args.dirs, args.other, args.methods)
