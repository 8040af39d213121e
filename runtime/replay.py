"""The forward a call runs when eager's autograd records its backward.

Stage: `replay_forward(module, n_fwd, in_place) -> Callable[..., tuple]`, at assembly of an entry
whose plan has `eager_autograd` (Note [Eager autograd on the ATen path] in aotc/eagerautograd.py).
Requires: `module` is the entry's partitioned forward graph (fwd outputs, then saved values);
`in_place` is what `writable_in_place` answered for it (graph arg, fwd output) pairs.
Ensures: `fwd_only(module, n_fwd, in_place)` is that graph (an fx.Graph of `module`'s nodes)
returning only its first `n_fwd` outputs, with the nodes only saved values needed removed (never
a random op or a write), and with the ops that computed the new values of the `in_place` inputs
running as their in-place variants on those inputs (Note [Buffers written in place]);
`replay_forward` is its launched function (runtime/launch.py), run with grad on so that each ATen
call records its own autograd node.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from aotc.runtime.launch import make_callable

# Note [Buffers written in place]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A BatchNorm's running statistics and step counter are written by the traced program without
# autograd history; the functional forward graph computes their new values
# (`_native_batch_norm_legit_functional`'s last two results, `add(num_batches_tracked, 1)`) and
# the epilogue copies them into the buffers. When eager's autograd records the backward, the
# forward can do what eager does instead: run the op's in-place variant on the buffers
# themselves (`_native_batch_norm_legit`, `add_`), which saves three allocations and three
# copies per BatchNorm (54 us of the conv net's forward, whose eager time is ~850 us). The epilogue
# then only sets the buffers' versions to eager's, from their versions read before the call
# (an in-place op may bump one; `EpiloguePlan.versions` is eager's count either way).
# A write is done in place only where that gives the graph's values exactly:
# - the input is a plain placeholder written by a no_grad copy into itself (no view, no
#   non-contiguous or symbolic geometry), its new value has its dtype and shape, and that value
#   feeds nothing but its own output slot (nothing later reads the buffer through the graph);
# - every other reader of the input runs before the op and makes no alias of it, so each reads
#   the value from before the write, as in the graph;
# - the op is an ATen `X_functional` whose `X` (same overload) returns its first results with
#   no alias and writes exactly the arguments the later results are new values of, all of them
#   written in place together, or a pointwise op with an in-place variant whose first argument
#   is the input and whose other arguments are constants.
# `writable_in_place` decides once per compile; the pairs are kept in the plan
# (`RuntimePlan.writes_in_place`), and `fwd_only` applies them in the same order, so the eager-
# autograd check (aotc/eagerautograd.py) runs the very graph the calls run.


def fwd_only(
    module: fx.GraphModule, n_fwd: int, in_place: Sequence[tuple[int, int]] = ()
) -> fx.Graph:
    graph = fx.Graph(owning_module=module)
    env: dict[fx.Node, fx.Node] = {}
    for node in module.graph.nodes:
        if node.op == "output":
            outs = tuple(node.args[0])[:n_fwd]
            graph.output(tuple(env[o] if isinstance(o, fx.Node) else o for o in outs))
            break
        env[node] = graph.node_copy(node, lambda n: env[n])
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and not node.users and not _keeps(node.target):
            graph.erase_node(node)
    if in_place:
        done = _write_in_place(graph, in_place)
        if done != tuple(in_place):
            raise RuntimeError(f"writes in place {in_place} do not apply to this graph: {done}")
    return graph


def writable_in_place(
    module: fx.GraphModule, n_fwd: int, writes: Sequence[tuple[int, int]]
) -> tuple[tuple[tuple[int, int], ...], fx.Graph]:
    """Of `writes` ((graph arg, fwd output of its new value): no_grad copies into the inputs
    themselves), those the replayed forward can do in place (Note [Buffers written in place]),
    and `fwd_only(module, n_fwd, those)`."""
    graph = fwd_only(module, n_fwd)
    return (_write_in_place(graph, writes) if writes else ()), graph


def _write_in_place(
    graph: fx.Graph, writes: Sequence[tuple[int, int]]
) -> tuple[tuple[int, int], ...]:
    """Rewrites `graph` for each write it can do in place; returns those, in `writes`' order."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    output = graph.output_node()
    outs = list(output.args[0])  # type: ignore[arg-type]
    order = {n: k for k, n in enumerate(graph.nodes)}
    new_value: dict[fx.Node, fx.Node] = {}  # input placeholder -> the node of its new value
    for target, out in writes:
        if target >= len(placeholders) or out >= len(outs):
            continue
        x, value = placeholders[target], outs[out]
        if x in new_value or not isinstance(value, fx.Node) or not _plain_write(x, value, outs):
            continue
        new_value[x] = value
    done: set[fx.Node] = set()
    for x, value in list(new_value.items()):
        if x in done:
            continue
        if value.target is operator.getitem:
            done |= _functional_in_place(graph, value.args[0], new_value, order)  # type: ignore[arg-type]
        elif _pointwise_in_place(graph, x, value, order):
            done.add(x)
    return tuple(
        (t, o)
        for t, o in writes
        if t < len(placeholders)
        and o < len(outs)
        and placeholders[t] in done
        and new_value[placeholders[t]] is outs[o]
    )


def _plain_write(x: fx.Node, value: fx.Node, outs: list[object]) -> bool:
    xv, vv = x.meta.get("val"), value.meta.get("val")
    if not isinstance(xv, torch.Tensor) or not isinstance(vv, torch.Tensor):
        return False
    if symbolic_geometry(xv) or symbolic_geometry(vv) or not xv.is_contiguous():
        return False
    if xv.dtype != vv.dtype or xv.shape != vv.shape or xv.device != vv.device:
        return False
    return (
        x not in outs
        and outs.count(value) == 1
        and list(value.users) == [value.graph.output_node()]
    )


def _readers_before(x: fx.Node, op: fx.Node, order: dict[fx.Node, int]) -> bool:
    """Every reader of `x` but `op` runs before `op` and makes no alias of `x`."""
    for user in x.users:
        if user is op:
            continue
        if order.get(user, len(order)) >= order[op] or not isinstance(
            user.target, torch._ops.OpOverload
        ):
            return False
        schema = user.target._schema
        if any(a.alias_info is not None for a in (*schema.arguments, *schema.returns)):
            return False
    return True


def _functional_in_place(
    graph: fx.Graph, node: fx.Node, new_value: dict[fx.Node, fx.Node], order: dict[fx.Node, int]
) -> set[fx.Node]:
    """Runs `node`, an `X_functional` op, as `X` when every argument `X` writes is an input whose
    new value is `node`'s matching result; the inputs so written (empty: nothing changed)."""
    mutable = _mutable_variant(node.target)
    if mutable is None or node.kwargs:
        return set()
    schema = mutable._schema
    n_ret = len(schema.returns)
    written = [k for k, a in enumerate(schema.arguments) if a.alias_info is not None]
    if len(node.args) < max(written, default=0) + 1:
        return set()
    inputs = [node.args[k] for k in written]
    results: dict[int, fx.Node] = {}
    for user in node.users:
        if user.target is not operator.getitem:
            return set()
        if user.args[1] in results:
            return set()
        results[user.args[1]] = user  # type: ignore[index]
    for j, x in enumerate(inputs):
        if not isinstance(x, fx.Node) or x not in new_value:
            return set()
        if new_value[x] is not results.get(n_ret + j):
            return set()
        if sum(a is x for a in node.args) != 1 or not _readers_before(x, node, order):
            return set()
    with graph.inserting_before(node):
        new = graph.call_function(mutable, node.args)
    val = node.meta.get("val")
    new.meta = {**node.meta}
    if isinstance(val, (tuple, list)):
        new.meta["val"] = tuple(val[:n_ret])
    for k, user in results.items():
        if k < n_ret:
            user.replace_input_with(node, new)
        else:
            user.replace_all_uses_with(inputs[k - n_ret])  # type: ignore[arg-type]
            graph.erase_node(user)
    graph.erase_node(node)
    return set(inputs)  # type: ignore[arg-type]


def _mutable_variant(target: object) -> torch._ops.OpOverload | None:
    """`X` of an ATen `X_functional` overload: its arguments the same but for the writes, its
    returns the functional op's first ones with no alias, then one per written argument."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    name = target._schema.name
    if not name.endswith("_functional"):
        return None
    mutable = _aten_overload(name.removesuffix("_functional"), target._overloadname)
    if mutable is None:
        return None
    fun, mut = target._schema, mutable._schema
    if len(fun.arguments) != len(mut.arguments):
        return None
    if any(
        a.name != b.name or str(a.type) != str(b.type) for a, b in zip(fun.arguments, mut.arguments)
    ):
        return None
    if any(a.alias_info is not None and not a.alias_info.is_write for a in mut.arguments):
        return None
    n_written = sum(a.alias_info is not None for a in mut.arguments)
    if any(r.alias_info is not None for r in mut.returns):
        return None
    if n_written == 0 or len(fun.returns) != len(mut.returns) + n_written:
        return None
    return mutable


def _pointwise_in_place(
    graph: fx.Graph, x: fx.Node, value: fx.Node, order: dict[fx.Node, int]
) -> bool:
    """Runs `value`, a pointwise op of `x` and constants, as its in-place variant on `x`."""
    op = value.target
    if not isinstance(op, torch._ops.OpOverload) or torch.Tag.pointwise not in op.tags:
        return False
    if not value.args or value.args[0] is not x:
        return False
    if any(isinstance(a, fx.Node) for a in (*value.args[1:], *value.kwargs.values())):
        return False
    inplace = _aten_overload(op._schema.name + "_", op._overloadname)
    if inplace is None:
        return False
    fun, inp = op._schema, inplace._schema
    if len(fun.arguments) != len(inp.arguments) or not inp.arguments:
        return False
    first = inp.arguments[0].alias_info
    if first is None or not first.is_write:
        return False
    if any(a.alias_info is not None for a in inp.arguments[1:]):
        return False
    if not _readers_before(x, value, order):
        return False
    with graph.inserting_before(value):
        new = graph.call_function(inplace, value.args, value.kwargs)
    new.meta = {**value.meta}
    value.replace_all_uses_with(x)
    graph.erase_node(value)
    return True


def _aten_overload(name: str, overload: str) -> torch._ops.OpOverload | None:
    """The ATen overload `overload` of the op named `name` ("aten::x"), if there is one."""
    if not name.startswith("aten::"):
        return None
    packet = getattr(torch.ops.aten, name.removeprefix("aten::"), None)
    op = getattr(packet, overload, None)
    return op if isinstance(op, torch._ops.OpOverload) else None


def symbolic_geometry(t: torch.Tensor) -> bool:
    """Whether `t`'s sizes, strides or offset are symbolic."""
    return any(isinstance(s, torch.SymInt) for s in (*t.shape, *t.stride(), t.storage_offset()))


def _keeps(target: object) -> bool:
    """Ops a call runs though nothing reads their results: random ops (they advance the
    generator as eager's do), writes, and anything that is not an ATen op or `getitem`.
    (fx's own dead-code pass is not used: inside a Dynamo compile it drops unused random ops.)"""
    if target is operator.getitem:
        return False
    if not isinstance(target, torch._ops.OpOverload):
        return True
    return bool(target._schema.is_mutable or getattr(target, "_nondeterministic_seeded", False))


def replay_forward(
    module: fx.GraphModule, n_fwd: int, in_place: Sequence[tuple[int, int]] = ()
) -> tuple[Callable[..., Any], bool]:
    """The launched function of `fwd_only(module, n_fwd, in_place)`, and whether that is
    `module`'s own graph (it keeps every node and writes nothing in place: the common case where
    the partition saves what eager's autograd saves), so that the function also serves as the
    compiled pair's forward; the call reads only the first `n_fwd` of its outputs."""
    graph = fwd_only(module, n_fwd, in_place)
    if not in_place and len(graph.nodes) == len(module.graph.nodes):
        return make_callable(module), True
    return make_callable(module, graph), False
