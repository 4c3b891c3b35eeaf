"""``kvarn-compile``: demo (fp16 vs KVarN cache on a real model), eval (accuracy table), plan (capacity),
inspect (what the torch.compile backend rewrites in a model)."""

from __future__ import annotations

import argparse
import functools
import json
import logging
import pathlib
import sys

from ..methods import DEFAULT_METHODS, get_method
from ..presets import DEFAULT_PRESET, get_preset
from .capacity import parse_bytes

log = logging.getLogger("kvarn.cli")


# Argument types: a bad value fails at parsing, before any model loads, in one line that says what was expected.
def argument_type(convert):
    """``convert`` as an argparse type whose ValueError messages reach the user (argparse drops a ValueError's)."""

    @functools.wraps(convert)
    def parse(text: str):
        try:
            return convert(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


def integer_from(lowest: int, what: str):
    """An argument type: an integer of at least ``lowest`` (``what`` names that in the error)."""

    @argument_type
    def parse(text: str) -> int:
        if not text.strip().isdigit() or int(text) < lowest:
            raise ValueError(f"expected {what}, got {text!r}")
        return int(text)

    return parse


positive = integer_from(1, "a positive integer")
at_least_two = integer_from(2, "an integer of at least 2")  # token counts: a window of n tokens scores n - 1


@argument_type
def method_names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise ValueError("expected comma-separated method names")
    for name in names:
        get_method(name)  # an unknown name raises, listing the known ones
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:  # (eval sums each method's counts under its name)
        raise ValueError(f"each method once, got {', '.join(repeated)} more than once")
    return names


@argument_type
def preset_name(text: str) -> str:
    return get_preset(text).name


@argument_type
def config_file(text: str) -> str:
    """A config.json, or a model directory holding one."""
    path = pathlib.Path(text)
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise ValueError(f"expected a config.json or a model directory holding one, got {text!r}")
    return str(path)


@argument_type
def png_path(text: str) -> str:
    if not pathlib.Path(text).resolve().parent.is_dir():
        raise ValueError(f"the plot's folder does not exist: {text!r}")
    return text


def _demo(args) -> None:
    from .demo import demo, report
    from .models import load_model

    model, tokenizer = load_model(args.model)
    runs = demo(model, tokenizer, args.preset, args.prompt, args.max_new_tokens, not args.quantize_first_tile)
    print(report(model, tokenizer, runs, args.model))


def _eval(args) -> None:
    from .corpus import load_corpus
    from .evaluate import Settings, accumulation, evaluate, plot, tokenize
    from .models import load_model

    model, tokenizer = load_model(args.model)
    ids = tokenize(tokenizer, load_corpus(args.corpus))
    if ids.numel() < 2:
        raise SystemExit(f"--corpus {args.corpus}: expected a text of at least 2 tokens, got {ids.numel()}")
    if not 0 <= args.offset < ids.numel():
        raise SystemExit(f"--offset must be in [0, {ids.numel()}): the corpus has {ids.numel()} tokens")
    ids = ids[args.offset :]
    settings = Settings(tokens=args.tokens, window=min(args.window, args.tokens),
                        keep_first_tile=not args.quantize_first_tile, prompts=args.prompts,
                        prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, paged=args.paged)  # fmt: skip
    methods = args.methods
    result = {"model": args.model, "corpus": args.corpus, "offset": args.offset,
              **evaluate(model, ids, methods, settings)}  # fmt: skip
    if args.accumulation:
        result["accumulation"] = accumulation(model, ids, methods, settings)
    _print_eval(result, args)
    if args.plot:  # after the table: a plot that fails loses no results
        plot(result, args.plot)
        log.info("plot written to %s", args.plot)


def _print_eval(result: dict, args) -> None:
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{'method':<24}{'bytes/token':>12}{'ppl':>10}{'KL':>10}{'top1':>8}{'greedy':>8}")
        for r in result["results"]:
            print(f"{r['method']:<24}{r['bytes_per_token']:>12,.0f}{r['ppl']:>10.3f}{r['kl']:>10.4f}"
                  f"{r['top1']:>8.3f}{r['greedy_prefix']:>8.1f}")  # fmt: skip
        if args.accumulation:
            print("\nrelative L2 error of each layer's attention output (layer 0 first):")
            for name, curves in result["accumulation"].items():
                for label, key in (("fed forward", "fed_forward"), ("recorded only", "recorded")):
                    print(f"{label:<14}{name:<24}" + " ".join(f"{e:.4f}" for e in curves[key]))


def _plan(args) -> None:
    from .capacity import KVGeometry, format_plan, plan

    geometry = KVGeometry.from_file(args.hf_config)
    rows = plan(geometry, args.kv_memory, args.context, not args.quantize_first_tile)
    print(json.dumps(rows) if args.json else format_plan(rows, args.kv_memory, args.context))


def _inspect(args) -> None:
    import transformers

    from .inspection import build_on_meta, format_report, inspect_model

    source = args.hf_config or args.hf_model
    config = transformers.AutoConfig.from_pretrained(source)
    result = inspect_model(build_on_meta(config), args.preset)
    print(json.dumps(result) if args.json else format_report(result))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvarn-compile", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    sink = {"action": "store_true", "help": "quantize each sequence's first tile too (default: kept exact, "
                                            "an attention sink costing one tile per sequence)"}  # fmt: skip

    d = sub.add_parser("demo", help="generate with an fp16 and a KVarN cache side by side")
    d.add_argument("--model", default="smollm2", help="'smollm2' (fetched once), a transformers dir or a .gguf")
    d.add_argument("--preset", default=DEFAULT_PRESET, type=preset_name)
    d.add_argument("--prompt", help="user message (default: summarise a passage of Python's docs)")
    d.add_argument("--max-new-tokens", type=positive, default=64)
    d.add_argument("--quantize-first-tile", **sink)
    d.set_defaults(run=_demo)

    e = sub.add_parser("eval", help="perplexity, KL, top-1 and greedy agreement of KV methods vs fp16")
    e.add_argument("--model", default="smollm2")
    e.add_argument("--corpus", default="stdlib", help="'stdlib' (Python's docstrings) or a UTF-8 text file")
    e.add_argument("--tokens", type=at_least_two, default=4096)
    e.add_argument("--offset", type=int, default=0, help="skip this many tokens of the corpus (held-out spans)")
    e.add_argument("--window", type=at_least_two, default=2048)
    e.add_argument("--methods", type=method_names, default=list(DEFAULT_METHODS), help="comma-separated")
    e.add_argument("--prompts", type=positive, default=4, help="greedy-agreement prompts")
    e.add_argument("--prompt-tokens", type=positive, default=512)
    e.add_argument("--new-tokens", type=positive, default=64)
    e.add_argument("--accumulation", action="store_true", help="per-layer error, fed forward vs recorded only")
    e.add_argument(
        "--paged",
        action="store_true",
        help="kvarn presets on the real paged cache (kvarn:: ops; Triton on a GPU) instead of its dense simulation",
    )
    e.add_argument("--quantize-first-tile", **sink)
    e.add_argument("--json", action="store_true")
    e.add_argument("--plot", type=png_path, help="PNG path for the KL / perplexity / error-growth plot")
    e.set_defaults(run=_eval)

    pl = sub.add_parser("plan", help="KV bytes per token, tokens and sequences that fit, per method")
    pl.add_argument("--hf-config", required=True, type=config_file, help="a transformers config.json (or its folder)")
    pl.add_argument("--kv-memory", required=True, type=argument_type(parse_bytes), help="KV-cache memory, e.g. 40GB")
    pl.add_argument("--context", type=positive, default=32768)
    pl.add_argument("--quantize-first-tile", **sink)
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(run=_plan)

    i = sub.add_parser("inspect", help="attention sites the torch.compile backend rewrites or leaves alone, and why")
    source = i.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf-config", type=config_file, help="a transformers config.json (built without weights)")
    source.add_argument("--hf-model", help="a transformers model directory (only its config is read)")
    i.add_argument("--preset", default=DEFAULT_PRESET, type=preset_name)
    i.add_argument("--json", action="store_true")
    i.set_defaults(run=_inspect)
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    args.run(args)


if __name__ == "__main__":
    main()
