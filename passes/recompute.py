"""Which forward values the backward may recompute instead of saving, and at what cost.

Policy, not a stage: `recompute_cost(node, executor, policy, in_forward)` feeds the min-cut
partitioner (passes/partition.py). Requires nodes with `meta["val"]` (fake values; symbolic sizes
count at their hint).

See Note [Recompute cost model]. In short, what a recomputation costs depends on what runs the
backward graph (`Executor`, from the `backend` option):

- free everywhere: views and reshapes of a value the backward has anyway, sizes, `getitem`;
- `Executor.TRITON`: pointwise ops, cheap copies/factories and reductions over at most
  `policy.reduction_max_numel` elements are free when every backward op that reads them is fused
  too (the recomputation folds into a kernel the backward runs anyway);
- otherwise an op costs what running it once more costs: one call plus its memory traffic
  (reading its inputs, writing its output), and the multiply-adds of matmuls and convolutions.

Random ops are never recomputed (each runs exactly once, in the forward), nor are mutating ops.

Note [Recompute cost model]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
Recomputing a forward value in the backward trades memory (the value is not kept alive between
forward and backward) for time (it is computed twice). Whether that time is real depends on the
executor:

    y = x.sin(); z = y.cos()     backward needs y (for cos') and x (for sin')
    Triton: the backward kernel that computes cos'(y) * g reads x and computes y = sin(x) in
            registers: saving x alone costs no extra pass over memory (y is free).
    ATen:   recomputing y is one more `aten.sin` call that reads x and writes y: a full pass over
            memory, paid every step, that eager does not pay (eager saves y).

So the default partition recomputes only what is free on the executor at hand: with ATen calls it
saves what eager saves, or less where recomputing costs nothing (views of saved values, sizes);
with Triton it keeps the aggressive recompute of fused pointwise chains, except values a
non-fused backward op (a matmul, a convolution, an op lowering does not know) reads: those would
have to be written to memory by an extra kernel, so they cost their traffic like on ATen.
A memory budget (`memory_budget=`) then unbans non-free ops, cheapest estimated seconds per byte
first (see Note [Min-cut partition] in passes/partition.py), so it trades step time for memory on
either executor: pointwise ops (a pass over memory per byte saved) go before matmuls (K
multiply-adds per element).

The estimate is `calls * call_s + traffic / bytes_per_s + flops / flops_per_s` with per-device
constants (`DEVICE_SPEEDS`); it only orders candidates and labels the report, so rough figures do.
"""

from __future__ import annotations

import enum
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx

from aotc.passes.ir import is_sym_node, size_hint

aten = torch.ops.aten


class Executor(enum.Enum):
    """What runs a stage graph's ops, which decides what a recomputation costs."""

    ATEN = "aten"  # one ATen call per op: nothing fuses, every op is a pass over memory
    TRITON = "triton"  # fused pointwise/reduction kernels; matmuls and the like stay ATen calls


def executor_for(backend: str, interpret: bool, device: torch.device | None) -> Executor:
    """The executor `passes.select.select_backend` picks for graphs on `device`: "aten" always
    ATen; "auto" Triton on CUDA; "triton" Triton on CUDA, or on CPU with Triton's interpreter.
    (A graph whose lowering fails at kernel time runs as ATen calls; the partition cannot know.)"""
    on_cuda = device is not None and device.type == "cuda"
    if backend == "aten" or (backend == "auto" and not on_cuda):
        return Executor.ATEN
    if not on_cuda and not interpret:
        return Executor.ATEN
    import importlib.util

    return Executor.TRITON if importlib.util.find_spec("triton") is not None else Executor.ATEN


@dataclass(frozen=True, slots=True)
class RecomputePolicy:
    # Heuristic: a reduction reading at most this many elements costs about as much as the
    # pointwise ops a fused kernel would fold it into; measured on LayerNorm/softmax rows
    # (<= 4096 features) where recomputing is cheaper than a round trip through memory.
    reduction_max_numel: int = 4096
    recompute_views: bool = True
    recompute_pointwise: bool = True


@dataclass(frozen=True, slots=True)
class DeviceSpeed:
    """Rough throughput of one device, for ordering recompute candidates (not for timing)."""

    bytes_per_s: float
    flops_per_s: float
    call_s: float  # fixed cost of one ATen call or kernel launch


# Heuristic: orders of magnitude of a laptop/server CPU core (10 GB/s effective memory traffic,
# 50 GFLOP/s fp32 matmul, ~3 us per ATen call from Python) and a datacenter GPU (1 TB/s, 50
# TFLOP/s, ~5 us per launch). Only ratios matter: they rank candidates by seconds per byte saved.
DEVICE_SPEEDS: dict[str, DeviceSpeed] = {
    "cpu": DeviceSpeed(bytes_per_s=1e10, flops_per_s=5e10, call_s=3e-6),
    "cuda": DeviceSpeed(bytes_per_s=1e12, flops_per_s=5e13, call_s=5e-6),
}


class CostKind(enum.Enum):
    FREE = "free"  # no data moves: a view, a size, a getitem
    FUSED = "fused"  # folds into a kernel the backward runs anyway (Triton)
    KERNEL = "kernel"  # its own ATen call or kernel: reads its inputs, writes its output
    MATMUL = "matmul"  # matmul, convolution, attention: bound by multiply-adds
    NEVER = "never"  # random or mutating: must run exactly once, in the forward


@dataclass(frozen=True, slots=True)
class RecomputeCost:
    kind: CostKind
    seconds: float  # estimated time to run it once more in the backward (0 when free or fused)
    traffic: int  # bytes read + written when it runs on its own (0 when free or fused)
    flops: int = 0  # multiply-adds * 2 (matmul-like ops)

    @property
    def is_free(self) -> bool:
        return self.kind is CostKind.FREE or self.kind is CostKind.FUSED

    def format(self) -> str:
        if self.kind is CostKind.FREE:
            return "free (no data moves)"
        if self.kind is CostKind.FUSED:
            return "free (fuses into a backward kernel)"
        if self.kind is CostKind.NEVER:
            return "never recomputed"
        flops = f", {self.flops} flops" if self.flops else ""
        return f"~{self.seconds * 1e6:.1f} us ({self.traffic} B traffic{flops})"


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
# Backward ops that Triton lowering decomposes into pointwise ops and reductions (fused kernels).
_FUSIBLE_BACKWARD = _ops(
    "_softmax_backward_data.default",
    "_log_softmax_backward_data.default",
    "native_layer_norm_backward.default",
    "nll_loss_backward.default",
    "nll_loss_forward.default",
    "threshold_backward.default",
    "gelu_backward.default",
    "sigmoid_backward.default",
    "tanh_backward.default",
    "silu_backward.default",
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


def _is_view(node: fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and target.is_view


def _input_numel(node: fx.Node) -> int:
    first = node.args[0] if node.args else None
    val = first.meta.get("val") if isinstance(first, fx.Node) else None
    return size_hint(val.numel()) if isinstance(val, torch.Tensor) else 0


def can_recompute(node: fx.Node, policy: RecomputePolicy) -> bool:
    """Whether a fused kernel can fold `node` in (pointwise, cheap copies and factories, small
    reductions, views, sizes): what Triton may recompute for free. Never random/mutating ops."""
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


def _fuses_as_consumer(node: fx.Node) -> bool:
    """Whether `node`, run in the backward, is part of a generated kernel (so a value it reads
    can be recomputed inside that kernel), rather than an ATen call reading a stored tensor."""
    target = node.target
    if node.op == "output":
        return False  # a gradient is written to memory
    if target is operator.getitem or is_sym_node(node):
        return True
    if not isinstance(target, torch._ops.OpOverload) or target._schema.is_mutable:
        return False
    return (
        target.is_view
        or torch.Tag.pointwise in target.tags
        or target in _CHEAP_OPS
        or target in _REDUCTIONS
        or target in _FUSIBLE_BACKWARD
    )


def _materialized_in_backward(node: fx.Node, in_forward: Callable[[fx.Node], bool]) -> bool:
    """Whether a backward op that is not fused reads `node` (through views): recomputing `node`
    would then need a kernel of its own that writes it to memory. Users that run in the forward
    anyway do not count."""
    stack, seen = [node], {node}
    while stack:
        current = stack.pop()
        for user in current.users:
            if user in seen:
                continue
            if _is_view(user) or user.target is operator.getitem:
                seen.add(user)
                stack.append(user)
            elif not in_forward(user) and not _fuses_as_consumer(user):
                return True
    return False


def _nbytes(value: object) -> int:
    if isinstance(value, torch.Tensor):
        return size_hint(value.numel()) * value.element_size()
    return 0


def _traffic(node: fx.Node) -> int:
    """Bytes one run of `node` reads (its tensor arguments) and writes (its results)."""
    read = 0
    for arg in node.all_input_nodes:
        read += _nbytes(arg.meta.get("val"))
    val = node.meta.get("val")
    written = sum(_nbytes(v) for v in val) if isinstance(val, (tuple, list)) else _nbytes(val)
    return read + written


def _flops(node: fx.Node) -> int:
    """2 * multiply-adds of a matmul-like op (0 for others)."""
    val = node.meta.get("val")
    out_numel = size_hint(val.numel()) if isinstance(val, torch.Tensor) else 0
    if isinstance(val, (tuple, list)) and val and isinstance(val[0], torch.Tensor):
        out_numel = size_hint(val[0].numel())
    target = node.target
    if target is aten.convolution.default:
        weight = node.args[1].meta.get("val") if isinstance(node.args[1], fx.Node) else None
        if isinstance(weight, torch.Tensor) and weight.dim() >= 2:
            # Heuristic: each output element is a dot product over (C_in / groups) * kernel.
            k = math.prod(size_hint(s) for s in weight.shape[1:])
            return 2 * out_numel * k
        return 2 * out_numel
    # Heuristic: 2*M*N*K ~ 2 * out_numel * K, with K the contracted size of the first matrix
    # (for attention, q's last dim: the dominant q @ k^T and p @ v products have that shape).
    with_bias = target in (aten.addmm.default, aten.baddbmm.default)
    first = node.args[1] if with_bias else node.args[0]
    val_in = first.meta.get("val") if isinstance(first, fx.Node) else None
    k = size_hint(val_in.shape[-1]) if isinstance(val_in, torch.Tensor) and val_in.dim() else 1
    return 2 * out_numel * k


def _device_speed(node: fx.Node) -> DeviceSpeed:
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        val = next((v for v in val if isinstance(v, torch.Tensor)), None)
    device = val.device.type if isinstance(val, torch.Tensor) else "cpu"
    return DEVICE_SPEEDS.get(device, DEVICE_SPEEDS["cuda" if device != "cpu" else "cpu"])


_FREE = RecomputeCost(CostKind.FREE, 0.0, 0)
_FUSED = RecomputeCost(CostKind.FUSED, 0.0, 0)
_NEVER = RecomputeCost(CostKind.NEVER, math.inf, 0)


def recompute_cost(
    node: fx.Node,
    executor: Executor,
    policy: RecomputePolicy,
    in_forward: Callable[[fx.Node], bool] = lambda _: False,
) -> RecomputeCost:
    """What running forward node `node` once more in the backward costs on `executor` (see Note
    [Recompute cost model]). `in_forward(user)`: whether a user of it runs in the forward anyway
    (its reads do not make the value materialize in the backward)."""
    if node.op == "placeholder":
        return _FREE  # an input is there already (it is saved, never computed)
    if node.op != "call_function" or is_random(node):
        return _NEVER
    target = node.target
    if target is operator.getitem or is_sym_node(node):
        return _FREE
    if not isinstance(target, torch._ops.OpOverload) or target._schema.is_mutable:
        return _NEVER if isinstance(target, torch._ops.OpOverload) else _kernel_cost(node)
    if target.is_view and policy.recompute_views:
        return _FREE
    if (
        executor is Executor.TRITON
        and can_recompute(node, policy)
        and not _materialized_in_backward(node, in_forward)
    ):
        return _FUSED
    return _kernel_cost(node)


def _kernel_cost(node: fx.Node) -> RecomputeCost:
    speed = _device_speed(node)
    traffic = _traffic(node)
    if node.target in _MATMUL_LIKE:
        flops = _flops(node)
        seconds = speed.call_s + flops / speed.flops_per_s + traffic / speed.bytes_per_s
        return RecomputeCost(CostKind.MATMUL, seconds, traffic, flops)
    return RecomputeCost(CostKind.KERNEL, speed.call_s + traffic / speed.bytes_per_s, traffic)


__all__ = [
    "DEVICE_SPEEDS",
    "CostKind",
    "DeviceSpeed",
    "Executor",
    "RecomputeCost",
    "RecomputePolicy",
    "can_recompute",
    "executor_for",
    "is_random",
    "recompute_cost",
]
