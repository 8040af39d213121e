"""Which forward values the backward may recompute instead of saving, and at what cost.

Policy, not a stage: `can_recompute(node, policy)` and `recompute_cost(node)` feed the min-cut
partitioner. Requires nodes with `meta["val"]` (fake values, static sizes).

Cheap (recomputable by default): pointwise ops, views and reshapes, broadcasts, copies and
factories, `getitem` of multi-output ops, and reductions over at most
`policy.reduction_max_numel` input elements. Expensive (never recomputed unless a memory budget
asks for it): matmuls, convolutions, attention, large reductions, and everything unknown. Random
ops are never recomputed: each runs exactly once, in the forward.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from aotc.passes.ir import is_sym_node, size_hint

aten = torch.ops.aten


@dataclass(frozen=True, slots=True)
class RecomputePolicy:
    # Heuristic: a reduction reading at most this many elements costs about as much as the
    # pointwise ops a fused kernel would fold it into; measured on LayerNorm/softmax rows
    # (<= 4096 features) where recomputing is cheaper than a round trip through memory.
    reduction_max_numel: int = 4096
    recompute_views: bool = True
    recompute_pointwise: bool = True


def _ops(*names: str) -> frozenset[object]:
    """OpOverloads by "name.overload", skipping any this torch version lacks."""
    found = []
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(aten, packet, None), overload, None)
        if op is not None:
            found.append(op)
    return frozenset(found)


_CHEAP_OPS = _ops(
    "_to_copy.default",
    "clone.default",
    "expand.default",
    "full.default",
    "zeros.default",
    "ones.default",
    "scalar_tensor.default",
    "full_like.default",
    "zeros_like.default",
    "ones_like.default",
    "empty_like.default",
    "cat.default",
    "stack.default",
    "where.self",
    "masked_fill.Scalar",
    "masked_fill.Tensor",
    "select_scatter.default",
    "slice_scatter.default",
    "fill.Scalar",
    "lift_fresh_copy.default",
    "arange.start",
    "arange.default",
    "arange.start_step",
    "constant_pad_nd.default",
    "repeat.default",
)
_REDUCTIONS = _ops(
    "sum.dim_IntList",
    "sum.default",
    "mean.dim",
    "mean.default",
    "amax.default",
    "amin.default",
    "max.dim",
    "min.dim",
    "var.correction",
    "var_mean.correction",
    "prod.dim_int",
    "logsumexp.default",
    "_softmax.default",
    "_log_softmax.default",
    "native_layer_norm.default",
    "linalg_vector_norm.default",
)
_MATMUL_LIKE = _ops(
    "mm.default",
    "bmm.default",
    "addmm.default",
    "baddbmm.default",
    "convolution.default",
    "_scaled_dot_product_flash_attention.default",
    "_scaled_dot_product_efficient_attention.default",
    "_scaled_dot_product_flash_attention_for_cpu.default",
)


def is_random(node: fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and (
        torch.Tag.nondeterministic_seeded in target.tags
    )


def _input_numel(node: fx.Node) -> int:
    first = node.args[0] if node.args else None
    val = first.meta.get("val") if isinstance(first, fx.Node) else None
    return size_hint(val.numel()) if isinstance(val, torch.Tensor) else 0


def can_recompute(node: fx.Node, policy: RecomputePolicy) -> bool:
    if node.op != "call_function" or is_random(node):
        return False
    target = node.target
    if target is operator.getitem or is_sym_node(node):  # sizes: see Note [Saved SymInts]
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if target._schema.is_mutable:
        return False
    if target.is_view:
        return policy.recompute_views
    if torch.Tag.pointwise in target.tags:
        return policy.recompute_pointwise
    if target in _CHEAP_OPS:
        return True
    if target in _REDUCTIONS:
        return _input_numel(node) <= policy.reduction_max_numel
    return False


def recompute_cost(node: fx.Node) -> float:
    """Rough work to recompute a node: multiply-adds for matmul-like ops, elements touched else."""
    val = node.meta.get("val")
    out_numel = size_hint(val.numel()) if isinstance(val, torch.Tensor) else 1
    if node.target in _MATMUL_LIKE:
        # Heuristic: 2*M*N*K ~ 2 * out_numel * K, with K the contracted size of the first input.
        with_bias = node.target in (aten.addmm.default, aten.baddbmm.default)
        first = node.args[1] if with_bias else node.args[0]
        val_in = first.meta.get("val") if isinstance(first, fx.Node) else None
        k = size_hint(val_in.shape[-1]) if isinstance(val_in, torch.Tensor) and val_in.dim() else 1
        return 2.0 * out_numel * k
    return float(max(out_numel, _input_numel(node), 1))
