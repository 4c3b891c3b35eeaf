"""How much KV cache a model needs per token and per sequence, per method (``kvarn-compile plan``).

A model's KV geometry comes from its transformers config: which layers hold a KV cache (hybrid models
list ``layer_types``, Jamba an attention period, Bamba attention indices; linear-attention / recurrent
layers hold none), KV heads and head dims, and sliding windows (such a layer never holds more than its
window). MLA layers (a ``kv_lora_rank``) cache one latent and one rope key per token for all heads, as
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
    def from_config(cls, cfg) -> KVGeometry:
        """From a transformers config object or its dict (``text_config`` of multimodal models is used)."""
        c = cfg if isinstance(cfg, dict) else cfg.to_dict()
        c = c.get("text_config") or c
        heads_q = c["num_attention_heads"]
        latent = (c["kv_lora_rank"], c["qk_rope_head_dim"]) if c.get("kv_lora_rank") else None
        if latent:  # MLA: the latent and the rope key of each token
            heads, dk, dv = 1, sum(latent), 0
        else:
            heads = c.get("num_key_value_heads") or heads_q
            dk = dv = c.get("head_dim") or c["hidden_size"] // heads_q
        types = c.get("layer_types") or _attention_pattern(c)
        window = c.get("sliding_window") or 0
        layers = []
        for t in types:
            if "linear" in t or t in ("mamba", "recurrent", "conv"):
                continue
            layers.append(AttentionLayer(heads, dk, dv, window if "sliding" in t else 0, latent))
        if not layers:
            raise ValueError("this config has no attention layer that holds a KV cache")
        return cls(tuple(layers))

    @classmethod
    def from_file(cls, path: str | pathlib.Path) -> KVGeometry:
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


def _attention_pattern(c: dict) -> list[str]:
    """Layer types of configs without ``layer_types``: Jamba (an attention layer every
    ``attn_layer_period`` from ``attn_layer_offset``), Bamba (``attn_layer_indices``), else all attention."""
    n = c["num_hidden_layers"]
    if c.get("attn_layer_period"):
        return ["full_attention" if i % c["attn_layer_period"] == c["attn_layer_offset"] else "mamba" for i in range(n)]
    if c.get("attn_layer_indices") is not None:
        return ["full_attention" if i in c["attn_layer_indices"] else "mamba" for i in range(n)]
    return ["full_attention"] * n


def parse_bytes(text: str) -> int:
    """'40GB', '40 GiB', '512MB', '1e9' -> bytes (GB = 1e9, GiB = 2**30)."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]?i?B)?\s*", text)
    if not match:
        raise ValueError(f"expected a size like 40GB, 40GiB or 512MB, got {text!r}")
    units = {None: 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
             "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}  # fmt: skip
    return int(float(match[1]) * units[match[2]])


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
