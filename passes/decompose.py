"""Decompose a stage graph to the small core ATen op set that kernel lowering understands.

Stage: `decompose(module) -> fx.GraphModule` (a new module, or the input itself when no node
needs decomposing; the input is never changed).
Requires: a functional ATen fx graph whose placeholders carry fake tensors in `meta["val"]`.
Ensures: every composite op with an entry in torch's public decomposition tables
(`torch._decomp`) is replaced by its decomposition, except the ops in `EXTERN_OPS` (matmul,
convolution, attention, RNG), which stay single ATen calls for cuBLAS/cuDNN/flash kernels; then
large sums with few results are split in two (passes.split_reduction). Every new node carries
`meta["val"]`. Placeholders and the output keep their order.

Worked example:

    before: _softmax = aten._softmax(x, -1, False)
    after:  amax = aten.amax(x, [-1], True); sub = aten.sub(x, amax); exp = aten.exp(sub)
            sum_1 = aten.sum.dim_IntList(exp, [-1], True); div = aten.div(exp, sum_1)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import fx
from torch._decomp import core_aten_decompositions, get_decompositions
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from aotc.passes.pin_dtypes import pin_default_dtypes
from aotc.passes.split_reduction import split_reductions

aten = torch.ops.aten

# Ops that run as library calls: kernels here do matmul, convolution, attention and RNG better.
EXTERN_OPS: frozenset[object] = frozenset(
    {
        aten.mm,
        aten.addmm,
        aten.bmm,
        aten.baddbmm,
        aten.matmul,
        aten.convolution,
        aten.convolution_backward,
        aten._scaled_dot_product_flash_attention,
        aten._scaled_dot_product_efficient_attention,
        aten._scaled_dot_product_cudnn_attention,
        aten._scaled_dot_product_flash_attention_for_cpu,
        aten._scaled_dot_product_flash_attention_backward,
        aten._scaled_dot_product_efficient_attention_backward,
        aten._scaled_dot_product_flash_attention_for_cpu_backward,
        aten._scaled_dot_product_cudnn_attention_backward,
        aten.native_dropout,
        aten.rand,
        aten.randn,
        aten.rand_like,
        aten.randn_like,
        aten.bernoulli,
        aten.embedding_dense_backward,
    }
)

# Pointwise ops that lowering handles directly; decomposing them would only add nodes.
_KEEP: frozenset[object] = frozenset(
    {
        aten.gelu,
        aten.relu,
        aten.sigmoid,
        aten.tanh,
        aten.silu,
        aten.clamp,
        aten.where,
    }
)


@functools.cache
def decomposition_table() -> dict[Any, Callable[..., Any]]:
    table = dict(core_aten_decompositions())
    table.update(
        get_decompositions(
            [
                aten.native_layer_norm,
                aten.native_layer_norm_backward,
                aten._softmax,
                aten._softmax_backward_data,
                aten._log_softmax,
                aten._log_softmax_backward_data,
                aten.gelu_backward,
                aten.silu_backward,
                aten.sigmoid_backward,
                aten.tanh_backward,
                aten.threshold_backward,
                aten.nll_loss_forward,
                aten.nll_loss_backward,
                aten.mse_loss,
                aten.mse_loss_backward,
                aten.rsub,
                aten.addcmul,
                aten.addcdiv,
                aten.lerp,
                aten.hardtanh,
                aten.leaky_relu,
                aten.leaky_relu_backward,
                aten.masked_fill,
                aten.native_dropout_backward,
            ]
        )
    )
    table = {
        op: fn
        for op, fn in table.items()
        if op.overloadpacket not in EXTERN_OPS and op.overloadpacket not in _KEEP
    }
    table[aten.mean.dim] = _mean
    table[aten.mean.default] = lambda x, *, dtype=None: _mean(x, None, dtype=dtype)
    table[aten.var_mean.correction] = _var_mean
    table[aten.var.correction] = lambda *a, **k: _var_mean(*a, **k)[0]
    return table


def _mean(
    x: torch.Tensor, dim: Any = None, keepdim: bool = False, *, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """A sum and a division, which fuse into the reduction's kernel (RMSNorm's
    `x.pow(2).mean(-1, keepdim=True)`); the sum accumulates in fp32 for half types, as eager's
    mean does, and the division happens before the one rounding to the result type."""
    dims = list(range(x.dim())) if not dim else [d % max(x.dim(), 1) for d in dim]
    n = 1
    for d in dims:
        n *= x.shape[d]
    return aten.sum.dim_IntList(x, dims, keepdim, dtype=dtype) / n


def _var_mean(
    x: torch.Tensor, dim: Any = None, *, correction: float | None = None, keepdim: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two-pass variance from aten sums, which the kernel scheduler fuses into one kernel."""
    dims = list(range(x.dim())) if dim is None else [d % max(x.dim(), 1) for d in dim]
    n = 1
    for d in dims:
        n *= x.shape[d]
    mean = aten.sum.dim_IntList(x, dims, True) / n
    centered = x - mean
    var = aten.sum.dim_IntList(centered * centered, dims, keepdim)
    var = var / max(n - (1.0 if correction is None else correction), 0)
    return var, mean if keepdim else aten.squeeze.dims(mean, dims)


def decompose(module: fx.GraphModule) -> fx.GraphModule:
    table = decomposition_table()
    if not any(n.op == "call_function" and n.target in table for n in module.graph.nodes):
        return split_reductions(module)  # nothing to decompose (and the input stays unchanged)
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    args = [_fresh(n.meta.get("val"), mode) for n in placeholders]
    interp = fx.Interpreter(module)
    with mode:
        traced = make_fx(
            lambda *a: interp.run(*a),
            decomposition_table=table,
            tracing_mode="real",
        )(*args)
    # Random ops stay even if unused (fx treats them as pure inside a Dynamo compilation).
    traced.graph.eliminate_dead_code(is_impure_node=lambda n: n.is_impure(impure_random=True))
    # Factory calls inside decompositions: see Note [Factory ops follow the default dtype]
    pin_default_dtypes(traced, None)
    traced.recompile()
    return split_reductions(traced)


def _fresh(val: object, mode: FakeTensorMode) -> object:
    if isinstance(val, torch.Tensor):
        with mode:
            return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device)
    return val
