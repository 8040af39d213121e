"""Partition: split a joint graph into a forward and a backward graph.

Stage: `partition(joint, mutated_args, policy, memory_budget) -> PartitionResult`.
Requires: `joint` outputs are `FwdOutput`s then `GradOutput`s; inputs are `PrimalInput`s then
`TangentInput`s; the graph is functional (lint_graph passes).
Ensures: forward(primals) -> fwd outputs + saved values; backward(saved values, tangents) ->
the non-None gradients; every backward input is a saved value or a tangent; a node runs in the
backward as well as the forward only if the policy allows recomputing it (or a memory budget asked
for it); random ops run once, in the forward.

The plan is a minimum cut (see Note [Min-cut partition]) under a recompute cost model that knows
what the executor fuses (see Note [Recompute cost model] in passes/recompute.py); `plan="simple"`
keeps the older "save what the backward reads" plan for comparison. The report gives the saved
values, every recomputed value with what recomputing it costs and what it saves, and saved bytes
against "save everything" and against the simple plan.

Note [Min-cut partition]
~~~~~~~~~~~~~~~~~~~~~~~~
Which values the forward saves is a cut between what the forward can compute (everything reachable
from the primals) and what the backward needs (everything that reads a tangent, and the gradient
values). Split each node n into n_in -> n_out with capacity = bytes of n's value (the cost of saving
it); every data edge u -> v becomes u_out -> v_in with infinite capacity. The source feeds every
primal; every node the backward must compute (tangent-dependent, or a gradient) drains into the
sink. (A view is charged its root's bytes: saving it keeps that whole storage alive.) A minimum
source/sink cut then crosses only n_in -> n_out edges: those n are saved, and
everything on the sink side is computed in the backward from them. A forward node whose
recomputation is not free (passes/recompute.py: on ATen every op but views and sizes; on Triton
matmuls, big reductions, random ops, and values a non-fused backward op reads) is fed by the
source too, so the cut must save it or something after it: it never runs twice. A node only the
backward needs (`cos(x)` for `sin`'s derivative) runs once on whichever side saves fewer bytes.

    x -> sin -> cos -> mul(tangent, .)         Triton: sin, cos fuse: cut at x (save x)
                                               ATen: sin runs once: save x and sin (as eager)
    x -> mm(x, w) -> relu -> mul(tangent, .)   mm never free: cut at mm or relu's input (save mm)

A memory budget below the min-cut plan unbans non-free forward ops, cheapest estimated seconds
per byte first (pointwise passes over memory before matmuls), and takes the fewest that fit
(binary search over that fixed order, so saved bytes fall monotonically as the budget falls).
The network actually solved is smaller and split, with the same cut (Note [Contracted flow
network]).
"""

from __future__ import annotations

import contextlib
import enum
import gc
import math
import operator
import time
from collections.abc import Iterable, Iterator, Sequence
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
from aotc.passes.ir import (
    JointGraph,
    StageGraph,
    is_sym_node,
    make_module,
    node_nbytes,
    primal_names,
)
from aotc.passes.provenance import describe_source, source_of
from aotc.passes.recompute import (
    CostKind,
    Executor,
    RecomputeCost,
    RecomputePolicy,
    is_random,
    recompute_cost,
)
from aotc.runtime.schema import GraphArg

__all__ = [
    "ancestors",
    "PartitionResult",
    "Recomputation",
    "RecomputeReason",
    "SavedValue",
    "is_random",
    "partition",
]


@dataclass(frozen=True, slots=True)
class SavedValue:
    name: str
    nbytes: int
    shape: tuple[int, ...] | None
    dtype: torch.dtype | None
    producer: str  # the op that produced it, or "input"
    source: str  # the user source line, when known
    is_symint: bool = False  # a size, saved as an int (see Note [Saved SymInts])


class RecomputeReason(enum.Enum):
    FREE = "free"  # recomputing costs nothing on this executor (a view, a fused op)
    BUDGET = "budget"  # not free: unbanned to meet the memory budget


@dataclass(frozen=True, slots=True)
class Recomputation:
    """One forward value the backward computes again, with what that costs and saves."""

    name: str
    producer: str  # the op
    nbytes: int  # bytes saving it would keep alive (0 for a view: its base is what is kept)
    cost: RecomputeCost
    reason: RecomputeReason

    def format(self) -> str:
        why = "to meet the memory budget" if self.reason is RecomputeReason.BUDGET else ""
        return (
            f"recomputed {self.name}: {self.producer}; costs {self.cost.format()}; "
            f"saves {self.nbytes} B{' ' + why if why else ''}"
        )


@dataclass(frozen=True, slots=True)
class PartitionResult:
    forward: StageGraph
    backward: StageGraph
    saved: tuple[SavedValue, ...]  # len == num saved; order = forward outputs after fwd outs
    recomputed: tuple[str, ...]  # forward nodes the backward computes again, graph order
    seconds: float
    plan: str  # "min_cut" or "simple"
    save_everything_bytes: int  # every forward value the backward reads, all ops in the forward
    simple_bytes: int  # the "save what the backward reads" plan
    budget_bytes: int | None  # the memory budget asked for, in bytes (None: no budget)
    unbanned: tuple[str, ...]  # expensive ops recomputed to meet the budget
    executor: Executor = Executor.ATEN  # what the recompute costs assumed runs the graphs
    recomputations: tuple[Recomputation, ...] = ()  # len == len(recomputed); same order

    @property
    def recompute_seconds(self) -> float:
        """Estimated time per step the backward spends recomputing (0 when all are free)."""
        return sum(r.cost.seconds for r in self.recomputations)

    @property
    def saved_bytes(self) -> int:
        return sum(s.nbytes for s in self.saved)

    @property
    def num_saved_symints(self) -> int:
        return sum(s.is_symint for s in self.saved)

    def format(self, arg_names: Sequence[str] = ()) -> str:
        """`arg_names`: readable names of the graph args (GraphArg space), for saved inputs."""
        input_names = primal_names(self.forward, arg_names)
        lines = [
            "# stage: partition",
            f"# plan: {self.plan}, executor: {self.executor.value}",
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
            name = f"{s.name} ({input_names[s.name]})" if s.name in input_names else s.name
            lines.append(f"saved {name}: {dtype}{shape} {s.nbytes} B from {s.producer}{where}")
        lines.append(
            f"# recomputed: {len(self.recomputations)} values, estimated cost "
            f"{self.recompute_seconds * 1e6:.1f} us per step"
        )
        lines += [r.format() for r in self.recomputations]
        return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class _Roles:
    """The joint graph's nodes by role. Node sets are in graph order when turned into lists."""

    primals: tuple[fx.Node, ...]
    tangents: tuple[fx.Node, ...]
    fwd_values: tuple[fx.node.Argument, ...]  # fwd outputs (nodes or constants)
    grad_pairs: tuple[tuple[fx.Node, GradOutput], ...]  # non-None gradients
    fwd_required: frozenset[fx.Node]  # what the forward must compute anyway
    random: frozenset[fx.Node]  # random ops: run once, in the forward
    bwd_required: frozenset[fx.Node]  # tangent-dependent nodes and gradient values
    order: dict[fx.Node, int]
    relevant: frozenset[fx.Node]  # the gradients' ancestors (what the backward may need)


def ancestors(roots: Iterable[object], stop: frozenset[fx.Node] = frozenset()) -> set[fx.Node]:
    """The nodes among `roots` and everything they read, transitively (not past `stop`)."""
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
        (v, d)
        for v, d in zip(values, joint.outputs)
        if isinstance(d, GradOutput) and isinstance(v, fx.Node)
    )
    tangent_dependent: set[fx.Node] = set(tangents)
    for node in graph.nodes:
        if any(i in tangent_dependent for i in node.all_input_nodes):
            tangent_dependent.add(node)
    tangent_dependent.discard(next(n for n in reversed(graph.nodes) if n.op == "output"))
    # Random ops of the forward run there, once. A backward op tagged random (the efficient and
    # cuDNN attention backwards, which read the forward's saved seed) reads a tangent and runs
    # in the backward: forcing it into the forward would pull the tangent in with it.
    random_nodes = frozenset(n for n in graph.nodes if is_random(n) and n not in tangent_dependent)
    fwd_required = ancestors([*fwd_values, *random_nodes]) | set(primals)
    bwd_required = tangent_dependent | {v for v, _ in grad_pairs}
    order = {n: i for i, n in enumerate(graph.nodes)}
    return _Roles(
        primals,
        tangents,
        fwd_values,
        grad_pairs,
        frozenset(fwd_required),
        random_nodes,
        frozenset(bwd_required),
        order,
        frozenset(ancestors(v for v, _ in grad_pairs)),
    )


def _simple_saved(roles: _Roles, all_in_forward: bool) -> set[fx.Node]:
    """Save what the backward reads. `all_in_forward`: every non-tangent node runs in the
    forward ("save everything"); else nodes only the gradients need run in the backward."""
    grads = [v for v, _ in roles.grad_pairs]
    needed = set(roles.relevant)
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

# Note [Ties go to values the forward has anyway]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Many cuts save the same bytes: for `y = x.sin()` the backward needs `cos(x)`, and saving `x`
# or saving `cos(x)` (computed in the forward for the purpose) both keep one tensor alive. They
# are not equally fast: the second moves backward work into the forward, where its result waits
# in memory until the backward reads it, instead of being computed right before its use while
# its input is still in cache. Measured on the 10-op pointwise chain (float32[256, 256], ATen
# calls, CPU): ~10% slower steps with the backward-only values computed in the forward. So
# capacities are bytes scaled by _TIE_SCALE, plus one for a node the forward does not need
# itself: among cuts with equal bytes the cut saves the fewest such nodes, and the scale keeps
# the tie-break from ever trading a byte for it (up to _TIE_SCALE - 1 such nodes).
_TIE_SCALE = 1 << 20


def _min_cut_saved(
    roles: _Roles, costs: dict[fx.Node, RecomputeCost], unbanned: frozenset[fx.Node]
) -> set[fx.Node]:
    """`costs`: per relevant forward node, what recomputing it costs; a node whose cost is not
    free is never recomputed unless in `unbanned` (see Note [Min-cut partition])."""
    relevant = roles.relevant
    inf = math.inf
    cut_edges: list[tuple[object, object, float]] = []  # n_in -> n_out, capacity = bytes
    inf_edges: list[tuple[object, object]] = []
    fwd_required, bwd_required = roles.fwd_required, roles.bwd_required

    def in_name(node: fx.Node) -> object:
        """A node's "in" half, or the source itself for a node that may not be recomputed (see
        Note [Contracted flow network])."""
        if node.op == "placeholder" or (
            node in fwd_required and node not in unbanned and not costs[node].is_free
        ):
            return _SOURCE
        return (node, "in")

    # Nodes the backward must compute sit on the sink side whatever the cut: they are not split,
    # and an edge into one of them goes straight to the sink (halves the network for a chain).
    always_cut: set[fx.Node] = set()  # source -> sink edges: cut by every cut
    split: list[fx.Node] = []  # nodes whose halves are both in the network
    for node in relevant:
        if node in bwd_required:
            continue
        val = node.meta.get("val")
        # Saving a view keeps its root's whole storage alive: charge the root's bytes.
        if isinstance(val, torch.Tensor):
            capacity: float = node_nbytes(_view_root(node)) * _TIE_SCALE
        else:  # See Note [Saved SymInts]
            capacity = _SYM_BYTES * _TIE_SCALE if is_sym_node(node) else inf
        if capacity != inf and node not in fwd_required:
            capacity += 1  # See Note [Ties go to values the forward has anyway]
        n_in = in_name(node)
        users = node.users
        if any(user in bwd_required for user in users):  # its "out" half is the sink's
            if n_in is _SOURCE and capacity != inf:
                always_cut.add(node)
            else:
                cut_edges.append((n_in, _SINK, capacity))
                split.append(node)
            continue
        n_out = (node, "out")
        cut_edges.append((n_in, n_out, capacity))
        split.append(node)
        for user in users:
            if user in relevant:
                user_in = in_name(user)
                if user_in is not _SOURCE:  # an edge into the source never carries flow
                    inf_edges.append((n_out, user_in))
    flow = nx.DiGraph()
    flow.add_weighted_edges_from(cut_edges, weight="capacity")
    flow.add_edges_from(inf_edges, capacity=inf)
    parts, reachable = _flow_parts(flow)
    for part in parts:
        # Heuristic: Boykov-Kolmogorov. Edmonds-Karp was fastest while cuts were small (few saved
        # values), but with ATen calls the cost model saves what eager saves, one augmenting path
        # per saved value: on a 1,500-op pointwise chain (3,500 joint nodes, ~750 saved values)
        # Edmonds-Karp 3.8 s, preflow-push 1.4 s, Boykov-Kolmogorov 0.3 s, the same cut.
        _, (side, _) = nx.minimum_cut(
            part, _SOURCE, _SINK, flow_func=nx.algorithms.flow.boykov_kolmogorov
        )
        reachable |= side
    reachable.discard(_SINK)
    saved = always_cut | {
        n
        for n in split
        if (n, "out") not in reachable and (in_name(n) is _SOURCE or (n, "in") in reachable)
    }
    return _drop_views_of_saved(saved)


def _flow_parts(flow: nx.DiGraph) -> tuple[list[nx.DiGraph], set[object]]:
    """The network split where only the source and the sink join it: one network per weakly
    connected component of the rest that touches both, and the nodes of the components that
    touch the source only (no flow reaches the sink through them, so they are all on the source
    side). Components that touch no source are on the sink side or cut nothing."""
    parts: list[nx.DiGraph] = []
    source_side: set[object] = set()
    pred, succ = flow.pred, flow.succ
    terminals = (_SOURCE, _SINK)
    seen: set[object] = set(terminals)
    both: list[list[object]] = []
    for start in flow:
        if start in seen:
            continue
        seen.add(start)
        component, stack = [start], [start]
        while stack:  # one weakly connected component, not walking through the terminals
            n = stack.pop()
            for m in (*succ[n], *pred[n]):
                if m not in seen:
                    seen.add(m)
                    component.append(m)
                    stack.append(m)
        if not any(_SOURCE in pred[n] for n in component):
            continue
        if any(_SINK in succ[n] for n in component):
            side = _path_source_side(flow, component)
            if side is None:
                both.append(component)
            else:
                source_side.update(side)
        else:
            source_side.update(component)
    if len(both) == 1 and not source_side:
        parts.append(flow)  # one part: the network itself
    else:
        for component in both:
            # A copy, not `flow.subgraph`: a view would scan the source's edges for every part.
            part = nx.DiGraph()
            for n in component:
                part.add_edges_from((u, n, d) for u, d in pred[n].items())
                part.add_edges_from((n, v, d) for v, d in succ[n].items())
            parts.append(part)
    if flow.has_edge(_SOURCE, _SINK):  # an infinite capacity: minimum_cut says unbounded
        parts.append(nx.DiGraph([(_SOURCE, _SINK, flow.succ[_SOURCE][_SINK])]))
    return parts, source_side


def _path_source_side(flow: nx.DiGraph, component: list[object]) -> list[object] | None:
    """If `component` is one path from the source to the sink (most parts are: a value the
    forward has, then the backward-only op reading it), the nodes on the source side of its
    minimum cut as `nx.minimum_cut` gives them: a path's maximum flow saturates exactly its
    smallest-capacity edges, and a node is on the sink side iff it reaches the sink through
    unsaturated edges, i.e. iff it comes after the last of them. None for any other shape, or
    when the path has no finite edge (the max-flow reports that)."""
    pred, succ = flow.pred, flow.succ
    if any(len(pred[n]) != 1 or len(succ[n]) != 1 for n in component):
        return None
    starts = [n for n in component if _SOURCE in pred[n]]
    if len(starts) != 1:
        return None
    path, caps = [starts[0]], [pred[starts[0]][_SOURCE]["capacity"]]
    while True:
        ((nxt, data),) = succ[path[-1]].items()
        caps.append(data["capacity"])
        if nxt is _SINK:
            break
        path.append(nxt)
    if len(path) != len(component):  # a cycle beside the path
        return None
    least = min(caps)
    if least == math.inf:
        return None
    last = max(i for i, c in enumerate(caps) if c == least)  # edge `last` enters path[last]
    return path[:last]


# Note [Contracted flow network]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A node that may not be recomputed (a primal, or a non-free value the forward computes anyway)
# has an infinite edge from the source into its "in" half, so every finite cut keeps that half on
# the source side: it is merged into the source, and edges into it (which would point into the
# source and never carry flow) are dropped. Cut values are unchanged, and so is the set reachable
# from the source in the residual network of a maximum flow (the same for every maximum flow),
# hence the saved set. Likewise a node with a user the backward must compute has an infinite edge
# from its "out" half to the sink: that half is merged into the sink and its other edges dropped
# (edges out of the sink carry no flow). A node merged at both ends is saved by every cut and
# stays out of the network. With ATen calls most forward nodes are such nodes: on the 10k-node
# scaling chain of bench/partition.py the ~20k-node, ~40k-edge network shrinks to ~700 parts of
# a few nodes each (the backward-only `cos(x)` of each `sin`), solved one by one: Boykov-Kolmogorov
# on the whole contracted network is slow on its star shape (an orphaned node rescans the source's
# thousands of edges), on a part it is not. The parts are the weakly connected components of the
# network without the source and sink; no flow crosses between them, so the cut of each is
# independent (a part the source reaches but the sink does not is all on the source side).
# tests/passes/test_min_cut_network.py checks the saved set against the plain network.


def _drop_views_of_saved(saved: set[fx.Node]) -> set[fx.Node]:
    """Save views as their base: a view of another saved value is recomputed from it, and a view
    of a primal is replaced by the primal (a saved view keeps its base's whole storage alive, so
    saving the base costs no more and the backward re-creates the view).

    Re-creating the view also reads the view ops' other arguments: with symbolic sizes these are
    sizes of other values (`slice(position_ids, 1, 0, sym_size(attention_mask, 1))`), and the
    backward may have no other way to them (the mask is not saved). They are saved too: a size
    costs one byte (Note [Saved SymInts]), and `_settle` drops any the backward does not read."""
    result = set(saved)
    for node in saved:
        base = _view_root(node)
        if base is node:
            continue
        if base in saved or base.op == "placeholder":
            result.discard(node)
            result.add(base)
            result |= _view_chain_operands(node, base)
    return result


def _view_chain_operands(node: fx.Node, base: fx.Node) -> set[fx.Node]:
    """The nodes the view ops from `base` to `node` read besides the value each one views."""
    operands: set[fx.Node] = set()
    while node is not base:
        viewed = node.args[0]
        operands |= {i for i in node.all_input_nodes if i is not viewed}
        assert isinstance(viewed, fx.Node), node.format_node()
        node = viewed
    return operands


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


def _costs(
    roles: _Roles, executor: Executor, policy: RecomputePolicy
) -> dict[fx.Node, RecomputeCost]:
    """What recomputing each forward node the gradients depend on would cost."""
    in_forward = roles.fwd_required.__contains__
    return {
        n: recompute_cost(n, executor, policy, in_forward)
        for n in roles.relevant
        if n not in roles.bwd_required
    }


def _budget_saved(
    roles: _Roles, costs: dict[fx.Node, RecomputeCost], budget_bytes: int, base: set[fx.Node]
) -> tuple[set[fx.Node], tuple[fx.Node, ...]]:
    """Fewest non-free ops to recompute (cheapest estimated seconds per byte first) so saved
    bytes fit."""
    if _bytes(base) <= budget_bytes:
        return base, ()
    candidates = sorted(
        (
            n
            for n, cost in costs.items()
            if n in roles.fwd_required
            and n.op == "call_function"
            and cost.kind is not CostKind.NEVER
            and not cost.is_free
        ),
        key=lambda n: (costs[n].seconds / max(node_nbytes(n), 1), roles.order[n]),
    )
    lo, hi = 1, len(candidates)
    best = (_min_cut_saved(roles, costs, frozenset(candidates)), tuple(candidates))
    if _bytes(best[0]) > budget_bytes:
        return best  # best effort: even recomputing every candidate does not fit
    while lo < hi:
        mid = (lo + hi) // 2
        saved = _min_cut_saved(roles, costs, frozenset(candidates[:mid]))
        if _bytes(saved) <= budget_bytes:
            hi = mid
            best = (saved, tuple(candidates[:mid]))
        else:
            lo = mid + 1
    if hi < len(candidates) and best[1] != tuple(candidates[:hi]):
        best = (_min_cut_saved(roles, costs, frozenset(candidates[:hi])), tuple(candidates[:hi]))
    return best


_DEFAULT_POLICY = RecomputePolicy()


def partition(
    joint: JointGraph,
    mutated_args: frozenset[GraphArg] = frozenset(),
    policy: RecomputePolicy = _DEFAULT_POLICY,
    memory_budget: float | int | None = None,
    plan: str = "min_cut",
    executor: Executor = Executor.ATEN,
) -> PartitionResult:
    """`mutated_args`: primals the epilogue mutates in place after the forward; a saved value
    that is one of them, or a view of one, is saved as a clone (see Note [Saving mutated inputs]).
    `memory_budget`: a fraction (0..1] of the save-everything bytes, or a byte count.
    `executor`: what will run the graphs; it decides which recomputations are free (see Note
    [Recompute cost model] in passes/recompute.py)."""
    with _gc_paused():
        return _partition(joint, mutated_args, policy, memory_budget, plan, executor)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Python's cyclic collector off for the duration (see Note [Partitioning without the cyclic
    collector]); its previous state restored after."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


# Note [Partitioning without the cyclic collector]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Partitioning allocates many small objects (flow network dicts, fx nodes for the two graphs,
# pytree generators), so the collector runs its young generations often and now and then a full
# collection over everything alive, which right after tracing a big program is the whole traced
# heap (~700k objects for the 10k-node scaling graph of bench/partition.py). Measured on that
# graph, alternating runs in one process: 1.36 / 3.75 / 3.02 s with the collector, 1.26 / 2.33 /
# 1.71 s without. The partition creates little cyclic garbage (the fx nodes it makes stay in the
# graphs it returns), so nothing piles up; the collector runs again after it, as configured.


def _partition(
    joint: JointGraph,
    mutated_args: frozenset[GraphArg],
    policy: RecomputePolicy,
    memory_budget: float | int | None,
    plan: str,
    executor: Executor,
) -> PartitionResult:
    start = time.perf_counter()
    roles = _roles(joint)
    everything = _simple_saved(roles, all_in_forward=True)
    simple = _simple_saved(roles, all_in_forward=False)
    costs = _costs(roles, executor, policy)
    budget_bytes: int | None = None
    unbanned: tuple[fx.Node, ...] = ()
    if plan == "simple":
        saved = simple
    elif plan == "min_cut":
        saved = _min_cut_saved(roles, costs, frozenset())
        if memory_budget is not None:
            budget_bytes = (
                int(memory_budget * _bytes(everything))
                if isinstance(memory_budget, float)
                else int(memory_budget)
            )
            saved, unbanned = _budget_saved(roles, costs, budget_bytes, saved)
    else:
        raise ValueError(f"partition(plan={plan!r}): expected 'min_cut' or 'simple'")
    if plan == "min_cut":
        saved = _settle(roles, saved, costs, frozenset(unbanned))
    forward, backward, saved_nodes, recomputed = _build(joint, roles, saved, mutated_args)
    return PartitionResult(
        forward=forward,
        backward=backward,
        saved=tuple(_saved_value(n) for n in saved_nodes),
        recomputed=tuple(n.name for n in recomputed),
        seconds=time.perf_counter() - start,
        plan=str(plan),  # a Partitioner member is its string; cache hits load a str
        save_everything_bytes=_bytes(everything),
        simple_bytes=_bytes(simple),
        budget_bytes=budget_bytes,
        unbanned=tuple(n.name for n in unbanned),
        executor=executor,
        recomputations=tuple(
            _recomputation(n, costs, executor, policy, frozenset(unbanned)) for n in recomputed
        ),
    )


def _recomputation(
    node: fx.Node,
    costs: dict[fx.Node, RecomputeCost],
    executor: Executor,
    policy: RecomputePolicy,
    unbanned: frozenset[fx.Node],
) -> Recomputation:
    cost = costs.get(node) or recompute_cost(node, executor, policy)
    return Recomputation(
        name=node.name,
        producer=str(node.target),
        nbytes=0 if _view_root(node) is not node else node_nbytes(node),
        cost=cost,
        reason=RecomputeReason.BUDGET if node in unbanned else RecomputeReason.FREE,
    )


def _sides(roles: _Roles, saved: set[fx.Node]) -> tuple[set[fx.Node], set[fx.Node]]:
    """The nodes the forward runs and the nodes the backward runs, for this saved set."""
    stop = frozenset(saved) | frozenset(roles.tangents)
    bwd_nodes = ancestors((v for v, _ in roles.grad_pairs), stop) - frozenset(saved)
    bwd_nodes -= set(roles.tangents)
    # Random ops run in the forward even when nothing reads them (they advance the RNG), and
    # with them the values they read (`torch.rand_like(a * 2)`).
    fwd_nodes = ancestors([*roles.fwd_values, *saved, *roles.random]) | set(roles.primals)
    return fwd_nodes, bwd_nodes


def _settle(
    roles: _Roles,
    saved: set[fx.Node],
    costs: dict[fx.Node, RecomputeCost],
    unbanned: frozenset[fx.Node],
) -> set[fx.Node]:
    """`saved`, plus every non-free node that would otherwise run in both graphs.

    The cut bans recomputing the nodes the forward needs anyway, but a node only the backward
    needs runs in the forward too when a saved value depends on it (`c = cos(x)` feeding a
    smaller saved `s = c.sum(1)` and, unsaved, a backward op): the flow network counts saving
    bytes, not running `c` twice. Saving such a node instead costs its bytes and no time; it may
    leave an earlier saved value unread, which is dropped."""
    saved = set(saved)
    while True:
        fwd_nodes, bwd_nodes = _sides(roles, saved)
        twice = {
            n
            for n in fwd_nodes & bwd_nodes
            if n in costs and not costs[n].is_free and n not in unbanned
        }
        more = _tensor_saves(twice) - saved
        if not more:
            break
        saved |= more
    _, bwd_nodes = _sides(roles, saved)
    read = {i for n in bwd_nodes for i in n.all_input_nodes} | {v for v, _ in roles.grad_pairs}
    return {n for n in saved if n in read}


def _build(
    joint: JointGraph, roles: _Roles, saved: set[fx.Node], mutated_args: frozenset[GraphArg]
) -> tuple[StageGraph, StageGraph, list[fx.Node], list[fx.Node]]:
    graph = joint.module.graph
    # Tensors first, then sizes: see Note [Saved SymInts].
    saved_nodes = sorted(saved, key=lambda n: (is_sym_node(n), roles.order[n]))
    fwd_nodes, bwd_nodes = _sides(roles, saved)
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


def _lookup(env: dict[fx.Node, fx.Node], value: fx.node.Argument) -> fx.node.Argument:
    return env[value] if isinstance(value, fx.Node) else value


def _saved_value(node: fx.Node) -> SavedValue:
    val = node.meta.get("val")
    return SavedValue(
        name=node.name,
        nbytes=node_nbytes(node),
        shape=tuple(val.shape) if isinstance(val, torch.Tensor) else None,
        dtype=val.dtype if isinstance(val, torch.Tensor) else None,
        producer="input" if node.op == "placeholder" else str(node.target),
        source=source_line(node),
        is_symint=is_sym_node(node),
    )


def source_line(node: fx.Node) -> str:
    """The node's user module and source line (see passes/provenance.py), or ''."""
    return describe_source(source_of(node))
