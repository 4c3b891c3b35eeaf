"""The paged KVarN cache of one MLA attention layer (DeepSeek-V2/V3), and the reference append and
attention on it.

An MLA layer caches, per token, one latent c [L] (``kv_lora_rank``) and one rope key r [R] that all its
heads share. Attention runs in latent space ("weight absorption"): a head's query becomes q_c [L]
(its no-rope part times W_UK) and q_r [R] (its rope part), its scores are ``(q_c . c + q_r . r) * scale``
and its output is ``sum_t p_t c_t`` [L] (then W_UV, outside the cache). So c is read as keys and as
values, and one quantized copy of it serves both (``presets.LatentLayout``).

Shape legend:

    P   pages (one tile each)     S   sequence slots     G   tokens per tile     H   query heads
    L   latent dim                R   rope key dim       B   sequences in a call T   tokens in a call

    pages       uint8 [P, nbytes]      quantized tiles (``presets.LatentLayout``)
    exact_c     [S, G, L]              each slot's current, incomplete tile: rotated latents,
    exact_r     [S, G, R]              and rope keys (fp16/bf16, as the model gives them)
    page_table  int32 [S, max_tiles]   page of tile i of slot s
    seq_lens    int32 [S]              tokens stored per slot (written by append)

Order (as vLLM runs MLA layers): a step's tokens are stored first, then attention reads them from the
cache. ``latent_attention`` reads, for each sequence, its first ``kv_lens[b]`` stored tokens: tiles that
were complete after the step's append come from their pages (quantized, the token that completed one
included), the rest from the exact current tile. A decode query sees ``kv_lens = seq_lens`` (itself
included); a prefill chunk's queries see ``kv_lens`` = the context before the chunk, and the caller
attends to the chunk's own tokens exactly (vLLM: MHA over the fresh tokens) and merges by the returned
log-sum-exp.
"""

from __future__ import annotations

import dataclasses

import torch

from .paged import check_dtype, check_pages_completed, page_of, pages_of, sequence_rows, store_rows, tiles_for
from .presets import Preset, get_preset, named_preset
from .reference import dequantize_latent_records, quantize_latent_records, rotate


@dataclasses.dataclass
class LatentCache:
    """The KVarN cache of one MLA layer (tensors and the preset that laid them out)."""

    preset: Preset
    pages: torch.Tensor
    exact_c: torch.Tensor
    exact_r: torch.Tensor
    page_table: torch.Tensor
    seq_lens: torch.Tensor

    @classmethod
    def allocate(cls, num_slots: int, max_seq_len: int, latent_dim: int, rope_dim: int,
                 preset: str | Preset = "kvarn_k4v2_g128", dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str | None = None) -> LatentCache:  # fmt: skip
        """A cache where slot s owns pages [s*W, (s+1)*W), W = max tiles per slot."""
        preset = named_preset(preset)
        check_dtype(dtype)
        layout = preset.latent_layout(latent_dim, rope_dim)
        g, tiles = preset.tile_size, tiles_for(max_seq_len, preset.tile_size)
        return cls(
            preset=preset,
            pages=torch.zeros(num_slots * tiles, layout.nbytes, dtype=torch.uint8, device=device),
            exact_c=torch.zeros(num_slots, g, latent_dim, dtype=dtype, device=device),
            exact_r=torch.zeros(num_slots, g, rope_dim, dtype=dtype, device=device),
            page_table=torch.arange(num_slots * tiles, dtype=torch.int32, device=device).view(num_slots, tiles),
            seq_lens=torch.zeros(num_slots, dtype=torch.int32, device=device),
        )

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """(pages, exact_c, exact_r, page_table, seq_lens): the order the ops take them in."""
        return self.pages, self.exact_c, self.exact_r, self.page_table, self.seq_lens

    # As ``paged.KVarNCache`` describes itself: every tile is quantized (no exact first tile), no sliding window.
    keep_first_tile = False
    window = 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.pages, self.exact_c, self.exact_r))

    def select_slots(self, index: torch.Tensor) -> LatentCache:
        """A new cache whose slot i holds a copy of slot ``index[i]`` of this one (beam search reorders its
        rows, generation repeats or drops them), laid out as ``allocate`` lays one out. Copies, not shared
        pages: two slots that completed tiles into one page would overwrite each other's."""
        index = index.to(device=self.seq_lens.device, dtype=torch.long)
        slots, tiles = self.page_table.shape
        if index.dim() != 1 or (index.numel() and not (0 <= int(index.min()) and int(index.max()) < slots)):
            raise ValueError(f"slot indices must be a 1-D tensor of values in [0, {slots}), got {index.tolist()}")
        pages = self.pages[self.page_table[index].flatten().long()]
        page_table = torch.arange(pages.shape[0], dtype=torch.int32, device=pages.device).view(-1, tiles)
        return dataclasses.replace(self, pages=pages, exact_c=self.exact_c[index], exact_r=self.exact_r[index],
                                   page_table=page_table, seq_lens=self.seq_lens[index])  # fmt: skip


def latent_append_reference(c, rope, pages, exact_c, exact_r, page_table, seq_lens, slots, start_pos,
                            query_start_loc, preset: str | Preset, max_query_len: int | None = None) -> None:  # fmt: skip
    """Store new tokens' latents c [T, L] (not rotated) and rope keys rope [T, R] at each sequence's
    ``start_pos``: completed tiles are quantized into their pages, the rest joins the exact current tile.
    Mutates pages, exact_c, exact_r, seq_lens."""
    preset = get_preset(preset)
    check_pages_completed(page_table, slots, start_pos, query_start_loc, preset.tile_size, pages.shape[0])
    for b in range(slots.numel()):
        rows = sequence_rows(query_start_loc, b)
        slot = int(slots[b])
        if rows.stop == rows.start:
            continue

        def complete(tile: int, tile_c: torch.Tensor, tile_r: torch.Tensor, slot: int = slot) -> None:
            pages[page_of(page_table, slot, tile, pages.shape[0])] = quantize_latent_records(tile_c, tile_r, preset)

        new = [rotate(c[rows].float()).to(exact_c.dtype), rope[rows].to(exact_r.dtype)]
        seq_lens[slot] = store_rows(new, [exact_c[slot], exact_r[slot]], int(start_pos[b]), preset.tile_size, complete)


def gather_latents(pages, exact_c, exact_r, page_table, slot: int, length: int, stored: int,
                   preset: Preset) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The first ``length`` of a slot's ``stored`` tokens as attention reads them: rotated latents [n, L]
    and rope keys [n, R], float32 (tiles complete in the cache dequantized, the current tile as stored)."""
    g = preset.tile_size
    layout = preset.latent_layout(exact_c.shape[-1], exact_r.shape[-1])
    paged = min(-(-length // g), stored // g)  # tiles to read from pages
    records = pages[pages_of(page_table, slot, 0, paged, pages.shape[0])]
    c_hat, r_hat = dequantize_latent_records(records, layout, exact_r.dtype)
    cs, rs = [c_hat.flatten(0, 1)], [r_hat.flatten(0, 1)]
    if length > paged * g:
        cs.append(exact_c[slot, : length - paged * g].float())
        rs.append(exact_r[slot, : length - paged * g].float())
    return torch.cat(cs)[:length], torch.cat(rs)[:length]


def latent_attention_reference(q_c, q_r, pages, exact_c, exact_r, page_table, seq_lens, slots, kv_lens,
                               query_start_loc, preset: str | Preset, scale: float,
                               max_query_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Attention of queries q_c [T, H, L] (not rotated), q_r [T, H, R] over each sequence's first
    ``kv_lens[b]`` stored tokens (all visible). Returns (out [T, H, L] in q_c's dtype, not rotated;
    lse [T, H] float32, the natural log-sum-exp of the scaled scores: -inf where kv_lens is 0, with out 0)."""
    preset = get_preset(preset)
    out = torch.zeros(q_c.shape, dtype=torch.float32, device=q_c.device)
    lse = torch.full(q_c.shape[:2], float("-inf"), dtype=torch.float32, device=q_c.device)
    for b in range(slots.numel()):
        rows, slot, length = sequence_rows(query_start_loc, b), int(slots[b]), int(kv_lens[b])
        if rows.stop == rows.start or length == 0:
            continue
        c, r = gather_latents(pages, exact_c, exact_r, page_table, slot, length, int(seq_lens[slot]), preset)
        scores = (rotate(q_c[rows].float()) @ c.T + q_r[rows].float() @ r.T) * scale  # [n, H, length]
        lse[rows] = scores.logsumexp(-1)
        out[rows] = rotate(scores.softmax(-1) @ c)
    return out.to(q_c.dtype), lse
