"""What the benchmarks write into their --out folder: the one-off device scripts under benchmarks/results/*/ their
folder and the table each writes there as markdown (out/NAME.md, also printed) and as JSON (out/NAME.json); the
benchmark scripts their results (``write_results``).

    out = out_dir(__doc__)
    write_table(out, "flush", "NVIDIA H200: ...", rows, {"batch": "batch", "ms": "ms"})
"""

import argparse
import json
import logging
import pathlib


def out_dir(description: str | None = None) -> pathlib.Path:
    """The script's --out folder (made if missing), from its command line; logging at INFO."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    out = parser.parse_args().out
    logging.basicConfig(level=logging.INFO)
    out.mkdir(parents=True, exist_ok=True)
    return out


def write_table(out: pathlib.Path, name: str, title: str, rows: list[dict], columns: dict[str, str],
                digits: int = 4) -> None:  # fmt: skip
    """``rows`` as a markdown table under ``title`` (``columns``: row key -> header; floats to ``digits``
    decimals, a missing key as nan) in out/NAME.md, and as they are in out/NAME.json."""

    def cell(value) -> str:
        return f"{value:.{digits}f}" if isinstance(value, float) else str(value)

    lines = [title, "", "| " + " | ".join(columns.values()) + " |", "|---" * len(columns) + "|"]
    lines += ["| " + " | ".join(cell(r.get(key, float("nan"))) for key in columns) + " |" for r in rows]
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    (out / f"{name}.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(lines))


def write_results(out: pathlib.Path, results: dict, table: str) -> None:
    """A benchmark's results: ``results`` (its rows and what they were measured on) in out/results.json, its
    markdown ``table`` in out/results.md, also printed."""
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(table.rstrip("\n") + "\n")
    print(table)
