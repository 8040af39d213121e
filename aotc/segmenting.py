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

from aotc.passes.segments import MARKER, Segmentation
from aotc.runtime.schema import FwdOut

# Heuristic: a trace with more autograd nodes than this is not segmented (the walk is Python,
# ~1 us a node; the largest programs keep the one-node behaviour they had).
MAX_NODES = 200_000


def mark_segments(
    outputs: Sequence[torch.Tensor], fwd_outs: Sequence[FwdOut], stops: Sequence[torch.Tensor]
) -> Segmentation | None:
    if len(outputs) < 2:
        return None
    roots: list[tuple[Any, int]] = []
    for t in outputs:
        if t.grad_fn is None:
            return None
        roots.append((t.grad_fn, t.output_nr))
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
    owners = {sig[id(fn)] for fn, _ in roots}
    if len(owners) < 2:
        return None
    takes: dict[int, set[int]] = {m: set() for m in owners}
    for node in order:
        mask = sig[id(node)]
        if mask not in owners:
            return None
        for child, nr in node.next_functions:
            if child is None or id(child) not in sig or sig[id(child)] == mask:
                continue
            out = slot_of.get((id(child), nr))
            if out is None:
                return None  # a gradient into a value that is not an output: one node
            takes[mask].add(out)
    # Supersets first: a segment's consumed outputs belong to segments reaching more outputs.
    ranked = sorted(owners, key=lambda m: (-bin(m).count("1"), m & -m))
    owned = tuple(
        tuple(fwd_outs[i] for i in range(len(roots)) if sig[id(roots[i][0])] == m) for m in ranked
    )
    consumes = tuple(tuple(fwd_outs[i] for i in sorted(takes[m])) for m in ranked)
    consumed = sorted({i for m in ranked for i in takes[m]})
    by_node: dict[int, dict[int, FwdOut]] = {}
    for i in consumed:
        fn, nr = roots[i]
        by_node.setdefault(id(fn), {})[nr] = fwd_outs[i]
    for fn_id, slots in by_node.items():
        nodes[fn_id].register_prehook(_marking(slots))
    return Segmentation(owned, consumes)


def _marking(slots: dict[int, FwdOut]) -> Any:
    def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...]:
        return tuple(
            MARKER(g, int(slots[i])) if i in slots and g is not None else g
            for i, g in enumerate(grad_outputs)
        )

    return hook
