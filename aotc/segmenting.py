"""Segmenting: find eager's node boundaries between a trace's outputs, and mark them.

Stage: `mark_segments(outputs, fwd_outs, stops) -> Segmentation | None`, called by the joint
trace (aotc/tracer.py) after the program ran and before its backward is traced.
Requires: `outputs` are the trace's differentiable forward outputs (autograd history recorded),
`fwd_outs` their FwdOut positions, `stops` the primals gradients are taken for.
Ensures: None when the call is one segment, or when a gradient would cross between segments
other than into an output's slot (Note [Segments] in passes/segments.py); else the segments, in
an order where each comes after those it consumes, with a pre-hook on the `grad_fn` of every
consumed output that marks the gradient at its slot (Note [Gradients at segment boundaries]).
The hooks live on the trace's own autograd nodes and die with them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

from aotc.passes.segments import MARKER, Segmentation
from aotc.runtime.schema import FwdOut

# Heuristic: a trace with more autograd nodes than this is not segmented (the walk is Python,
# ~1 us a node; the largest programs keep the one-node behaviour they had).
MAX_NODES = 200_000


class MadeTensors(TorchFunctionMode):
    """The tensors a traced program makes, by the autograd slot (`grad_fn`, `output_nr`) they
    come out of: where a segment boundary is a value the call does not return, the trace
    returns it too (Note [Hidden segment boundaries] in passes/segments.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.made: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not torch.is_grad_enabled():
            return out  # no history recorded (and a no_grad view's grad_fn may raise)
        if isinstance(out, torch.Tensor):
            self._add(out)
        elif isinstance(out, (tuple, list)):
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self._add(t)
        return out

    def _add(self, t: torch.Tensor) -> None:
        if not t.requires_grad:
            return
        try:
            fn = t.grad_fn
        except RuntimeError:  # a view eager forbids using (its error comes where it is used)
            return
        if fn is not None:  # the node is held: ids of freed nodes are reused
            self.made[(id(fn), t.output_nr)] = (fn, t)


def mark_segments(
    outputs: Sequence[torch.Tensor],
    fwd_outs: Sequence[FwdOut],
    stops: Sequence[torch.Tensor],
    views: Sequence[tuple[torch.Tensor, FwdOut, FwdOut]] = (),
    made: MadeTensors | None = None,
    next_out: int = 0,
    input_views: Sequence[tuple[torch.Tensor, int, torch.Tensor]] = (),
) -> tuple[Segmentation | None, list[torch.Tensor]]:
    """`views`: the outputs the runtime regenerates as views of a differentiable output (the
    trace's view, its FwdOut, its base's FwdOut); see Note [Views other outputs are computed
    from] in passes/segments.py. `made`: the program's tensors by autograd slot, for boundaries
    at values it does not return, which become forward outputs `next_out`, `next_out + 1`...:
    also returns those values (Note [Hidden segment boundaries]). `input_views`: the outputs
    the runtime regenerates as views of inputs (the trace's view, its UserOut, the input); the
    segmentation names each by `FwdOut(num_fwd + j)`, `num_fwd` the forward outputs with the
    hidden boundaries, `j` its UserOut."""
    found = _mark(outputs, fwd_outs, stops, views, made, next_out, input_views)
    if found is None:
        return None, []
    return found


def _mark(
    outputs: Sequence[torch.Tensor],
    fwd_outs: Sequence[FwdOut],
    stops: Sequence[torch.Tensor],
    views: Sequence[tuple[torch.Tensor, FwdOut, FwdOut]],
    made: MadeTensors | None,
    next_out: int,
    input_views: Sequence[tuple[torch.Tensor, int, torch.Tensor]],
) -> tuple[Segmentation, list[torch.Tensor]] | None:
    if len(outputs) + len(input_views) < 2 or not outputs:
        return None
    roots: list[tuple[Any, int]] = []
    for t in outputs:
        if t.grad_fn is None:
            return None
        roots.append((t.grad_fn, t.output_nr))
    n_real = len(roots)
    view_outs: list[tuple[torch.Tensor, FwdOut | int, FwdOut | torch.Tensor]] = [
        (t, k, b) for t, k, b in views if t.grad_fn is not None and b in fwd_outs
    ]
    # An input's view is named by its UserOut until the hidden boundaries are counted.
    view_outs += [(t, j, base) for t, j, base in input_views if t.grad_fn is not None]
    roots += [(t.grad_fn, t.output_nr) for t, _, _ in view_outs]
    slots: list[Any] = [*fwd_outs, *(k for _, k, _ in view_outs)]
    slot_of = {(id(fn), nr): i for i, (fn, nr) in enumerate(roots)}
    if len(slot_of) != len(roots):
        return None  # one tensor returned twice
    # Every node is held while it is walked: torch 2.11 reuses a freed node's Python object id.
    stop = {id(p.grad_fn): p.grad_fn for p in stops if p.grad_fn is not None}
    nodes: dict[int, Any] = {}
    postorder: list[Any] = []
    for fn, _ in roots:
        if id(fn) in nodes:
            continue
        nodes[id(fn)] = fn
        stack: list[tuple[Any, int]] = [(fn, 0)]
        while stack:
            node, i = stack.pop()
            nexts = node.next_functions
            while i < len(nexts):
                child = nexts[i][0]
                i += 1
                if child is None or id(child) in stop or id(child) in nodes:
                    continue
                if not child.next_functions and type(child).__name__ == "AccumulateGrad":
                    continue
                nodes[id(child)] = child
                stack.append((node, i))
                stack.append((child, 0))
                break
            else:
                postorder.append(node)
                continue
        if len(nodes) > MAX_NODES:
            return None
    order = postorder[::-1]  # every node before the nodes it feeds gradients into
    sig: dict[int, int] = dict.fromkeys(nodes, 0)
    for i, (fn, _) in enumerate(roots):
        sig[id(fn)] |= 1 << i
    for node in order:
        mask = sig[id(node)]
        for child, _ in node.next_functions:
            if child is not None and id(child) in sig:
                sig[id(child)] |= mask
    table = made.made if made is not None else {}
    planned = _plan(order, sig, roots, slot_of, n_real, [b for _, _, b in view_outs], slots, table)
    if view_outs and (
        planned is None or not any(n_real <= i < len(roots) for takes in planned[1] for i in takes)
    ):  # no output is computed from a regenerated view: plan without them
        real = (1 << n_real) - 1
        sig = {k: m & real for k, m in sig.items() if m & real}
        order = [n for n in order if id(n) in sig]
        roots = roots[:n_real]
        slot_of = {key: i for key, i in slot_of.items() if i < n_real}
        planned = _plan(order, sig, roots, slot_of, n_real, [], slots, table)
    if planned is None:
        return None
    ranked, takes, hidden = planned
    n_roots = len(roots)
    hidden_outs = [FwdOut(next_out + h) for h in range(len(hidden))]
    first_pseudo = next_out + len(hidden)
    named = [
        FwdOut(first_pseudo + k) if isinstance(b, torch.Tensor) else k
        for _, k, b in view_outs[: n_roots - n_real]
    ]
    slots = [*slots[:n_real], *named, *hidden_outs]
    sigs = [sig[id(fn)] for fn, _ in roots] + [sig[id(fn)] for fn, _ in hidden]
    owned = tuple(tuple(slots[i] for i in range(len(sigs)) if sigs[i] == m) for m in ranked)
    consumes = tuple(tuple(slots[i] for i in sorted(t)) for t in takes)
    consumed = sorted({i for t in takes for i in t})
    every = [*roots, *hidden]
    by_node: dict[int, dict[int, FwdOut]] = {}
    for i in consumed:
        fn, nr = every[i]
        by_node.setdefault(id(fn), {})[nr] = slots[i]
    for fn_id, marks in by_node.items():
        nodes[fn_id].register_prehook(_marking(marks))
    regenerated = tuple(slots[i] for i in range(n_real, n_roots))
    values = [table[(id(fn), nr)][1] for fn, nr in hidden]
    return Segmentation(owned, consumes, regenerated, tuple(hidden_outs)), values


def _plan(
    order: list[Any],
    sig: dict[int, int],
    roots: list[tuple[Any, int]],
    slot_of: dict[tuple[int, int], int],
    n_real: int,
    view_bases: list[Any],
    slots: list[FwdOut],
    made: dict[tuple[int, int], tuple[Any, torch.Tensor]],
) -> tuple[list[int], list[set[int]], list[tuple[Any, int]]] | None:
    """The segments' signatures in creation order, the values each takes (indices into the
    roots, then into the hidden boundaries), and the hidden boundaries' (node, slot); or None
    when the call keeps one node. Roots from `n_real` on are regenerated views: each must be the
    only output of its segment, whose nodes are the chain of view nodes from it to its base's
    slot. A gradient into a value no root is at becomes a hidden boundary where `made` knows
    the value, it is not a view, and its node's signature is a segment's."""
    owners = {sig[id(fn)] for fn, _ in roots}
    real_owners = {sig[id(fn)] for fn, _ in roots[:n_real]}
    if len(owners) < 2:
        return None
    takes: dict[int, set[int]] = {m: set() for m in owners}
    count: dict[int, int] = dict.fromkeys(owners, 0)
    hidden: dict[tuple[int, int], int] = {}
    hidden_at: list[tuple[Any, int]] = []
    for node in order:
        mask = sig[id(node)]
        if mask not in owners:
            return None
        count[mask] += 1
        for child, nr in node.next_functions:
            if child is None or id(child) not in sig or sig[id(child)] == mask:
                continue
            key = (id(child), nr)
            out = slot_of.get(key)
            if out is None:
                out = hidden.get(key)
            if out is None:
                value = made.get(key)
                if value is None or sig[id(child)] not in real_owners:
                    return None  # a gradient into a value the trace cannot return: one node
                out = hidden[key] = len(roots) + len(hidden_at)
                hidden_at.append((child, nr))
            takes[mask].add(out)
    for v in range(n_real, len(roots)):
        mask = sig[id(roots[v][0])]
        if mask in real_owners or sum(sig[id(fn)] == mask for fn, _ in roots) != 1:
            return None  # a view sharing its nodes with another output
        base = view_bases[v - n_real]
        walked = _chain(roots[v][0], mask, sig)
        if walked is None or walked[0] != count[mask]:
            return None  # not a plain view (the runtime regenerates it from its base)
        if isinstance(base, torch.Tensor):  # a view of an input: the chain ends at the input
            if takes[mask] or not _is_node_of(walked[1], base):
                return None
        elif takes[mask] != {slots.index(base)} or walked[1] != roots[slots.index(base)]:
            return None
    # Supersets first: a segment's consumed outputs belong to segments reaching more outputs.
    ranked = sorted(owners, key=lambda m: (-bin(m).count("1"), m & -m))
    return ranked, [takes[m] for m in ranked], hidden_at


def _chain(fn: Any, mask: int, sig: dict[int, int]) -> tuple[int, tuple[Any, int]] | None:
    """Walking from `fn` through the nodes of signature `mask`, each with one edge (a view's
    node): how many nodes, and the (node, slot) the walk leaves them at; None when one has
    several edges or none."""
    length = 0
    while True:
        length += 1
        edges = [(c, nr) for c, nr in fn.next_functions if c is not None]
        if len(edges) != 1:
            return None
        child, nr = edges[0]
        if id(child) not in sig or sig[id(child)] != mask:
            return length, (child, nr)
        fn = child


def _is_node_of(end: tuple[Any, int], t: torch.Tensor) -> bool:
    """Whether the edge `end` leads to tensor `t`'s own slot: its grad_fn's, or its
    AccumulateGrad when it is a leaf."""
    node, nr = end
    if t.grad_fn is not None:
        return node is t.grad_fn and nr == t.output_nr
    return getattr(node, "variable", None) is t


def _marking(slots: dict[int, FwdOut]) -> Any:
    def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...]:
        return tuple(
            MARKER(g, int(slots[i])) if i in slots and g is not None else g
            for i, g in enumerate(grad_outputs)
        )

    return hook
