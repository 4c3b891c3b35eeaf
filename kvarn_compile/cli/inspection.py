"""``kvarn-compile inspect``: which attention sites of a model the kvarn backend rewrites, and why it
leaves the others alone.

The model is built from its config on the meta device (no weights, no memory: any size works), given a
transformers StaticCache with full-length sliding-window layers (``integrations.static_cache``, the cache to
compile such models with), and one decode step is traced through the backend with ``dry_run``: the passes
run on the real graph and report, nothing is allocated or executed on real data.
"""

from __future__ import annotations

import torch
import transformers

from ..backend import kvarn_backend
from ..integrations.static_cache import static_cache
from ..presets import DEFAULT_PRESET, get_preset


def build_on_meta(config: transformers.PretrainedConfig) -> torch.nn.Module:
    """The causal LM of ``config`` with meta weights, bf16 (grouped MoE matmuls need it), SDPA attention where
    the model has it."""
    with torch.device("meta"):
        try:
            return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                                 attn_implementation="sdpa").eval()  # fmt: skip
        except ValueError:  # no SDPA in this architecture (e.g. no attention at all)
            return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                                 attn_implementation="eager").eval()  # fmt: skip


def inspect_model(model: torch.nn.Module, preset: str = DEFAULT_PRESET, max_len: int | None = None) -> dict:
    """Trace one decode step of ``model`` (with a StaticCache of ``max_len``) through the kvarn backend and
    report every attention site: rewritten (with its shape and window) or skipped (with the reason), and
    the KV bytes per token (all layers, one sequence) before and after. ``max_len`` defaults to 1024 or past
    twice the config's window, whichever is longer: a window the cache does not exceed shows in no mask."""
    config = model.config.get_text_config()
    longest = getattr(config, "max_position_embeddings", None) or float("inf")
    windows = [getattr(config, name, None) or 0 for name in ("sliding_window", "attention_chunk_size")]
    # (a window no position reaches, as Phi-3-128k's 262,144, takes no effect: not traced)
    max_len = max_len or max(1024, *(2 * w + 128 for w in windows if w < longest))
    device = next(model.parameters()).device
    cache = static_cache(model, max_len, initialize=False)
    ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    reports: list = []
    torch._dynamo.reset()
    with torch.no_grad():
        model(ids, past_key_values=cache)  # the cache allocates its buffers on first use
        compiled = torch.compile(model, backend=kvarn_backend, fullgraph=False,
                                 options={"preset": preset, "reports": reports, "dry_run": True})  # fmt: skip
        compiled(ids, past_key_values=cache)
    torch._dynamo.reset()
    # One report a compiled graph: a graph break in the model's code splits the step's sites over several.
    rewritten = [r for report in reports for r in report.rewritten]
    skipped = [s for report in reports for s in report.skipped]
    p = get_preset(preset)
    kv_layers = [layer for layer in cache.layers if getattr(layer, "keys", None) is not None]  # not recurrent ones
    fp16 = sum(layer.keys.shape[1] * (layer.keys.shape[3] + layer.values.shape[3]) * 2 for layer in kv_layers)
    saved = sum(r.shape["Hkv"] * ((r.shape["Dk"] + r.shape["Dv"]) * 2 - p.bytes_per_token(r.shape["Dk"], r.shape["Dv"]))
                for r in rewritten)  # fmt: skip
    return {
        "model": type(model).__name__,
        "preset": preset,
        "attention_sites": sum(1 + len(r.readers) for r in rewritten) + len(skipped),
        "rewritten": [
            {"site": r.site, "kind": r.kind, "window": r.window, **r.shape, "read_by": [n for n, _ in r.readers]}
            for r in rewritten
        ],
        "skipped": skipped,
        "kv_bytes_per_token_fp16": fp16,
        "kv_bytes_per_token_kvarn": fp16 - saved,
    }


def format_report(result: dict) -> str:
    rewritten = sum(1 + len(r["read_by"]) for r in result["rewritten"])
    lines = [(f"{result['model']}: {result['attention_sites']} attention sites, {rewritten} rewritten "
              f"onto {result['preset']}, {len(result['skipped'])} left alone")]  # fmt: skip
    if not result["attention_sites"]:
        lines.append("  no attention site recognised in the decode graph (the pass matches SDPA and matmul-softmax-matmul "
                     "reading a cache buffer; attention with sinks, as GPT-OSS's, is not one): nothing is rewritten, "
                     "the model runs unchanged")  # fmt: skip
    for r in result["rewritten"]:
        window = f", window {r['window']}" if r["window"] else ""
        read_by = f", its cache also read by {', '.join(r['read_by'])}" if r["read_by"] else ""
        lines.append(f"  rewritten {r['site']:<16} {r['kind']:<6} Hq {r['Hq']} Hkv {r['Hkv']} D {r['Dk']}/{r['Dv']}"
                     f"{window}{read_by}")  # fmt: skip
    for s in result["skipped"]:
        lines.append(f"  skipped   {s['site']:<16} {s['reason']}")
    fp16, kv = result["kv_bytes_per_token_fp16"], result["kv_bytes_per_token_kvarn"]
    ratio = f" ({fp16 / kv:.2f}x less)" if kv else ""
    lines.append(f"KV bytes per token: {fp16:,} fp16 -> {kv:,.0f} kvarn{ratio}")
    return "\n".join(lines)
