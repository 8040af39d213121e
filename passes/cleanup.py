"""Cleanup passes run on the joint graph before partitioning. Each is a pure stage:
`pass(graph: StageGraph) -> StageGraph` on a copy; placeholders and outputs keep their roles.

- `eliminate_dead_code`: drop nodes nothing reads (never random ops: they advance the RNG).
- `eliminate_common_subexpressions`: one node per (op, args) among deterministic ops.
- `remove_noop_views`: views and copies that return their input unchanged in shape and layout
  (`view(x, x.shape)`, `expand(x, x.shape)`, `alias(x)`, `_to_copy(x)` with x's dtype) read
  their input instead; so does the last view of a chain of views that ends where it started
  (`t(t(w))`, `view(view(x, s), x.shape)`, `permute(permute(x, p), inverse(p))`), which reads
  the chain's start (see Note [View chains that come back]).

Worked example (CSE then no-op removal then DCE):

    before: a = sin(x); b = sin(x); c = view(a, [3]); d = add(b, c)     # x: float[3]
    after:  a = sin(x); d = add(a, a)
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from aotc.passes.ir import StageGraph, make_module
from aotc.passes.recompute import is_random

aten = torch.ops.aten

_IDENTITY_VIEWS = {
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.expand.default,
}
_IDENTITY_COPIES = {aten.alias.default, aten.clone.default}

# Note [View chains that come back]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Autograd formulas compose views: a Linear's weight gradient is `t(mm(t(g), x))` and then
# TBackward's `t` of that, and its input gradient reads `t(t(w))`. Each link is one ATen call
# (~4 us of dispatch on CPU) and, on the ATen executor, the backward runs every one of them,
# where eager's C++ autograd nodes pay less per call. A view at the end of a chain of
# view-only ops (`_CHAIN_VIEWS`: no data movement when they are views, and the same values
# when `reshape` copies) whose size, stride, storage offset and dtype equal those of the
# chain's start is that start: the same elements of the same storage (graphs here are
# functional, so nothing mutates it in between). Readers of the end read the start instead
# and dead-code elimination drops the links nothing else reads. Graph outputs are left alone,
# as for every no-op here: whether an output is a view of another value is user-visible
# aliasing, which the runtime regenerates from the graph.
_CHAIN_VIEWS = {
    aten.t.default,
    aten.transpose.int,
    aten.permute.default,
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.expand.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.unsqueeze.default,
    aten.alias.default,
}
_MAX_CHAIN = 8


def _copy(graph: StageGraph) -> fx.Graph:
    new_graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in graph.module.graph.nodes:
        env[node] = new_graph.node_copy(node, env.__getitem__)
    return new_graph


def _wrap(graph: StageGraph, fx_graph: fx.Graph) -> StageGraph:
    return StageGraph(make_module(graph.module, fx_graph), graph.inputs, graph.outputs)


def eliminate_dead_code(graph: StageGraph) -> StageGraph:
    g = _copy(graph)
    _dce(g)
    return _wrap(graph, g)


def _dce(g: fx.Graph) -> None:
    for node in reversed(list(g.nodes)):
        if node.op in ("placeholder", "output") or node.users or is_random(node):
            continue
        g.erase_node(node)


def _key(value: object) -> object:
    if isinstance(value, fx.Node):
        return ("node", id(value))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_key(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, _key(v)) for k, v in value.items())))
    if isinstance(value, float) and value != value:
        return ("nan",)
    return (type(value).__name__, value)


def eliminate_common_subexpressions(graph: StageGraph) -> StageGraph:
    g = _copy(graph)
    _cse(g)
    return _wrap(graph, g)


def _cse(g: fx.Graph) -> None:
    # Two graph outputs that eager returns as distinct tensors must stay distinct objects
    # (a caller may mutate one): an output is never merged into another output. Nor is a value
    # whose memory an output returns (through views) merged into another such value that is not
    # a view: `v.reshape(-1)` twice of a non-contiguous v is two copies in eager, each returned
    # as a view; merged, the two outputs would share memory (fuzz seed 14974).
    outputs = set(next(n for n in reversed(g.nodes) if n.op == "output").all_input_nodes)
    returned = _returned_storage(outputs)
    seen: dict[object, fx.Node] = {}
    for node in list(g.nodes):
        if node.op != "call_function" or is_random(node):
            continue
        target = node.target
        if isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable:
            continue
        key = (target, _key(node.args), _key(node.kwargs))
        first = seen.get(key)
        if first is None:
            seen[key] = node
        elif node in outputs and first in outputs:
            continue
        elif node in returned and first in returned and not _is_view(node):
            continue
        else:
            if node in outputs:
                outputs.add(first)
            if node in returned:
                returned.add(first)
            node.replace_all_uses_with(first)
            g.erase_node(node)


def _is_view(node: fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and bool(target.is_view)


def _is_noop(node: fx.Node) -> bool:
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    src, out = node.args[0].meta.get("val"), node.meta.get("val")
    if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor):
        return False
    same = (
        _known_equal(src.shape, out.shape)
        and _known_equal(src.stride(), out.stride())
        and src.dtype == out.dtype
        and _known_equal((src.storage_offset(),), (out.storage_offset(),))
    )
    if node.target in _IDENTITY_VIEWS:
        return same
    if node.target in _IDENTITY_COPIES or node.target == aten._to_copy.default:
        # A copy of a value nothing mutates is the value (graphs here are functional).
        return same and src.device == out.device and not node.kwargs.get("memory_format")
    return False


def _known_equal(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    """Equal sizes/strides, deciding symbolic ones without adding a guard to the ShapeEnv (a
    comparison that is not known statically counts as different)."""
    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))


# Ops whose result shares its input's memory although their schema does not say so:
# `reshape` of a non-contiguous tensor traces as `clone` + `_unsafe_view`.
_UNMARKED_VIEWS = frozenset({aten._unsafe_view.default})


def _returned_storage(outputs: set[fx.Node]) -> set[fx.Node]:
    """The outputs and every value an output is a view of (through view ops, and `getitem` of
    a multi-output view op such as `split`): their memory is returned. `v = x.clone(); return
    v.detach()` returns the clone's memory, not x's; so does `v.split(1)[0].detach()` (fuzz
    seed 18388)."""
    found = set(outputs)
    stack = list(outputs)
    while stack:
        node = stack.pop()
        if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        target, source = node.target, node.args[0]
        if target is operator.getitem:
            view = _is_view(source) or source.target in _UNMARKED_VIEWS
        else:
            view = isinstance(target, torch._ops.OpOverload) and (
                target.is_view or target in _UNMARKED_VIEWS
            )
        if view and source not in found:
            found.add(source)
            stack.append(source)
    return found


def remove_noop_views(graph: StageGraph) -> StageGraph:
    g = _copy(graph)
    _remove_noops(g)
    return _wrap(graph, g)


def _remove_noops(g: fx.Graph) -> None:
    outputs = set(next(n for n in reversed(g.nodes) if n.op == "output").all_input_nodes)
    returned = _returned_storage(outputs)
    for node in list(g.nodes):
        if node in outputs:
            continue
        if _is_noop(node):
            if node in returned and node.target not in _IDENTITY_VIEWS:
                continue  # a copy whose memory an output views: dropping it would alias the input
            node.replace_all_uses_with(node.args[0])
            g.erase_node(node)
        elif (start := _chain_start(node)) is not None:
            node.replace_all_uses_with(start)
            g.erase_node(node)  # a view: pure; links nothing else reads go in DCE


def _chain_start(node: fx.Node) -> fx.Node | None:
    """The start of the view chain ending at `node` when `node` has its exact geometry (see
    Note [View chains that come back]), else None."""
    if node.op != "call_function" or node.target not in _CHAIN_VIEWS or not node.users:
        return None
    out = node.meta.get("val")
    if not isinstance(out, torch.Tensor):
        return None
    src = node.args[0] if node.args else None
    for _ in range(_MAX_CHAIN):
        if not isinstance(src, fx.Node):
            return None
        val = src.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return None
        if (
            val.dtype == out.dtype
            and val.device == out.device
            and _known_equal(val.shape, out.shape)
            and _known_equal(val.stride(), out.stride())
            and _known_equal((val.storage_offset(),), (out.storage_offset(),))
        ):
            return src
        if src.op != "call_function" or src.target not in _CHAIN_VIEWS or not src.args:
            return None
        src = src.args[0]
    return None


def cleanup(graph: StageGraph) -> StageGraph:
    """All cleanup passes in order, on one copy of the graph."""
    g = _copy(graph)
    _cse(g)
    _remove_noops(g)
    _dce(g)
    return _wrap(graph, g)
