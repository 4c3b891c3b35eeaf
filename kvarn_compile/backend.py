"""``torch.compile(model, backend="kvarn")``: rewrite every attention that reads a KV-cache buffer onto a
KVarN cache (``passes``), then compile the graph with an inner backend (Inductor by default).

    model = torch.compile(model, backend="kvarn")
    model = torch.compile(model, backend="kvarn", options={"preset": "kvarn_k4v2_g64"})

The backend is registered through the ``torch_dynamo_backends`` entry point (no import needed).
Options (per call; nothing global):

    preset              KVarN preset (default kvarn_k4v2_g128)
    keep_first_tile     keep each sequence's first tile unquantized (default True: the attention sink)
    sliding             "quantize" (default) or "skip": what to do with sliding-window layers
    release_fp16_cache  free the memory of the fp16 buffers the graph no longer reads (default False, see below)
    inner               "inductor" (default), "aot_eager" or "eager": what compiles the rewritten graph
    cudagraphs          run the Inductor-compiled graph in CUDA graphs (default: on with mode="reduce-overhead";
                        torch.compile takes a mode or options, not both)
    reports             a list: each compiled graph appends its ``passes.Report`` (what was rewritten/skipped)
    dry_run             only report: run the graph as traced, allocate nothing (``kvarn-compile inspect``)

Who owns the cache: the backend allocates one KVarN cache per fp16 K/V buffer pair it rewrote (kept in a
registry keyed by the buffer, shared by every graph that reads it: prefill, decode, recompilations). Row
b of the buffer is cache slot b. When something outside the compiled graphs wrote the fp16 buffer (its
version counter moved: an eager prefill, ``cache.reset()``, a graph compiled with other options over the same
buffers), or moved a position counter the graph advances (``cache.crop``) back into a tile the KVarN cache
completed, the next call adopts the buffer's tokens [0, p) into the KVarN cache first (p: the call's start
position; host syncs only when a counter moved). The buffers must not be inference tensors (no version counter).

Module constants: where the analysis read the values of weights or module buffers (MLA's maps, read off the
layer's weights; a mask table's window), a call that passes other such tensors (one graph serves every layer of
a step function given the layer module: Dynamo guards them by shape), or the same ones changed in place, has the
graph analysed again with them, once for each new set: MLA's maps are then the call's own, and a site that would be
compiled otherwise (another window) raises.

Memory: the fp16 buffers stay allocated by default, because transformers' ``generate`` runs the prefill
eagerly into them, and the compiled graphs keep writing the new tokens into them too: what runs outside the
compiled graphs (a later turn's eager prefill over the earlier turns' tokens, beam search's ``reorder_cache``)
reads them, and the KVarN cache adopts what it wrote. When every forward goes through the compiled model,
``release_fp16_cache=True`` points them at one element each (their shape stays; ``zero_()`` still works; any
other write raises), so KV memory really drops. The strides change, so Dynamo recompiles each graph once after that.
``integrations.static_cache(..., fp16_buffers=False)`` makes them so from the start (no fp16 memory ever).

Sliding windows: a site's window comes from its mask; a mask made outside the graph cannot show it, so
the window of a buffer's layer can be declared (``declare_window``). A windowed site's KVarN cache holds
only the pages its window reaches (``paged.ring_tiles``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
import weakref

import torch
from torch.fx import GraphModule

from .ops import prepare_constants, store
from .paged import Batch, KVarNCache, history_gaps, tokens_major
from .paged_latent import LatentCache
from .passes.graph import ancestors, evaluate
from .passes.rewrite import KVarNAttentionPass, Report, Rewritten
from .passes.sites import NO_MEMORY_META, SLICE_WRITE_META, WINDOW_META, find_writes, read_in_graph, written_in_graph
from .presets import DEFAULT_PRESET

log = logging.getLogger("kvarn.backend")

INNER_BACKENDS = ("inductor", "aot_eager", "eager")


@dataclasses.dataclass(frozen=True)
class Options:
    preset: str = DEFAULT_PRESET
    keep_first_tile: bool = True
    sliding: str = "quantize"
    release_fp16_cache: bool = False
    inner: str = "inductor"
    cudagraphs: bool = False
    reports: list | None = None
    dry_run: bool = False

    @classmethod
    def parse(cls, options: dict | None) -> Options:
        options = dict(options or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown kvarn backend options {unknown}; known: {sorted(known)}")
        parsed = cls(**options)
        if parsed.inner not in INNER_BACKENDS:
            raise ValueError(f"inner must be one of {INNER_BACKENDS}, got {parsed.inner!r}")
        for flag in ("keep_first_tile", "release_fp16_cache", "cudagraphs", "dry_run"):
            if not isinstance(getattr(parsed, flag), bool):
                raise TypeError(f"{flag} must be True or False, got {getattr(parsed, flag)!r}")
        KVarNAttentionPass(parsed.preset, parsed.sliding)  # the pass's own checks of both: here, before a compile
        return parsed


@dataclasses.dataclass
class _Entry:
    """The KVarN cache that replaces one fp16 K/V buffer pair, and the buffers' versions it has seen."""

    cache: KVarNCache | LatentCache  # LatentCache for an MLA site
    seen: tuple[int, ...] | None = None  # ``_Site.versions`` after the last call; None: never synced
    released: bool = False
    adoptions: int = 0
    end: int | None = None  # where the last call's positions ended, when they were read on the host (``_Site.sync``)


# id(fp16 K buffer) -> (weak reference to it, {(preset, keep_first_tile, window): its KVarN cache}): by identity
# (tensors compare elementwise), and weak: an entry lives as long as the model's own cache buffer. By options too:
# graphs compiled with other options over the same buffers keep a KVarN cache each.
_CACHES: dict[int, tuple[weakref.ref, dict[tuple, _Entry]]] = {}


def _lookup(buffer: torch.Tensor) -> dict[tuple, _Entry]:
    ref, entries = _CACHES.get(id(buffer), (None, {}))
    return entries if ref is not None and ref() is buffer else {}


def memoryless(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """One element seen at ``shape`` (all strides 0): a cache buffer the rewritten graphs no longer read or
    write keeps its shape (Dynamo guards, ``zero_()``) without its memory; any other write into it raises."""
    return torch.zeros(1, dtype=dtype, device=device).expand(shape)


def has_no_memory(t: torch.Tensor) -> bool:
    return t.numel() > 1 and all(s == 0 for s in t.stride())


# id(fp16 K or V buffer) -> (weak reference to it, the sliding window of its layer): ``declare_window``
_WINDOWS: dict[int, tuple[weakref.ref, int]] = {}


def declare_window(buffer: torch.Tensor, window: int) -> None:
    """Declare that ``buffer`` (a K or V cache buffer) belongs to a sliding-window layer of ``window``
    tokens. Needed where the attention mask is made outside the compiled graph (transformers' ``generate``):
    the pass cannot see its window there, so it probes, and checks at run time, masks with this one.
    ``integrations.static_cache`` declares its sliding layers."""
    if window <= 0:
        raise ValueError(f"window must be > 0, got {window}")
    key = id(buffer)
    _WINDOWS[key] = (weakref.ref(buffer, lambda _: _WINDOWS.pop(key, None)), window)


def _declared_window(buffer: torch.Tensor) -> int:
    ref, window = _WINDOWS.get(id(buffer), (None, 0))
    return window if ref is not None and ref() is buffer else 0


def kvarn_cache_of(buffer: torch.Tensor) -> KVarNCache | LatentCache | None:
    """The KVarN cache that serves an fp16 K buffer, if the backend rewrote an attention reading it (the last one
    allocated, where graphs compiled with other options serve the buffer too)."""
    entries = _lookup(buffer)
    return list(entries.values())[-1].cache if entries else None


def _entry_for(k_buf: torch.Tensor, v_buf: torch.Tensor, rewritten: Rewritten, options: Options) -> _Entry:
    s = rewritten.shape
    latent = bool(rewritten.constants)  # MLA: the buffers hold the latent [.., Dv] and the rope key [.., Dk - Dv]
    wanted = (options.preset, options.keep_first_tile and not latent, rewritten.window)
    entries = _lookup(k_buf)
    if wanted in entries:
        return entries[wanted]
    dtype = k_buf.dtype if k_buf.dtype in (torch.float16, torch.bfloat16) else torch.float16
    if latent:
        if options.keep_first_tile:
            log.warning("kvarn: %s is MLA: its latent cache quantizes every tile, the first too (keep_first_tile "
                        "applies to K/V caches only)", rewritten.site)  # fmt: skip
        cache = LatentCache.allocate(s["B"], s["L"], s["Dv"], s["Dk"] - s["Dv"], options.preset, dtype, k_buf.device)
    else:  # a sliding-window site gets the pages its window reaches, reused in turn (``paged.ring_tiles``)
        cache = KVarNCache.allocate(s["B"], s["L"], s["Hkv"], s["Dk"], s["Dv"], options.preset, dtype, k_buf.device,
                                    options.keep_first_tile, rewritten.window)  # fmt: skip
    for t in cache.tensors():
        torch._dynamo.mark_static_address(t)  # fixed addresses: CUDA graphs read them in place
    prepare_constants(s["Dv"] if latent else s["Dk"], s["Dv"], dtype, k_buf.device)
    log.info("kvarn: %s cache for %s (%d rows x %d KV heads x %d tokens, D %d/%d): %.1f MB vs %.1f MB fp16",
             options.preset, rewritten.site, s["B"], s["Hkv"], s["L"], s["Dk"], s["Dv"], cache.nbytes / 1e6,
             (k_buf.numel() * k_buf.element_size() + v_buf.numel() * v_buf.element_size()) / 1e6)  # fmt: skip
    entry = _Entry(cache)
    key = id(k_buf)
    if not entries:
        _CACHES[key] = (weakref.ref(k_buf, lambda _: _CACHES.pop(key, None)), entries)
    entries[wanted] = entry
    return entry


def _version_of(t: torch.Tensor) -> int:
    # (an inference tensor has no version counter: changed in place under inference_mode, it is not seen)
    return 0 if t.is_inference() else t._version


def _as_compiled(r: Rewritten) -> tuple:
    """What a compiled graph holds of a rewritten site besides its inputs: kind, shape, (preset, scale, window) of
    its call and of each call reading its cache."""
    return r.kind, r.shape, r.node.args[-3:], *((name, call.args[-3:]) for name, call in r.readers)


def _describe(r: Rewritten) -> str:
    return f"window {r.window}, scale {r.node.args[-2]:.4g}, shape {r.shape}"


@functools.cache
def _warn_adopting_again() -> None:
    log.warning("kvarn: a KVarN cache adopts the fp16 buffers' tokens again (written outside its compiled graphs: "
                "an eager forward between compiled ones, as a later turn's prefill with a compiled decode only, "
                "beam search's reorder_cache, or a graph compiled with other options over the same buffers; or its "
                "positions moved back into a completed tile, as assisted decoding's crop does): each adoption "
                "quantizes the whole prefix again, a slow path; compile every forward (model.forward = "
                "torch.compile(model.forward, backend='kvarn')) to stay off it where you can. (Logged once.)")  # fmt: skip


@functools.cache
def _warn_grad_enabled() -> None:
    log.warning("kvarn: a graph compiled with gradients enabled (parameters that require grad, outside "
                "torch.no_grad()): the KVarN ops have no backward, so its rewritten form runs without autograd and "
                "its outputs do not require grad (a backward through them raises). Run inference under "
                "torch.no_grad() or torch.inference_mode() to keep this quiet. (Logged once.)")  # fmt: skip


@dataclasses.dataclass
class _Site:
    """Runtime view of one rewritten site: where its buffers are among the call's arguments, and where its KVarN
    cache's tensors are among the compiled graph's extra inputs."""

    rewritten: Rewritten
    k_index: int
    v_index: int
    position_inputs: dict  # placeholder node -> argument index (to evaluate the start position)
    counters: tuple[int, ...]  # the argument indices of the position inputs the graph advances itself
    options: Options
    cache_inputs: slice  # of the extra inputs
    map_inputs: slice  # of the extra inputs: MLA's maps (empty for other sites)
    reads: tuple[int, ...]  # the argument indices of the module constants the site's analysis read
    releasable: bool  # the graph reads neither fp16 buffer (``release_fp16_cache`` may free them)
    # the values of those constants analysed: {((id, version) of each): (weak references to them, the maps they give)}
    analysed: dict = dataclasses.field(default_factory=dict)

    def _key(self, args) -> tuple:
        return tuple((id(args[i]), _version_of(args[i])) for i in self.reads)

    def maps_for(self, args) -> tuple | None:
        """The maps of this call's module constants (MLA: read off its weights; () for other sites), or None if
        they were not analysed: Dynamo guards weights and module buffers by shape, not value, so one graph may be
        called for another layer's (a function given the layer module, compiled once)."""
        refs, maps = self.analysed.get(self._key(args), ((), None))
        if maps is not None and all(ref() is args[i] for ref, i in zip(refs, self.reads)):
            return maps
        return None

    def learn(self, args, again: Report) -> tuple:
        """The maps of this call's constants from ``again``, the graph analysed again with them, after checking
        that it rewrites this site as the compiled graph does."""
        old = self.rewritten
        new = next((r for r in again.rewritten if r.site == old.site), None)
        if new is None or _as_compiled(new) != _as_compiled(old):
            got = _describe(new) if new else next((s["reason"] for s in again.skipped if s["site"] == old.site), "")
            raise RuntimeError(
                f"kvarn: {old.site} was compiled for module constants (weights, buffers) that give {_describe(old)}; "
                f"this call passes others ({', '.join(str(tuple(args[i].shape)) for i in self.reads)}) that give: "
                f"{got or 'no such site'}. Dynamo runs one compiled graph for every call its guards accept, and they "
                "do not see these values: give the modules an attribute that tells them apart (Dynamo guards it), "
                "or compile each one's step apart"
            )  # fmt: skip
        maps = tuple(t.to(args[self.k_index].device) for _, t in new.constants)
        self.remember(args, maps)
        return maps

    def remember(self, args, maps: tuple) -> None:
        """Keep the maps of this call's constants, dropping those of constants freed, or of these same tensors
        before they changed in place (other layers' stay: a step function serves each layer in turn)."""
        key = self._key(args)
        ids = [i for i, _ in key]
        self.analysed = {
            k: (refs, m) for k, (refs, m) in self.analysed.items()
            if all(ref() is not None for ref in refs) and [i for i, _ in k] != ids
        }  # fmt: skip
        self.analysed[key] = (tuple(weakref.ref(args[i]) for i in self.reads), maps)

    def versions(self, args) -> tuple[int, ...]:
        """The version counters of the call's buffers and of the position counters the graph advances itself
        (transformers' ``cumulative_length``, torchtune's ``cache_pos``): one that moved outside the compiled graphs
        (an eager write, ``cache.crop``, ``cache.reset``) makes the next call look at what the KVarN cache holds.
        (Positions given afresh each call, or advanced by the caller, as gpt-fast's ``input_pos``, tell nothing.)"""
        tensors = [args[i] for i in (self.k_index, self.v_index, *self.counters)]
        if any(t.is_inference() for t in tensors):
            raise RuntimeError(f"kvarn: {self.rewritten.site}'s cache buffers or position counter are inference "
                               "tensors (made under torch.inference_mode()), which keep no version counter: writes "
                               "outside the compiled graphs could not be seen. Make the cache outside "
                               "inference_mode (torch.no_grad() is enough)")  # fmt: skip
        return tuple(t._version for t in tensors)

    def sync(self, args) -> _Entry:
        """The KVarN cache of this call's buffers, after the fp16 buffers' tokens [0, p) were adopted (p: the call's
        start) where the KVarN cache does not hold what the call reads: when something else wrote the buffers since
        its last call, or moved its position back into a tile the cache completed (``paged.history_gaps``: cropped,
        as assisted decoding does). Dynamo runs a compiled graph for every call its guards accept, which may pass
        other buffers of the same shapes (a new StaticCache, or one attention function compiled once and called for
        each layer): each buffer pair has a KVarN cache of its own."""
        k_buf, v_buf = args[self.k_index], args[self.v_index]
        entry = _entry_for(k_buf, v_buf, self.rewritten, self.options)
        versions = self.versions(args)
        # Positions given as ints (an int start: Python values, no tensor) are read every call, so that a move back
        # into a completed tile is seen even where no counter records it (gpt-fast's speculative decoding verifies
        # from before the furthest position it wrote); positions in tensors are read only when a version moved (on a
        # GPU each read is a sync; on the CPU too, so that what the tests see is what runs there).
        on_host = bool(self.position_inputs) and not any(
            isinstance(args[i], torch.Tensor) for i in self.position_inputs.values()
        )
        if versions == entry.seen and not on_host:
            return entry
        env = {node: args[i].cpu() if isinstance(args[i], torch.Tensor) else args[i]  # probes run on the CPU
               for node, i in self.position_inputs.items()}  # fmt: skip
        positions = evaluate(self.rewritten.positions, env).reshape(-1)
        start = int(positions[0])
        moved_back, entry.end = entry.end is not None and start < entry.end, start + positions.numel()
        if versions == entry.seen and not moved_back:
            return entry
        written = entry.seen is None or versions[:2] != entry.seen[:2]
        if start > 0 and (written or self._misses_history(entry.cache, start)):
            if entry.released:
                raise RuntimeError("kvarn: the fp16 cache buffer was released (release_fp16_cache=True) but "
                                   f"holds {start} tokens written outside the compiled model, or the cache was "
                                   "moved back into a tile its KVarN cache completed; run every forward through "
                                   "the compiled model, or keep the buffers")  # fmt: skip
            self._adopt(entry.cache, k_buf, v_buf, start)
            entry.adoptions += 1
            if entry.adoptions == 2:
                _warn_adopting_again()
        entry.seen = versions
        return entry

    @staticmethod
    def _misses_history(cache: KVarNCache | LatentCache, start: int) -> bool:
        """Whether a call starting at ``start`` in every row misses rows it reads in ``cache``
        (``paged.history_gaps``; a host sync of its lengths)."""
        held = cache.seq_lens.cpu()
        return any(bool(gap.any()) for gap in history_gaps(cache, torch.full_like(held, start), held))

    def _adopt(self, cache, k_buf: torch.Tensor, v_buf: torch.Tensor, length: int) -> None:
        rows = k_buf.shape[0]
        empty = (~k_buf[:, :, :length].flatten(1).any(1)).nonzero()[:, 0].tolist()
        if empty:  # no real key is all zeros: nothing wrote these tokens
            raise RuntimeError(
                f"kvarn: {self.rewritten.site} would adopt {length} tokens of rows {empty} written outside the "
                "compiled graph, but the fp16 buffer holds zeros there: nothing wrote them (buffers made without "
                "memory or released, or a copy of such buffers: beam search's reorder_cache). Keep the fp16 "
                "buffers (fp16_buffers=True, release_fp16_cache=False) where something outside the compiled "
                "graph reads or moves the cache"
            )  # fmt: skip
        log.info("kvarn: %s adopts %d tokens x %d rows written outside the compiled graph", self.rewritten.site,
                 length, rows)  # fmt: skip

        batch = Batch.from_lengths(range(rows), [0] * rows, [length] * rows, device=k_buf.device)
        if isinstance(cache, LatentCache):  # MLA: the buffers hold the latent and the rope key, one "head" each
            c, rope = (tokens_major(x[:, :, :length], cache.exact_c.dtype)[:, 0] for x in (k_buf, v_buf))
            torch.ops.kvarn.latent_append(c, rope, *cache.tensors(), *batch[:3], cache.preset.name, length)
            return
        k, v = (tokens_major(x[:, :, :length], cache.exact_k.dtype) for x in (k_buf, v_buf))
        store(cache, k, v, batch)

    def release(self, args, entry: _Entry) -> None:
        for buf in (args[self.k_index], args[self.v_index]):
            if not has_no_memory(buf):
                buf.set_(memoryless(buf.shape, buf.dtype, buf.device))
        entry.released = True


class _Compiled:
    """The callable Dynamo runs: syncs the caches, then calls the compiled graph with the arguments it
    still reads plus the KVarN cache tensors of the call's buffers (and MLA's maps of the call's weights).
    ``analyse(args)``: the graph's report analysed again with the call's module constants."""

    def __init__(self, compiled, keep: list[int], extra: list[torch.Tensor], sites: list[_Site], release: bool,
                 analyse, no_grad: bool = False) -> None:  # fmt: skip
        self.compiled, self.keep, self.extra, self.sites, self.release = compiled, keep, extra, sites, release
        self.analyse, self.no_grad = analyse, no_grad

    def __call__(self, *args):
        extra = list(self.extra)
        maps = [site.maps_for(args) for site in self.sites]
        if any(m is None for m in maps):  # other weights or buffers than analysed: once for the whole graph
            log.info("kvarn: a compiled graph called with other module constants (weights, buffers) than it was "
                     "analysed with: MLA maps and masks read again (%d sites)", maps.count(None))  # fmt: skip
            again = self.analyse(args)
            maps = [site.learn(args, again) if m is None else m for site, m in zip(self.sites, maps)]
        entries = [site.sync(args) for site in self.sites]
        for site, entry, site_maps in zip(self.sites, entries, maps):
            extra[site.map_inputs] = site_maps
            extra[site.cache_inputs] = entry.cache.tensors()
        with torch.no_grad() if self.no_grad else contextlib.nullcontext():
            out = self.compiled(*[args[i] for i in self.keep], *extra)
        for site, entry in zip(self.sites, entries):
            if self.release and site.releasable and not entry.released:
                site.release(args, entry)
            entry.seen = site.versions(args)  # (the graph writes the buffers and advances the positions too)
        return out


def _inner(name: str, cudagraphs: bool):
    if name == "inductor":
        from torch._inductor.compile_fx import compile_fx

        return lambda gm, inputs: compile_fx(gm, inputs, config_patches={"triton.cudagraphs": cudagraphs})
    return torch._dynamo.lookup_backend(name)


def _copy(gm: GraphModule) -> GraphModule:
    """A copy to rewrite: Dynamo still reads its own graph after the backend returns. Keeps what
    AOTAutograd reads from Dynamo graphs (module meta, parameter sources, placeholder sources)."""
    graph = torch.fx.Graph()
    nodes: dict = {}
    graph.output(graph.graph_copy(gm.graph, nodes))
    for old, new in nodes.items():
        if hasattr(old, "_dynamo_source"):
            new._dynamo_source = old._dynamo_source
    copy = GraphModule(gm, graph)
    copy.meta.update(gm.meta)
    if hasattr(gm, "_param_name_to_source"):
        copy._param_name_to_source = gm._param_name_to_source
    return copy


def _analyse(dynamo_gm: GraphModule, opts: Options, values: list) -> tuple[GraphModule, Report]:
    """A copy of Dynamo's graph, rewritten by the pass, and its report; ``values``: the graph's inputs, of which the
    probes read the module constants' (parameters and buffers: static inputs) and the windows declared for
    buffers (the example inputs at compile time; a call's own when it passes other constants, ``_Site.learn``)."""
    gm = _copy(dynamo_gm)
    for node, value in zip([n for n in gm.graph.nodes if n.op == "placeholder"], values):
        if not isinstance(value, torch.Tensor):
            continue
        if node.meta.get("tensor_dict", {}).get("_dynamo_static_input_type"):
            node.meta["kvarn_constant"] = value
        if _declared_window(value):
            node.meta[WINDOW_META] = _declared_window(value)
        if has_no_memory(value):
            node.meta[NO_MEMORY_META] = True
    return gm, KVarNAttentionPass(opts.preset, opts.sliding)(gm.graph)


def kvarn_backend(dynamo_gm: GraphModule, example_inputs: list, *, options: dict | None = None,
                  mode: str | None = None):  # fmt: skip
    """The Dynamo backend (see the module docstring)."""
    opts = Options.parse(options)
    cudagraphs = opts.cudagraphs or mode in ("reduce-overhead", "max-autotune")
    start = time.perf_counter()
    gm, report = _analyse(dynamo_gm, opts, example_inputs)
    log.info("kvarn: %d attention sites rewritten, %d left alone (pass: %.2f s)", len(report.rewritten),
             len(report.skipped), time.perf_counter() - start)  # fmt: skip
    if opts.reports is not None:
        opts.reports.append(report)
    if opts.dry_run:
        return dynamo_gm.forward
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"][: len(example_inputs)]  # the pass's follow
    index = {n: i for i, n in enumerate(placeholders)}
    _check_no_write_into_empty_buffers(gm, example_inputs, index, report)

    fake_mode = torch._guards.detect_fake_mode(example_inputs)
    extra, sites, buffers = [], [], set()
    for r in report.rewritten:
        k_buf, v_buf = example_inputs[index[r.k_buffer]], example_inputs[index[r.v_buffer]]
        entry = _entry_for(k_buf, v_buf, r, opts)
        inputs = [(node, t.to(k_buf.device)) for node, t in r.constants]  # MLA's maps (first), then the cache
        map_inputs = slice(len(extra), len(extra) + len(inputs))
        cache_inputs = slice(map_inputs.stop, map_inputs.stop + len(r.cache_inputs))
        for node, tensor in [*inputs, *zip(r.cache_inputs, entry.cache.tensors())]:
            node.meta["example_value"] = fake_mode.from_tensor(tensor, static_shapes=True) if fake_mode else tensor
            # what AOTAutograd reads on Dynamo graphs: no user-code source; a static input (CUDA graphs
            # read it in place instead of copying it in)
            node._dynamo_source = None
            node.meta["tensor_dict"] = {"_dynamo_static_input_type": "unguarded"}
            extra.append(tensor)
        inputs = {n: index[n] for n in ancestors(r.positions) if n.op == "placeholder"}
        counters = tuple(i for n, i in inputs.items() if written_in_graph(n))
        read, sliced = read_in_graph(r.k_buffer) or read_in_graph(r.v_buffer), r.positions.meta.get(SLICE_WRITE_META)
        releasable = not (read or sliced)
        if opts.release_fp16_cache and not releasable:
            log.warning("kvarn: release_fp16_cache: %s's fp16 buffers are kept: %s", r.site,
                        "the graph reads them outside the attention" if read else "the graph writes them through "
                        "slices (buf[:, :, a:b] = k), which Dynamo cannot trace into a buffer without memory")  # fmt: skip
        site = _Site(r, index[r.k_buffer], index[r.v_buffer], inputs, counters, opts, cache_inputs, map_inputs,
                     tuple(index[n] for n in r.reads), releasable)  # fmt: skip
        site.remember(example_inputs, tuple(extra[map_inputs]))
        sites.append(site)
        buffers.update((r.k_buffer, r.v_buffer))
    keep = []
    for node in placeholders:
        if node in buffers and not node.users:
            gm.graph.erase_node(node)  # the graph no longer reads this fp16 buffer
            continue
        if node in buffers and cudagraphs:
            # The graph still writes this fp16 buffer in place (kept for what reads it outside). Inductor's
            # CUDA-graph trees skip a graph that mutates an input that is not static ("mutated inputs"), as
            # buffers passed to a compiled function as plain arguments are (a module's buffers and
            # transformers' StaticCache are static): mark it static, so the graph writes it at its address.
            node.meta["tensor_dict"] = {**node.meta.get("tensor_dict", {}), "_dynamo_static_input_type": "unguarded"}
        keep.append(index[node])
    gm.recompile()
    # Dynamo guards the grad mode: a graph compiled with gradients enabled (inference outside torch.no_grad(), the
    # parameters requiring grad) runs the KVarN ops, which have no backward, without autograd
    grad = bool(sites) and torch.is_grad_enabled() and any(getattr(x, "requires_grad", False) for x in example_inputs)
    if grad:
        _warn_grad_enabled()
    with torch.no_grad() if grad else contextlib.nullcontext():
        compiled = _inner(opts.inner, cudagraphs)(gm, [example_inputs[i] for i in keep] + extra)
    if not sites:
        return compiled
    return _Compiled(compiled, keep, extra, sites, opts.release_fp16_cache,
                     lambda args: _analyse(dynamo_gm, opts, args)[1], grad)  # fmt: skip


def _check_no_write_into_empty_buffers(gm: GraphModule, example_inputs: list, index: dict, report: Report) -> None:
    """A cache buffer without memory (``static_cache(fp16_buffers=False)``, or released) that the graph still
    writes: an attention reading it was left alone. Say which and why, instead of the inner compiler's
    "more than one element of the written-to tensor refers to a single memory location"."""
    for buffer in find_writes(gm.graph):
        value = example_inputs[index[buffer]] if buffer in index else None
        if isinstance(value, torch.Tensor) and has_no_memory(value):
            reasons = "; ".join(f"{s['site']}: {s['reason']}" for s in report.skipped) or "none recorded"
            raise RuntimeError(f"kvarn: the cache buffer {buffer.name} has no memory (one element seen at its full "
                               "shape: static_cache(fp16_buffers=False) or a released buffer), but this graph still "
                               f"writes it, because an attention reading it was left alone ({reasons})")  # fmt: skip


def backend_with(**options):
    """``kvarn_backend`` with options bound, for callers that cannot pass ``options`` to torch.compile,
    e.g. transformers' ``CompileConfig(backend=backend_with(preset="kvarn_k4v2_g64"))`` (it always
    passes a mode, and torch.compile takes a mode or options, not both)."""
    Options.parse(options)  # fail here, not at the first compile

    def kvarn(gm: GraphModule, example_inputs: list, *, mode: str | None = None):
        return kvarn_backend(gm, example_inputs, options=options, mode=mode)

    return kvarn
