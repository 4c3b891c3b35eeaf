"""The rewrite: each checked attention site (``sites.check``) and its two cache writes become one call of
``kvarn_attention``, which reads and appends to a KVarN cache given as new graph inputs.

Before (any spelling of it):

    k_buf.index_copy_(2, pos, k_new); v_buf.index_copy_(2, pos, v_new)
    out = attention(q, view(k_buf), view(v_buf), mask)

After:

    out = kvarn_attention(q, k_new, v_new, pos, pages, exact_k, exact_v, page_table, seq_lens, preset, scale, window)

Sites that read one buffer pair after the same writes (Gemma4's KV-shared layers: later layers attend over an
earlier layer's cache) share its KVarN cache: each a ``kvarn_attention`` call, ``append=False`` on all but the
last, so every one reads the cache as it was plus the fresh tokens, appended once.

The fp16 buffers are no longer read by the graph; it keeps writing them while they have memory (whatever runs
outside the compiled graphs reads every token) and drops the writes into buffers without memory
(``NO_MEMORY_META``: released, or made without). An MLA site
(``sites.Latent``) becomes ``kvarn_latent_attention`` instead, over a latent cache (``paged_latent``) with its
per-head maps as more inputs; what
the pass could only probe on inputs is asserted at run time by one ``kvarn_checks`` call per graph.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import logging
import pathlib

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.fx import Graph, Node

from ..paged import tokens_major
from ..presets import get_preset
from .graph import ancestors, dependencies, insert_placeholder, op_name
from .sites import NO_MEMORY_META, Site, Unsupported, check, erase_unused_positions, find_attention, find_writes

log = logging.getLogger("kvarn.passes")

# KVarNCache.tensors() order (LatentCache: exact_c, exact_r in place of exact_k, exact_v)
CACHE_TENSORS = ("pages", "exact_k", "exact_v", "page_table", "seq_lens")


def kvarn_checks(positions, padding_mask, given_mask, check_positions: bool, mask_window: int = 0,
                 from_start: bool = False) -> None:  # fmt: skip
    """Device-side asserts (no host sync) of what the pass could only probe on inputs: ``positions`` [T]
    are consecutive (when they are an input) and start at 0 (``from_start``: an empty cache's prefill),
    ``padding_mask`` [B, S] marks every token real (the ops have no padding) and ``given_mask``
    [B, 1 or Hq, T, S] (bool, or 0 / -inf) is causal at ``positions`` (with a window of ``mask_window`` keys
    when > 0). Emitted once per graph and set of inputs, not per layer."""
    flat = positions.reshape(-1)
    if check_positions:
        steps = torch.arange(flat.shape[0], device=flat.device, dtype=flat.dtype)
        torch._assert_async((flat - flat[:1] == steps).all(), "kvarn: cache positions must be consecutive")
    if from_start:
        torch._assert_async((flat[:1] == 0).all(), "kvarn: a prefill that reads the first T cache slots must "
                            "start at position 0")  # fmt: skip
    if padding_mask is not None:
        torch._assert_async(padding_mask.bool().all(), "kvarn: padded rows are not supported (rows of equal length)")
    if given_mask is not None:
        visible = given_mask if given_mask.dtype == torch.bool else given_mask == 0
        k_pos = torch.arange(given_mask.shape[-1], device=flat.device)[None, :]
        causal = k_pos <= flat[:, None]
        if mask_window:
            causal &= k_pos > flat[:, None] - mask_window
        torch._assert_async((visible == causal).all(), "kvarn: the attention mask is not causal at the positions"
                            + (f" (with a window of {mask_window})" if mask_window else "")
                            + ": a padded batch (padding is not supported: rows of equal length), or another "
                            "mask pattern")  # fmt: skip


def kvarn_attention(q, k, v, positions, pages, exact_k, exact_v, page_table, seq_lens, preset: str, scale: float,
                    window: int, append: bool = True) -> torch.Tensor:  # fmt: skip
    """Attention of q [B, Hq, T, Dk] over the KVarN cache plus the fresh k [B, Hkv, T, Dk], v [B, Hkv, T, Dv]
    at positions [p, p + T) (``positions`` int [T]), then their append (``append=False``: a layer that reads
    another layer's cache, the last reader appends). Row b of the batch is cache slot b.
    Returns [B, Hq, T, Dv] in q's dtype (q/k/v are cast to the cache dtype for the ops)."""
    b, hq, t, _ = q.shape
    dtype = exact_k.dtype

    q_t, k_t, v_t = (tokens_major(x, dtype) for x in (q, k, v))
    slots = torch.arange(b, dtype=torch.int32, device=q.device)
    start = positions.reshape(-1)[:1].to(torch.int32).expand(b).contiguous()
    query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=q.device) * t
    out = torch.ops.kvarn.chunk_attention(q_t, k_t, v_t, pages, exact_k, exact_v, page_table, slots, start,
                                          query_start_loc, preset, scale, True, window, t)  # fmt: skip
    if append:
        torch.ops.kvarn.append(k_t, v_t, pages, exact_k, exact_v, page_table, seq_lens, slots, start,
                               query_start_loc, preset, t)  # fmt: skip
    return out.view(b, t, hq, -1).transpose(1, 2).to(q.dtype)


def kvarn_latent_attention(q, c, rope, positions, a, b, v, pages, exact_c, exact_r, page_table, seq_lens,
                           preset: str, scale: float, window: int) -> torch.Tensor:  # fmt: skip
    """MLA in latent space (``sites.Latent``) over a latent cache (``paged_latent``, whose order it keeps: the
    new tokens are stored first): q [B, Hq, T, Dk], the new latent c [B, 1, T, R] and rope key rope
    [B, 1, T, Dr]; a [Hq, R, Dk], b [Hq, Dr, Dk], v [Hq, R, Dv]. One token (decode) reads everything from the
    cache, itself included; a chunk reads its context from the cache and itself exactly, merged by log-sum-exp.
    Returns [B, Hq, T, Dv] in q's dtype. (``window`` is 0: the site check refuses sliding-window MLA.)"""
    bsz, hq, t, _ = q.shape
    dtype = exact_c.dtype
    q_c = torch.einsum("bhtd,hrd->bthr", q, a.to(q.dtype)).to(dtype)  # [B, T, Hq, R]
    q_r = torch.einsum("bhtd,hsd->bths", q, b.to(q.dtype)).to(dtype)
    c_new, r_new = c[:, 0].to(dtype), rope[:, 0].to(dtype)  # [B, T, R], [B, T, Dr]
    slots = torch.arange(bsz, dtype=torch.int32, device=q.device)
    start = positions.reshape(-1)[:1].to(torch.int32).expand(bsz).contiguous()
    query_start_loc = torch.arange(bsz + 1, dtype=torch.int32, device=q.device) * t
    cache = (pages, exact_c, exact_r, page_table, seq_lens)
    torch.ops.kvarn.latent_append(c_new.reshape(bsz * t, -1), r_new.reshape(bsz * t, -1), *cache, slots, start,
                                  query_start_loc, preset, t)  # fmt: skip
    kv_lens = start + 1 if t == 1 else start
    out, lse = torch.ops.kvarn.latent_attention(q_c.reshape(bsz * t, hq, -1), q_r.reshape(bsz * t, hq, -1), *cache,
                                                slots, kv_lens, query_start_loc, preset, scale, t)  # fmt: skip
    out = out.view(bsz, t, hq, -1).float()
    if t > 1:  # the chunk's own tokens, exact and causal, merged with the context by log-sum-exp
        scores = (torch.einsum("bthr,bsr->bhts", q_c.float(), c_new.float())
                  + torch.einsum("bths,bus->bhtu", q_r.float(), r_new.float())) * scale  # fmt: skip
        causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        lse_new = scores.logsumexp(-1).transpose(1, 2)  # [B, T, Hq]
        out_new = torch.einsum("bhts,bsr->bthr", scores.softmax(-1), c_new.float())
        lse_ctx = lse.view(bsz, t, hq)
        total = torch.logaddexp(lse_ctx, lse_new)
        out = out * (lse_ctx - total).exp()[..., None] + out_new * (lse_new - total).exp()[..., None]
    return torch.einsum("bthr,hrd->bhtd", out, v.float()).to(q.dtype)


@dataclasses.dataclass
class Rewritten:
    """A rewritten site: the placeholders the backend must feed (one KVarN cache per site)."""

    site: str
    kind: str
    window: int
    shape: dict[str, int]
    k_buffer: Node  # placeholders of the fp16 buffers the site used to read and write
    v_buffer: Node
    positions: Node  # the write positions [p, p + T) (the backend reads p when it adopts a buffer's tokens)
    cache_inputs: tuple[Node, ...]  # new placeholders, in CACHE_TENSORS order
    node: Node  # the kvarn_attention call
    constants: tuple[tuple[Node, torch.Tensor], ...] = ()  # new placeholders and their values (MLA's maps)
    reads: tuple[Node, ...] = ()  # the module constants the site's analysis read (``Site.reads``)
    # later sites reading the same buffers after the same writes (Gemma4's KV-shared layers): (site, its
    # kvarn_attention call), on this site's cache; the last call of all appends
    readers: tuple[tuple[str, Node], ...] = ()


@dataclasses.dataclass
class Report:
    """What one run of the pass did."""

    preset: str
    rewritten: list[Rewritten] = dataclasses.field(default_factory=list)
    skipped: list[dict[str, str]] = dataclasses.field(default_factory=list)  # {site, reason}


class KVarNAttentionPass(CustomGraphPass):
    """Rewrites every attention site ``sites.check`` accepts onto ``kvarn_attention``.

    Settings: ``preset`` (a preset name), ``sliding`` ("quantize": sliding-window layers are rewritten too,
    with their window; "skip": they keep their own cache). ``counters`` counts matches and outcomes;
    ``report`` is the last run's ``Report``.
    """

    def __init__(self, preset: str = "kvarn_k4v2_g128", sliding: str = "quantize"):
        if sliding not in ("quantize", "skip"):
            raise ValueError(f"sliding must be 'quantize' or 'skip', got {sliding!r}")
        self.preset = get_preset(preset)
        self.sliding = sliding
        self.counters: collections.Counter[str] = collections.Counter()
        self.report = Report(self.preset.name)

    def uuid(self) -> str:
        sources = sorted(pathlib.Path(__file__).parent.glob("*.py"))
        digest = hashlib.sha256(json.dumps({"preset": self.preset.name, "sliding": self.sliding}).encode())
        for path in sources:
            digest.update(path.read_bytes())
        return digest.hexdigest()

    def __call__(self, graph: Graph) -> Report:
        self.report = Report(self.preset.name)
        writes = find_writes(graph)
        sites, attentions = [], find_attention(graph)
        for buffer in _read_by_none(writes, attentions):
            self._skip(buffer.name, Unsupported(
                "a cache buffer this graph writes at positions, read by no attention the pass recognises in it "
                "(scores changed between the product and the softmax, as by softcapping, sinks or ALiBi; attention "
                "in another spelling; or a graph break between the write and its attention): left as it is"))  # fmt: skip
        for attention in attentions:
            self.counters[f"found_{attention.kind}"] += 1
            try:
                site = check(attention, writes, self.preset)
                if site.window and self.sliding == "skip":
                    raise Unsupported(f"sliding-window layer (window {site.window}) left as is (sliding='skip')")
            except Unsupported as e:
                self._skip(attention.output.name, e)
                continue
            sites.append(site)
        checked: set[tuple] = set()
        for group in _by_cache(sites):  # in graph order
            try:
                _check_sharing(group)
            except Unsupported as e:
                for site in group:
                    self._skip(site.name, e)
                continue
            rewritten = _rewrite(graph, group, self.preset.name)
            self.report.rewritten.append(rewritten)
            self.counters["rewritten"] += len(group)
            for site, node in zip(group, (rewritten.node, *(call for _, call in rewritten.readers))):
                key = tuple(site.runtime_checks.get(kind) for kind in ("positions", "padding", "mask"))
                if any(key) and (*key, site.mask_window, site.from_start) not in checked:  # once per graph and inputs
                    checked.add((*key, site.mask_window, site.from_start))
                    with graph.inserting_before(node):
                        graph.call_function(kvarn_checks, (site.k_write.positions, key[1], key[2], key[0] is not None,
                                                           site.mask_window, site.from_start))  # fmt: skip
        erase_unused_positions(graph)
        graph.lint()
        return self.report

    def _skip(self, site: str, reason: Unsupported) -> None:
        self.counters["skipped"] += 1
        self.report.skipped.append({"site": site, "reason": str(reason)})
        log.info("kvarn: left %s alone: %s", site, reason)


def _read_by_none(writes: dict[Node, list], attentions: list) -> list[Node]:
    """The written cache buffers (``find_writes``) that no found attention's K or V is made from."""
    all_writes = frozenset(w.node for ws in writes.values() for w in ws)
    read = set()
    for a in attentions:
        for operand in (a.k, a.v):
            try:  # (what MLA's K and V are made of includes writes into views: ``dependencies``)
                read.update(dependencies(operand, a.output, all_writes))
            except ValueError:
                read.update(ancestors(operand))
    return [buffer for buffer in writes if buffer.op == "placeholder" and buffer not in read]


def _by_cache(sites: list[Site]) -> list[list[Site]]:
    """The sites grouped by the cache writes they read after, in graph order: one site each, but for layers
    that read another layer's cache (Gemma4's and Gemma3n's KV-shared layers attend over the buffers an earlier
    layer wrote, in the same forward)."""
    groups: dict[tuple[Node, Node], list[Site]] = {}
    for site in sites:
        groups.setdefault((site.k_write.node, site.v_write.node), []).append(site)
    return list(groups.values())


def _check_sharing(group: list[Site]) -> None:
    """Sites reading one cache (``_by_cache``) share its KVarN cache: the same window (the pages it keeps), and
    K/V sites only (an MLA site appends before it attends)."""
    owner, *readers = group
    for site in readers:
        if owner.latent is not None or site.latent is not None:
            raise Unsupported(f"MLA layers sharing one latent cache ({owner.name}, {site.name})")
        if site.window != owner.window:
            raise Unsupported(f"{site.name} reads {owner.name}'s cache with a window of {site.window}, "
                              f"{owner.name} with {owner.window}")  # fmt: skip


def _rewrite(graph: Graph, group: list[Site], preset: str) -> Rewritten:
    """The group's sites (``_by_cache``: one, or a cache's writer and its readers) onto one KVarN cache: each
    attention a call of its own, the last one appending."""
    site = group[0]
    constants = ()
    if site.latent is not None:  # MLA: the maps are inputs too
        maps = {"a": site.latent.a, "b": site.latent.b, "v": site.latent.v}
        constants = tuple((insert_placeholder(graph, f"kvarn_{site.name}_{k}"), t) for k, t in maps.items())
    cache_inputs = tuple(insert_placeholder(graph, f"kvarn_{site.name}_{name}") for name in CACHE_TENSORS)
    fn, extra = (kvarn_latent_attention, [n for n, _ in constants]) if constants else (kvarn_attention, [])
    calls = []
    for i, reader in enumerate(group):
        attention = reader.attention
        old = ancestors(attention.output)
        kwargs = {} if i == len(group) - 1 else {"append": False}
        with graph.inserting_before(attention.output):
            new = graph.call_function(fn, (attention.q, site.k_write.src, site.v_write.src, site.k_write.positions,
                                           *extra, *cache_inputs, preset, reader.scale, site.window), kwargs)  # fmt: skip
        new.meta.update({k: v for k, v in attention.output.meta.items() if k in ("stack_trace", "nn_module_stack")})
        attention.output.replace_all_uses_with(new)
        _erase_dead(graph, old)
        calls.append(new)
    for write in (site.k_write, site.v_write):
        if not write.buffer.meta.get(NO_MEMORY_META):
            continue  # the buffer keeps its tokens (``NO_MEMORY_META``)
        if write.node.users:
            raise AssertionError(f"{write.node.name}: the result of a cache write is used")  # checked by sites
        target = write.node.args[0]
        graph.erase_node(write.node)
        if isinstance(target, Node) and target is not write.buffer and not target.users:
            graph.erase_node(target)  # the slice view a copy_ wrote through
    return Rewritten(site.name, site.attention.kind, site.window, site.shape, site.k_write.buffer, site.v_write.buffer,
                     site.k_write.positions, cache_inputs, calls[0], constants, site.reads,
                     tuple((reader.name, call) for reader, call in zip(group[1:], calls[1:])))  # fmt: skip


def _erase_dead(graph: Graph, candidates: list[Node]) -> None:
    """Erase the nodes of the old attention that nothing uses any more (never placeholders or in-place ops)."""
    for node in reversed(candidates):
        name = op_name(node) or ""
        if node.op in ("call_function", "call_method") and not node.users and not name.endswith("_"):
            graph.erase_node(node)
