"""How much KV cache a model needs per token and per sequence, per method (``kvarn-compile plan``).

A model's KV geometry comes from its transformers config: which layers hold a KV cache (``_layer_kinds``:
hybrid models list their layers' kinds, Jamba gives an attention period, Bamba attention indices; linear-attention,
recurrent and Mamba layers hold none), KV heads and head dims, and sliding windows (such a layer never holds more
than its window). MLA layers (a ``kv_lora_rank``) cache one latent and one rope key per token for all heads, as
transformers 5 and vLLM cache them: fp16 holds (latent + rope) x 2 bytes, a kvarn preset its latent tile
(``presets.LatentLayout``: every tile quantized, the current one exact); other methods are not modelled there.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re

from ..methods import get_method
from ..presets import NAMED_PRESETS, SUPPORTED_HEAD_DIMS, get_preset

PLAN_METHODS = ("fp16", "fp8", *NAMED_PRESETS, "kvarn_k2v2_g128")
FP16_BYTES = 2


@dataclasses.dataclass(frozen=True)
class AttentionLayer:
    kv_heads: int
    head_dim_k: int
    head_dim_v: int
    window: int = 0  # 0: holds the whole context
    latent: tuple[int, int] | None = None  # MLA: (latent dim, rope key dim), one "head" of both

    def supported(self, method: str) -> bool:
        """Whether ``method`` can store this layer: KVarN tile formats need supported head dims."""
        m = get_method(method)
        if self.latent is None:
            return m.preset is None or {self.head_dim_k, self.head_dim_v} <= set(SUPPORTED_HEAD_DIMS)
        if m.exact:
            return True
        if not method.startswith("kvarn_"):
            return False
        try:
            get_preset(method).latent_layout(*self.latent)
        except ValueError:
            return False
        return True

    def bytes_per_token(self, method: str) -> float:
        """Bytes of one token once its tile is quantized."""
        m = get_method(method)
        if self.latent is None:
            return self.kv_heads * m.bytes_per_token(self.head_dim_k, self.head_dim_v)
        if m.exact:
            return self.exact_bytes_per_token
        layout = get_preset(method).latent_layout(*self.latent)
        return layout.nbytes / layout.tile_size

    @property
    def exact_bytes_per_token(self) -> int:
        """Bytes of one token held exact (fp16/bf16)."""
        return self.kv_heads * (self.head_dim_k + self.head_dim_v) * FP16_BYTES


@dataclasses.dataclass(frozen=True)
class KVGeometry:
    layers: tuple[AttentionLayer, ...]

    @classmethod
    def from_config(cls, cfg, latent_cache: bool = True) -> KVGeometry:
        """From a transformers config object or its dict (``text_config`` of multimodal models is used).
        ``latent_cache``: MLA layers cache their latent (transformers 5, vLLM, ``LatentKVarNCache``); False: the
        per-head keys and values it expands to, which ``KVSession`` quantizes (the CLI's eval and demo)."""
        if not isinstance(cfg, dict):
            cfg = cfg.get_text_config()
            # the standard names of fields a class stores under its own (GPT-2's n_head, n_layer, ...)
            cfg = {**{name: getattr(cfg, name) for name in cfg.attribute_map}, **cfg.to_dict()}
        c = cfg.get("text_config") or cfg
        mla = bool(c.get("kv_lora_rank"))
        latent = (c["kv_lora_rank"], c["qk_rope_head_dim"]) if mla and latent_cache else None
        types, windows = _layer_kinds(c)
        if not types:
            raise ValueError("this config has no attention layer that holds a KV cache")
        if latent:  # MLA: the latent and the rope key of each token
            heads, dk, dv = 1, sum(latent), 0
        else:
            heads_q = c["num_attention_heads"]
            heads = c.get("num_key_value_heads") or heads_q
            dk = c.get("attention_head_dim") or c.get("head_dim") or c["hidden_size"] // heads_q
            if mla:  # a head's key: its no-rope and rope parts
                dk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
            dv = c.get("v_head_dim") or dk
        return cls(tuple(AttentionLayer(heads, dk, dv, windows.get(t, 0), latent) for t in types))

    @classmethod
    def from_file(cls, path: str | pathlib.Path) -> KVGeometry:
        """From a config.json, read by transformers (its class's defaults and derived values, such as the layer kinds
        Gemma2 and Gemma3 derive from a pattern) where it knows the ``model_type``, else as written."""
        try:
            import transformers

            return cls.from_config(transformers.AutoConfig.from_pretrained(path))
        except (ImportError, ValueError, KeyError):  # no transformers, or no model_type / an unknown one
            return cls.from_config(json.loads(pathlib.Path(path).read_text()))

    def supported(self, method: str) -> bool:
        """Whether ``method`` can store every layer of this model."""
        return all(layer.supported(method) for layer in self.layers)

    def bytes_per_token(self, method: str) -> float:
        """K+V bytes of one token over all layers, once its tile is quantized (sliding layers included)."""
        return sum(layer.bytes_per_token(method) for layer in self.layers)

    def bytes_per_sequence(self, method: str, context: int, keep_first_tile: bool = True) -> float:
        """Bytes one sequence of ``context`` tokens holds: its quantized tiles, plus the tile buffers kept
        exact in fp16 (the current tile, and the first when ``keep_first_tile``); sliding layers hold
        their window."""
        m = get_method(method)
        total = 0.0
        for layer in self.layers:
            tokens = min(context, layer.window) if layer.window else context
            per_exact = layer.exact_bytes_per_token
            if m.exact:
                total += tokens * per_exact
                continue
            g, kept = m.tile_size, 2 if keep_first_tile and layer.latent is None else 1  # latents: every tile
            quantized_tiles = max(tokens // g - (kept - 1), 0)
            total += kept * g * per_exact + quantized_tiles * g * layer.bytes_per_token(method)
        return total


# The per-layer kinds configs list: transformers' ``layer_types`` (most models), Zamba2's and NemotronH's
# ``layers_block_type``, RecurrentGemma's ``block_types`` (a pattern repeated over the layers, its attention local:
# ``attention_window_size``). Every kind holds a KV cache but those below; "sliding" / "local" kinds hold their
# window, Llama4's chunked layers their chunk; any other (full, indexed, compressed, ...) the whole context.
LAYER_KIND_LISTS = ("layer_types", "layers_block_type", "block_types")
NO_KV_CACHE = ("linear", "mamba", "recurrent", "conv", "mlp", "moe")  # (a kind containing one of these)
CHUNKED = "chunked_attention"


def _layer_kinds(c: dict) -> tuple[list[str], dict[str, int]]:
    """The kinds of a config's layers that hold a KV cache, in order, and the window of each windowed kind."""
    n = c.get("num_hidden_layers") or c.get("num_layers")
    listed = next((c[key] for key in LAYER_KIND_LISTS if c.get(key)), None)
    window = c.get("sliding_window") or 0
    if listed is not None:
        if c.get("block_types"):  # RecurrentGemma: a pattern over the layers; its attention layers are local
            listed = [listed[i % len(listed)] for i in range(n)]
            listed = ["local_attention" if kind == "attention" else kind for kind in listed]
            window = c.get("attention_window_size") or window
    elif c.get("attn_layer_period"):  # Jamba: an attention layer every period from the offset
        listed = [
            "full_attention" if i % c["attn_layer_period"] == c["attn_layer_offset"] else "mamba" for i in range(n)
        ]
    elif c.get("attn_layer_indices") is not None:  # Bamba
        listed = ["full_attention" if i in c["attn_layer_indices"] else "mamba" for i in range(n)]
    elif "num_attention_heads" not in c:  # Mamba, FalconMamba: no attention at all
        listed = []
    elif window and c.get("use_sliding_window") is not False:  # Mistral: every layer slides
        listed = ["sliding_attention"] * n
    else:
        listed = ["full_attention"] * n
    kinds = [kind for kind in listed if not any(part in kind for part in NO_KV_CACHE)]
    windows = {kind: window for kind in kinds if "sliding" in kind or "local" in kind}
    return kinds, {**windows, CHUNKED: c.get("attention_chunk_size") or 0}


def parse_bytes(text: str) -> int:
    """'40GB', '40 GiB', '40G', '512mb', '1e9' -> bytes (G, GB = 1e9; GiB = 2**30; case does not matter)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(?:([kmgt])(i?))?b?\s*", text.lower())
    size = int(float(match[1]) * (2**10 if match[3] else 1000) ** " kmgt".index(match[2] or " ")) if match else 0
    if size < 1:
        raise ValueError(f"expected a size of at least one byte, like 40GB, 40GiB or 512MB, got {text!r}")
    return size


def plan(geometry: KVGeometry, kv_memory: int, context: int, keep_first_tile: bool = True) -> list[dict]:
    """One row per method: bytes per token, tokens that fit, sequences of ``context`` tokens that fit."""
    rows = []
    fp16 = geometry.bytes_per_token("fp16")
    for method in PLAN_METHODS:
        if not geometry.supported(method):
            rows.append({"method": method, "supported": False})
            continue
        per_token = geometry.bytes_per_token(method)
        per_seq = geometry.bytes_per_sequence(method, context, keep_first_tile)
        rows.append({
            "method": method, "supported": True, "bytes_per_token": per_token, "compression": fp16 / per_token,
            "tokens": int(kv_memory // per_token), "sequences": int(kv_memory // per_seq),
        })  # fmt: skip
    return rows


def format_plan(rows: list[dict], kv_memory: int, context: int) -> str:
    lines = [f"KV memory {kv_memory / 1e9:.1f} GB, context {context} tokens",
             f"{'method':<18}{'bytes/token':>13}{'vs fp16':>9}{'tokens':>15}{'sequences':>11}"]  # fmt: skip
    for r in rows:
        if not r["supported"]:
            lines.append(f"{r['method']:<18}  not supported for this model's heads (KVarN head dims: "
                         f"{', '.join(map(str, SUPPORTED_HEAD_DIMS))}; MLA latents: fp16 and kvarn presets)")  # fmt: skip
            continue
        lines.append(f"{r['method']:<18}{r['bytes_per_token']:>13,.0f}{r['compression']:>8.2f}x"
                     f"{r['tokens']:>15,}{r['sequences']:>11,}")  # fmt: skip
    return "\n".join(lines)
