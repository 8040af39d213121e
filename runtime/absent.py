"""Absent gradients: the backward graph of a call where some outputs received no gradient.

Stage: `absent_backward(graph, num_tangents, absent) -> fx.GraphModule | None`, once per
absence pattern per entry (at run time, cached by the caller).
Requires: `graph` is an entry's backward graph: its last `num_tangents` placeholders are the
tangents of the differentiable outputs, in order; `absent` holds the positions among them whose
gradient is None in this backward.
Ensures: a graph with the same placeholders and outputs that computes what eager's backward
computes when those outputs get no gradient: no value that only those tangents feed is
computed; an output only they feed is None. None when the graph cannot be pruned (a size it
would need to make zeros is symbolic): the caller then runs the full graph on zero tangents.

Note [Absent gradients]
~~~~~~~~~~~~~~~~~~~~~~~
Eager's engine runs only the autograd nodes a gradient reaches. A compiled entry has one node,
whose backward graph computes every input's gradient from every output's tangent; when an
output gets no gradient (the loss uses only some outputs), filling its tangent with zeros is not
the same: the branch still runs, and a zero times an infinite local derivative is NaN
(`x.sqrt()` at 0 returned beside `x * 2`, and only the second used: eager's x.grad is 2, zeros
gave NaN; also AOTAutograd's). So an entry with several differentiable outputs asks autograd for
unmaterialized gradients, and a backward that gets a None runs this pruned graph: a value that
depends on tangents only through absent ones is *absent* (not computed); an `add`/`sub` of an
absent and a present value is the present one (the engine sums the contributions eager computes,
and the absent one does not exist); any other op that mixes them gets zeros for the absent inputs,
which is what eager's multi-output nodes do for their outputs without a gradient (`unbind`,
`split`); an absent graph output is None. The backward graph is linear in the tangents, so an
absent value is exactly the part of the sum eager never computes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

aten = torch.ops.aten

_SUMS = {aten.add.Tensor, aten.sub.Tensor}


class _Unprunable(Exception):
    """A size or value the pruned graph would need is not known statically."""


def absent_backward(
    graph: fx.GraphModule, num_tangents: int, absent: frozenset[int]
) -> fx.GraphModule | None:
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    tangents = placeholders[len(placeholders) - num_tangents :]
    gone: set[fx.Node] = {t for k, t in enumerate(tangents) if k in absent}
    fed: set[fx.Node] = set(tangents)  # values that depend on some tangent
    present = [t for t in tangents if t not in gone]
    if not present:
        return None
    try:
        for node in graph.graph.nodes:
            if node.op == "placeholder":
                env[node] = g.node_copy(node)
                continue
            if node.op == "output":
                results = [
                    None if a in gone else env[a] if isinstance(a, fx.Node) else a
                    for a in node.args[0]
                ]
                g.output(tuple(results))
                continue
            inputs = [a for a in node.all_input_nodes if a in fed]
            if not inputs:
                env[node] = g.node_copy(node, env.__getitem__)
                continue
            fed.add(node)
            missing = {a for a in inputs if a in gone}
            if len(missing) == len(inputs):
                gone.add(node)  # fed only by absent tangents: eager never computes it
            elif missing:
                env[node] = _mixed(g, node, missing, env, env[present[0]])
            else:
                env[node] = g.node_copy(node, env.__getitem__)
    except _Unprunable:
        return None
    g.eliminate_dead_code()
    return fx.GraphModule(graph, g)


def _mixed(
    g: fx.Graph,
    node: fx.Node,
    missing: set[fx.Node],
    env: dict[fx.Node, fx.Node],
    ref: fx.Node,
) -> fx.Node:
    """A node that some absent and some present values feed. `ref`: a present tangent, whose
    device zeros are made on (node values may be meta tensors)."""
    if node.target in _SUMS and len(node.args) == 2 and node.kwargs.get("alpha", 1) == 1:
        a, b = node.args
        if a in missing and isinstance(b, fx.Node):  # 0 + b, 0 - b
            if node.target is aten.add.Tensor:
                return _like(g, env[b], node, ref)
            return _like(g, g.call_function(aten.neg.default, (env[b],)), node, ref, env[b])
        if b in missing and isinstance(a, fx.Node):  # a + 0, a - 0
            return _like(g, env[a], node, ref)
    zeros = {a: _zeros(g, a.meta.get("val"), ref) for a in missing}
    return g.node_copy(node, lambda a: zeros[a] if a in zeros else env[a])


def _like(
    g: fx.Graph, value: fx.Node, node: fx.Node, ref: fx.Node, source: fx.Node | None = None
) -> fx.Node:
    """`value` in place of `node`: as is when it has `node`'s shape and dtype, else added to
    zeros of them (what broadcasting and promotion in `node` would have made of it)."""
    want = node.meta.get("val")
    have = (source if source is not None else value).meta.get("val")
    if not isinstance(want, torch.Tensor) or not isinstance(have, torch.Tensor):
        raise _Unprunable
    if (tuple(want.shape), want.dtype) == (tuple(have.shape), have.dtype):
        return value
    return g.call_function(aten.add.Tensor, (_zeros(g, want, ref), value))


def _zeros(g: fx.Graph, val: Any, ref: fx.Node) -> fx.Node:
    if not isinstance(val, torch.Tensor) or not all(type(s) is int for s in val.shape):
        raise _Unprunable
    return g.call_function(aten.new_zeros.default, (ref, list(val.shape)), {"dtype": val.dtype})


__all__ = ["absent_backward"]
