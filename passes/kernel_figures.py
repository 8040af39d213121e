"""Static figures of one lowered graph: how much runs as generated kernels, and their traffic.

Stage: `kernel_figures(plan, generated) -> runtime.kernels.KernelFigures`.
Requires: the fusion plan of a graph and the names of its groups that became kernels (a group
whose kernel could not be generated runs its ops as ATen calls).
Ensures:
- coverage: the pointwise, reduction, scan and indexing nodes of the decomposed graph (torch's
  `pointwise`/`reduction` tags, plus the ops in `_ELIGIBLE`), how many run inside generated
  kernels, and which ATen ops the others are (op name, count);
- traffic, in bytes, when sizes are static: `kernel_bytes`, what the generated kernels read and
  write (each kernel reads each input buffer once and writes each stored buffer once, as its
  header says); `aten_bytes`, what the ATen calls read and write (inputs and outputs of each
  non-view call); `min_bytes`, every graph input read once and every graph output written once
  (the least any implementation moves); `fusion_min_bytes`, the least the kernels must move
  given the ATen calls: every buffer kernels read but do not produce read once, every buffer
  they produce that a graph output or an ATen call needs written once. `kernel_bytes /
  fusion_min_bytes` measures fusion alone (1.0: nothing is stored or re-read that need not be).

Worked example, the forward of RMSNorm `x * rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w`
on float32 x[4, 8], w[8]: one reduction kernel reads x and w and writes the output: coverage
6/6, kernel_bytes = 128 + 32 + 128 = min_bytes = fusion_min_bytes.
"""

from __future__ import annotations

import operator
from collections import Counter

import torch
from torch import fx

from aotc.passes.fusion import FusionPlan, GroupKind
from aotc.passes.loop_ir import is_static
from aotc.passes.lowering import is_view_node
from aotc.passes.lowering_ir import Computed, Extern
from aotc.runtime.kernels import KernelFigures

aten = torch.ops.aten

# Not tagged pointwise/reduction by torch, but the kind of op generated kernels are for.
_ELIGIBLE = {
    aten.cat.default,
    aten.gather.default,
    aten.index.Tensor,
    aten.index_select.default,
    aten.embedding.default,
    aten.cumsum.default,
    aten.cumprod.default,
    aten.argmax.default,
    aten.argmin.default,
    aten.where.self,
    aten.clone.default,
    aten._to_copy.default,
    torch.ops.prims.convert_element_type.default,
}


def is_eligible(node: fx.Node) -> bool:
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if target in _ELIGIBLE:
        return True
    tags = target.tags
    return torch.Tag.pointwise in tags or torch.Tag.reduction in tags


def kernel_figures(plan: FusionPlan, generated: set[str]) -> KernelFigures:
    module = plan.lowered.module
    in_kernels: set[fx.Node] = set()
    aten_nodes: list[fx.Node] = []
    for group in plan.groups:
        if group.kind is GroupKind.EXTERN:
            ext = group.members[0]
            assert isinstance(ext, Extern)
            aten_nodes.append(ext.node)
            continue
        cone = {n for m in group.members if isinstance(m, Computed) for n in m.cone}
        if group.name in generated:
            in_kernels |= cone
        else:
            aten_nodes += sorted(cone, key=lambda n: n.name)
    eligible = [n for n in module.graph.nodes if is_eligible(n)]
    fallback = Counter(str(n.target) for n in eligible if n not in in_kernels)
    figures = KernelFigures(
        eligible_ops=len(eligible),
        kernel_ops=sum(1 for n in eligible if n in in_kernels),
        fallback_ops=tuple(sorted(fallback.items())),
        kernel_bytes=None,
        aten_bytes=None,
        min_bytes=None,
        fusion_min_bytes=None,
    )
    if plan.lowered.symbols:
        return figures  # byte counts would be expressions; see KernelFigures
    return KernelFigures(
        **{
            **{f: getattr(figures, f) for f in ("eligible_ops", "kernel_ops", "fallback_ops")},
            **_traffic(plan, generated, module, aten_nodes),
        }
    )


def _traffic(
    plan: FusionPlan, generated: set[str], module: fx.GraphModule, aten_nodes: list[fx.Node]
) -> dict[str, int]:
    buffers = plan.lowered.buffers

    def nbytes(name: str) -> int:
        size, _, _, dtype = buffers[name]
        n = 1
        for s in size:
            n *= int(s)
        return n * int(dtype.itemsize)

    kernels = [g for g in plan.kernel_groups if g.name in generated]
    kernel_bytes = sum(int(g.bytes_read) + int(g.bytes_written) for g in kernels)
    aten_bytes = sum(_node_bytes(n) for n in aten_nodes)
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder" and n.users]
    out_node = next(n for n in reversed(module.graph.nodes) if n.op == "output")
    outputs = [n for n in dict.fromkeys(out_node.all_input_nodes) if n.op != "placeholder"]
    min_bytes = sum(_val_bytes(n.meta.get("val")) for n in [*placeholders, *outputs])
    produced = {s for g in kernels for s in g.stores}
    read = {b for g in kernels for b in g.reads}
    needed_outside = {o for o in plan.lowered.outputs if isinstance(o, str)} | {
        b for g in plan.groups if g.name not in generated for b in g.reads
    }
    boundary = (read - produced) | (produced & needed_outside)
    return {
        "kernel_bytes": kernel_bytes,
        "aten_bytes": aten_bytes,
        "min_bytes": min_bytes,
        "fusion_min_bytes": sum(nbytes(b) for b in sorted(boundary) if b in buffers),
    }


def _val_bytes(val: object) -> int:
    if isinstance(val, torch.Tensor):
        size = [int(s) if is_static(s) else 0 for s in val.shape]
        n = 1
        for s in size:
            n *= s
        return n * val.element_size()
    if isinstance(val, (tuple, list)):
        return sum(_val_bytes(v) for v in val)
    return 0


def _node_bytes(node: fx.Node) -> int:
    """What one ATen call reads and writes (a view, a getitem or a constant moves nothing)."""
    if node.op != "call_function" or node.target is operator.getitem or is_view_node(node):
        return 0
    reads = sum(_val_bytes(a.meta.get("val")) for a in node.all_input_nodes)
    return reads + _val_bytes(node.meta.get("val"))
