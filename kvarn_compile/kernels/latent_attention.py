"""MLA attention in latent space over the KVarN latent cache (``paged_latent``: shapes and order).

Grid: (sequence, query token of it x block of BLOCK_H heads, split of the context). A program reads its
split's tiles of its sequence's first ``kv_lens[b]`` stored tokens in blocks of BLOCK_T: from the tile's
page while the tile is complete in the cache, else from the exact current tile; it writes an unnormalised
partial (acc, max, sum) that ``combine_splits`` merges (as for ``paged_attention``). The latent is read once per block and serves twice, as keys
and as values:

    scores[t] = c_tok[t] * ((q_c * c_scale) . codes[t] + q_c . c_zero) + q_r . rope[t]
    out      += c_scale * ((p * c_tok) @ codes) + c_zero * sum(p * c_tok)

A code byte holds NF = 8 / BITS channels (channel NF * j + f is its field f, ``tile_math.code_field``), so
q_c, the output and the scales are kept by field (q_c[:, f::NF]): the dots run over the bytes as they are,
with no reshape of unpacked codes, and the output's fields are interleaved once at the end.

Runs in the rotated space: the op rotates q_c in and the output back. Output: the normalised latent
output [T, H, L] (fp32) and the log-sum-exp of the scaled scores (natural log, -inf with no key).
NOTE (H200, benchmarks/results/h200-latent-attention): the first version, one program per sequence and 16
heads streaming the whole context, took 0.85 ms at batch 1 / 8K whatever the batch (one program on 132 SMs).
Reference: ``paged_latent.latent_attention_reference``.
"""

import torch
import triton
import triton.language as tl

from ..presets import LatentLayout
from .combine_splits import combine_splits
from .paged_attention import num_splits_for
from .tile_math import LOG2E, check_sequence, code_field, fp16_ptr, interpreting, multiprocessors, online_softmax_step


@triton.jit
def _by_field(ptr, offs_j, NF: tl.constexpr, limit):
    """Vectors at ``ptr`` [NF * J] as fp32, by field: field f [J] holds entries NF * j + f."""
    fields = ()
    for f in tl.static_range(NF):
        idx = NF * offs_j + f
        fields = fields + (tl.load(ptr + idx, mask=idx < limit, other=0.0).to(tl.float32),)
    return fields


@triton.jit(
    do_not_specialize=["num_slots", "max_tiles", "nsplit", "head_blocks", "max_query_len"],
    do_not_specialize_on_alignment=["slots_ptr", "kv_lens_ptr", "qsl_ptr"],
)
def _latent_attention_kernel(
    qc_ptr, qr_ptr, part_acc_ptr, part_ml_ptr, pages_ptr, exact_c_ptr, exact_r_ptr, page_table_ptr, seq_lens_ptr,
    slots_ptr, kv_lens_ptr, qsl_ptr, scale, num_slots, max_tiles, nsplit, head_blocks, max_query_len,
    H: tl.constexpr, BLOCK_H: tl.constexpr, G: tl.constexpr, BLOCK_T: tl.constexpr, L: tl.constexpr,
    R: tl.constexpr, BITS: tl.constexpr, NBYTES: tl.constexpr, OFF_CS: tl.constexpr, OFF_CZ: tl.constexpr,
    OFF_TS: tl.constexpr, OFF_ROPE: tl.constexpr, PTX: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    j = tl.program_id(1) // head_blocks
    hb = tl.program_id(1) % head_blocks
    split = tl.program_id(2)
    row0 = tl.load(qsl_ptr + b)
    n = tl.load(qsl_ptr + b + 1) - row0
    if j >= n:
        return
    slot = tl.load(slots_ptr + b).to(tl.int64)
    check_sequence(slot, 0, n, max_query_len, num_slots, max_tiles * G, PTX)  # the grid covers max_query_len rows
    kv_len = tl.load(kv_lens_ptr + b)
    stored = tl.load(seq_lens_ptr + slot)
    check_sequence(slot, kv_len, 0, 0, num_slots, stored, PTX)  # kv_len in [0, the tokens the slot holds]
    paged = tl.minimum((kv_len + G - 1) // G, stored // G)  # tiles read from pages

    NF: tl.constexpr = 8 // BITS
    W: tl.constexpr = L // NF  # code bytes per token
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    offs_w = tl.arange(0, W)
    offs_t = tl.arange(0, BLOCK_T)
    offs_r = tl.arange(0, R)
    t = (row0 + j).to(tl.int64)
    # q by field, the softmax in the log2 domain: scale * log2(e) folded into q
    q_rows = qc_ptr + t * H * L + offs_h[:, None] * L
    q_parts = ()
    for f in tl.static_range(NF):
        q_f = tl.load(q_rows + NF * offs_w[None, :] + f, mask=h_ok[:, None], other=0.0)
        q_parts = q_parts + (q_f * (scale * LOG2E),)
    q_r = tl.load(qr_ptr + t * H * R + offs_h[:, None] * R + offs_r[None, :], mask=h_ok[:, None], other=0.0)
    q_r = q_r.to(tl.float32) * (scale * LOG2E)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    accs = ()
    for f in tl.static_range(NF):
        accs = accs + (tl.zeros([BLOCK_H, W], tl.float32),)
    # this split's share of the sequence's own tiles (not of its page table's width: tile_math.quantized_tiles)
    tiles = (kv_len + G - 1) // G
    per = tl.cdiv(tiles, nsplit)
    for tile in range(split * per, tl.minimum((split + 1) * per, tiles)):
        if tile < paged:
            record = pages_ptr + tl.load(page_table_ptr + slot * max_tiles + tile).to(tl.int64) * NBYTES
            c_scale = _by_field(fp16_ptr(record + OFF_CS), offs_w, NF, L)
            c_zero = _by_field(fp16_ptr(record + OFF_CZ), offs_w, NF, L)
            q_scaled = ()
            q_zero = tl.zeros([BLOCK_H], tl.float32)
            for f in tl.static_range(NF):
                q_scaled = q_scaled + ((q_parts[f] * c_scale[f][None, :]).to(tl.float16),)
                q_zero += tl.sum(q_parts[f] * c_zero[f][None, :], axis=1)
            for t0 in range(0, G, BLOCK_T):
                pos = tile * G + t0 + offs_t
                t_ok = pos < kv_len
                c_tok = tl.load(fp16_ptr(record + OFF_TS) + t0 + offs_t).to(tl.float32)
                # the same bytes as [W, BLOCK_T] (keys) and [BLOCK_T, W] (values): two loads, no transpose
                key_bytes = tl.load(record + (t0 + offs_t[None, :]) * W + offs_w[:, None])
                s = tl.zeros([BLOCK_H, BLOCK_T], tl.float32)
                for f in tl.static_range(NF):
                    s = tl.dot(q_scaled[f], code_field(key_bytes, BITS, f, PTX), s)
                rope = tl.load(record.to(tl.pointer_type(exact_r_ptr.dtype.element_ty)) + OFF_ROPE // 2
                               + (t0 + offs_t[:, None]) * R + offs_r[None, :]).to(tl.float32)  # fmt: skip
                s = (s + q_zero[:, None]) * c_tok[None, :] + tl.dot(q_r, tl.trans(rope))
                s = tl.where(t_ok[None, :], s, float("-inf"))
                p, alpha, m, l = online_softmax_step(s, m, l)
                p_tok = p * c_tok[None, :]
                p_sum = tl.sum(p_tok, axis=1)
                value_bytes = tl.load(record + (t0 + offs_t[:, None]) * W + offs_w[None, :])
                new_accs = ()
                for f in tl.static_range(NF):
                    pv = tl.dot(p_tok.to(tl.float16), code_field(value_bytes, BITS, f, PTX))
                    new_accs = new_accs + (accs[f] * alpha[:, None] + pv * c_scale[f][None, :]
                                           + p_sum[:, None] * c_zero[f][None, :],)  # fmt: skip
                accs = new_accs
        else:  # the exact current tile (fp32 operands: tf32 on the GPU; the interpreter's bf16 dot is wrong)
            for t0 in range(0, G, BLOCK_T):
                pos = tile * G + t0 + offs_t
                t_ok = pos < kv_len
                rows = slot * G + t0 + offs_t
                s = tl.zeros([BLOCK_H, BLOCK_T], tl.float32)
                for f in tl.static_range(NF):
                    c_t = tl.load(exact_c_ptr + rows[None, :] * L + NF * offs_w[:, None] + f, mask=t_ok[None, :],
                                  other=0.0).to(tl.float32)  # fmt: skip
                    s = tl.dot(q_parts[f], c_t, s)
                rope = tl.load(exact_r_ptr + rows[:, None] * R + offs_r[None, :], mask=t_ok[:, None], other=0.0)
                s += tl.dot(q_r, tl.trans(rope.to(tl.float32)))
                s = tl.where(t_ok[None, :], s, float("-inf"))
                p, alpha, m, l = online_softmax_step(s, m, l)
                new_accs = ()
                for f in tl.static_range(NF):
                    c_f = tl.load(exact_c_ptr + rows[:, None] * L + NF * offs_w[None, :] + f, mask=t_ok[:, None],
                                  other=0.0).to(tl.float32)  # fmt: skip
                    new_accs = new_accs + (accs[f] * alpha[:, None] + tl.dot(p, c_f),)
                accs = new_accs

    # the partial of (token, head, split): acc[:, NF * w + f] = accs[f][:, w], and (max, sum), log2 domain
    part = (t * H + offs_h) * nsplit + split
    for f in tl.static_range(NF):
        tl.store(part_acc_ptr + part[:, None] * L + NF * offs_w[None, :] + f, accs[f], mask=h_ok[:, None])
    tl.store(part_ml_ptr + part * 2, m, mask=h_ok)
    tl.store(part_ml_ptr + part * 2 + 1, l, mask=h_ok)


def latent_attention(q_c_rot, q_r, pages, exact_c, exact_r, page_table, seq_lens, slots, kv_lens, query_start_loc,
                     layout: LatentLayout, scale: float, max_query_len: int, num_splits: int | None = None,
                     block_t: int = 64, num_warps: int = 4, num_stages: int = 2) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Launch the kernel and the combine: q_c_rot [T, H, L] fp32 (rotated), q_r [T, H, R] -> (out [T, H, L]
    fp32, rotated; lse [T, H]). Validated by the op (``kvarn::latent_attention``). ``block_t``: tokens per
    step of the tile loop (at most the tile); the launch settings are swept by ``benchmarks/latent_attention.py
    --sweep``. NOTE (H200, benchmarks/results/h200-latent-sweep, kernel alone, H16 B8/32K): 64 tokens, 4 warps,
    2 stages 0.491 ms; the earlier 32 / 8 / 3 0.582 (B32/32K 1.346 -> 0.991, H128 B8/32K 1.941 -> 1.253; B1/8K
    the same, 0.216); 2 warps 0.69, 3 stages 0.53, 128 tokens 0.51."""
    num_tokens, heads, _ = q_c_rot.shape
    block_h = 16  # the smallest M of tl.dot; more heads take more programs
    head_blocks = triton.cdiv(heads, block_h)
    max_tiles = page_table.shape[1]
    if num_splits is None:
        sms = multiprocessors(q_c_rot.device)
        num_splits = num_splits_for(slots.numel() * max_query_len * head_blocks, max_tiles, sms)
    part_acc = q_c_rot.new_empty(num_tokens, heads, num_splits, layout.latent_dim)
    part_ml = q_c_rot.new_empty(num_tokens, heads, num_splits, 2)
    out = q_c_rot.new_zeros(num_tokens, heads, layout.latent_dim)
    if slots.numel() == 0 or max_query_len == 0 or num_tokens == 0:
        return out, q_c_rot.new_full((num_tokens, heads), float("-inf"))
    _latent_attention_kernel[(slots.numel(), max_query_len * head_blocks, num_splits)](
        q_c_rot.contiguous(), q_r.contiguous(), part_acc, part_ml, pages, exact_c, exact_r, page_table, seq_lens,
        slots, kv_lens, query_start_loc, scale, exact_c.shape[0], max_tiles, num_splits,
        head_blocks, max_query_len,
        H=heads, BLOCK_H=block_h, G=layout.tile_size, BLOCK_T=min(layout.tile_size, block_t), L=layout.latent_dim,
        R=layout.rope_dim, BITS=layout.bits, NBYTES=layout.nbytes, OFF_CS=layout.c_chan_scale,
        OFF_CZ=layout.c_chan_zero, OFF_TS=layout.c_tok_scale, OFF_ROPE=layout.rope, PTX=not interpreting(),
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    combine_splits(part_acc, part_ml, out)
    # the log-sum-exp over the splits (natural log; -inf where no split saw a key)
    m, l = part_ml.unbind(-1)
    top = m.amax(-1)
    total = (l * torch.exp2(m - torch.where(top == float("-inf"), 0.0, top)[..., None])).sum(-1)
    lse = torch.where(total > 0, (top + torch.log2(total)) / LOG2E.value, float("-inf"))
    return out, lse
