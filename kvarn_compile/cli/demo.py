"""``kvarn-compile demo``: one model, the same prompt, an fp16 KV cache and the KVarN cache side by side.

Prints the KV bytes each cache holds and their ratio, decode tokens/s, where the two greedy generations
first differ, and the perplexity of each on a held-in sample of text (stdlib docstrings, fed tile by
tile, so every position reads quantized history as at decode time).
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch
from tqdm import tqdm

from ..integrations.hf import KVSession, kv_dtype_for
from .capacity import KVGeometry
from .corpus import stdlib_text
from .evaluate import chunk_for, teacher_forced, tokenize

log = logging.getLogger("kvarn.demo")

INSTRUCTION = "Read this passage from Python's documentation, then explain in a few sentences what it is about."
PASSAGE_TOKENS = 700  # enough history for several quantized 128-token tiles
PPL_OFFSET, PPL_TOKENS = 20_000, 1024  # held-in sample: tokens [20000, 21024) of the stdlib corpus


@dataclasses.dataclass
class Run:
    method: str
    prompt_tokens: int
    tokens: torch.Tensor  # generated ids [N]
    tokens_per_s: float
    kv_bytes: int  # bytes holding the prompt + generated tokens
    ppl: float


def build_prompt(tokenizer, corpus_ids: torch.Tensor, prompt: str | None) -> torch.Tensor:
    """Token ids [T] of the chat prompt: ``prompt`` or the instruction with a passage of the corpus."""
    if prompt is None:
        prompt = f"{INSTRUCTION}\n\n{tokenizer.decode(corpus_ids[:PASSAGE_TOKENS])}"
    messages = [{"role": "user", "content": prompt}]
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    else:
        ids = tokenizer(prompt)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def run(model, method: str, prompt: torch.Tensor, sample: torch.Tensor, max_new_tokens: int, eos, keep_first_tile):
    session = KVSession.for_method(model, method, max_seq_len=prompt.numel() + max_new_tokens + sample.numel(),
                                   keep_first_tile=keep_first_tile)  # fmt: skip
    tokens, rate = session.generate(prompt[None].to(model.device), max_new_tokens, eos)
    kv_bytes = session.kv_bytes()
    logp = teacher_forced(session, sample.to(model.device), chunk_for(method))[:-1]
    nll = -logp.gather(-1, sample[1:, None].to(logp.device)).mean().item()
    return Run(method, prompt.numel(), tokens[0].cpu(), rate, kv_bytes, math.exp(nll))


def demo(model, tokenizer, preset: str, prompt: str | None = None, max_new_tokens: int = 64,
         keep_first_tile: bool = True) -> list[Run]:  # fmt: skip
    corpus_ids = tokenize(tokenizer, stdlib_text())
    prompt_ids = build_prompt(tokenizer, corpus_ids, prompt)
    sample = corpus_ids[PPL_OFFSET : PPL_OFFSET + PPL_TOKENS]
    methods = tqdm(("fp16", preset), desc="demo: generate, then perplexity, per cache")
    return [run(model, m, prompt_ids, sample, max_new_tokens, tokenizer.eos_token_id, keep_first_tile)
            for m in methods]  # fmt: skip


def report(model, tokenizer, runs: list[Run], name: str) -> str:
    base, kv = runs
    prompt_tokens = base.prompt_tokens
    n = min(base.tokens.numel(), kv.tokens.numel())
    diff = (base.tokens[:n] != kv.tokens[:n]).nonzero()
    geometry = KVGeometry.from_config(model.config, latent_cache=False)  # what the KVSession runs cached
    stored = prompt_tokens + max(base.tokens.numel(), kv.tokens.numel())
    per_token = [geometry.bytes_per_token(r.method) for r in runs]
    rows = [  # (label, fp16 value, kvarn value, comparison)
        (f"KV bytes ({stored} tokens)", f"{base.kv_bytes:,}", f"{kv.kv_bytes:,}", f"{base.kv_bytes / kv.kv_bytes:.2f}x less"),
        ("KV bytes per token (long context)", f"{per_token[0]:,.0f}", f"{per_token[1]:,.0f}",
         f"{per_token[0] / per_token[1]:.2f}x less"),
        ("decode tokens/s", f"{base.tokens_per_s:.1f}", f"{kv.tokens_per_s:.1f}", ""),
        (f"perplexity ({PPL_TOKENS} tokens of docs)", f"{base.ppl:.3f}", f"{kv.ppl:.3f}",
         f"{100 * (kv.ppl / base.ppl - 1):+.2f}%"),
    ]  # fmt: skip
    same = not diff.numel() and base.tokens.numel() == kv.tokens.numel()
    header = f"model {name} on {model.device.type}: {model.dtype} weights, {kv_dtype_for(model.dtype)} KV cache"
    lines = [f"{header}, prompt of {prompt_tokens} tokens"]
    lines += [f"{label:<36}{a:>16}{b:>18}   {c}" for label, a, b, c in [("", base.method, kv.method, ""), *rows]]
    lines.append(
        "generations: " + ("identical" if same else f"first differ at new token {int(diff[0]) if diff.numel() else n}")
    )
    for r in runs:
        lines += [f"--- {r.method} ---", tokenizer.decode(r.tokens, skip_special_tokens=True).strip()]
    return "\n".join(lines)
