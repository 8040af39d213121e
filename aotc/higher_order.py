"""The differentiable backward of a compiled entry: what `create_graph=True` runs.

Stage: `DifferentiableBackward(forward, backward, plan, names, options, name)(args, versions,
grads) -> gradients`, called by an entry's autograd node when its backward runs with grad mode
on (runtime/autograd.py, Note [Double backward]).
Requires: `forward(*graph_args)` returns the forward outputs then the saved values and
`backward(*saved, *tangents)` the gradients of `plan.grad_args` (the entry's partition);
`args` are the graph args the forward ran on, `versions` their `_version`s then.
Ensures: the gradients are computed by a compiled program of (graph args, tangents) that
recomputes the saved values from the graph args and then runs the backward graph, so autograd
records one node whose inputs are the graph args and the tangents; that node's own backward is
compiled the same way (lazily, on first need), so any order works. Refuses, with an error that
names the input or op, what it cannot compute as eager would.

Note [Double backward]
~~~~~~~~~~~~~~~~~~~~~~
Eager's double backward differentiates each op's backward formula, whose saved values are that
op's own inputs and outputs, so they are in the autograd graph. A compiled entry's saved values
are intermediates computed inside one autograd node: they have no history, so differentiating the
backward graph alone would miss every path through them (d(grad x)/dx through tanh(x @ w)). So
the differentiable backward takes the entry's graph args, the tensors the forward ran on, which
are in the user's autograd graph, and recomputes the saved values from them: the program is the
forward graph cut down to what the saved values need, followed by the backward graph. aotc
compiles that program like any other function of tensors (its own joint graph, partition and
autograd node), keyed by the signature of its inputs; its node is the one a third-order
gradient differentiates, and so on.

What it needs at backward time:
- The graph args' values as the forward saw them. The node keeps the graph args (not copies)
  and the versions of those no saved value holds; one changed in place since (by the user, or
  by the entry's own input mutation) has lost that value: refused, naming the input.
- The same random draws. When a saved value comes from a random op (dropout), the forward notes
  the generator state before it runs (AutogradPlan.rng_device); the recomputation keeps every
  random op of the forward in order, runs from that state and restores the generator after, so
  it draws exactly the forward's numbers and leaves the user's stream as eager's double backward
  does (untouched).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from aotc import oncediff
from aotc.options import CompileOptions
from aotc.passes.partition import ancestors
from aotc.passes.recompute import is_random
from aotc.runtime.autograd import AutogradPlan
from aotc.runtime.errors import UnsupportedError
from aotc.runtime.wrappers import CompiledEntry, Dispatcher


class DifferentiableBackward:
    """Compiles and runs an entry's backward as a differentiable program (Note [Double
    backward]). One per compiled entry; thread-safe; the program is built on first use."""

    def __init__(
        self,
        graphs: Callable[[], tuple[fx.GraphModule, fx.GraphModule]],
        plan: AutogradPlan,
        names: Sequence[str],
        options: CompileOptions,
        name: str,
    ) -> None:
        self._graphs = graphs
        self._plan = plan
        self._names = tuple(names)
        self._options = options
        self._fn_name = name
        self._name = f"{name}.backward"
        self._lock = threading.Lock()
        # (program, graph args it reads, whether it takes an anchor: Note [Once-differentiable
        # backwards] in aotc/oncediff.py)
        self._ready: tuple[fx.GraphModule, tuple[int, ...], bool] | None = None
        self._dispatch: Dispatcher | None = None

    def _prepare(self) -> tuple[fx.GraphModule, tuple[int, ...], bool]:
        with self._lock:
            if self._ready is None:
                forward, backward = self._graphs()
                self._ready = compose_backward(forward, backward, self._plan)
                self._dispatch = Dispatcher(
                    self._compile,
                    self._name,
                    self._options.recompile_warn_limit,
                    self._options.max_signatures,
                )
            return self._ready

    def _compile(self, leaves: list[object], key: tuple[object, ...]) -> CompiledEntry:
        from aotc.pipeline import compile_signature

        assert self._ready is not None
        program_module = self._ready[0]

        spec = pytree.tree_flatten(tuple(self._plan.grad_args))[1]

        def program(user_leaves: list[object]) -> tuple[list[object], object]:
            return list(program_module(*user_leaves)), spec

        names = [*self._names, *(f"tangent{k}" for k in range(len(self._plan.diff_outs)))]
        names += ["once_differentiable_anchor"] if self._ready[2] else []
        return compile_signature(program, leaves, names, self._options, self._name, self._name)

    def __call__(
        self,
        args: Sequence[object],
        versions: Sequence[int | None],
        grads: Sequence[torch.Tensor],
        rng: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        _, needed, anchored = self._prepare()
        what = f"double backward (create_graph=True) through aotc-compiled {self._fn_name}"
        changed = [i for i in needed if args[i] is None]  # written by the entry itself
        changed += [
            i
            for i, v in zip(self._plan.watch_args, versions)
            if args[i] is not None and cast(torch.Tensor, args[i])._version != v
        ]
        if changed:
            raise UnsupportedError(
                f"{what}: input {self._names[changed[0]]!r} was modified in place after the "
                "call (by the program itself or later), and the derivative of its gradient "
                "needs the value from the call. Modify a clone instead, or keep the value "
                "unchanged until the double backward has run."
            )
        assert self._dispatch is not None
        leaves = [*args, *grads, *((oncediff.anchor(),) if anchored else ())]
        if rng is None:
            return cast(tuple[torch.Tensor, ...], self._dispatch(leaves, None))
        # Replay the call's random draws, and leave the generator as it was (eager's double
        # backward draws nothing).
        device = self._plan.rng_device
        now = _get_rng(device)
        _set_rng(device, rng)
        try:
            return cast(tuple[torch.Tensor, ...], self._dispatch(leaves, None))
        finally:
            _set_rng(device, now)


def _recomputed(forward: fx.GraphModule, num_fwd_outs: int) -> tuple[set[fx.Node], list[Any], bool]:
    """The forward nodes the differentiable backward recomputes, the saved values, and whether
    they include random ops (then every random op of the forward, in order, so that replaying
    the generator state from the call draws the same numbers: Note [Double backward])."""
    (out,) = [n for n in forward.graph.nodes if n.op == "output"]
    saved = list(out.args[0])[num_fwd_outs:]
    needed = ancestors(saved)
    random = [n for n in forward.graph.nodes if is_random(n)]
    if not any(n in needed for n in random):
        return needed, saved, False
    return needed | ancestors(random), saved, True


def watched_args(forward: fx.GraphModule, num_fwd_outs: int) -> tuple[int, ...]:
    """Graph args (tensors) the saved values are computed from that are not saved themselves:
    the ones whose versions a forward notes (AutogradPlan.watch_args)."""
    needed, saved, _ = _recomputed(forward, num_fwd_outs)
    inputs = [n for n in forward.graph.nodes if n.op == "placeholder"]
    return tuple(
        i
        for i, n in enumerate(inputs)
        if n in needed and n not in saved and isinstance(n.meta.get("val"), torch.Tensor)
    )


def saved_graph_args(forward: fx.GraphModule, num_fwd_outs: int) -> frozenset[int]:
    """Graph args the forward saves as they are (a placeholder among the saved values): their
    version counter is checked when the backward unpacks them, as eager's saved values are."""
    (out,) = [n for n in forward.graph.nodes if n.op == "output"]
    saved = set(list(out.args[0])[num_fwd_outs:])
    inputs = [n for n in forward.graph.nodes if n.op == "placeholder"]
    return frozenset(i for i, n in enumerate(inputs) if n in saved)


def random_device(forward: fx.GraphModule, num_fwd_outs: int) -> str | None:
    """The device type whose generator state a forward notes (AutogradPlan.rng_device): that of
    its random ops when the differentiable backward recomputes them, else None."""
    _, _, random = _recomputed(forward, num_fwd_outs)
    if not random:
        return None
    for node in forward.graph.nodes:
        val = node.meta.get("val")
        if is_random(node) and isinstance(val, torch.Tensor):
            return val.device.type
    return "cpu"


def compose_backward(
    forward: fx.GraphModule,
    backward: fx.GraphModule,
    plan: AutogradPlan,
) -> tuple[fx.GraphModule, tuple[int, ...], bool]:
    """(graph args, tangents[, anchor]) -> gradients: the forward graph cut down to the saved
    values (and its random ops, see `_recomputed`), then the backward graph. Also the graph args
    it reads, and whether it takes an anchor (the backward has nodes a once-differentiable
    backward computed: Note [Once-differentiable backwards] in aotc/oncediff.py)."""
    fwd_graph, bwd_graph = forward.graph, backward.graph
    fwd_inputs = [n for n in fwd_graph.nodes if n.op == "placeholder"]
    needed_nodes, saved, _ = _recomputed(forward, plan.num_fwd_outs)

    graph = fx.Graph()
    root = torch.nn.Module()
    env: dict[fx.Node, Any] = {}
    for node in fwd_inputs:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
    for node in fwd_graph.nodes:
        if node.op in ("placeholder", "output") or node not in needed_nodes:
            continue
        env[node] = _copy(graph, node, env, root, "fwd")
    bwd_inputs = [n for n in bwd_graph.nodes if n.op == "placeholder"]
    n_saved = plan.num_saved
    for node, value in zip(bwd_inputs[:n_saved], saved):
        env[node] = env[value] if isinstance(value, fx.Node) else value
    for k, node in enumerate(bwd_inputs[n_saved:]):
        env[node] = graph.placeholder(f"tangent{k}")
        env[node].meta = dict(node.meta)
    for node in bwd_graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            graph.output(fx.map_arg(node.args[0], lambda n: env[n]))
            break
        env[node] = _copy(graph, node, env, root, "bwd")
    tangents = [env[n] for n in bwd_inputs[n_saved:]]
    anchored = _insert_barriers(graph, tangents)
    graph.eliminate_dead_code()
    module = fx.GraphModule(root, graph, class_name="DifferentiableBackward")
    used = {n.name for n in graph.nodes if n.op == "placeholder" and n.users}
    needed = tuple(i for i, n in enumerate(fwd_inputs) if env[n].name in used)
    return module, needed, anchored


def _insert_barriers(graph: fx.Graph, tangents: list[fx.Node]) -> bool:
    """Each value that nodes of a once-differentiable backward return goes through
    `oncediff.barrier` (its gradient inputs: the nodes it reads from outside the backward that
    depend on a tangent). Adds the anchor placeholder when there is any."""
    marked = [n for n in graph.nodes if n.meta.get(oncediff.ONCE_KEY)]
    if not marked:
        return False
    inside = set(marked)
    on_tangents = set(tangents)
    for node in graph.nodes:
        if any(a in on_tangents for a in node.all_input_nodes):
            on_tangents.add(node)
    returned = [n for n in marked if any(u not in inside for u in n.users)]
    if not returned:
        return False
    last = next(n for n in reversed(graph.nodes) if n.op == "placeholder")
    with graph.inserting_after(last):
        anchor = graph.placeholder("once_differentiable_anchor")
    for value in returned:
        grads = [n for n in _region_inputs(value, inside) if n in on_tangents]
        with graph.inserting_after(value):
            joined = graph.call_function(oncediff.barrier, (value, anchor, *grads))
        joined.meta = {k: v for k, v in value.meta.items() if k != oncediff.ONCE_KEY}
        keep = inside | {joined}
        value.replace_all_uses_with(joined, delete_user_cb=lambda u, keep=keep: u not in keep)
    return True


def _region_inputs(value: fx.Node, inside: set[fx.Node]) -> list[fx.Node]:
    """The nodes outside `inside` that the marked nodes computing `value` read."""
    seen: set[fx.Node] = set()
    found: list[fx.Node] = []
    stack = [value]
    while stack:
        node = stack.pop()
        for arg in node.all_input_nodes:
            if arg in seen:
                continue
            seen.add(arg)
            if arg in inside:
                stack.append(arg)
            else:
                found.append(arg)
    return found


def _get_rng(device: str | None) -> torch.Tensor:
    return torch.cuda.get_rng_state() if device == "cuda" else torch.random.get_rng_state()


def _set_rng(device: str | None, state: torch.Tensor) -> None:
    if device == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.random.set_rng_state(state)


def _copy(
    graph: fx.Graph, node: fx.Node, env: dict[fx.Node, Any], root: torch.nn.Module, prefix: str
) -> fx.Node:
    if node.op == "get_attr":
        owner = node.graph.owning_module
        assert owner is not None
        target = f"{prefix}_{node.target}".replace(".", "_")
        setattr(root, target, _attr(owner, str(node.target)))
        new = graph.get_attr(target)
        new.meta = dict(node.meta)
        return new
    return graph.node_copy(node, lambda n: env[n])


def _attr(module: torch.nn.Module, path: str) -> Any:
    value: Any = module
    for part in path.split("."):
        value = getattr(value, part)
    return value
