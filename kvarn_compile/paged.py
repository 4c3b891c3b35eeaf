"""The paged KVarN cache of one attention layer, and the reference (PyTorch) append and attention on it.

Shape legend:

    P      pages (one tile of one KV head each... for all KV heads: a page holds Hkv records)
    S      sequence slots                      Hkv / Hq   KV / query heads
    G      tokens per tile                     Dk / Dv    key / value head dims
    E      exact tiles kept per slot: 1 (the current, incomplete tile) or 2 (also the first tile)
    B      sequences in a call                 T          new tokens in a call (all sequences)

    pages       uint8 [P, Hkv, nbytes]       quantized tiles (layout in ``presets``)
    exact_k     [S, Hkv, E, G, Dk]           unquantized rotated keys: [..., 0, :, :] the current tile,
    exact_v     [S, Hkv, E, G, Dv]           [..., 1, :, :] the first tile (attention sink) when E == 2
    page_table  int32 [S, max_tiles]         page of tile i of slot s (the entry for tile 0 is unused
                                             when the first tile is kept exact). Tiles may share a page:
                                             the last one written wins (a sliding-window layer's ring)
    seq_lens    int32 [S]                    tokens stored per slot (written by append)

A call describes its sequences as in vLLM: ``slots`` int32 [B] (cache slot of each sequence),
``start_pos`` int32 [B] (position of its first new token: the tokens already cached) and
``query_start_loc`` int32 [B+1] (its new tokens are rows ``query_start_loc[b]:query_start_loc[b+1]`` of
q/k/v). Attention runs BEFORE the append of the same tokens: it reads the cache as it was plus the fresh,
exact k/v of the call. So a query sees quantized tiles for the history before its chunk's first tile,
and exact values for the rest: the tile it is in (up to itself) and the fresh chunk.

A cache for sliding-window attention only (window W) needs the pages of the tiles a window can reach:
``ring_tiles(W, G)`` per slot, with tile i of slot s in page ``s * R + i % R`` (``KVarNCache.allocate``'s
``window``). Attention never reads a tile wholly before its first query's window, and a tile's page is
reused only once no later query's window reaches that tile.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from .presets import Preset, get_preset, named_preset
from .reference import dequantize_records, quantize_records, rotate


class Batch(NamedTuple):
    """Which sequences a call touches and where their new tokens go (see the module docstring)."""

    slots: torch.Tensor  # int32 [B]
    start_pos: torch.Tensor  # int32 [B]
    query_start_loc: torch.Tensor  # int32 [B+1]
    max_query_len: int  # host-side bound on new tokens per sequence (sizes the launch grids)

    @staticmethod
    def decode(slots: torch.Tensor, start_pos: torch.Tensor) -> Batch:
        """One new token per sequence."""
        qsl = torch.arange(slots.numel() + 1, dtype=torch.int32, device=slots.device)
        return Batch(_int32("slots", slots), _int32("start_pos", start_pos), qsl, 1)

    @staticmethod
    def from_lengths(slots, start_pos, new_tokens: list[int], device=None) -> Batch:
        """Sequences with ``new_tokens[b]`` new tokens each (host list: this builds the offsets)."""
        new_tokens = _int32("new_tokens", new_tokens).tolist()
        qsl = torch.tensor([0, *torch.tensor(new_tokens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32,
                           device=device)  # fmt: skip
        return Batch(
            _int32("slots", slots, device),
            _int32("start_pos", start_pos, device),
            qsl,
            max(new_tokens, default=0),
        )


def _int32(name: str, values, device=None) -> torch.Tensor:
    """Integers (a tensor or a list) as an int32 tensor: a float or one past int32 is an error, not a value cast or
    wrapped into some other slot or position."""
    t = torch.as_tensor(values, device=device)
    if t.numel() and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
        raise TypeError(f"{name} must be integers, got {t.dtype}")
    if t.dtype != torch.int32 and t.numel() and t.device.type == "cpu":
        lo, hi = torch.iinfo(torch.int32).min, torch.iinfo(torch.int32).max
        if not bool(((t >= lo) & (t <= hi)).all()):
            raise ValueError(f"{name} must fit in int32, got {t.tolist()}")
    return t.to(torch.int32)


@dataclasses.dataclass
class KVarNCache:
    """The KVarN cache of one attention layer (tensors and the preset that laid them out)."""

    preset: Preset
    pages: torch.Tensor
    exact_k: torch.Tensor
    exact_v: torch.Tensor
    page_table: torch.Tensor
    seq_lens: torch.Tensor
    window: int = 0  # > 0: pages for sliding-window attention of at most this window only (a ring per slot)

    @classmethod
    def allocate(
        cls,
        num_slots: int,
        max_seq_len: int,
        num_kv_heads: int,
        head_dim: int,
        head_dim_v: int | None = None,
        preset: str | Preset = "kvarn_k4v2_g128",
        dtype: torch.dtype = torch.float16,
        device: torch.device | str | None = None,
        keep_first_tile: bool = False,
        window: int = 0,
    ) -> KVarNCache:
        """A cache where slot s owns pages [s*R, (s+1)*R): no allocator needed. R = max_tiles, or with a
        ``window`` > 0 (the cache then serves sliding-window attention of at most that window only) the
        ``ring_tiles`` a window can reach, reused in turn."""
        preset = named_preset(preset)
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        check_dtype(dtype)
        layout = preset.layout(head_dim, head_dim_v)
        g = preset.tile_size
        max_tiles = tiles_for(max_seq_len, g)
        if window < 0:
            raise ValueError(f"window must be >= 0 (0: no sliding window), got {window}")
        ring = slot_pages(window, g, max_tiles)
        exact = 2 if keep_first_tile else 1
        tiles = torch.arange(max_tiles, dtype=torch.int32, device=device) % ring
        return cls(
            preset=preset,
            pages=torch.zeros(num_slots * ring, num_kv_heads, layout.nbytes, dtype=torch.uint8, device=device),
            exact_k=torch.zeros(num_slots, num_kv_heads, exact, g, head_dim, dtype=dtype, device=device),
            exact_v=torch.zeros(num_slots, num_kv_heads, exact, g, head_dim_v, dtype=dtype, device=device),
            page_table=torch.arange(num_slots, dtype=torch.int32, device=device)[:, None] * ring + tiles,
            seq_lens=torch.zeros(num_slots, dtype=torch.int32, device=device),
            window=window,
        )

    def check_window(self, window: int) -> None:
        """A ring cache (``window`` > 0) holds only what windows up to its own reach: refuse wider ones."""
        if self.window and not 0 < window <= self.window:
            raise ValueError(f"this KVarN cache keeps pages for sliding windows of up to {self.window} tokens; "
                             f"attention with window {window or 'none (full attention)'} would read overwritten pages")  # fmt: skip

    @property
    def keep_first_tile(self) -> bool:
        return self.exact_k.shape[2] == 2

    @property
    def capacity(self) -> int:
        """Most tokens one slot can hold."""
        return self.page_table.shape[1] * self.preset.tile_size

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.pages, self.exact_k, self.exact_v))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """(pages, exact_k, exact_v, page_table, seq_lens): the order the ops take them in."""
        return self.pages, self.exact_k, self.exact_v, self.page_table, self.seq_lens


def tiles_for(max_seq_len: int, tile_size: int) -> int:
    """The pages a slot of ``max_seq_len`` tokens needs (a cache's allocation)."""
    if max_seq_len <= 0:
        raise ValueError(f"a cache holds max_seq_len > 0 tokens per slot, got {max_seq_len}")
    return math.ceil(max_seq_len / tile_size)


def ring_tiles(window: int, tile_size: int) -> int:
    """Pages per slot that sliding-window attention (window W > 0) needs: a call whose queries start at
    position p reads the tiles (p - W + 1) // G .. p // G - 1 (at most ceil((W - 1) / G) of them; the
    current tile is exact), so R pages hold them all, and the page a call's append gives a new tile belonged
    to a tile R before it, which no later window reaches."""
    return max(1, -(-(window - 1) // tile_size))


def slot_pages(window: int, tile_size: int, max_tiles: int) -> int:
    """Pages a slot owns: one a tile, or with a sliding ``window`` (> 0) the ``ring_tiles`` it reuses in turn."""
    return min(ring_tiles(window, tile_size), max_tiles) if window else max_tiles


def history_gaps(cache: KVarNCache, start: torch.Tensor, held: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where a call starting at ``start`` (per sequence) does not find the history it reads in a slot of ``cache``
    (a ``KVarNCache`` or a ``LatentCache``) holding ``held`` tokens: (inside a tile, a ring), bool masks. Inside a
    tile the call reads the tile's earlier rows from the slot's exact current tile, which holds them only while the
    slot holds from ``start`` to short of the tile's end (a gap would read stale rows, a rewind into an earlier tile
    rows of a later one, a rewind into a tile the slot completed rows its exact tile may never have held: a call
    that completes a tile quantizes the rows it brings straight into the page). A start at a tile's first row reads
    no held rows, unless a ring cache (a sliding window) gave a page its window reaches to a later tile."""
    g, window = cache.preset.tile_size, cache.window
    inside = (start % g != 0) & ((held < start) | (held >= (start // g + 1) * g))
    if not window:
        return inside, torch.zeros_like(inside)
    ring = slot_pages(window, g, cache.page_table.shape[1])
    first, last = (start - window + 1).clamp(min=0) // g, held // g - 1  # the oldest tile it reaches, the last done
    return inside, (first < start // g) & (last >= first + ring)


def tokens_major(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """[B, H, T, D] (transformers' layout) -> [B*T, H, D], the rows of a call (contiguous, in ``dtype``)."""
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b * t, h, d).to(dtype or x.dtype).contiguous()


SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


def check_dtype(dtype: torch.dtype) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"KVarN caches hold float16 or bfloat16 models, got {dtype}")


# ----------------------------------------------------------------------------------------------------
# Reference implementations (CPU path of the ops, oracle of the kernels). Plain Python loops over the
# sequences of a call: clarity over speed.
# ----------------------------------------------------------------------------------------------------
def _rotated(x: torch.Tensor, already: bool) -> torch.Tensor:
    """x rotated, in float32 (``already``: x comes rotated, e.g. by vLLM's compiled graph)."""
    return x.float() if already else rotate(x.float())


def sequence_rows(query_start_loc: torch.Tensor, b: int) -> slice:
    """The rows of sequence b in a call's tokens."""
    return slice(int(query_start_loc[b]), int(query_start_loc[b + 1]))


def append_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    pages: torch.Tensor,
    exact_k: torch.Tensor,
    exact_v: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    slots: torch.Tensor,
    start_pos: torch.Tensor,
    query_start_loc: torch.Tensor,
    preset: str | Preset,
    max_query_len: int | None = None,
    rotated: bool = False,
) -> None:
    """Store new tokens k [T, Hkv, Dk], v [T, Hkv, Dv] (not rotated, unless ``rotated``) of each sequence
    of the call.

    Completed tiles are quantized into their pages (the first tile into exact_k/v[:, :, 1] when kept);
    the tokens of an incomplete last tile go to exact_k/v[:, :, 0]. Mutates pages, exact_k, exact_v,
    seq_lens. ``max_query_len`` only sizes the kernels' launch grid; both paths share one signature.
    """
    preset = get_preset(preset)
    sink = exact_k.shape[2] == 2
    check_pages_completed(page_table, slots, start_pos, query_start_loc, preset.tile_size, pages.shape[0], int(sink))
    for b in range(slots.numel()):
        rows = sequence_rows(query_start_loc, b)
        slot = int(slots[b])
        if rows.stop == rows.start:
            continue

        def complete(tile: int, tile_k: torch.Tensor, tile_v: torch.Tensor, slot: int = slot) -> None:  # [G, Hkv, D]
            if sink and tile == 0:
                exact_k[slot, :, 1] = tile_k.transpose(0, 1)
                exact_v[slot, :, 1] = tile_v.transpose(0, 1)
            else:
                pages[page_of(page_table, slot, tile, pages.shape[0])] = quantize_records(
                    tile_k.transpose(0, 1), tile_v.transpose(0, 1), preset
                )

        # Rotated new tokens, rounded to the cache dtype as the kernels store them: [n, Hkv, D]
        new = [_rotated(k[rows], rotated).to(exact_k.dtype), _rotated(v[rows], rotated).to(exact_v.dtype)]
        current = [exact_k[slot, :, 0].transpose(0, 1), exact_v[slot, :, 0].transpose(0, 1)]  # views [G, Hkv, D]
        seq_lens[slot] = store_rows(new, current, int(start_pos[b]), preset.tile_size, complete)


def check_pages_completed(page_table: torch.Tensor, slots, start_pos, query_start_loc, tile_size: int, num_pages: int,
                          first_paged: int = 0) -> None:  # fmt: skip
    """The pages of every tile a call's sequences complete (from tile ``first_paged`` on: a kept first tile has
    none) are the cache's (``pages_of``), checked before any sequence is stored: a bad one leaves the cache as it
    was, not with the sequences before it stored."""
    for b in range(slots.numel()):
        rows, start = sequence_rows(query_start_loc, b), int(start_pos[b])
        first, last = max(start // tile_size, first_paged), (start + rows.stop - rows.start) // tile_size
        pages_of(page_table, int(slots[b]), first, max(first, last), num_pages, "completes")


def page_of(page_table: torch.Tensor, slot: int, tile: int, num_pages: int) -> int:
    """The page a slot's completed tile goes to (``pages_of``). The kernels skip such a tile's write."""
    return int(pages_of(page_table, slot, tile, tile + 1, num_pages, "completes")[0])


def pages_of(
    page_table: torch.Tensor, slot: int, first: int, last: int, num_pages: int, use: str = "reads"
) -> torch.Tensor:
    """The pages of a slot's tiles [first, last), int64 [last - first]; an entry that is not one of the cache's
    pages is an error: a negative one would index, and ``use`` (read or overwrite), another slot's page."""
    pages = page_table[slot, first:last]
    bad = ((pages < 0) | (pages >= num_pages)).nonzero()
    if bad.numel():
        tile = first + int(bad[0, 0])
        raise ValueError(f"slot {slot} {use} tile {tile} but its page table gives page {int(page_table[slot, tile])}, "
                         f"not one of the cache's {num_pages} pages")  # fmt: skip
    return pages.long()


def store_rows(new: list[torch.Tensor], current: list[torch.Tensor], start: int, tile_size: int,
               complete: Callable[..., None]) -> int:  # fmt: skip
    """Store one sequence's new rows, given per part of a token (keys and values; MLA's latent and rope
    key): ``new`` [n, ...] at positions ``start``.. and the sequence's exact current tile ``current``
    [G, ...] (written in place). Rows of an incomplete last tile join ``current``; each tile they complete
    goes, whole ([G, ...] per part, earlier rows from ``current`` first), to ``complete(tile, *parts)``.
    Returns the sequence's new length."""
    end = start + new[0].shape[0]
    for tile in range(start // tile_size, (end - 1) // tile_size + 1):
        lo, hi = max(tile * tile_size, start), min(tile * tile_size + tile_size, end)
        fresh, held = slice(lo - start, hi - start), lo - tile * tile_size  # held: rows stored by earlier calls
        if hi < tile * tile_size + tile_size:  # incomplete: the new rows join the exact current tile
            for x, tile_rows in zip(new, current):
                tile_rows[held : held + hi - lo] = x[fresh]
        else:
            complete(tile, *(torch.cat([tile_rows[:held], x[fresh]]) for x, tile_rows in zip(new, current)))
    return end


def gather_history(
    pages: torch.Tensor,
    exact_k: torch.Tensor,
    exact_v: torch.Tensor,
    page_table: torch.Tensor,
    slot: int,
    length: int,
    preset: Preset,
    first_tile: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated float32 keys [Hkv, n, Dk] and values [Hkv, n, Dv] of a slot's tokens
    ``[min(first_tile, length // G) * G, length)``, as attention sees them: quantized tiles dequantized, exact
    tiles as stored. Tiles before ``first_tile`` (wholly outside a sliding window) are not read: their pages
    may be gone (vLLM frees them)."""
    g = preset.tile_size
    layout = preset.layout(exact_k.shape[-1], exact_v.shape[-1])
    full = length // g
    first_tile = min(first_tile, full)
    sink = exact_k.shape[2] == 2 and full > 0  # the first tile is kept exact
    ks, vs = [], []
    if sink and first_tile == 0:
        ks.append(exact_k[slot, :, 1].float())
        vs.append(exact_v[slot, :, 1].float())
    first_page = max(first_tile, 1 if sink else 0)
    if full > first_page:
        records = pages[pages_of(page_table, slot, first_page, full, pages.shape[0])]  # [n, Hkv, nbytes]
        k_hat, v_hat = dequantize_records(records, layout)  # [n, Hkv, G, D]
        ks.append(k_hat.transpose(0, 1).flatten(1, 2))
        vs.append(v_hat.transpose(0, 1).flatten(1, 2))
    ks.append(exact_k[slot, :, 0, : length - full * g].float())
    vs.append(exact_v[slot, :, 0, : length - full * g].float())
    return torch.cat(ks, 1), torch.cat(vs, 1)


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pages: torch.Tensor,
    exact_k: torch.Tensor,
    exact_v: torch.Tensor,
    page_table: torch.Tensor,
    slots: torch.Tensor,
    start_pos: torch.Tensor,
    query_start_loc: torch.Tensor,
    preset: str | Preset,
    scale: float,
    causal: bool = True,
    window: int = 0,
    max_query_len: int | None = None,
    rotated: bool = False,
) -> torch.Tensor:
    """Attention of q [T, Hq, Dk] over each sequence's cached history plus its fresh k [T, Hkv, Dk],
    v [T, Hkv, Dv] (not rotated; with ``rotated``, q, k and v come rotated). Returns [T, Hq, Dv] (not
    rotated) in q's dtype.

    Masks: history is always visible (it is in the past); fresh tokens are visible causally (or all of
    them when ``causal`` is False); ``window > 0`` keeps only keys at positions > query position - window.
    """
    preset = get_preset(preset)
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float32, device=q.device)
    for b in range(slots.numel()):
        rows = sequence_rows(query_start_loc, b)
        n = rows.stop - rows.start
        if n == 0:
            continue
        p0 = int(start_pos[b])
        # with a window, tiles wholly before the first query's window are skipped (as the kernel does)
        first_tile = min(max(0, p0 - window + 1) // preset.tile_size, p0 // preset.tile_size) if window > 0 else 0
        hist_k, hist_v = gather_history(pages, exact_k, exact_v, page_table, int(slots[b]), p0, preset, first_tile)
        fresh_k = _rotated(k[rows], rotated).to(exact_k.dtype).float().transpose(0, 1)
        fresh_v = _rotated(v[rows], rotated).to(exact_v.dtype).float().transpose(0, 1)
        keys = torch.cat([hist_k, fresh_k], 1)  # [Hkv, p0+n-first, Dk]
        values = torch.cat([hist_v, fresh_v], 1)
        queries = _rotated(q[rows], rotated).transpose(0, 1)  # [Hq, n, Dk]
        q_pos = p0 + torch.arange(n, device=q.device)[:, None]
        k_pos = torch.arange(first_tile * preset.tile_size, p0 + n, device=q.device)[None, :]
        visible = (k_pos < p0) | (k_pos <= q_pos) if causal else torch.ones_like(k_pos < q_pos)
        if window > 0:
            visible = visible & (k_pos > q_pos - window)
        out[rows] = rotate(_grouped_attention(queries, keys, values, visible, scale)).transpose(0, 1)
    return out.to(q.dtype)


def _grouped_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
                       scale: float) -> torch.Tensor:  # fmt: skip
    """softmax(q k^T * scale, masked by ``visible`` [n, L]) v for queries [Hq, n, Dk] over keys [Hkv, L, Dk] and
    values [Hkv, L, Dv] (Hq a multiple of Hkv; query head h reads KV head h // (Hq / Hkv)): [Hq, n, Dv], float32.

    Each KV head's group of query heads is one batched product over the head's keys expanded (stride 0: no copy
    per query head), so each query head's product is the same one as against a copy of its KV head's keys and
    rounds alike; a product of the group's queries as rows of one matrix, or a batch of one, rounds otherwise
    (the vLLM tests compare engines with this reference near fp16 ties). Without the copies a CPU decode step of
    32 / 8 heads runs 1.2-1.7x faster (benchmarks/results/cpu-s38)."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # [B, n, Dk], [B, L, Dk], ...
        probs = (torch.bmm(q, k.transpose(1, 2)) * scale).masked_fill(~visible, float("-inf")).softmax(-1)
        return torch.bmm(probs, v)

    group = queries.shape[0] // keys.shape[0]
    if group == 1:
        return attend(queries, keys, values)
    return torch.cat([attend(queries[h * group : (h + 1) * group], keys[h].expand(group, -1, -1),
                             values[h].expand(group, -1, -1)) for h in range(keys.shape[0])])  # fmt: skip
