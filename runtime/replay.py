"""The forward a call runs when eager's autograd records its backward.

Stage: `replay_forward(module, n_fwd) -> Callable[..., tuple]`, at assembly of an entry whose plan
has `eager_autograd` (Note [Eager autograd on the ATen path] in aotc/eagerautograd.py).
Requires: `module` is the entry's partitioned forward graph (fwd outputs, then saved values).
Ensures: `fwd_only(module, n_fwd)` is that graph (an fx.Graph of `module`'s nodes) returning
only its first `n_fwd` outputs, with the nodes only saved values needed removed (never a random
op or a write); `replay_forward` is its launched function (runtime/launch.py), run with grad on
so that each ATen call records its own autograd node.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from aotc.runtime.launch import make_callable


def fwd_only(module: fx.GraphModule, n_fwd: int) -> fx.Graph:
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
    return graph


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
    module: fx.GraphModule, n_fwd: int, launched: Callable[..., Any] | None = None
) -> Callable[..., Any]:
    """`launched`: `module`'s own launched function, returned as it is when the pruned graph
    keeps every node (the saved values are all forward values the outputs need: the common
    case where the partition saves what eager's autograd saves), so that no second function
    is generated; the call reads only the first `n_fwd` of its outputs."""
    graph = fwd_only(module, n_fwd)
    if launched is not None and len(graph.nodes) == len(module.graph.nodes):
        return launched
    return make_callable(module, graph)
