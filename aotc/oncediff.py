"""Backwards marked `@once_differentiable`: recorded in the joint trace, refused twice as in eager.

Not a stage: `marking(outputs)` around the traced backward and `mark_from_stack_traces(module)`
after the trace (aotc/tracer.py) set `node.meta[ONCE_KEY]` on the nodes such a backward computed;
`barrier(...)` is what the differentiable backward (aotc/higher_order.py `compose_backward`)
calls on each value such a backward returns; `anchor()` is its extra argument at run time.
Requires: nothing.
Ensures: a gradient of the differentiable backward never flows through a once-differentiable
backward, and a backward that reaches one raises eager's error (Note [Once-differentiable
backwards]).

Note [Once-differentiable backwards]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A custom Function whose backward is `@once_differentiable` runs that backward under no_grad; when
grad mode is on (`create_graph=True`) and one of its incoming gradients requires grad, eager
hands back detached copies of its results that require grad through an error node
(`DelayedError`): a later backward that reaches them raises "trying to differentiate twice a
function that was marked with @once_differentiable", and `autograd.grad` towards inputs they do
not lead to computes without them. The joint trace inlines the backward as ATen nodes, and the
differentiable backward (Note [Double backward] in aotc/higher_order.py) differentiated straight
through them: a silent second-order gradient.

So the nodes such a backward computes are marked while tracing: strict mode registers hooks on
the Function's autograd nodes, which mark the nodes traced while the backward runs; a Function
Dynamo captured runs its backward graph through an fx.Interpreter, whose nodes carry the stack
trace of once_differentiable's wrapper. The differentiable backward replaces each value the
marked nodes return by `barrier(value, anchor, *grads)`: the value detached (no gradient flows
through it, as through eager's detached copy), joined, when one of the backward's incoming
gradients (`grads`: its inputs that depend on a tangent) requires grad, to `anchor` by a
`where` that keeps the value bit for bit and gives `anchor` a zero gradient. The call passes as
`anchor` the output of `_Refuse`, whose backward raises eager's error when a gradient reaches it,
so a backward reaching the value raises, and one that does not (other outputs, or `autograd.grad`
towards inputs the anchor does not lead to) computes as eager's.

Not matched: a marked node that common-subexpression elimination merged into an equal unmarked
one; and the backward's incoming gradients are told from its saved tensors by whether they depend
on a tangent, which a saved value the partitioner recomputes from one would not.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx

from aotc.runtime.autograd import autograd_nodes
from aotc.runtime.schema import ONCE_DIFFERENTIABLE_KEY as ONCE_KEY  # node.meta[ONCE_KEY] = True

MESSAGE = "trying to differentiate twice a function that was marked with @once_differentiable"

_WRAPPER = torch.autograd.function.once_differentiable(lambda ctx: None).__code__
_WRAPPER_LINES = frozenset(line for _, _, line in _WRAPPER.co_lines() if line is not None)
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\w+)')


def is_once_differentiable(fn: object) -> bool:
    """Whether `fn` (a Function's `backward`) is wrapped by `once_differentiable`."""
    return getattr(fn, "__code__", None) is _WRAPPER


@contextlib.contextmanager
def marking(outputs: Sequence[torch.Tensor]) -> Iterator[None]:
    """Around `torch.autograd.grad(outputs, ...)` inside make_fx (strict mode's Functions)."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    mode = get_proxy_mode()
    graph = None if mode is None else mode.tracer.graph
    handles = []
    if graph is not None:
        for grad_fn in autograd_nodes(outputs):
            cls = getattr(grad_fn, "_forward_cls", None)
            if cls is not None and is_once_differentiable(getattr(cls, "backward", None)):
                entered: list[fx.Node] = []
                handles.append(grad_fn.register_prehook(_enter(graph, entered)))
                handles.append(grad_fn.register_hook(_leave(graph, entered)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _enter(graph: fx.Graph, entered: list[fx.Node]) -> Any:
    def enter(grad_outputs: Any) -> None:
        entered.append(graph._root.prev)  # the last node before the backward runs

    return enter


def _leave(graph: fx.Graph, entered: list[fx.Node]) -> Any:
    def leave(grad_inputs: Any, grad_outputs: Any) -> None:
        node = entered.pop().next
        while node.op != "root":
            node.meta[ONCE_KEY] = True
            node = node.next

    return leave


def mark_from_stack_traces(module: fx.GraphModule) -> None:
    """Mark the nodes of Functions Dynamo captured: their stack trace has a frame of
    once_differentiable's wrapper (Note [Once-differentiable backwards])."""
    for node in module.graph.nodes:
        trace = node.meta.get("stack_trace")
        if trace and in_once_differentiable(trace):
            node.meta[ONCE_KEY] = True


def in_once_differentiable(trace: str) -> bool:
    """Whether a node's stack trace runs inside once_differentiable's wrapper (the cache's graph
    key writes it: aotc/graphkey.py)."""
    return any(
        path == _WRAPPER.co_filename and name == _WRAPPER.co_name and int(line) in _WRAPPER_LINES
        for path, line, name in _FRAME.findall(trace)
    )


def barrier(value: torch.Tensor, anchor: torch.Tensor, *grads: object) -> torch.Tensor:
    """`value` as the differentiable backward uses it (Note [Once-differentiable backwards])."""
    detached = value.detach()
    if not any(isinstance(g, torch.Tensor) and g.requires_grad for g in grads):
        return detached
    keep = torch.ones((), dtype=torch.bool, device=anchor.device)
    return torch.where(keep, detached, anchor.to(value.dtype))


class _Refuse(torch.autograd.Function):
    """Identity on the anchor leaf; its backward raises eager's error when a gradient arrives."""

    @staticmethod
    def forward(ctx: Any, leaf: torch.Tensor) -> torch.Tensor:
        ctx.set_materialize_grads(False)
        return leaf.detach().clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> None:
        if grad is not None:
            raise RuntimeError(MESSAGE)


_LEAF = torch.zeros((), requires_grad=True)


def anchor() -> torch.Tensor:
    """A fresh anchor for one call of a differentiable backward with barriers."""
    with torch.enable_grad():
        return _Refuse.apply(_LEAF)
