"""What the passes need to read a Dynamo FX graph: one name per operation whatever its spelling, the
example value of a node, and a small evaluator that runs a node's ancestors on probe inputs.

Dynamo graphs are torch-level: the same operation arrives as ``torch.matmul``, ``operator.matmul`` or
``Tensor.matmul`` (a ``call_method`` node). ``op_name`` maps them all to one name so the passes match
names, not spellings.

Why evaluate instead of matching structure: a model can spell "keys of head h // group" or "query at
position p + t may see key j <= p + t" in many ways (repeat_kv, expand + reshape, repeat_interleave; masks
from aranges, comparisons, where, additive -inf). Running the subgraph that produces a mask, a position
index or a view of the cache on probe inputs and comparing it with the semantics the kvarn ops implement
checks all spellings at once, and anything that is not exactly that is rejected with a reason.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx import Graph, Node

# call_function targets -> one name per operation (call_method nodes are named by their method name)
_FUNCTION_NAMES: dict[Callable, str] = {
    F.scaled_dot_product_attention: "sdpa",
    torch.matmul: "matmul", operator.matmul: "matmul", torch.bmm: "matmul",
    F.softmax: "softmax", torch.softmax: "softmax",
    F.dropout: "dropout",
    operator.getitem: "getitem", operator.setitem: "setitem",
    operator.mul: "mul", torch.mul: "mul", operator.truediv: "div", torch.div: "div",
    operator.add: "add", torch.add: "add",
    torch.transpose: "transpose", torch.reshape: "reshape", torch.repeat_interleave: "repeat_interleave",
    torch.unsqueeze: "unsqueeze",
}  # fmt: skip
_METHOD_ALIASES = {"__getitem__": "getitem", "__setitem__": "setitem", "__matmul__": "matmul", "__mul__": "mul",
                   "__truediv__": "div", "__add__": "add", "bmm": "matmul"}  # fmt: skip

# Operations that only move or copy elements (or change dtype): the path from a cache buffer to the
# attention's K/V operand may consist of these only.
# (what a chain of them computes is then checked by evaluating it on probes: the names only bound the search)
VIEW_OPS = frozenset({"getitem", "expand", "expand_as", "reshape", "view", "view_as", "contiguous", "transpose",
                      "permute", "unsqueeze", "squeeze", "flatten", "unflatten", "repeat_interleave", "clone", "to",
                      "float", "half", "bfloat16", "type_as"})  # fmt: skip
# dtype casts, skipped when probing index maps (the probes use int64/float64 values)
CASTS = frozenset({"to", "float", "half", "bfloat16", "type_as"})


def op_name(node: Node) -> str | None:
    """One name per operation for call_function / call_method nodes (None for other nodes)."""
    if node.op == "call_method":
        return _METHOD_ALIASES.get(node.target, node.target)
    if node.op == "call_function":
        if node.target in _FUNCTION_NAMES:
            return _FUNCTION_NAMES[node.target]
        return getattr(node.target, "__name__", None)  # torch.zeros, Tensor.index_copy_ called as a function
    return None


def example(node) -> object:
    """The example value Dynamo recorded for a node (a FakeTensor, SymInt, ...), or the constant itself."""
    if isinstance(node, Node):
        return node.meta.get("example_value", node.meta.get("val"))
    return node


def arg(node: Node, index: int, name: str, default=None):
    """Argument ``index`` / keyword ``name`` of a call node."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


# Queries of a tensor's shape: their value is a (symbolic) size, known from the trace without the tensor.
SHAPE_QUERIES = frozenset({"size", "sym_size", "dim", "numel", "sym_numel"})


def shape_query(node: Node) -> bool:
    """A node that reads only the shape of its input (``k.size(2)``, ``k.shape`` as Dynamo records it)."""
    return op_name(node) in SHAPE_QUERIES and not isinstance(example(node), torch.Tensor)


# ``x.expand_as(other)`` and the like read only the shape of ``other``: x's op with other's traced shape
LIKE_SHAPE_OF = {"expand_as": "expand", "view_as": "view", "reshape_as": "reshape"}


def _inputs(node: Node) -> list[Node]:
    """The nodes ``node``'s value depends on (not what it reads the shape of only)."""
    if op_name(node) in LIKE_SHAPE_OF and isinstance(node.args[0], Node):
        return [node.args[0]]
    return [] if shape_query(node) else node.all_input_nodes


def ancestors(node: Node) -> list[Node]:
    """Every node ``node`` depends on (itself included), in graph order. Shape queries are leaves: what
    depends on ``x.size(d)`` does not depend on x's values (probes take sizes at their traced values)."""
    seen: dict[Node, None] = {}
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen[n] = None
        stack.extend(_inputs(n))
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def hint(value) -> object:
    """A concrete value for a SymInt (its hint), or the value itself."""
    if isinstance(value, torch.SymInt):
        return value.node.hint
    return value


def evaluate(node: Node, env: dict[Node, object], skip_casts: bool = False, known_writes: frozenset[Node] = frozenset(),
             read_at: Node | None = None):  # fmt: skip
    """Run ``node``'s ancestors with the given values for some of them (placeholders at least).

    Values are computed on the CPU (devices in arguments become the CPU). Placeholders not in ``env``
    raise KeyError; SymInt placeholders not in ``env`` evaluate to their hints. Writes into evaluated
    values (``x.add_``, ``x[i] = y``, also through views of x) between their making and their last read
    (for the value returned: up to ``read_at``, default ``node``) are evaluated too, with what they need,
    in program order; a write that would change a placeholder raises ValueError. So a probe changes
    nothing and misses nothing that changes what it computes. ``known_writes``: writes the caller
    accounts for itself (the cache writes a rewrite replaces). ``skip_casts`` treats dtype casts as
    identities (for probing index maps with exact int64 values).
    """
    with unset_fake_temporarily():
        return _evaluate(node, dict(env), skip_casts, known_writes, node if read_at is None else read_at)


def _evaluate(node: Node, values: dict, skip_casts: bool, known_writes: frozenset[Node], read_at: Node) -> object:
    for n in dependencies(node, read_at, known_writes):
        if n in values:
            continue
        if n.op == "placeholder":
            ex = example(n)
            if isinstance(ex, torch.SymInt):
                values[n] = hint(ex)
                continue
            raise KeyError(n.name)
        if n.op == "get_attr":
            values[n] = operator.attrgetter(n.target)(n.graph.owning_module)
            continue
        if shape_query(n):  # the traced size (its input is not evaluated: see ``ancestors``)
            ex = example(n)
            values[n] = tuple(hint(s) for s in ex) if isinstance(ex, (tuple, torch.Size)) else hint(ex)
            continue
        name = op_name(n)
        if name in LIKE_SHAPE_OF and n.args[0] in values:  # (``_inputs``)
            shape = [hint(d) for d in example(n.args[1]).shape]
            values[n] = getattr(values[n.args[0]], LIKE_SHAPE_OF[name])(shape)
            continue
        args = _on_cpu(torch.fx.node.map_arg(n.args, values.__getitem__))
        kwargs = _on_cpu(torch.fx.node.map_arg(n.kwargs, values.__getitem__))
        if skip_casts and name in CASTS:
            values[n] = args[0]
        elif n.op == "call_method":
            values[n] = getattr(args[0], n.target)(*args[1:], **kwargs)
        else:
            values[n] = n.target(*args, **kwargs)
    return values[node]


# Python's augmented assignments (``x += y`` on a tensor), as Dynamo records them: in place
AUGMENTED = frozenset({"iadd", "isub", "imul", "imatmul", "itruediv", "ifloordiv", "imod", "ipow", "ilshift",
                       "irshift", "iand", "ixor", "ior"})  # fmt: skip


def in_place(node: Node) -> bool:
    """Whether ``node`` writes into its first argument."""
    name = op_name(node) or ""
    return name == "setitem" or name in AUGMENTED or (name.endswith("_") and not name.endswith("__"))


# Operations whose result may share memory with their first argument: writing into it writes into that.
ALIASING = frozenset({"getitem", "view", "reshape", "transpose", "expand", "unsqueeze", "squeeze", "permute",
                      "narrow", "select", "as_strided", "t", "contiguous", "flatten", "unflatten", "view_as", "expand_as",
                      "split", "chunk", "unbind", "diagonal", "movedim", "swapaxes", "detach"})  # fmt: skip


def dependencies(node: Node, read_at: Node | None = None, known_writes: frozenset[Node] = frozenset()) -> list[Node]:
    """What ``node``'s value depends on, in graph order: its ancestors, plus the writes into their memory
    before they are read (``evaluate``), with their own dependencies."""
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    inside = set(ancestors(node))
    while (writer := _missed_write(node, inside, order, known_writes, read_at or node)) is not None:
        inside.update(ancestors(writer))  # e.g. k[..., :d].copy_(x): evaluated too, in program order
    return sorted(inside, key=order.__getitem__)


def _missed_write(node: Node, inside: set, order: dict, known_writes: frozenset, read_at: Node) -> Node | None:
    """A write into the memory of a node in ``inside`` that is not in ``inside`` and happens between that
    node's making and its last read (for ``node``'s value, or what it views: up to ``read_at``); None if
    there is none. A write that would change a placeholder raises ValueError."""
    aliases_target = _alias_sources(node, inside)
    last_reads = {}
    for n in sorted(inside, key=order.__getitem__, reverse=True):  # views first: a base is read where they are
        reads = [order[u] for u in n.users if u in inside]
        views = [last_reads[u] for u in n.users if u in last_reads and op_name(u) in ALIASING and u.args[0] is n]
        last_reads[n] = max([*reads, *views, order[read_at] if n in aliases_target else -1])
    for n in sorted(inside, key=order.__getitem__):
        last_read = last_reads[n]
        writer = _hidden_write(n, order[n], last_read, inside, order, known_writes, n.op == "placeholder")
        if writer is not None and (writer in inside or n.op == "placeholder"):
            raise ValueError(f"{n.name} (an input) would be changed in place by {writer.name}")
        if writer is not None:
            return writer
    return None


def _alias_sources(node: Node, inside: set) -> set:
    """``node`` and the nodes it is a view of (through ALIASING ops among ``inside``)."""
    sources = {node}
    while op_name(node) in ALIASING and node.args and isinstance(node.args[0], Node) and node.args[0] in inside:
        node = node.args[0]
        sources.add(node)
    return sources


def _hidden_write(n: Node, born: int, last_read: int, inside: set, order: dict, known_writes: frozenset,
                  protect: bool):  # fmt: skip
    """A node that writes into ``n``'s memory (directly or through views of it) after it is made and before
    its last read, and that evaluating the ancestors would miss; or one that would change a placeholder's
    value (``protect``). None if there is none."""
    for user in n.users:
        if user in known_writes or not user.args or user.args[0] is not n:
            continue
        if in_place(user) and ((protect and user in inside) or (user not in inside and born < order[user] < last_read)):
            return user
        if op_name(user) in ALIASING:
            found = _hidden_write(user, born, last_read, inside, order, known_writes, protect and user in inside)
            if found is not None:
                return found
    return None


def _on_cpu(tree):
    """Probes run on the CPU whatever device the graph was traced for (a meta or CUDA model)."""
    return torch.utils._pytree.tree_map(lambda x: torch.device("cpu") if isinstance(x, torch.device) else x, tree)


def view_path(start: Node, end: Node) -> list[Node] | None:
    """The chain of view-like nodes from ``start`` (excluded) to ``end`` (included), following the first
    argument of each node; None if ``end`` is not reached that way through VIEW_OPS only."""
    chain = []
    node = end
    while node is not start:
        if not isinstance(node, Node) or op_name(node) not in VIEW_OPS or not node.args:
            return None
        chain.append(node)
        node = node.args[0]
    return chain[::-1]


def source_of(node: Node) -> Node:
    """Follow view-like nodes back (through their first argument) to the node they read from."""
    while isinstance(node, Node) and op_name(node) in VIEW_OPS and node.args and isinstance(node.args[0], Node):
        node = node.args[0]
    return node


def insert_placeholder(graph: Graph, name: str) -> Node:
    """A new placeholder after the last one (the compiled function then takes one more argument)."""
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    with graph.inserting_after(last):
        return graph.placeholder(name)
