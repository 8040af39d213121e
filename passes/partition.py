"""Partition: split a joint graph into a forward and a backward graph.

Stage: `partition(joint) -> PartitionResult`.
Requires: `joint` outputs are `FwdOutput`s then `GradOutput`s; inputs are `PrimalInput`s then
`TangentInput`s; the graph is functional (lint_graph passes).
Ensures: forward(primals) -> fwd outputs + saved values; backward(saved values, tangents) ->
the non-None gradients; every backward input is a saved value or a tangent.

The plan here is "save what the backward reads": every node a forward output needs runs in the
forward; a node only the gradients need runs in the backward; values crossing the boundary are
saved. Random and side-effecting ops always run in the forward, so each runs exactly once.

Note [Saving mutated inputs]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The epilogue copies new values into mutated inputs after the forward ran. autograd checks the
version counter of every saved tensor at backward time, so saving such an input (or a view of it)
directly would fail there ("modified by an inplace operation") and, without the check, would read
the new value instead of the old one. Eager saves the pre-mutation value in that case; so do we,
by saving a clone taken inside the forward graph.

Worked example (f(x) = sin(x), x requires grad):

    joint:    sin = aten.sin(x); cos = aten.cos(x); mul = aten.mul(tangent, cos)
              outputs (fwd_out0=sin, grad x=mul)
    forward:  sin = aten.sin(x)                       -> (sin, x)     # x saved
    backward: cos = aten.cos(x); mul = aten.mul(tangent, cos) -> (mul,)
"""

from __future__ import annotations

import operator
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.fx as fx

from passes.descriptors import (
    FwdOutput,
    GradOutput,
    PrimalInput,
    SavedInput,
    SavedOutput,
    TangentInput,
)
from passes.ir import JointGraph, StageGraph, node_nbytes
from runtime.schema import GraphArg


@dataclass(frozen=True, slots=True)
class SavedValue:
    name: str
    nbytes: int
    shape: tuple[int, ...] | None
    dtype: torch.dtype | None
    producer: str  # the op that produced it, or "input"
    source: str  # the user source line, when known


@dataclass(frozen=True, slots=True)
class PartitionResult:
    forward: StageGraph
    backward: StageGraph
    saved: tuple[SavedValue, ...]  # len == num saved; order = forward outputs after fwd outs
    recomputed: tuple[str, ...]  # nodes run in both graphs (none for this plan)
    seconds: float

    @property
    def saved_bytes(self) -> int:
        return sum(s.nbytes for s in self.saved)

    def format(self) -> str:
        lines = ["# stage: partition", f"# saved: {len(self.saved)} values, {self.saved_bytes} bytes"]
        for s in self.saved:
            dtype = str(s.dtype).removeprefix("torch.") if s.dtype is not None else "-"
            shape = list(s.shape) if s.shape is not None else "-"
            where = f"  # {s.source}" if s.source else ""
            lines.append(f"saved {s.name}: {dtype}{shape} {s.nbytes} B from {s.producer}{where}")
        lines.append(f"# recomputed: {', '.join(self.recomputed) or 'none'}")
        return "\n".join(lines)


def is_random(node: fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and (
        torch.Tag.nondeterministic_seeded in target.tags
    )


def _ancestors(roots: Iterable[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [r for r in roots if isinstance(r, fx.Node)]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return seen


def partition(joint: JointGraph, mutated_args: frozenset[GraphArg] = frozenset()) -> PartitionResult:
    """`mutated_args`: primals the epilogue mutates in place after the forward; a saved value
    that is one of them, or a view of one, is saved as a clone (see Note [Saving mutated inputs])."""
    start = time.perf_counter()
    graph = joint.module.graph
    placeholders = joint.placeholders()
    values = joint.output_values()
    fwd_values = [v for v, d in zip(values, joint.outputs) if isinstance(d, FwdOutput)]
    grad_pairs = [
        (v, d) for v, d in zip(values, joint.outputs) if isinstance(d, GradOutput) and v is not None
    ]
    primals = [n for n, d in zip(placeholders, joint.inputs) if isinstance(d, PrimalInput)]
    tangents = [n for n, d in zip(placeholders, joint.inputs) if isinstance(d, TangentInput)]

    random_nodes = [n for n in graph.nodes if is_random(n)]
    fwd_nodes = _ancestors([*fwd_values, *random_nodes]) | set(primals)
    bwd_nodes = _ancestors(v for v, _ in grad_pairs) - fwd_nodes
    # A getitem of a multi-output forward op is free and keeps saved values tensors.
    for node in graph.nodes:
        if node in bwd_nodes and node.target is operator.getitem and node.args[0] in fwd_nodes:
            bwd_nodes.discard(node)
            fwd_nodes.add(node)

    saved_nodes: list[fx.Node] = []
    saved_set: set[fx.Node] = set()
    order = {n: i for i, n in enumerate(graph.nodes)}
    needed = [inp for n in bwd_nodes for inp in n.all_input_nodes if inp in fwd_nodes]
    needed += [v for v, _ in grad_pairs if v in fwd_nodes]
    for node in sorted(set(needed), key=order.__getitem__):
        saved_set.add(node)
        saved_nodes.append(node)

    fwd_graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        if node in fwd_nodes:
            env[node] = fwd_graph.node_copy(node, env.__getitem__)
    mutated_nodes = {
        n for n, d in zip(placeholders, joint.inputs)
        if isinstance(d, PrimalInput) and d.arg in mutated_args
    }
    saved_out = []
    for node in saved_nodes:
        value = env[node]
        if _aliases(node, mutated_nodes):
            value = fwd_graph.call_function(torch.ops.aten.clone.default, (value,))
            value.meta = dict(node.meta)
        saved_out.append(value)
    fwd_graph.output(tuple(_lookup(env, v) for v in fwd_values) + tuple(saved_out))
    saved_names = tuple(n.name for n in saved_nodes)
    forward = StageGraph(
        module=fx.GraphModule(joint.module, fwd_graph),
        inputs=tuple(d for d in joint.inputs if isinstance(d, PrimalInput)),
        outputs=tuple(d for d in joint.outputs if isinstance(d, FwdOutput))
        + tuple(SavedOutput(name) for name in saved_names),
    )

    bwd_graph = fx.Graph()
    benv: dict[fx.Node, fx.Node] = {}
    for node in saved_nodes:
        benv[node] = bwd_graph.placeholder(node.name)
        benv[node].meta = dict(node.meta)
    for node in tangents:
        benv[node] = bwd_graph.node_copy(node, benv.__getitem__)
    for node in graph.nodes:
        if node in bwd_nodes and node.op != "placeholder":
            benv[node] = bwd_graph.node_copy(node, benv.__getitem__)
    bwd_graph.output(tuple(benv[v] for v, _ in grad_pairs))
    backward = StageGraph(
        module=fx.GraphModule(joint.module, bwd_graph),
        inputs=tuple(SavedInput(name) for name in saved_names)
        + tuple(d for d in joint.inputs if isinstance(d, TangentInput)),
        outputs=tuple(d for _, d in grad_pairs),
    )
    saved = tuple(_saved_value(n) for n in saved_nodes)
    return PartitionResult(forward, backward, saved, (), time.perf_counter() - start)


def _aliases(node: fx.Node, roots: set[fx.Node]) -> bool:
    """Whether `node` is one of `roots` or a chain of view ops over one."""
    while True:
        if node in roots:
            return True
        target = node.target
        if not (isinstance(target, torch._ops.OpOverload) and target.is_view and node.args):
            return False
        first = node.args[0]
        if not isinstance(first, fx.Node):
            return False
        node = first


def _lookup(env: dict[fx.Node, fx.Node], value: object) -> object:
    return env[value] if isinstance(value, fx.Node) else value


def _saved_value(node: fx.Node) -> SavedValue:
    val = node.meta.get("val")
    is_tensor = isinstance(val, torch.Tensor)
    trace = node.meta.get("stack_trace") or ""
    source = trace.strip().splitlines()[-1].strip() if trace.strip() else ""
    return SavedValue(
        name=node.name,
        nbytes=node_nbytes(node),
        shape=tuple(val.shape) if is_tensor else None,
        dtype=val.dtype if is_tensor else None,
        producer="input" if node.op == "placeholder" else str(node.target),
        source=source,
    )
