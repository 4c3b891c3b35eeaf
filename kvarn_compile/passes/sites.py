"""Find the attention sites of a Dynamo graph and decide, for each, whether the kvarn ops can serve it.

A site is rewritable when everything the kvarn ops assume is shown on the graph itself:

    attention   SDPA, or eager matmul -> [scale] -> [+ mask] -> softmax -> [cast, dropout p=0] -> matmul
    K and V     read persistent cache buffers (graph inputs) [B, Hkv, L, D], through views only, as
                "query head h reads KV head h // group" (repeat_kv, expand + reshape, enable_gqa, ...);
                or their first T slots with is_causal and no mask (transformers' SDPA prefill into an empty
                static cache), then only at p = 0, checked at run time
    writes      each buffer is written once in the graph, before the attention, at positions
                [p, p + T) along its sequence dim, with the fresh k/v [B, Hkv, T, D] of the same T
    mask        query t (position p + t) sees keys j with p + t - W < j <= p + t (W = 0: no window);
                masks built from mask inputs (a padding mask, or a mask made outside the graph) are
                probed with no padding / causal inputs, and the rewrite asserts at run time that the
                inputs are exactly that

MLA (``Latent``): when K and V are computed from two cached buffers, a latent and a rope key, by
per-token linear maps (transformers' DeepSeek-V3), the maps are read off the graph by evaluating K and V
on basis probes and checked on random ones; the site becomes attention in latent space over KVarN's latent
cache (``paged_latent``: the latent quantized once for keys and values, the rope key kept).

Views, positions, masks and MLA maps are checked by evaluation on probes (``graph.evaluate``), for
several start positions p. Everything else is left alone with the reason recorded.

Shape legend: B rows, Hq / Hkv query / KV heads, T new tokens, L cache length, Dk / Dv head dims.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
from torch.fx import Graph, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..presets import Preset
from .graph import ALIASING, CASTS, ancestors, arg, dependencies, example, hint, in_place, op_name, source_of, view_path
from .graph import evaluate as _evaluate


class Unsupported(Exception):
    """Why a site is left alone (the message is reported)."""


@dataclasses.dataclass
class CacheWrite:
    """``buffer[:, :, positions] = src`` in any spelling (index_copy_ along dim 2, setitem at an index tensor
    or a slice, copy_ into a slice, scatter_ along dim 2)."""

    node: Node
    buffer: Node  # placeholder [B, Hkv, L, D]
    positions: Node  # int [T]
    src: Node  # [B, Hkv, T, D]
    index: Node | None = None  # scatter_: the full index [B, Hkv, T, D], checked to be positions broadcast


@dataclasses.dataclass
class Attention:
    """One attention in the graph, as found (not yet checked)."""

    output: Node  # the node whose value is the attention output [B, Hq, T, Dv]
    kind: str  # "sdpa" or "eager"
    q: Node
    k: Node  # the K operand as the attention reads it (eager: K transposed)
    v: Node
    mask: Node | None
    is_causal: bool
    scale: float | None
    dropout: float
    enable_gqa: bool = False
    mask_hides: bool = False  # the mask marks the keys hidden (``scores.masked_fill(mask, -inf)``), not those seen


@dataclasses.dataclass
class Latent:
    """MLA, read from the graph: per query head h, K[h] = c @ a[h] + r @ b[h] and V[h] = c @ v[h] for each
    token's cached latent c [R] and rope key r [Dr]. Attention then runs in latent space (``paged_latent``:
    scores q_c[h] . c + q_r[h] . r, output the p-weighted c) with q_c[h] = q[h] @ a[h]^T, q_r[h] = q[h] @ b[h]^T,
    and out[h] = out_lat[h] @ v[h]."""

    a: torch.Tensor  # [Hq, R, Dk]
    b: torch.Tensor  # [Hq, Dr, Dk]
    v: torch.Tensor  # [Hq, R, Dv]


@dataclasses.dataclass
class Site:
    """A rewritable attention: what the rewrite needs."""

    attention: Attention
    k_write: CacheWrite
    v_write: CacheWrite
    scale: float
    window: int  # 0: none
    shape: dict[str, int]  # B, Hq, Hkv, L, Dk, Dv
    # inputs to check at run time: {"padding": [B, S], "mask": [B, h, T, S], "positions": [T] (given, not computed)}
    runtime_checks: dict[str, Node]
    latent: Latent | None = None  # MLA: K and V are linear maps of cached latents (k_write: latent, v_write: rope)
    mask_window: int = 0  # the window a given mask is checked to have at run time (0: plain causal)
    from_start: bool = False  # prefill of an empty cache only (K/V: the buffer's first T slots, is_causal)
    # the module constants (weights, buffers: placeholders with a "kvarn_constant") whose values the probes read
    # (MLA's maps, a mask table): a graph called with other tensors there needs them read again
    reads: tuple[Node, ...] = ()

    @property
    def name(self) -> str:
        return self.attention.output.name


# ----------------------------------------------------------------------------------------------------
# Finding
# ----------------------------------------------------------------------------------------------------
def find_writes(graph: Graph) -> dict[Node, list[CacheWrite]]:
    """Writes into placeholders at a position index along dim 2, by buffer."""
    writes: dict[Node, list[CacheWrite]] = {}
    for node in graph.nodes:
        name = op_name(node)
        write = None
        if name == "index_copy_" and len(node.args) >= 4 and node.args[1] in (2, -2):
            write = CacheWrite(node, node.args[0], node.args[2], node.args[3])
        elif name == "setitem":
            buffer, index, src = node.args
            if isinstance(index, tuple) and len(index) == 3 and index[0] == index[1] == slice(None):
                if isinstance(index[2], Node):  # buf[:, :, pos] = src
                    write = CacheWrite(node, buffer, index[2], src)
                elif isinstance(index[2], slice) and index[2].step is None and isinstance(src, Node):
                    write = CacheWrite(node, buffer, _slice_positions(node, index[2], src), src)
        elif (name == "scatter_" and arg(node, 1, "dim") in (2, -2) and isinstance(arg(node, 3, "src"), Node)
              and arg(node, 4, "reduce") is None):  # fmt: skip
            index = arg(node, 2, "index")  # buf.scatter_(2, positions broadcast to [B, Hkv, T, D], src)
            write = CacheWrite(node, node.args[0], _scatter_positions(node, index), arg(node, 3, "src"), index)
        elif name == "copy_" and isinstance(node.args[0], Node) and op_name(node.args[0]) == "getitem":
            view = node.args[0]  # buf[:, :, a:b].copy_(src)
            buffer, index = view.args
            if (isinstance(index, tuple) and len(index) == 3 and index[0] == index[1] == slice(None)
                    and isinstance(index[2], slice) and index[2].step is None and len(view.users) == 1):  # fmt: skip
                write = CacheWrite(node, buffer, _slice_positions(view, index[2], node.args[1]), node.args[1])
        if write is not None and isinstance(write.buffer, Node):
            write.positions = _as_written(write.node, write.positions)
            writes.setdefault(write.buffer, []).append(write)
    return writes


def _as_written(write: Node, positions: Node) -> Node:
    """``positions`` as they are at the write: a copy made there when they view a graph input that the graph
    changes later (torchtune's ``cache_pos[:T]``, advanced after the write), since the rewrite reads them
    at the attention."""
    source = source_of(positions)
    if not (isinstance(source, Node) and source.op == "placeholder" and any(_writes(u, source) for u in source.users)):
        return positions
    with write.graph.inserting_before(write):
        copy = write.graph.call_function(torch.clone, (positions,))
    copy.meta["kvarn_slice_positions"] = True  # erased when no rewrite uses it
    return copy


# node.meta key of the positions of a write through a slice (``buf[:, :, a:b] = src``): Dynamo traces such a write
# into a buffer without memory (``backend.memoryless``) as an error, so the backend keeps its memory
SLICE_WRITE_META = "kvarn_slice_write"


def _slice_positions(write: Node, index: slice, src: Node) -> Node:
    """For ``buf[:, :, a:b] = src``: a node ``arange(a, b)`` (the positions the write covers) before the write.
    A start that is an int input of the graph is a position counter for the probes. Unused ones are
    erased after the pass (``erase_unused_positions``)."""
    device = example(src).device
    with write.graph.inserting_before(write):
        positions = write.graph.call_function(torch.arange, (index.start or 0, index.stop), {"device": device})
    positions.meta["kvarn_slice_positions"] = True
    positions.meta[SLICE_WRITE_META] = True
    if isinstance(index.start, Node) and index.start.op == "placeholder":
        index.start.meta["kvarn_position"] = True
    return positions


def _scatter_positions(write: Node, index: Node) -> Node:
    """For ``buf.scatter_(2, index, src)``: a node ``index[0, 0, :, 0]`` before the write, the positions if the
    index is them broadcast over batch, heads and channels (``_positions_are_contiguous`` checks that)."""
    with write.graph.inserting_before(write):
        positions = write.graph.call_function(operator.getitem, (index, (0, 0, slice(None), 0)))
    positions.meta["kvarn_slice_positions"] = True  # erased when no rewrite uses it
    return positions


def erase_unused_positions(graph: Graph) -> None:
    for node in list(graph.nodes):
        if node.meta.get("kvarn_slice_positions") and not node.users:
            graph.erase_node(node)


def _scalar(node) -> float | None:
    value = example(node)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _skip_casts(node: Node, forward: bool) -> Node:
    """Step over dtype casts (and dropout with p=0 going forward)."""
    while True:
        if forward:
            if len(node.users) != 1:
                return node
            nxt = next(iter(node.users))
            name = op_name(nxt)
            if name in CASTS or (
                name == "dropout" and (arg(nxt, 1, "p", 0.5) == 0 or arg(nxt, 2, "training", True) is False)
            ):
                node = nxt
                continue
            return node
        if op_name(node) in CASTS and isinstance(node.args[0], Node):
            node = node.args[0]
            continue
        return node


def _eager(softmax: Node) -> Attention | None:
    """The eager pattern around a softmax over the last dim, or None."""
    if arg(softmax, 1, "dim") not in (-1, 3):
        return None
    probs = _skip_casts(softmax, forward=True)
    if len(probs.users) != 1:
        return None
    pv = next(iter(probs.users))
    if op_name(pv) != "matmul" or pv.args[0] is not probs:
        return None
    scores, mask, scale, hides = _skip_casts(softmax.args[0], forward=False), None, 1.0, False
    if op_name(scores) == "add":
        a, b = scores.args
        if not (isinstance(a, Node) and isinstance(b, Node)):
            return None  # a constant added to the scores (a mask is a tensor)
        scores, mask = (a, b) if op_name(a) in ("mul", "div", "matmul") else (b, a)
    elif op_name(scores) == "masked_fill":  # nanoGPT's scores.masked_fill(hidden, float("-inf"))
        scores, mask, value = (arg(scores, i, name) for i, name in enumerate(("self", "mask", "value")))
        if not (isinstance(mask, Node) and isinstance(value, (int, float)) and value < -1e4):
            return None
        hides = True
    while op_name(scores) in ("mul", "div"):
        a, b = scores.args
        factor = _scalar(b) if isinstance(a, Node) else _scalar(a)
        if factor is None:
            return None
        scale = scale * factor if op_name(scores) == "mul" else scale / factor
        scores = a if isinstance(a, Node) else b
    if op_name(scores) != "matmul":
        return None
    q, kt = scores.args[:2]
    return Attention(pv, "eager", q, kt, pv.args[1], mask, False, scale, 0.0, mask_hides=hides)


def find_attention(graph: Graph) -> list[Attention]:
    found = []
    for node in graph.nodes:
        name = op_name(node)
        if name == "sdpa":
            found.append(Attention(
                node, "sdpa", node.args[0], node.args[1], node.args[2], arg(node, 3, "attn_mask"),
                bool(arg(node, 5, "is_causal", False)), arg(node, 6, "scale"), float(arg(node, 4, "dropout_p", 0.0)),
                bool(arg(node, 7, "enable_gqa", False)),
            ))  # fmt: skip
        elif name == "softmax":
            eager = _eager(node)
            if eager is not None:
                found.append(eager)
    return found


# ----------------------------------------------------------------------------------------------------
# Checking
# ----------------------------------------------------------------------------------------------------
def evaluate(
    node: Node, env: dict, read_at: Node, skip_casts: bool = False, known_writes: frozenset[Node] = frozenset()
):
    """``graph.evaluate``, with any failure reported as the reason to leave the site alone."""
    try:
        return _evaluate(node, env, skip_casts, known_writes=known_writes, read_at=read_at)
    except Exception as e:  # noqa: BLE001 (a probe that cannot run proves nothing: never rewrite on it)
        raise Unsupported(f"could not evaluate {node.name} on probes ({type(e).__name__}: {e})") from None


def _dims(node: Node, what: str, rank: int) -> list:
    value = example(node)
    if not isinstance(value, torch.Tensor) or value.dim() != rank:
        raise Unsupported(f"{what} is not a {rank}-D tensor")
    return list(value.shape)


def _static(size, what: str) -> int:
    if isinstance(size, torch.SymInt):
        raise Unsupported(f"{what} has a dynamic size ({size}); the cache buffer must have a static shape")
    return int(size)


def _same(a, b) -> bool:
    return statically_known_true(a == b) if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt) else a == b


def _buffer(operand: Node, what: str, writes: dict[Node, list[CacheWrite]]) -> Node:
    source = source_of(operand)
    if source.op == "placeholder":
        return source
    if op_name(source) in ("zeros", "empty", "zeros_like", "empty_like", "full"):
        raise Unsupported(f"{what} reads a cache created inside the compiled graph ({source.name}); create the "
                          "cache before compiling (e.g. run the prefill once, or initialize it early)")  # fmt: skip
    computed_from = [n.name for n in ancestors(operand) if n in writes]
    if computed_from:  # e.g. MLA: K and V are projections of a cached latent
        raise Unsupported(f"{what} is computed from the cache buffer(s) {computed_from}, not a view of one")
    raise Unsupported(f"{what} does not read a cache buffer that is a graph input (it comes from {source.name})"
                      + _ring_hint(operand))  # fmt: skip


RING_HINT = ("; a sliding-window ring buffer (transformers' StaticSlidingWindowLayer)? Build the cache with "
             "kvarn_compile.integrations.static_cache.static_cache(model, max_cache_len, batch_size) (chunked "
             "attention, as in Llama4, shares the ring class and is not served either way)")  # fmt: skip


def _ring_hint(node: Node) -> str:
    """``RING_HINT`` for the writes of transformers' sliding-window layers: ``node`` (an attention operand
    or a buffer) comes from a ``cat`` or ``roll`` of a graph input, or a whole graph-input buffer is
    overwritten (``buffer.copy_(...)``) with what the operand is made of or of a ``cat`` / ``roll``."""
    refills = [u for u in node.graph.nodes if op_name(u) == "copy_" and len(u.args) > 1
               and isinstance(u.args[0], Node) and u.args[0].op == "placeholder" and isinstance(u.args[1], Node)]  # fmt: skip
    if node.op == "placeholder":
        sources = [n for u in refills if u.args[0] is node for n in ancestors(u.args[1])]
    else:
        sources = ancestors(node)
        if any(source_of(node) in ancestors(u.args[1]) for u in refills):
            return RING_HINT
    ring = any(op_name(n) in ("cat", "roll") and any(a.op == "placeholder" for a in map(source_of, n.all_input_nodes))
               for n in sources)  # fmt: skip
    return RING_HINT if ring else ""


def _check_view(buffer: Node, operand: Node, group: int, transposed: bool, what: str, write: CacheWrite,
                read_at: Node, prefix: int = 0) -> None:  # fmt: skip
    """operand must be buffer (its first ``prefix`` slots when > 0) with each KV head repeated ``group``
    times (and transposed for eager K)."""
    if view_path(buffer, operand) is None:
        raise Unsupported(f"{what} is not a view of its cache buffer")
    shape = [_static(s, f"{what} cache") for s in example(buffer).shape]
    probe = torch.arange(torch.Size(shape).numel(), dtype=torch.int64).view(shape)
    got = evaluate(operand, {buffer: probe}, read_at, skip_casts=True, known_writes=frozenset({write.node}))
    want = (probe[:, :, :prefix] if prefix else probe).repeat_interleave(group, 1)
    if transposed:
        want = want.transpose(-1, -2)
    if tuple(got.shape) != tuple(want.shape) or not torch.equal(got, want):
        raise Unsupported(f"{what} is not the whole cache buffer with KV head h // {group} per query head h "
                          "(a slice, or another head layout)")  # fmt: skip


def _write_of(buffer: Node, writes: dict[Node, list[CacheWrite]], attention: Attention, what: str) -> CacheWrite:
    found = writes.get(buffer, [])
    if len(found) != 1:
        raise Unsupported(f"{what} buffer {buffer.name} is written {len(found)} times in the graph (need exactly 1)"
                          + _ring_hint(buffer))  # fmt: skip
    write = found[0]
    if write.node.users:
        raise Unsupported(f"the result of the write into {buffer.name} is used")
    order = {n: i for i, n in enumerate(attention.output.graph.nodes)}
    if order[write.node] > order[attention.output]:
        raise Unsupported(f"{what} buffer {buffer.name} is written after the attention reads it")
    return write


# Inputs a probe sets (by kind): "counter" a scalar integer tensor (or an int start of the write positions), the
# start position p; "positions" a
# [T] integer tensor, p + arange(T) (gpt-fast's input_pos); "position buffer" a 1-D integer buffer the graph
# advances in place, p + arange(len) (torchtune's cache_pos); "constant" a module buffer the graph does not
# write (its value, given by the backend as node.meta["kvarn_constant"]: gpt-fast's causal-mask table); "padding" a
# [rows, tokens] integer (not bool) padding mask (transformers' 2-D attention_mask), all ones; "mask" a
# [rows, 1 or heads, T, S], [rows, T, S] or [T, S] bool/float mask made outside the graph (transformers' generate,
# torchtune's), causal at p (with the window declared for the buffer, if any: ``WINDOW_META``); "size" the symbolic length
# of either mask, p + T. The rewrite checks at run time that padding masks are all ones and given masks causal (with that
# window), so what the probes assume is what runs.
RUNTIME_CHECKED = ("padding", "mask")
# node.meta key of a cache-buffer placeholder: the sliding window its layer has (the backend sets it for buffers
# declared with ``backend.declare_window``): a mask made outside the graph cannot show it to the probes
WINDOW_META = "kvarn_window"
# node.meta key of a cache-buffer placeholder whose tensor has no memory (``backend.memoryless``: released, or made
# so): the rewrite drops the graph's writes into it. Other buffers keep them: they are the graph's side effects, and
# what runs outside the compiled graphs (an eager prefill of a later turn, beam search's reorder) reads them
NO_MEMORY_META = "kvarn_no_memory"


def _probe_inputs(nodes: list[Node], what: str, tokens, masks_ok: bool = False) -> dict[Node, str]:
    """The inputs among ``nodes`` a probe sets, by kind (above); any other tensor input means the value
    depends on more than the position (Unsupported)."""
    inputs = {}
    for n in nodes:
        value = example(n)
        if n.op == "placeholder" and isinstance(value, torch.SymInt):
            # the start of a slice write is the position; other sizes are kept below if they are the length
            # of a mask, else evaluated at their traced value
            inputs[n] = "counter" if n.meta.get("kvarn_position") else "size"
            continue
        if n.op != "placeholder" or not isinstance(value, torch.Tensor):
            continue
        integer = not value.is_floating_point() and not value.is_complex()
        if isinstance(n.meta.get("kvarn_constant"), torch.Tensor) and not written_in_graph(n):
            inputs[n] = "constant"
        elif value.numel() == 1 and integer and value.dtype != torch.bool:
            inputs[n] = "counter"
        elif value.dim() == 1 and integer and value.dtype != torch.bool and _same(value.shape[0], tokens):
            inputs[n] = "positions"
        elif value.dim() == 1 and integer and value.dtype != torch.bool and written_in_graph(n):
            inputs[n] = "position buffer"
        elif masks_ok and value.dim() == 2 and integer and value.dtype != torch.bool:  # [B, S] (transformers')
            inputs[n] = "padding"
        elif masks_ok and value.dim() in (2, 3, 4) and (value.dtype == torch.bool or value.is_floating_point()):
            inputs[n] = "mask"
        else:
            raise Unsupported(f"{what} depends on the input {n.name} {tuple(value.shape)}, not only on the position")
    lengths = [example(n).shape[-1] for n, kind in inputs.items() if kind in RUNTIME_CHECKED]
    return {n: kind for n, kind in inputs.items() if kind != "size" or any(_same(example(n), s) for s in lengths)}


def written_in_graph(node: Node) -> bool:
    """Whether the graph writes ``node`` (a placeholder) in place: state it advances itself (transformers'
    ``cumulative_length``, torchtune's ``cache_pos``), which changes outside it only when something moves it."""
    return any(_writes(u, node) for u in node.users)


# in-place ops that write without reading what they overwrite
OVERWRITES = frozenset({"setitem", "index_copy_", "copy_", "scatter_", "index_put_", "fill_", "zero_"})


def read_in_graph(node: Node) -> bool:
    """Whether the graph reads the values of ``node`` (a placeholder): anything but overwrites into it or into
    views of it whose results nothing uses."""
    for user in node.users:
        name = op_name(user)
        if name in ALIASING or (name in OVERWRITES and user.args[0] is node):
            if read_in_graph(user):
                return True
            continue
        return True
    return False


def _writes(user: Node, node: Node) -> bool:
    return bool(user.args) and user.args[0] is node and in_place(user)


def _length(n: Node, p: int, tokens: int) -> int:
    """The length a mask input has at start position p: its static length, or p + T if symbolic."""
    length = example(n).shape[-1]
    return p + tokens if isinstance(length, torch.SymInt) else int(length)


def _probe_env(inputs: dict[Node, str], p: int, tokens: int = 0, mask_window: int = 0) -> dict[Node, torch.Tensor]:
    env = {}
    for n, kind in inputs.items():
        value = example(n)
        if kind == "size":
            env[n] = p + tokens
        elif kind == "counter":
            env[n] = p if isinstance(value, torch.SymInt) else torch.full(value.shape, p, dtype=value.dtype)
        elif kind == "positions":
            env[n] = torch.arange(p, p + tokens, dtype=value.dtype)
        elif kind == "position buffer":
            env[n] = torch.arange(p, p + int(hint(value.shape[0])), dtype=value.dtype)
        elif kind == "constant":
            env[n] = n.meta["kvarn_constant"].cpu()
        elif kind == "padding":
            env[n] = torch.ones(int(hint(value.shape[0])), p + tokens, dtype=value.dtype)
        else:
            lead = [int(hint(s)) for s in value.shape[:-1]]  # [rows, (heads,) T]
            k_pos, q_pos = torch.arange(_length(n, p, tokens))[None, :], p + torch.arange(lead[-1])[:, None]
            visible = (k_pos <= q_pos) & (k_pos > q_pos - mask_window) if mask_window else k_pos <= q_pos
            if value.is_floating_point():
                visible = torch.zeros(visible.shape, dtype=value.dtype).masked_fill(
                    ~visible, torch.finfo(value.dtype).min
                )
            env[n] = visible.expand(*lead[:-1], *visible.shape).contiguous()
    return env


def _consistent(inputs: dict[Node, str], p: int, tokens: int) -> bool:
    """Whether the graph can be called at start position p: a padding mask of static length S (a graph
    specialized to it) only comes with p + T = S, a given mask must cover p + T tokens."""
    for n, kind in inputs.items():
        if kind == "padding" and _length(n, p, tokens) != p + tokens:
            return False
        if kind == "mask" and _length(n, p, tokens) < p + tokens:
            return False
    return True


def _positions_are_contiguous(write: CacheWrite, size, probes: list[int], what: str) -> tuple[bool, list[int]]:
    """The write covers [p, p + T) (``size``: T, possibly symbolic) at every probe p, or, when its positions
    are constants (a graph specialized to one start), at that start. Returns whether that rests on a
    positions input (which the rewrite must then check at run time) and the start positions it holds at."""
    tokens = int(hint(size))
    for n in ancestors(write.positions):  # an int start (arange(start, start + T)) is the position, as a slice's
        if n.op == "placeholder" and isinstance(example(n), torch.SymInt) and not _same(example(n), size):
            n.meta["kvarn_position"] = True
    inputs = _probe_inputs(ancestors(write.positions), f"the {what} write position", size)
    if not inputs:  # constant positions: the graph only runs at one start
        probes = [int(evaluate(write.positions, {}, write.node).reshape(-1)[0])]
    for p in probes:
        got = evaluate(write.positions, _probe_env(inputs, p, tokens), write.node)
        if not torch.equal(got.cpu().long().flatten(), torch.arange(p, p + tokens)):
            raise Unsupported(f"the {what} write does not cover positions [p, p + T) (probe p={p}: "
                              f"{got.flatten()[:8].tolist()}...)")  # fmt: skip
        if write.index is not None:  # scatter_: every row, head and channel writes the same positions
            index = evaluate(write.index, _probe_env(inputs, p, tokens), write.node).cpu().long()
            want = torch.arange(p, p + tokens).view(1, 1, -1, 1)
            shape = tuple(int(hint(d)) for d in example(write.src).shape)
            if tuple(index.shape) != shape or not torch.equal(index, want.expand(shape)):
                raise Unsupported(f"the {what} scatter_ index is not the positions [p, p + T) broadcast over "
                                  f"batch, heads and channels (probe p={p})")  # fmt: skip
    return bool({"positions", "position buffer"} & set(inputs.values())), probes


def _allowed(mask: torch.Tensor) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return mask
    allowed = mask == 0
    if not bool(((mask == 0) | (mask < -1e4)).all()):
        raise Unsupported("the attention mask carries values (a bias), not only 0 / -inf")
    return allowed


def _window(attention: Attention, size, length: int, probes: list[int], positions: set[Node], mask_window: int = 0
            ) -> tuple[int, dict[str, Node]]:  # fmt: skip
    """The sliding window the mask implements (0: plain causal) and the mask inputs it was built from
    that the rewrite must check at run time ({kind: node}), or Unsupported. ``size``: T, possibly symbolic;
    ``positions``: the inputs the write positions are made from (a mask made from other positions given to
    the graph is probed at the same p, which nothing checks at run time); ``mask_window``: the window a mask given as an
    input is probed (and later checked) with."""
    tokens = int(hint(size))
    if attention.mask is None:
        if attention.is_causal and tokens == length:
            return 0, {}
        raise Unsupported("no mask over a cache buffer: the attention would read unwritten slots (is_causal "
                          f"{attention.is_causal} aligns queries to the buffer's start)")  # fmt: skip
    if attention.is_causal:
        raise Unsupported("both a mask and is_causal=True")
    inputs = _probe_inputs(ancestors(attention.mask), "the attention mask", size, masks_ok=True)
    others = [n.name for n, kind in inputs.items()  # (a counter the graph advances is state, as the cache's own)
              if kind in ("positions", "counter") and n not in positions and not written_in_graph(n)]  # fmt: skip
    if others:
        raise Unsupported(f"the attention mask is made from {others}, other position inputs than the cache writes': "
                          "nothing would check at run time that they agree")  # fmt: skip
    for n, kind in inputs.items():  # a mask input of static length S: also probe where it ends, p = S - T
        if kind in RUNTIME_CHECKED and not isinstance(example(n).shape[-1], torch.SymInt):
            probes = sorted({*probes, int(example(n).shape[-1]) - tokens} & set(range(length - tokens + 1)))
    probes = [p for p in probes if _consistent(inputs, p, tokens)]
    if not probes:
        raise Unsupported("the mask input's length does not fit the positions the cache can hold")
    rows = []
    for p in probes:
        env = _probe_env(inputs, p, tokens, mask_window)
        allowed = _allowed(evaluate(attention.mask, env, attention.output)).cpu()
        allowed = ~allowed if attention.mask_hides else allowed
        allowed = allowed.expand(*allowed.shape[:-2], tokens, length)
        flat = allowed.reshape(-1, tokens, length)
        if not bool((flat == flat[:1]).all()):
            raise Unsupported("the attention mask differs between rows or heads (padding?)")
        rows.append((p, flat[0]))
    q_pos = torch.arange(tokens)[:, None]
    kv = torch.arange(length)[None, :]
    end, last = max(rows, key=lambda r: r[0])
    first_seen = int(last[-1].int().argmax()) if bool(last[-1].any()) else 0
    window = end + tokens - first_seen if first_seen > 0 else 0
    for p, allowed in rows:
        want = kv <= p + q_pos
        if window:
            want &= kv > p + q_pos - window
        if not torch.equal(allowed, want):
            chunk = _chunk(rows, first_seen)
            if chunk:
                raise Unsupported(f"chunked attention (each query sees its chunk of {chunk} tokens, as in Llama4's "
                                  "chunked layers): KVarN serves causal and sliding-window attention")  # fmt: skip
            shape = f"causal with a window of {window}" if window else "causal"
            raise Unsupported(f"the attention mask is not {shape} at the write positions (probe p={p})")
    checked = {kind: [n for n, k in inputs.items() if k == kind] for kind in RUNTIME_CHECKED}
    if any(len(nodes) > 1 for nodes in checked.values()):
        raise Unsupported(f"the attention mask is built from several mask inputs {checked}")
    return window, {kind: nodes[0] for kind, nodes in checked.items() if nodes}


def _chunk(rows: list[tuple[int, torch.Tensor]], first_seen: int) -> int:
    """The chunk size C of a mask that lets query q see keys [C * (q // C), q] at every probe (``rows``: (start p,
    visible [T, L]) each), else 0. ``first_seen``: the first key the last probe's last query sees, a multiple of C."""
    for c in (first_seen // k for k in range(1, first_seen + 1) if first_seen % k == 0):
        for p, allowed in rows:
            q = p + torch.arange(allowed.shape[0])[:, None]
            kv = torch.arange(allowed.shape[1])[None, :]
            if not torch.equal(allowed, (kv <= q) & (kv >= q // c * c)):
                break
        else:
            return c
    return 0


def _check_new(writes: tuple[CacheWrite, ...], names: tuple[str, ...], dims: tuple[int, ...], rows, heads: int,
               tokens) -> None:  # fmt: skip
    """Each write's new values are [rows, heads, T, its head dim]."""
    for write, what, d in zip(writes, names, dims):
        src = _dims(write.src, f"the new {what}", 4)
        if not (_same(src[0], rows) and src[1] == heads and _same(src[2], tokens) and src[3] == d):
            raise Unsupported(f"the new {what} {src} is not [{rows}, {heads}, T={tokens}, {d}]")


def _positions_and_mask(attention: Attention, writes: tuple[CacheWrite, CacheWrite], names: tuple[str, str], tokens,
                        length: int, preset: Preset, from_start: bool = False) -> tuple[int, dict[str, Node], int]:  # fmt: skip
    """Both writes cover [p, p + T) and the mask is causal (or windowed) there, for start positions p around
    tile boundaries and the cache's end: (window, runtime checks) as ``_window`` returns them, plus the
    write positions when they are an input, and the window a given mask is checked with (the buffers'
    declared window, ``WINDOW_META``). ``from_start``: the attention reads the buffers' first T slots (an
    empty cache's prefill): only p = 0 is probed, and the mask is is_causal over those T."""
    t, g = int(hint(tokens)), preset.tile_size
    # length - t - 1 beside the last start: a window found at the cache's end then also has to move with the
    # query, which tells it from chunked attention (Llama4's chunks: the first key seen stays at the chunk's start)
    starts = (0, 1, g - 1, g + 3, length - t - 1, length - t)
    probes = [0] if from_start else sorted({p for p in starts if 0 <= p <= length - t})
    given = False
    for write, what in zip(writes, names):
        given_here, probes = _positions_are_contiguous(write, tokens, probes, what)
        given = given or given_here
    declared = {w.buffer.meta.get(WINDOW_META, 0) for w in writes}
    if len(declared) > 1:
        raise Unsupported(f"the {names[0]} and {names[1]} buffers were declared with different windows {declared}")
    mask_window = declared.pop()
    if from_start and probes != [0]:
        raise Unsupported(f"the attention reads the first T cache slots (an empty cache's prefill), but the write "
                          f"is at position {probes[0]}")  # fmt: skip
    positions = {n for w in writes for n in ancestors(w.positions) if n.op == "placeholder"}
    window, runtime_checks = _window(attention, tokens, t if from_start else length, probes, positions, mask_window)
    if given:
        runtime_checks["positions"] = writes[0].positions
    return window, runtime_checks, mask_window if "mask" in runtime_checks else 0


def check(attention: Attention, writes: dict[Node, list[CacheWrite]], preset: Preset) -> Site:
    """A ``Site`` if the kvarn ops compute exactly this attention (up to quantization), else Unsupported."""
    if attention.dropout:
        raise Unsupported(f"dropout {attention.dropout} (inference only)")
    try:
        kb, vb = _buffer(attention.k, "K", writes), _buffer(attention.v, "V", writes)
    except Unsupported as e:
        if "computed from" not in str(e):
            raise
        return _check_latent(attention, writes, preset)
    b, hkv, length, dk = (_static(s, "K cache") for s in _dims(kb, "the K cache", 4))
    b2, hkv2, length2, dv = (_static(s, "V cache") for s in _dims(vb, "the V cache", 4))
    if (b, hkv, length) != (b2, hkv2, length2):
        raise Unsupported(f"K and V caches differ in shape: {(b, hkv, length)} vs {(b2, hkv2, length2)}")
    qb, hq, tokens, qd = _dims(attention.q, "q", 4)
    if hint(tokens) is None:  # (OPT's decode graph: its positions come from the mask's cumsum)
        raise Unsupported(f"the number of new tokens ({tokens}) is a size the graph computes from tensor values (an "
                          "unbacked SymInt): there is no example value to probe the cache writes and the mask with")  # fmt: skip
    if not (_same(qb, b) and _same(qd, dk)) or hint(hq) % hkv:
        layout = (" (a cache of [B, L, H, D], tokens before heads, as in Meta's Llama reference code: the pass reads "
                  "caches of [B, H, L, D])" if hint(hq) % length == 0 and hkv > length else "")  # fmt: skip
        raise Unsupported(f"q [{qb}, {hq}, T, {qd}] does not fit the K cache [{b}, {hkv}, {length}, {dk}]{layout}")
    hq = int(hint(hq))
    group = 1 if attention.enable_gqa else hq // hkv
    k_write, v_write = _write_of(kb, writes, attention, "K"), _write_of(vb, writes, attention, "V")
    # transformers' SDPA prefill into an empty static cache reads only the first T slots, with is_causal
    read = example(attention.v).shape[-2]
    from_start = attention.mask is None and attention.is_causal and not _same(read, length) and _same(read, tokens)
    prefix = int(hint(tokens)) if from_start else 0
    _check_view(kb, attention.k, group, attention.kind == "eager", "K", k_write, attention.output, prefix)
    _check_view(vb, attention.v, group, False, "V", v_write, attention.output, prefix)
    _check_new((k_write, v_write), ("K", "V"), (dk, dv), b, hkv, tokens)
    window, runtime_checks, mask_window = _positions_and_mask(attention, (k_write, v_write), ("K", "V"), tokens,
                                                              length, preset, from_start)  # fmt: skip
    try:
        preset.layout(dk, dv)
    except ValueError as e:
        raise Unsupported(str(e)) from None
    scale = dk**-0.5 if attention.scale is None else float(attention.scale)
    shape = {"B": b, "Hq": hq, "Hkv": hkv, "L": length, "Dk": dk, "Dv": dv}
    if from_start:
        runtime_checks.setdefault("positions", k_write.positions)  # checked to start at 0
    reads = _constants_read(attention, (k_write, v_write))
    return Site(attention, k_write, v_write, scale, window, shape, runtime_checks, mask_window=mask_window,
                from_start=from_start, reads=reads)  # fmt: skip


def _constants_read(attention: Attention, writes: tuple[CacheWrite, CacheWrite], more: list[Node] = ()
                    ) -> tuple[Node, ...]:  # fmt: skip
    """The module constants whose values the probes of a site read: those its write positions, its mask and
    ``more`` (MLA's K and V) are computed from, less the buffers the graph writes (the cache buffers, a position
    counter: probed by kind, never read by value, and changed by every call)."""
    nodes = [*ancestors(writes[0].positions), *ancestors(writes[1].positions), *more]
    if isinstance(attention.mask, Node):
        nodes += ancestors(attention.mask)
    written = {w.buffer for w in writes}
    return tuple(dict.fromkeys(
        n for n in nodes
        if n.op == "placeholder" and isinstance(n.meta.get("kvarn_constant"), torch.Tensor) and n not in written
        and not written_in_graph(n)
    ))  # fmt: skip


def _probe_constants(nodes: list[Node], probes: dict[Node, torch.Tensor], what: str) -> dict[Node, torch.Tensor]:
    """Probe values for the inputs ``nodes`` depend on: ``probes``, module constants, SymInt hints."""
    env = dict(probes)
    for n in nodes:
        if n.op != "placeholder" or n in env or isinstance(example(n), torch.SymInt):
            continue
        if not isinstance(n.meta.get("kvarn_constant"), torch.Tensor):
            raise Unsupported(f"{what} depends on the input {n.name}, not only on the cache and the weights")
        if n.meta["kvarn_constant"].is_meta:
            raise Unsupported(f"reading {what} needs the model's weights, and {n.name} has none (a model on the meta "
                              "device, as `inspect` builds it); the compiled model with weights rewrites it")  # fmt: skip
        env[n] = n.meta["kvarn_constant"].detach().cpu()
    return env


MAX_PROBE_ELEMENTS = 2**27  # K and V values evaluated on the CPU to read MLA's maps (0.5 GB of fp32)


def _check_latent(attention: Attention, writes: dict[Node, list[CacheWrite]], preset: Preset) -> Site:
    """MLA (``Latent``): K from two cached buffers, the latent c [B, 1, L, R] and the rope key r [B, 1, L, Dr],
    V from c alone, both per-token linear maps, read off the graph by evaluating K and V on basis probes
    (token i < R holds c = e_i, token R + j holds r = e_j) and checked on random probes."""
    all_writes = frozenset(w.node for ws in writes.values() for w in ws)
    try:
        k_deps = dependencies(attention.k, attention.output, all_writes)
        v_deps = dependencies(attention.v, attention.output, all_writes)
    except ValueError as e:
        raise Unsupported(f"K/V: {e}") from None
    k_bufs = [n for n in k_deps if n in writes]
    v_bufs = [n for n in v_deps if n in writes]
    if len(k_bufs) != 2 or len(v_bufs) != 1 or v_bufs[0] not in k_bufs:
        raise Unsupported("K and V are computed from cache buffers, but not as MLA (K from a latent and a rope "
                          "buffer, V from the latent): not rewritten")  # fmt: skip
    cb = v_bufs[0]
    rb = next(n for n in k_bufs if n is not cb)
    b, one, length, r = (_static(x, "latent cache") for x in _dims(cb, "the latent cache", 4))
    b2, one2, length2, dr = (_static(x, "rope cache") for x in _dims(rb, "the rope cache", 4))
    if (one, one2) != (1, 1) or (b, length) != (b2, length2) or length < r + dr:
        raise Unsupported(f"MLA caches [{b}, {one}, {length}, {r}] / [{b2}, {one2}, {length2}, {dr}]: need one head "
                          f"each, equal rows and length, and length >= {r + dr} to read the maps off")  # fmt: skip
    try:  # before any probe: a latent the format cannot hold is left alone cheaply
        preset.latent_layout(r, dr)
    except ValueError as e:
        raise Unsupported(f"MLA's latent cache (latent {r}, rope key {dr}): {e}") from None
    c_write, r_write = _write_of(cb, writes, attention, "latent"), _write_of(rb, writes, attention, "rope")
    _, hq, tokens, dk = _dims(attention.q, "q", 4)
    hq = int(hint(hq))
    dv = _dims(attention.v, "V", 4)[3]
    if b * hq * length * (int(hint(dk)) + int(hint(dv))) > MAX_PROBE_ELEMENTS:
        raise Unsupported(f"reading MLA's maps off the graph would evaluate K/V of {b} rows x {hq} heads x {length} "
                          "tokens; compile with a smaller batch or cache length")  # fmt: skip
    dtype = example(cb).dtype
    _check_new((c_write, r_write), ("latent", "rope key"), (r, dr), b, 1, tokens)
    known = frozenset({c_write.node, r_write.node})
    nodes = k_deps + v_deps

    def k_and_v(c: torch.Tensor, rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        env = _probe_constants(nodes, {cb: c.to(dtype), rb: rope.to(dtype)}, "MLA's K/V")
        k = evaluate(attention.k, env, attention.output, known_writes=known).float()
        v = evaluate(attention.v, env, attention.output, known_writes=known).float()
        return (k.transpose(-1, -2) if attention.kind == "eager" else k), v  # (eager attention reads K^T)

    basis_c, basis_r = torch.zeros(b, 1, length, r), torch.zeros(b, 1, length, dr)
    basis_c[:, 0, torch.arange(r), torch.arange(r)] = 1
    basis_r[:, 0, r + torch.arange(dr), torch.arange(dr)] = 1
    k, v = k_and_v(basis_c, basis_r)
    if tuple(k.shape[:3]) != (b, hq, length) or tuple(v.shape[:3]) != (b, hq, length):
        raise Unsupported(f"MLA's K {tuple(k.shape)} / V {tuple(v.shape)} are not [{b}, {hq}, {length}, D]")
    latent = Latent(k[0, :, :r], k[0, :, r : r + dr], v[0, :, :r])
    gen = torch.Generator().manual_seed(0)
    c, rope = torch.randn(b, 1, length, r, generator=gen), torch.randn(b, 1, length, dr, generator=gen)
    c, rope = c.to(dtype).float(), rope.to(dtype).float()
    k2, v2 = k_and_v(c, rope)
    want_k = torch.einsum("blr,hrd->bhld", c[:, 0], latent.a) + torch.einsum("bls,hsd->bhld", rope[:, 0], latent.b)
    want_v = torch.einsum("blr,hrd->bhld", c[:, 0], latent.v)
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    for got, want, what in ((k2, want_k, "K"), (v2, want_v, "V")):
        if not torch.allclose(got, want, rtol=tol, atol=tol * want.abs().max().item()):
            raise Unsupported(f"MLA's {what} is not a per-token linear map of the cached latent")
    window, runtime_checks, mask_window = _positions_and_mask(attention, (c_write, r_write), ("latent", "rope key"),
                                                              tokens, length, preset)  # fmt: skip
    if window:
        raise Unsupported(f"sliding-window MLA (window {window}): the latent cache serves full attention only")
    scale = int(hint(dk)) ** -0.5 if attention.scale is None else float(attention.scale)
    shape = {"B": b, "Hq": hq, "Hkv": 1, "L": length, "Dk": r + dr, "Dv": r}
    reads = _constants_read(attention, (c_write, r_write), nodes)
    return Site(attention, c_write, r_write, scale, window, shape, runtime_checks, latent, mask_window, reads=reads)
