"""The KVarN MLA cache ops (``paged_latent`` has the shape legend and the order), as ``torch.ops.kvarn.*``:

    kvarn::latent_append     store new tokens' latents and rope keys, quantize every tile they complete
    kvarn::latent_attention  queries in latent space over each sequence's first kv_lens stored tokens:
                             (out [T, H, L], lse [T, H])

CPU runs the PyTorch reference, CUDA the Triton kernels (``kernels.quantize_store.latent_store``, the append
kernel with the rope key stored as given; ``kernels.latent_attention``). As for ``ops``: nothing on CUDA reads a
device value on the host.
"""

from __future__ import annotations

import math

import torch

from .kernels.rotate import rotated_to
from .ops import check_batch, check_input, check_one_device, expect
from .paged import SUPPORTED_DTYPES
from .paged_latent import latent_append_reference, latent_attention_reference
from .presets import Preset, get_preset


def _check_cache(preset: Preset, pages, exact_c, exact_r, page_table, seq_lens) -> None:
    expect(exact_c.dim() == 3 and exact_r.dim() == 3 and exact_c.shape[:2] == exact_r.shape[:2],
            f"exact_c/exact_r must be [slots, tile, latent_dim] / [slots, tile, rope_dim], got "
            f"{tuple(exact_c.shape)} and {tuple(exact_r.shape)}")  # fmt: skip
    slots, g, latent_dim = exact_c.shape
    expect(g == preset.tile_size, f"{preset.name} stores tiles of {preset.tile_size} tokens, the cache holds {g}")
    if exact_c.dtype not in SUPPORTED_DTYPES or exact_r.dtype != exact_c.dtype:
        raise TypeError(f"exact_c/exact_r must both be float16 or bfloat16, got {exact_c.dtype}/{exact_r.dtype}")
    layout = preset.latent_layout(latent_dim, exact_r.shape[-1])
    expect(pages.dtype == torch.uint8 and pages.dim() == 2 and pages.shape[1] == layout.nbytes,
            f"pages must be uint8 [num_pages, {layout.nbytes}] for {preset.name} with latent {latent_dim} and rope "
            f"{exact_r.shape[-1]}, got {pages.dtype} {tuple(pages.shape)}")  # fmt: skip
    expect(page_table.dtype == torch.int32 and page_table.dim() == 2 and page_table.shape[0] == slots,
            f"page_table must be int32 [{slots}, max_tiles], got {page_table.dtype} {tuple(page_table.shape)}")  # fmt: skip
    expect(seq_lens.dtype == torch.int32 and tuple(seq_lens.shape) == (slots,),
            f"seq_lens must be int32 [{slots}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")  # fmt: skip
    for name, t in (("pages", pages), ("exact_c", exact_c), ("exact_r", exact_r), ("page_table", page_table),
                    ("seq_lens", seq_lens)):  # fmt: skip
        expect(t.is_contiguous(), f"{name} must be contiguous")
        expect(t.device == exact_c.device, f"{name} is on {t.device} but exact_c is on {exact_c.device}")


def _check_rows(what: str, x: torch.Tensor, shape: tuple[int | None, ...], exact: torch.Tensor) -> None:
    """x must be ``shape`` (None: any size) and an input ``exact``'s cache takes (``ops.check_input``)."""
    expect(x.dim() == len(shape) and all(want is None or got == want for got, want in zip(x.shape, shape)),
            f"{what} must be [{', '.join('*' if d is None else str(d) for d in shape)}], got {tuple(x.shape)}")  # fmt: skip
    check_input(what, x, exact)


@torch.library.custom_op("kvarn::latent_append", mutates_args=("pages", "exact_c", "exact_r", "seq_lens"))
def latent_append(
    c: torch.Tensor,
    rope: torch.Tensor,
    pages: torch.Tensor,
    exact_c: torch.Tensor,
    exact_r: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    slots: torch.Tensor,
    start_pos: torch.Tensor,
    query_start_loc: torch.Tensor,
    preset: str,
    max_query_len: int,
) -> None:
    """Store latents c [T, L] (not rotated) and rope keys rope [T, R] at each sequence's start_pos."""
    p = get_preset(preset)
    _check_cache(p, pages, exact_c, exact_r, page_table, seq_lens)
    _check_rows("c", c, (None, exact_c.shape[-1]), exact_c)
    _check_rows("rope", rope, (c.shape[0], exact_r.shape[-1]), exact_r)
    check_batch(slots, start_pos, query_start_loc, c.shape[0], max_query_len, exact_c.shape[0],
                 page_table.shape[1] * p.tile_size, device=exact_c.device)  # fmt: skip
    if not c.is_cuda:
        latent_append_reference(c, rope, pages, exact_c, exact_r, page_table, seq_lens, slots, start_pos,
                                query_start_loc, p, max_query_len)  # fmt: skip
        return
    from .kernels.quantize_store import latent_store

    latent_store(rotated_to(c, c.dtype), rope, pages, exact_c, exact_r, page_table, seq_lens, slots, start_pos,
                 query_start_loc, p, max_query_len)  # fmt: skip


@latent_append.register_fake
def _(*args, **kwargs) -> None:
    check_one_device("latent_append", *args, *kwargs.values())


@torch.library.custom_op("kvarn::latent_attention", mutates_args=())
def latent_attention(
    q_c: torch.Tensor,
    q_r: torch.Tensor,
    pages: torch.Tensor,
    exact_c: torch.Tensor,
    exact_r: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    slots: torch.Tensor,
    kv_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    preset: str,
    scale: float,
    max_query_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q_c [T, H, L], q_r [T, H, R] over each sequence's first kv_lens[b] stored tokens -> (out [T, H, L],
    lse [T, H] float32)."""
    p = get_preset(preset)
    _check_cache(p, pages, exact_c, exact_r, page_table, seq_lens)
    _check_rows("q_c", q_c, (None, None, exact_c.shape[-1]), exact_c)
    _check_rows("q_r", q_r, (*q_c.shape[:2], exact_r.shape[-1]), exact_r)
    check_batch(
        slots, kv_lens, query_start_loc, q_c.shape[0], max_query_len, exact_c.shape[0], None, "kv_lens", exact_c.device
    )
    expect(math.isfinite(scale), f"the softmax scale must be a finite number, got {scale}")
    if kv_lens.device.type == "cpu":
        stored = seq_lens[slots.long()]
        expect(bool((kv_lens <= stored).all()),
                f"kv_lens {kv_lens.tolist()} must not exceed the tokens the slots hold, {stored.tolist()}")  # fmt: skip
    if not q_c.is_cuda:
        return latent_attention_reference(q_c, q_r, pages, exact_c, exact_r, page_table, seq_lens, slots, kv_lens,
                                          query_start_loc, p, scale, max_query_len)  # fmt: skip
    from .kernels.latent_attention import latent_attention as kernel

    layout = p.latent_layout(exact_c.shape[-1], exact_r.shape[-1])
    out, lse = kernel(rotated_to(q_c, torch.float32), q_r, pages, exact_c, exact_r, page_table, seq_lens, slots,
                      kv_lens, query_start_loc, layout, scale, max_query_len)  # fmt: skip
    return rotated_to(out, q_c.dtype), lse


@latent_attention.register_fake
def _(q_c, q_r, *args) -> tuple[torch.Tensor, torch.Tensor]:
    check_one_device("latent_attention", q_c, q_r, *args)
    # contiguous, as the op returns them (empty_like copied the strides of a q_c made by a transpose: Inductor's
    # stride checks then failed on every MLA model)
    return q_c.new_empty(q_c.shape), q_c.new_empty(q_c.shape[:2], dtype=torch.float32)
