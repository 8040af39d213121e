"""Segments: one autograd node per group of outputs, where eager's graph has a boundary.

Records: `Segmentation` (found by the joint trace, aotc/segmenting.py: which differentiable
forward outputs each node returns, and which outputs of earlier nodes it takes as inputs),
`SegmentBackward` (one node's backward graph, cut out of the partition's).
Stages: `split_backward(backward, segmentation, num_graph_args) -> tuple[SegmentBackward, ...]
| None`; `strip_markers(graph) -> StageGraph` (the graph without the trace's markers, for entries
that run as one node and for the records).
Requires: `backward` is a partition's backward graph (saved values, then tangents; gradients of
graph args), traced with the markers of Note [Gradients at segment boundaries].
Ensures: every segment's graph reads the saved values it needs (a subset, in order) and the
gradients of the outputs it owns, and returns its contribution to the gradient of each graph arg
and of each earlier output it consumes: summed by autograd, the contributions are the partition's
gradients. None when the backward does not split along the boundaries (the entry then runs as one
node).

Note [Segments]
~~~~~~~~~~~~~~~
A compiled call used to be one autograd node whatever it returned. Where eager's graph runs
gradients from one output into another, one node differs from eager:

    y = x * 2
    return y, y.sin()      # z = y.sin() is computed from the output y

- a hook on `y` (`y.register_hook`, `retain_grad`) sees only the gradient that reaches `y` from
  outside, not the part that flows in from `z`; a hook that changes it changes the wrong sum
  (Grad-CAM's hooks on returned features, `.grad` of a retained hidden state);
- `torch.autograd.grad(z, y)` finds no path from `z` to `y` ("not used" or a silent None);
- outputs whose graphs share nothing (`return a, b`) share one node, so a backward from `a` frees
  what `b`'s backward needs: `a.sum().backward(); b.sum().backward()` raised where eager runs.

AOTAutograd has the same three differences. aotc follows eager's boundaries instead: the trace
groups the differentiable outputs by *which outputs each autograd node of the program reaches*
(its signature). Nodes with one signature form a segment; a segment owns the outputs whose
`grad_fn` it holds. `y`'s node reaches `{y, z}` and `sin`'s only `{z}`: two segments, the second
taking `y` as an input. Independent outputs are segments of their own. Gradients cross
between segments into an owned output's slot, into a regenerated view (Note [Views other outputs
are computed from]) or into a value the call does not return (Note [Hidden segment
boundaries]); a node whose signature is no segment's keeps the call one node. The compiled call still runs one forward graph;
it then creates one node per segment, in an order where a segment comes after those whose outputs
it consumes (runtime/segments.py). The engine sums what each segment returns for a graph arg or
a consumed output, as eager's engine sums its nodes' contributions, and runs each segment's
backward only when a gradient reaches it. A program with one output, or whose outputs all reach
the same nodes, is one segment: nothing changes for it.

Note [Gradients at segment boundaries]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The backward is traced as one graph, so the trace marks where a segment boundary's gradient is
complete: a pre-hook on the `grad_fn` of each consumed output wraps the gradient arriving at that
output's slot, which autograd has already summed over the output's own tangent and every
consumer, in `aotc::segment_grad(g, out)`. In the traced graph the marker's input is that sum,
and everything after it is the owning segment's backward. `split_backward` cuts there: the
owning segment reads the marker's value as the gradient of its output (autograd delivers it at
run time, summed the same way), and each consumer segment returns its own terms of the sum. The
same cut applies to the gradients of graph args. Only sums may mix segments: a graph whose other
ops mix them, or whose tangent of a consumed output reaches anything but its marker's sum, keeps
one node. The markers never reach a graph that runs: `split_backward` and `strip_markers` take
them out.

Note [Views other outputs are computed from]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
An output that is a view of a value the call computes (GPT-2's last hidden state is
`hidden.view(shape)`, and the LM head reads it) is not a node's output: the runtime regenerates
it as a view of its base, which a node returns (Note [Output aliasing] in aotc/aliasing.py), so
its own `grad_fn` is autograd's view node. A segment computed from the view would, taking the
base, send its gradient past the view's node: the view's hooks and `.grad` would miss it. So the
trace walks these views too: the nodes only a view (and what is computed from it) reaches form
the view's segment, which must be exactly the chain of view nodes from the view to its base's
slot. Such a segment has no compiled node: at run time, after the base's node ran, the runtime
regenerates the view (the same tensor the user gets back) and hands it to the segments computed
from it, whose backwards return their terms of its gradient; autograd's view node carries the sum
to the base, as in eager. Where no output is computed from a view, the views are left out of the
walk, and the segments are those the differentiable outputs alone give.

Note [Hidden segment boundaries]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Eager's boundary is often a value the call does not return: attention that returns its
probabilities computes both them and its output from one normalized input `h`; T5 adds one
position bias to every layer. The gradient from the later segment flows into `h`'s node, which
belongs to the earlier one. The trace records, during the program, every tensor by the autograd
slot it comes out of (`MadeTensors`); where the walk finds a gradient entering another segment
at a slot no output is at, it looks the value up there and makes it a forward output after the
entry's own (the user never sees it): the earlier segment's node returns it, later ones take it,
and its marker cuts the backward as for an output. Unlike an output, the earlier segment itself
may add to the value's gradient (`h` feeds its own nodes too): its backward adds those terms to
the gradient autograd gives its node for `h`, the later segments' sum. The value may be a view
(GPT-2's `value` is a `split` of one projection whose other parts feed the attention
probabilities): the earlier node returns it as it is. A value the table does not know (made
inside a composite op), or one whose node has no segment's signature, keeps the call one node.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from aotc.passes.descriptors import GradOutput, InputDesc, OutputDesc, SavedInput, TangentInput
from aotc.passes.ir import StageGraph, make_module
from aotc.runtime.schema import FwdOut, GraphArg

aten = torch.ops.aten


@torch.library.custom_op("aotc::segment_grad", mutates_args=())
def segment_grad(grad: torch.Tensor, out: int) -> torch.Tensor:
    """The gradient arriving at forward output `out`'s slot (Note [Gradients at segment
    boundaries]); an identity that only the trace calls."""
    return grad.clone()


@segment_grad.register_fake
def _segment_grad_fake(grad: torch.Tensor, out: int) -> torch.Tensor:
    return torch.empty_like(grad)


MARKER = torch.ops.aotc.segment_grad.default

# Where the trace leaves its `Segmentation` for the compile driver: the joint module's meta.
SEGMENTS_KEY = "aotc_segments"


@dataclass(frozen=True, slots=True)
class Segmentation:
    """The segments of one training trace (Note [Segments]), in node creation order."""

    owned: tuple[tuple[FwdOut, ...], ...]  # per segment: the diff outputs its node returns
    consumes: tuple[tuple[FwdOut, ...], ...]  # per segment: earlier segments' outputs it takes
    # Views the runtime regenerates from their base: a segment owning one has no node of its own
    # (Note [Views other outputs are computed from]).
    regenerated: tuple[FwdOut, ...] = ()
    # Values the call does not return that are segment boundaries: forward outputs after the
    # entry's own, returned by their segment's node only (Note [Hidden segment boundaries]).
    hidden: tuple[FwdOut, ...] = ()

    def format(self) -> str:
        return "\n".join(
            f"segment {s}: "
            + ("regenerated view " if set(owned) <= set(self.regenerated) else "returns ")
            + ", ".join(f"fwd_out{k}" for k in owned)
            + (f"; takes {', '.join(f'fwd_out{k}' for k in takes)}" if takes else "")
            for s, (owned, takes) in enumerate(zip(self.owned, self.consumes))
        )


@dataclass(frozen=True, slots=True)
class SegmentBackward:
    """One segment node's backward. Inputs: saved values (`saved`: positions among the
    partition's saved values), then one gradient per owned output; outputs: `GradOutput(a)` per
    node argument `a` it contributes to: graph args first, then the consumed outputs
    (`num_graph_args + j` for the j-th of `consumes`)."""

    backward: StageGraph
    saved: tuple[int, ...]
    owned: tuple[FwdOut, ...]
    consumes: tuple[FwdOut, ...]


def is_marker(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is MARKER


def has_markers(module: fx.GraphModule) -> bool:
    return any(is_marker(n) for n in module.graph.nodes)


def strip_markers(graph: StageGraph) -> StageGraph:
    """`graph` with every marker replaced by its input (the graph the trace would have given
    without them); the same record when it has none."""
    if not has_markers(graph.module):
        return graph
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in graph.module.graph.nodes:
        if is_marker(node):
            env[node] = env[node.args[0]]
            continue
        env[node] = g.node_copy(node, env.__getitem__)
    return StageGraph(make_module(graph.module, g), graph.inputs, graph.outputs)


_EXTERNAL = -1  # the tag of a consumed output's own tangent: autograd adds it at run time


def split_backward(
    backward: StageGraph, segmentation: Segmentation, num_graph_args: int
) -> tuple[SegmentBackward, ...] | None:
    """The per-segment backward graphs of Note [Gradients at segment boundaries], or None when
    `backward` does not split (see there)."""
    graph = backward.module.graph
    hidden = set(segmentation.hidden)
    consumes = segmentation.consumes
    owner = {k: s for s, outs in enumerate(segmentation.owned) for k in outs}
    consumed = {k for takes in segmentation.consumes for k in takes}
    markers: dict[FwdOut, fx.Node] = {}
    for node in graph.nodes:
        if is_marker(node):
            k = FwdOut(int(node.args[1]))
            if k in markers or k not in consumed:
                return None
            markers[k] = node
    if set(markers) != consumed:
        return None
    # tags[n]: the segments whose gradients n is computed from; (_EXTERNAL, k): from the
    # tangent of consumed output k, which only its marker's sum may read.
    tags: dict[fx.Node, frozenset[tuple[int, FwdOut]]] = {}
    saved_nodes: list[fx.Node] = []
    tangent: dict[FwdOut, fx.Node] = {}
    for node, desc in zip(backward.placeholders(), backward.inputs, strict=True):
        if isinstance(desc, TangentInput):
            if desc.out not in owner:
                return None
            tangent[desc.out] = node
            tag = (_EXTERNAL, desc.out) if desc.out in consumed else (owner[desc.out], desc.out)
            tags[node] = frozenset({tag})
        else:
            saved_nodes.append(node)
            tags[node] = frozenset()
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    for node in graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if is_marker(node):
            k = FwdOut(int(node.args[1]))
            tags[node] = frozenset({(owner[k], k)})
            continue
        tags[node] = frozenset().union(*(tags[a] for a in node.all_input_nodes))

    def segments(node: fx.Node) -> set[int]:
        return {s for s, _ in tags[node]}

    def is_sum(node: fx.Node) -> bool:
        return (
            node.op == "call_function"
            and node.target is aten.add.Tensor
            and len(node.args) == 2
            and not node.kwargs
            and all(isinstance(a, fx.Node) for a in node.args)
        )

    mixed = {n for n in tags if n.op == "call_function" and len(segments(n)) > 1}
    for node in mixed:
        if is_marker(node) or not is_sum(node):
            return None
        if any(u not in mixed and not is_marker(u) and u is not output for u in node.users):
            return None
    for k in consumed:  # a consumed output's own tangent: only into its marker's sum
        if any(
            _EXTERNAL in segments(n) and n not in mixed and n is not tangent.get(k)
            for n in tags
            if n.op == "call_function" and not is_marker(n)
        ):
            return None

    def terms(value: fx.Node) -> list[tuple[int, fx.Node]] | None:
        if value in mixed:
            a, b = value.args
            left, right = terms(a), terms(b)  # type: ignore[arg-type]
            return None if left is None or right is None else left + right
        found = segments(value)
        if len(found) != 1:
            return None  # a gradient computed from no gradient at all: keep one node
        return [(found.pop(), value)]

    # Each sink's terms, per segment: graph args' gradients, and the sums at the markers.
    per_arg: list[tuple[GraphArg, list[tuple[int, fx.Node]]]] = []
    for value, out_desc in zip(output.args[0], backward.outputs, strict=True):
        if not isinstance(out_desc, GradOutput) or not isinstance(value, fx.Node):
            return None
        found = terms(value)
        if found is None or any(s == _EXTERNAL for s, _ in found):
            return None
        per_arg.append((out_desc.arg, found))
    per_marker: dict[FwdOut, list[tuple[int, fx.Node]]] = {}
    for k, marker in markers.items():
        found = terms(marker.args[0])  # type: ignore[arg-type]
        if found is None:
            return None
        external = [n for s, n in found if s == _EXTERNAL]
        if external not in ([], [tangent[k]] if k in tangent else []):
            return None
        rest = [(s, n) for s, n in found if s != _EXTERNAL]
        # Only a hidden boundary's own segment adds to its gradient (Note [Hidden segment
        # boundaries]): its backward adds those terms to what the consumers send.
        if any(
            (s == owner[k] and k not in hidden) or (s != owner[k] and k not in consumes[s])
            for s, _ in rest
        ):
            return None
        per_marker[k] = rest

    result = []
    for s, (owned, takes) in enumerate(zip(segmentation.owned, segmentation.consumes)):
        sinks: list[tuple[int, list[fx.Node]]] = [
            (a, [n for t, n in found if t == s]) for a, found in per_arg
        ]
        sinks += [
            (num_graph_args + j, [n for t, n in per_marker[k] if t == s])
            for j, k in enumerate(takes)
        ]
        sinks = [(a, nodes) for a, nodes in sinks if nodes]
        own = {k: [n for t, n in per_marker[k] if t == s] for k in owned if k in per_marker}
        built = _segment_graph(
            backward,
            s,
            owned,
            sinks,
            saved_nodes,
            tangent,
            markers,
            tags,
            mixed,
            {k: nodes for k, nodes in own.items() if nodes},
        )
        if built is None:
            return None
        graph_s, saved = built
        result.append(SegmentBackward(graph_s, saved, owned, takes))
    return tuple(result)


def _segment_graph(
    backward: StageGraph,
    s: int,
    owned: tuple[FwdOut, ...],
    sinks: Sequence[tuple[int, list[fx.Node]]],
    saved_nodes: list[fx.Node],
    tangent: dict[FwdOut, fx.Node],
    markers: dict[FwdOut, fx.Node],
    tags: dict[fx.Node, frozenset[tuple[int, FwdOut]]],
    mixed: set[fx.Node],
    own_terms: dict[FwdOut, list[fx.Node]],
) -> tuple[StageGraph, tuple[int, ...]] | None:
    """Segment `s`'s graph: the nodes its sinks are computed from, cut at its own markers. A
    marker with `own_terms` (a hidden boundary this segment adds to) becomes the sum of the
    gradient the node is given and those terms."""
    inputs_of = {k: markers.get(k, tangent.get(k)) for k in owned}
    stops = {n for n in inputs_of.values() if n is not None}
    needed: set[fx.Node] = set()
    stack = [n for _, nodes in sinks for n in nodes]
    stack += [n for nodes in own_terms.values() for n in nodes]
    while stack:
        node = stack.pop()
        if node in needed:
            continue
        if node in mixed or any(t != s for t, _ in tags[node]):
            return None  # another segment's value (by construction only through a marker)
        needed.add(node)
        if node not in stops and node.op != "placeholder":
            stack.extend(node.all_input_nodes)
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    in_descs: list[InputDesc] = []
    saved: list[int] = []
    for i, node in enumerate(saved_nodes):
        if node in needed:
            env[node] = g.node_copy(node)
            desc = _saved_desc(backward, node)
            in_descs.append(desc)
            saved.append(i)
    given: dict[fx.Node, fx.Node] = {}  # a marker with own terms: the gradient it is given
    for k in owned:
        source = inputs_of[k]
        placeholder = g.placeholder(f"grad_fwd_out{k}")
        if source is not None:
            placeholder.meta = dict(source.meta)
            if k in own_terms:
                given[source] = placeholder
            else:
                env[source] = placeholder
        in_descs.append(TangentInput(k))
    for node in backward.module.graph.nodes:
        if node in given and node in needed:
            total = given[node]
            for n in own_terms[FwdOut(int(node.args[1]))]:
                total = g.call_function(aten.add.Tensor, (total, env[n]))
                total.meta = dict(node.meta)
            env[node] = total
        elif node in needed and node not in env:
            env[node] = g.node_copy(node, env.__getitem__)
    results: list[fx.Node] = []
    out_descs: list[OutputDesc] = []
    for a, nodes in sinks:
        total = env[nodes[0]]
        for n in nodes[1:]:
            added = g.call_function(aten.add.Tensor, (total, env[n]))
            added.meta = dict(n.meta)
            total = added
        results.append(total)
        out_descs.append(GradOutput(GraphArg(a)))
    g.output(tuple(results))
    return (
        StageGraph(make_module(backward.module, g), tuple(in_descs), tuple(out_descs)),
        tuple(saved),
    )


def _saved_desc(backward: StageGraph, node: fx.Node) -> InputDesc:
    for n, desc in zip(backward.placeholders(), backward.inputs, strict=True):
        if n is node:
            assert isinstance(desc, SavedInput)
            return desc
    raise AssertionError(f"{node.name} is not a placeholder of the backward")


__all__ = [
    "MARKER",
    "SEGMENTS_KEY",
    "SegmentBackward",
    "Segmentation",
    "has_markers",
    "is_marker",
    "padded_backward",
    "split_backward",
    "strip_markers",
]


def padded_backward(
    backward: fx.GraphModule, saved: Sequence[int], num_saved: int
) -> fx.GraphModule:
    """A segment's backward taking every saved value of the entry (its own at `saved`), as the
    entry's differentiable backward composes a backward with the forward (aotc/higher_order.py)."""
    g = fx.Graph()
    placeholders = [n for n in backward.graph.nodes if n.op == "placeholder"]
    own = dict(zip(saved, placeholders))
    env: dict[fx.Node, fx.Node] = {}
    for i in range(num_saved):
        node = own.get(i)
        new = g.placeholder(node.name if node is not None else f"unused_saved{i}")
        if node is not None:
            new.meta = dict(node.meta)
            env[node] = new
    for node in backward.graph.nodes:
        if node not in env:
            env[node] = g.node_copy(node, env.__getitem__)
    return make_module(backward, g)
