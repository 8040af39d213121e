"""Partition: split a joint graph into a forward and a backward graph.

Stage: `partition(joint, mutated_args, policy, memory_budget) -> PartitionResult`.
Requires: `joint` outputs are `FwdOutput`s then `GradOutput`s; inputs are `PrimalInput`s then
`TangentInput`s; the graph is functional (lint_graph passes).
Ensures: forward(primals) -> fwd outputs + saved values; backward(saved values, tangents) ->
the non-None gradients; every backward input is a saved value or a tangent; a node runs in the
backward as well as the forward only if the policy allows recomputing it (or a memory budget asked
for it); random ops run once, in the forward.

The plan is a minimum cut (see Note [Min-cut partition]); `plan="simple"` keeps the older "save
what the backward reads" plan for comparison. The report gives the saved values, what is
recomputed, and saved bytes against "save everything" and against the simple plan.

Note [Min-cut partition]
~~~~~~~~~~~~~~~~~~~~~~~~
Which values the forward saves is a cut between what the forward can compute (everything reachable
from the primals) and what the backward needs (everything that reads a tangent, and the gradient
values). Split each node n into n_in -> n_out with capacity = bytes of n's value (the cost of saving
it); every data edge u -> v becomes u_out -> v_in with infinite capacity. The source feeds every
primal; every node the backward must compute (tangent-dependent, or a gradient) drains into the
sink. (A view is charged its root's bytes: saving it keeps that whole storage alive.) A minimum
source/sink cut then crosses only n_in -> n_out edges: those n are saved, and
everything on the sink side is computed in the backward from them. A forward node the policy
may not recompute (a matmul, a big reduction, a random op) is fed by the source too, so the cut
must save it or something after it: it never runs twice.

    x -> sin -> cos -> mul(tangent, .)         sin, cos pointwise: cut at x (save x, 1 tensor)
    x -> mm(x, w) -> relu -> mul(tangent, .)   mm banned: cut at mm or relu's input (save mm)

A memory budget below the min-cut plan unbans expensive forward ops, cheapest recompute cost per
byte first, and takes the fewest that fit (binary search over that fixed order, so saved bytes fall
monotonically as the budget falls).
"""

from __future__ import annotations

import math
import operator
import time
from collections.abc import Iterable
from dataclasses import dataclass

import networkx as nx
import torch
import torch.fx as fx

from aotc.passes.descriptors import (
    FwdOutput,
    GradOutput,
    PrimalInput,
    SavedInput,
    SavedOutput,
    TangentInput,
)
from aotc.passes.ir import JointGraph, StageGraph, is_sym_node, make_module, node_nbytes
from aotc.passes.recompute import RecomputePolicy, can_recompute, is_random, recompute_cost
from aotc.runtime.schema import GraphArg

__all__ = ["PartitionResult", "SavedValue", "is_random", "partition"]


@dataclass(frozen=True, slots=True)
class SavedValue:
    name: str
    nbytes: int
    shape: tuple[int, ...] | None
    dtype: torch.dtype | None
    producer: str  # the op that produced it, or "input"
    source: str  # the user source line, when known
    is_symint: bool = False  # a size, saved as an int (see Note [Saved SymInts])


@dataclass(frozen=True, slots=True)
class PartitionResult:
    forward: StageGraph
    backward: StageGraph
    saved: tuple[SavedValue, ...]  # len == num saved; order = forward outputs after fwd outs
    recomputed: tuple[str, ...]  # forward nodes the backward computes again
    seconds: float
    plan: str  # "min_cut" or "simple"
    save_everything_bytes: int  # every forward value the backward reads, all ops in the forward
    simple_bytes: int  # the "save what the backward reads" plan
    budget_bytes: int | None  # the memory budget asked for, in bytes (None: no budget)
    unbanned: tuple[str, ...]  # expensive ops recomputed to meet the budget

    @property
    def saved_bytes(self) -> int:
        return sum(s.nbytes for s in self.saved)

    @property
    def num_saved_symints(self) -> int:
        return sum(s.is_symint for s in self.saved)

    def format(self) -> str:
        lines = [
            "# stage: partition",
            f"# plan: {self.plan}",
            f"# saved: {len(self.saved)} values, {self.saved_bytes} bytes "
            f"(save everything: {self.save_everything_bytes}, simple plan: {self.simple_bytes})",
        ]
        if self.budget_bytes is not None:
            met = "met" if self.saved_bytes <= self.budget_bytes else "NOT met (best effort)"
            lines.append(
                f"# memory budget: {self.budget_bytes} bytes, {met}; recomputing "
                f"expensive ops: {', '.join(self.unbanned) or 'none'}"
            )
        for s in self.saved:
            dtype = str(s.dtype).removeprefix("torch.") if s.dtype is not None else "-"
            shape = list(s.shape) if s.shape is not None else "-"
            where = f"  # {s.source}" if s.source else ""
            lines.append(f"saved {s.name}: {dtype}{shape} {s.nbytes} B from {s.producer}{where}")
        lines.append(f"# recomputed: {', '.join(self.recomputed) or 'none'}")
        return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class _Roles:
    """The joint graph's nodes by role. Node sets are in graph order when turned into lists."""

    primals: tuple[fx.Node, ...]
    tangents: tuple[fx.Node, ...]
    fwd_values: tuple[object, ...]  # fwd outputs (nodes or constants)
    grad_pairs: tuple[tuple[fx.Node, GradOutput], ...]  # non-None gradients
    fwd_required: frozenset[fx.Node]  # what the forward must compute anyway
    bwd_required: frozenset[fx.Node]  # tangent-dependent nodes and gradient values
    order: dict[fx.Node, int]


def _ancestors(roots: Iterable[object], stop: frozenset[fx.Node] = frozenset()) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [r for r in roots if isinstance(r, fx.Node)]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node not in stop:
            stack.extend(node.all_input_nodes)
    return seen


def _roles(joint: JointGraph) -> _Roles:
    graph = joint.module.graph
    placeholders = joint.placeholders()
    values = joint.output_values()
    primals = tuple(n for n, d in zip(placeholders, joint.inputs) if isinstance(d, PrimalInput))
    tangents = tuple(n for n, d in zip(placeholders, joint.inputs) if isinstance(d, TangentInput))
    fwd_values = tuple(v for v, d in zip(values, joint.outputs) if isinstance(d, FwdOutput))
    grad_pairs = tuple(
        (v, d) for v, d in zip(values, joint.outputs) if isinstance(d, GradOutput) and v is not None
    )
    random_nodes = [n for n in graph.nodes if is_random(n)]
    fwd_required = _ancestors([*fwd_values, *random_nodes]) | set(primals)
    tangent_dependent: set[fx.Node] = set(tangents)
    for node in graph.nodes:
        if any(i in tangent_dependent for i in node.all_input_nodes):
            tangent_dependent.add(node)
    tangent_dependent.discard(next(n for n in reversed(graph.nodes) if n.op == "output"))
    bwd_required = tangent_dependent | {v for v, _ in grad_pairs}
    order = {n: i for i, n in enumerate(graph.nodes)}
    return _Roles(
        primals,
        tangents,
        fwd_values,
        grad_pairs,
        frozenset(fwd_required),
        frozenset(bwd_required),
        order,
    )


def _simple_saved(roles: _Roles, all_in_forward: bool) -> set[fx.Node]:
    """Save what the backward reads. `all_in_forward`: every non-tangent node runs in the
    forward ("save everything"); else nodes only the gradients need run in the backward."""
    grads = [v for v, _ in roles.grad_pairs]
    needed = _ancestors(grads)
    fwd = set(roles.fwd_required)
    if all_in_forward:
        fwd |= needed - roles.bwd_required
    bwd = needed - fwd
    saved = {i for n in bwd for i in n.all_input_nodes if i in fwd}
    saved |= {v for v in grads if v in fwd}
    return _tensor_saves(saved)


def _tensor_saves(saved: set[fx.Node]) -> set[fx.Node]:
    """A tuple-valued node (multi-output op) is saved through its getitem users."""
    out: set[fx.Node] = set()
    for node in saved:
        if isinstance(node.meta.get("val"), (tuple, list)):
            out |= {u for u in node.users if u.target is operator.getitem}
        else:
            out.add(node)
    return out


_SOURCE, _SINK = "__source__", "__sink__"

# Note [Saved SymInts]
# ~~~~~~~~~~~~~~~~~~~~
# With symbolic sizes the backward reads sizes (`expand(tangent, [sym_size(x, 0), 4])`). A size
# node costs almost nothing to save (a Python int at run time, kept on ctx outside autograd's
# saved tensors) and is recomputable from any saved tensor it is a size of, so it gets a capacity
# of one byte: the cut saves the size itself rather than a tensor only to read its shape, and
# recomputes it when that tensor is saved anyway. Saved sizes come after saved tensors.
_SYM_BYTES = 1


def _min_cut_saved(
    roles: _Roles, policy: RecomputePolicy, unbanned: frozenset[fx.Node]
) -> set[fx.Node]:
    grads = [v for v, _ in roles.grad_pairs]
    relevant = _ancestors(grads)
    inf = math.inf
    cut_edges: list[tuple[object, object, float]] = []  # n_in -> n_out, capacity = bytes
    inf_edges: list[tuple[object, object]] = []
    # Nodes the backward must compute sit on the sink side whatever the cut: they are not split,
    # and an edge into one of them goes straight to the sink (halves the network for a chain).
    for node in relevant:
        if node in roles.bwd_required:
            continue
        val = node.meta.get("val")
        # Saving a view keeps its root's whole storage alive: charge the root's bytes.
        if isinstance(val, torch.Tensor):
            capacity = node_nbytes(_view_root(node))
        else:  # See Note [Saved SymInts]
            capacity = _SYM_BYTES if is_sym_node(node) else inf
        n_in, n_out = (node, "in"), (node, "out")
        cut_edges.append((n_in, n_out, capacity))
        if node.op == "placeholder" or (
            node in roles.fwd_required and node not in unbanned and not can_recompute(node, policy)
        ):
            inf_edges.append((_SOURCE, n_in))
        for user in node.users:
            if user in roles.bwd_required:
                inf_edges.append((n_out, _SINK))
            elif user in relevant:
                inf_edges.append((n_out, (user, "in")))
    flow = nx.DiGraph()
    flow.add_weighted_edges_from(cut_edges, weight="capacity")
    flow.add_edges_from(inf_edges, capacity=inf)
    if _SOURCE not in flow or _SINK not in flow:
        return set()
    # Heuristic: Edmonds-Karp, because these cuts are small (few saved values, so few augmenting
    # paths); measured on a 10,000-node joint graph: 0.7 s vs 1.9 s for networkx's default
    # preflow-push, and no slower on the GPT-block and conv-net workloads of bench/partition.py.
    _, (reachable, _) = nx.minimum_cut(
        flow, _SOURCE, _SINK, flow_func=nx.algorithms.flow.edmonds_karp
    )
    saved = {n for n in relevant if (n, "in") in reachable and (n, "out") not in reachable}
    return _drop_views_of_saved(saved)


def _drop_views_of_saved(saved: set[fx.Node]) -> set[fx.Node]:
    """Save views as their base: a view of another saved value is recomputed from it, and a view
    of a primal is replaced by the primal (a saved view keeps its base's whole storage alive, so
    saving the base costs no more and the backward re-creates the view)."""
    result = set(saved)
    for node in saved:
        base = _view_root(node)
        if base is node:
            continue
        if base in saved or base.op == "placeholder":
            result.discard(node)
            result.add(base)
    return result


def _view_root(node: fx.Node) -> fx.Node:
    """Follow view ops back to the value they view (the node itself if it is no view)."""
    while isinstance(node.target, torch._ops.OpOverload) and node.target.is_view:
        first = node.args[0]
        if not isinstance(first, fx.Node):
            break
        node = first
    return node


def _bytes(nodes: Iterable[fx.Node]) -> int:
    return sum(node_nbytes(n) for n in nodes)


def _budget_saved(
    roles: _Roles, policy: RecomputePolicy, budget_bytes: int, base: set[fx.Node]
) -> tuple[set[fx.Node], tuple[fx.Node, ...]]:
    """Fewest expensive ops to recompute (cheapest per byte first) so saved bytes fit."""
    if _bytes(base) <= budget_bytes:
        return base, ()
    grads = [v for v, _ in roles.grad_pairs]
    candidates = sorted(
        (
            n
            for n in _ancestors(grads)
            if n in roles.fwd_required
            and n.op == "call_function"
            and not is_random(n)
            and not can_recompute(n, policy)
            and not (isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable)
        ),
        key=lambda n: (recompute_cost(n) / max(node_nbytes(n), 1), roles.order[n]),
    )
    lo, hi = 1, len(candidates)
    best = (_min_cut_saved(roles, policy, frozenset(candidates)), tuple(candidates))
    if _bytes(best[0]) > budget_bytes:
        return best  # best effort: even recomputing every candidate does not fit
    while lo < hi:
        mid = (lo + hi) // 2
        saved = _min_cut_saved(roles, policy, frozenset(candidates[:mid]))
        if _bytes(saved) <= budget_bytes:
            hi = mid
            best = (saved, tuple(candidates[:mid]))
        else:
            lo = mid + 1
    if hi < len(candidates) and best[1] != tuple(candidates[:hi]):
        best = (_min_cut_saved(roles, policy, frozenset(candidates[:hi])), tuple(candidates[:hi]))
    return best


_DEFAULT_POLICY = RecomputePolicy()


def partition(
    joint: JointGraph,
    mutated_args: frozenset[GraphArg] = frozenset(),
    policy: RecomputePolicy = _DEFAULT_POLICY,
    memory_budget: float | int | None = None,
    plan: str = "min_cut",
) -> PartitionResult:
    """`mutated_args`: primals the epilogue mutates in place after the forward; a saved value
    that is one of them, or a view of one, is saved as a clone (see Note [Saving mutated inputs]).
    `memory_budget`: a fraction (0..1] of the save-everything bytes, or a byte count."""
    start = time.perf_counter()
    roles = _roles(joint)
    everything = _simple_saved(roles, all_in_forward=True)
    simple = _simple_saved(roles, all_in_forward=False)
    budget_bytes: int | None = None
    unbanned: tuple[fx.Node, ...] = ()
    if plan == "simple":
        saved = simple
    elif plan == "min_cut":
        saved = _min_cut_saved(roles, policy, frozenset())
        if memory_budget is not None:
            budget_bytes = (
                int(memory_budget * _bytes(everything))
                if isinstance(memory_budget, float)
                else int(memory_budget)
            )
            saved, unbanned = _budget_saved(roles, policy, budget_bytes, saved)
    else:
        raise ValueError(f"partition(plan={plan!r}): expected 'min_cut' or 'simple'")
    forward, backward, saved_nodes, recomputed = _build(joint, roles, saved, mutated_args)
    return PartitionResult(
        forward=forward,
        backward=backward,
        saved=tuple(_saved_value(n) for n in saved_nodes),
        recomputed=tuple(n.name for n in recomputed),
        seconds=time.perf_counter() - start,
        plan=plan,
        save_everything_bytes=_bytes(everything),
        simple_bytes=_bytes(simple),
        budget_bytes=budget_bytes,
        unbanned=tuple(n.name for n in unbanned),
    )


def _build(
    joint: JointGraph, roles: _Roles, saved: set[fx.Node], mutated_args: frozenset[GraphArg]
) -> tuple[StageGraph, StageGraph, list[fx.Node], list[fx.Node]]:
    graph = joint.module.graph
    # Tensors first, then sizes: see Note [Saved SymInts].
    saved_nodes = sorted(saved, key=lambda n: (is_sym_node(n), roles.order[n]))
    stop = frozenset(saved) | frozenset(roles.tangents)
    bwd_nodes = _ancestors((v for v, _ in roles.grad_pairs), stop) - frozenset(saved)
    bwd_nodes -= set(roles.tangents)
    # Random ops run in the forward even when nothing reads them (they advance the RNG), and
    # with them the values they read (`torch.rand_like(a * 2)`).
    random_nodes = [n for n in graph.nodes if is_random(n)]
    fwd_nodes = _ancestors([*roles.fwd_values, *saved_nodes, *random_nodes]) | set(roles.primals)
    recomputed = [n for n in graph.nodes if n in bwd_nodes and n in fwd_nodes]

    fwd_graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        if node in fwd_nodes:
            env[node] = fwd_graph.node_copy(node, env.__getitem__)
    mutated_nodes = {
        n
        for n, d in zip(joint.placeholders(), joint.inputs)
        if isinstance(d, PrimalInput) and d.arg in mutated_args
    }
    saved_out = []
    for node in saved_nodes:
        value = env[node]
        if _aliases(node, mutated_nodes):
            value = fwd_graph.call_function(torch.ops.aten.clone.default, (value,))
            value.meta = dict(node.meta)
        saved_out.append(value)
    fwd_graph.output(tuple(_lookup(env, v) for v in roles.fwd_values) + tuple(saved_out))
    saved_names = tuple(n.name for n in saved_nodes)
    forward = StageGraph(
        module=make_module(joint.module, fwd_graph),
        inputs=tuple(d for d in joint.inputs if isinstance(d, PrimalInput)),
        outputs=tuple(d for d in joint.outputs if isinstance(d, FwdOutput))
        + tuple(SavedOutput(name) for name in saved_names),
    )

    bwd_graph = fx.Graph()
    benv: dict[fx.Node, fx.Node] = {}
    for node in saved_nodes:
        benv[node] = bwd_graph.placeholder(node.name)
        benv[node].meta = dict(node.meta)
    for node in roles.tangents:
        benv[node] = bwd_graph.node_copy(node, benv.__getitem__)
    for node in graph.nodes:
        if node in bwd_nodes and node.op != "placeholder":
            benv[node] = bwd_graph.node_copy(node, benv.__getitem__)
        elif node in bwd_nodes:
            raise AssertionError(
                f"partition: backward needs primal {node.name} but it is not saved"
            )
    bwd_graph.output(tuple(benv[v] for v, _ in roles.grad_pairs))
    backward = StageGraph(
        module=make_module(joint.module, bwd_graph),
        inputs=tuple(SavedInput(name) for name in saved_names)
        + tuple(d for d in joint.inputs if isinstance(d, TangentInput)),
        outputs=tuple(d for _, d in roles.grad_pairs),
    )
    return forward, backward, saved_nodes, recomputed


def _aliases(node: fx.Node, roots: set[fx.Node]) -> bool:
    """Whether `node` is one of `roots` or a chain of view ops over one.

    Note [Saving mutated inputs]: the epilogue copies new values into mutated inputs after the
    forward ran. autograd checks the version counter of every saved tensor at backward time, so
    saving such an input (or a view of it) directly would fail there, and without the check would
    read the new value. Eager saves the pre-mutation value; so do we, by saving a clone taken
    inside the forward graph.
    """
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
    return SavedValue(
        name=node.name,
        nbytes=node_nbytes(node),
        shape=tuple(val.shape) if is_tensor else None,
        dtype=val.dtype if is_tensor else None,
        producer="input" if node.op == "placeholder" else str(node.target),
        source=source_line(node),
        is_symint=is_sym_node(node),
    )


def source_line(node: fx.Node) -> str:
    """`file:line  code` of the innermost user frame in the node's stack trace, or ''."""
    lines = (node.meta.get("stack_trace") or "").strip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        text = lines[i].strip()
        if text.startswith("File "):
            parts = text.split('"')
            where = parts[1] if len(parts) > 2 else text
            lineno = text.split("line ")[-1].split(",")[0] if "line " in text else "?"
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            return f"{where}:{lineno}  {code}"
    return ""
