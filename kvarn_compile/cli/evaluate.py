"""Accuracy of KV methods on a real model and text (``kvarn-compile eval``).

Decoding semantics, teacher-forced: the text is fed in chunks of one tile (G tokens), so every position
attends to the quantized tiles before its own and to exact values inside its tile, exactly what the
cache serves at decode time. Every method runs on ``DenseKV`` (same tiles, same exact first/current
tiles; each tile quantized once); ``paged=True`` runs the kvarn presets on the real paged cache instead
(``PagedKV``: the ``kvarn::`` ops, Triton kernels on a GPU), which tests/test_hf.py checks gives the
same logits as the simulation, and which on a CPU re-reads the whole history at every chunk (slower).

Metrics per method against fp16 (the same model with an unquantized fp16 cache):
    ppl            perplexity of the text
    kl             mean KL(fp16 || method) of the next-token distributions
    top1           fraction of positions whose most likely next token equals fp16's
    greedy_prefix  mean number of identical tokens before the first divergence, greedy generation of
                   ``new_tokens`` tokens after each of ``prompts`` prompts of ``prompt_tokens`` tokens
The error-accumulation protocol (``accumulation``): the relative L2 error of each layer's attention
output when the quantization errors are fed forward through the model, vs recorded only (every layer
gets the exact fp16 inputs and its quantized output is measured, then discarded).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys

import torch
from tqdm import tqdm

from ..integrations.hf import DenseKV, KVSession, kv_dtype_for
from ..methods import get_method
from .capacity import KVGeometry

log = logging.getLogger("kvarn.eval")


@dataclasses.dataclass
class Settings:
    tokens: int = 4096  # tokens of text scored (split into windows)
    window: int = 2048  # tokens per window (each starts with an empty cache)
    keep_first_tile: bool = True  # the first tile of each sequence stays exact (attention sink), all methods
    prompts: int = 4  # greedy-agreement prompts
    prompt_tokens: int = 512
    new_tokens: int = 64
    paged: bool = False  # kvarn presets on the real paged cache instead of DenseKV


def chunk_for(method: str) -> int:
    """Teacher-forcing chunk: one tile of the method (128 tokens for fp16)."""
    return 128 if get_method(method).exact else get_method(method).tile_size


def _session(model, method: str, settings: Settings) -> KVSession:
    longest = settings.window + settings.prompt_tokens + settings.new_tokens
    paged = settings.paged and method.startswith("kvarn_")
    return KVSession.for_method(model, method, longest, settings.keep_first_tile, paged)


def teacher_forced(session: KVSession, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """Log-probs [T, vocab] (float32) of ``ids`` [T] fed ``chunk`` tokens at a time into a fresh cache."""
    session.reset()
    parts = [session.forward(ids[None, i : i + chunk])[0] for i in range(0, ids.numel(), chunk)]
    return torch.log_softmax(torch.cat(parts).float(), -1)


def _windows(ids: torch.Tensor, settings: Settings) -> list[torch.Tensor]:
    ids = ids[: settings.tokens]
    return [w for w in ids.split(settings.window) if w.numel() >= 2]


def _prompts(ids: torch.Tensor, settings: Settings) -> list[torch.Tensor]:
    span = settings.prompt_tokens
    if ids.numel() < span:
        raise ValueError(f"the corpus has {ids.numel()} tokens, fewer than --prompt-tokens {span}")
    starts = torch.linspace(0, ids.numel() - span, settings.prompts).long().tolist()
    return [ids[s : s + span] for s in starts]


def _agreement(a: torch.Tensor, b: torch.Tensor) -> int:
    """Identical tokens before the first divergence."""
    n = min(a.numel(), b.numel())
    diff = (a[:n] != b[:n]).nonzero()
    return int(diff[0]) if diff.numel() else n


def evaluate(model, ids: torch.Tensor, methods: list[str], settings: Settings, progress: bool = True) -> dict:
    """Evaluate ``methods`` on token ids [N] of a text; returns the ``eval`` JSON (without model/corpus)."""
    for m in methods:
        get_method(m)  # a clear error for a bad name before any work
    ids = ids.to(model.device)
    windows, prompts = _windows(ids, settings), _prompts(ids, settings)
    reference = KVSession.for_method(model, "fp16")
    geometry = KVGeometry.from_config(model.config, latent_cache=False)  # what the sessions cache
    stats = {m: {"nll": 0.0, "kl": 0.0, "top1": 0, "n": 0, "greedy": 0} for m in methods}
    kl_curve = {m: torch.zeros(settings.window) for m in methods}
    counts = torch.zeros(settings.window)
    bar = tqdm(total=(len(windows) + len(prompts)) * len(methods), desc="eval", disable=not progress)
    for window in windows:
        ref = teacher_forced(reference, window, 128)[:-1]
        targets = window[1:].to(ref.device)
        counts[: targets.numel()] += 1
        for m in methods:
            logp = teacher_forced(_session(model, m, settings), window, chunk_for(m))[:-1]
            kl = (ref.exp() * (ref - logp)).sum(-1).clamp_min(0)
            s = stats[m]
            s["nll"] -= logp.gather(-1, targets[:, None]).sum().item()
            s["kl"] += kl.sum().item()
            s["top1"] += (logp.argmax(-1) == ref.argmax(-1)).sum().item()
            s["n"] += targets.numel()
            kl_curve[m][: targets.numel()] += kl.cpu()
            bar.update()
    for prompt in prompts:
        ref_tokens = _generate(reference, prompt, settings)
        for m in methods:
            tokens = _generate(_session(model, m, settings), prompt, settings)
            stats[m]["greedy"] += _agreement(tokens, ref_tokens)
            bar.update()
    bar.close()
    results = []
    for m in methods:
        s = stats[m]
        results.append({
            "method": m,
            "ppl": math.exp(s["nll"] / s["n"]),
            "kl": s["kl"] / s["n"],
            "top1": s["top1"] / s["n"],
            "greedy_prefix": s["greedy"] / len(prompts),
            "bytes_per_token": geometry.bytes_per_token(m),
        })  # fmt: skip
    valid = counts > 0
    return {
        "tokens": sum(w.numel() for w in windows),
        "settings": dataclasses.asdict(settings),
        "python": sys.version.split()[0],
        "results": results,
        "kl_by_position": {m: (kl_curve[m][valid] / counts[valid]).tolist() for m in methods},
    }


def _generate(session: KVSession, prompt: torch.Tensor, settings: Settings) -> torch.Tensor:
    """Greedy tokens [new_tokens] after ``prompt`` [T], from an empty cache."""
    session.reset()
    return session.generate(prompt[None], settings.new_tokens)[0][0].cpu()


class _Tap:
    """A store that records each attention output of the store it wraps (per layer, in call order)."""

    def __init__(self, inner, record: list):
        self.inner, self.record = inner, record

    def attend(self, q, k, v, scale, causal, window):
        out = self.inner.attend(q, k, v, scale, causal, window)
        self.record.append(out.float())
        return out

    def nbytes(self) -> int:
        return self.inner.nbytes()


class _Twin:
    """Recorded-only error: attends with the exact store and the method's store on the same inputs,
    records the method's relative error and returns the exact output (errors are not fed forward)."""

    def __init__(self, exact, quantized, errors: list):
        self.exact, self.quantized, self.errors = exact, quantized, errors

    def attend(self, q, k, v, scale, causal, window):
        out = self.exact.attend(q, k, v, scale, causal, window)
        approx = self.quantized.attend(q, k, v, scale, causal, window)
        self.errors.append(_relative_error(approx.float(), out.float()))
        return out

    def nbytes(self) -> int:
        return self.quantized.nbytes()


def _relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return ((approx - exact).norm() / exact.norm().clamp_min(1e-12)).item()


def accumulation(model, ids: torch.Tensor, methods: list[str], settings: Settings, progress: bool = True) -> dict:
    """Per-layer attention-output relative error, fed forward vs recorded only, on the first window:
    ``{method: {"fed_forward": [per layer], "recorded": [per layer]}}``, averaged over the tiles that read quantized
    history (the window is fed a tile a call: the first call, and the second where the first tile stays exact, read
    none, and their zero errors would dilute the mean)."""
    window = _windows(ids.to(model.device), settings)[0]
    exact_calls = 2 if settings.keep_first_tile else 1
    kv_dtype = kv_dtype_for(model.dtype)
    out = {}
    for m in tqdm([m for m in methods if not get_method(m).exact], desc="accumulation", disable=not progress):
        method_store = _session(model, m, settings).make_store
        exact, approx, recorded = [], [], []
        _feed(model, window, chunk_for(m), lambda: _Tap(DenseKV("fp16", kv_dtype), exact))  # noqa: B023
        _feed(model, window, chunk_for(m), lambda: _Tap(method_store(), approx))  # noqa: B023
        layers = _feed(model, window, chunk_for(m), lambda: _Twin(DenseKV("fp16", kv_dtype), method_store(), recorded))  # noqa: B023

        def per_layer(errors: list[float]) -> list[float]:  # calls come tile by tile, layer by layer
            calls = torch.tensor(errors).view(-1, layers)[exact_calls:]  # noqa: B023
            if not calls.numel():
                raise ValueError(f"--accumulation needs a window of more than {exact_calls} tiles of "
                                 f"{chunk_for(m)} tokens (one that reads quantized history), got {window.numel()}")  # noqa: B023  # fmt: skip
            return calls.mean(0).tolist()

        fed = [_relative_error(a, e) for a, e in zip(approx, exact)]
        out[m] = {"fed_forward": per_layer(fed), "recorded": per_layer(recorded)}
    return out


def _feed(model, ids: torch.Tensor, chunk: int, make_store) -> int:
    """Feed ids [T] through a fresh session ``chunk`` tokens at a time; returns its number of KV layers.
    (The lambdas above run within their loop iteration, hence the B023 waivers.)"""
    session = KVSession(model, make_store)
    for i in range(0, ids.numel(), chunk):
        session.forward(ids[None, i : i + chunk])
    return len(session.stores)


def plot(report: dict, path: str) -> None:
    """2 x 2 panels: KL and perplexity per method (horizontal bars), KL vs position, and (if present) the
    error per layer, fed forward (solid) vs recorded only (dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [r for r in report["results"] if not get_method(r["method"]).exact]
    names = [r["method"] for r in results]
    fp16 = next((r["ppl"] for r in report["results"] if r["method"] == "fp16"), None)
    fig, axes = plt.subplots(2, 2, figsize=(15, 10))
    (kl_ax, ppl_ax), (pos_ax, acc_ax) = axes
    kl_ax.barh(names, [r["kl"] for r in results])
    kl_ax.set(xscale="log", xlabel="mean KL(fp16 || method), log scale", title="KL of next-token distributions")
    ppl_ax.barh(names, [r["ppl"] for r in results])
    if fp16 and results:
        ppl_ax.axvline(fp16, color="k", lw=0.8, ls="--", label=f"fp16 {fp16:.3f}")
        ppl_ax.set_xlim(fp16 * 0.98, max(r["ppl"] for r in results) * 1.01)
        ppl_ax.legend()
    ppl_ax.set(xlabel="perplexity", title=f"perplexity ({report.get('corpus', '')})")
    for ax in (kl_ax, ppl_ax):
        ax.invert_yaxis()
    tile = 128
    for name in names:
        c = torch.tensor(report["kl_by_position"][name])
        starts = range(0, c.numel(), tile)
        binned = [c[i : i + tile].mean().item() for i in starts]  # 0 before the first quantized tile: not drawn
        pos_ax.plot(
            [i + tile / 2 for i in starts],
            [b if b > 0 else float("nan") for b in binned],
            label=name,
            marker="o",
            markersize=3,
        )  # (a marker: a method with one drawn bin is still seen)
    pos_ax.set(xlabel="position in window", ylabel="mean KL per 128 positions", yscale="log", title="error growth")
    pos_ax.legend(fontsize=8)
    for name, curves in (report.get("accumulation") or {}).items():
        line = acc_ax.plot(curves["fed_forward"], label=name)[0]
        acc_ax.plot(curves["recorded"], ls="--", color=line.get_color())
    acc_ax.set(xlabel="layer", ylabel="relative L2 error of the attention output",
               title="error accumulation: fed forward (solid) vs recorded only (dashed)")  # fmt: skip
    if report.get("accumulation"):
        acc_ax.legend(fontsize=8)
    fig.suptitle(f"{report.get('model', '')}, {report['tokens']} tokens, first tile exact: "
                 f"{report['settings']['keep_first_tile']}")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def tokenize(tokenizer, text: str) -> torch.Tensor:
    """Token ids [N] of a text, without special tokens (no BOS in the middle of evaluation text)."""
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
