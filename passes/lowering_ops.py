"""The op table of passes.lowering: how each ATen op becomes loop-IR expressions.

Each function is registered (`register`) for the ATen overloads it lowers: it takes the lowering
context, the fx node and the node's arguments (lowered values or constants) and returns a lowered
value, a `Computed` (a reduction or scan: materialized) or raises `Unsupported` (the node stays
an ATen call). Gathers, scatters and `cat` are in passes/lowering_gather.py.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import sympy
import torch
from torch import fx

from aotc.passes.loop_ir import (
    Const,
    Expr,
    IndexFn,
    IndexValue,
    Op,
    Size,
    at_most_one,
    contiguous_strides,
    flat_index,
    floordiv,
    is_static,
    mod,
    static_or_expr,
)
from aotc.passes.lowering import (
    FLOAT_TYPES,
    Lowering,
    _Lowering,
    _non_overlapping,
    _offset_is_zero,
    _shape,
    _strides,
    _val,
    _Value,
    register,
)
from aotc.passes.lowering_ir import Computed, NodeKind, ReductionInfo, SymScalar, Unsupported

aten = torch.ops.aten


def _broadcast_fn(v: Any, size: tuple[Size, ...], dtype: torch.dtype) -> Callable[..., Expr]:
    """Index fn reading `v` (a _Value, a Python scalar or a SymScalar) broadcast to `size`, cast
    to dtype."""
    if isinstance(v, SymScalar):
        iv = IndexValue(v.expr, torch.int64)
        return lambda idx: Op("cast", (iv,), dtype)
    if not isinstance(v, _Value):
        if isinstance(v, complex):
            raise Unsupported("complex scalar")
        c = Const(v, dtype)
        return lambda idx: c
    lead = len(size) - len(v.size)

    def fn(idx: Sequence[sympy.Expr]) -> Expr:
        sub = [sympy.Integer(0) if at_most_one(s) else idx[lead + d] for d, s in enumerate(v.size)]
        e = v.fn(sub)
        return e if v.dtype == dtype else Op("cast", (e,), dtype)

    return fn


def _cost(*vs: Any) -> int:
    return 1 + sum(v.cost for v in vs if isinstance(v, _Value))


def _pointwise(name: str, compute: Callable[[torch.dtype], torch.dtype] | None = None) -> Lowering:
    def lowering(ctx: _Lowering, node: fx.Node, *args: Any, **kwargs: Any) -> _Value:
        out = _val(node)
        operands = [a for a in args if isinstance(a, (_Value, int, float, bool, SymScalar))]
        if kwargs.get("alpha", 1) != 1:
            operands[1] = _scale(operands[1], kwargs["alpha"])
        dt = _compute_dtype(node) if compute is None else compute(out.dtype)
        fns = [_broadcast_fn(a, _shape(out), dt) for a in operands]
        return _Value(
            _shape(out),
            out.dtype,
            lambda idx: _cast(Op(name, tuple(f(idx) for f in fns), dt), out.dtype),
            cost=_cost(*operands),
        )

    return lowering


def _scale(v: Any, alpha: Any) -> Any:
    if isinstance(v, SymScalar) or isinstance(alpha, SymScalar):
        raise Unsupported("alpha with a symbolic size")
    if isinstance(v, _Value):
        fn = v.fn
        return _Value(
            v.size,
            v.dtype,
            lambda idx: Op("mul", (fn(idx), Const(alpha, v.dtype)), v.dtype),
            cost=v.cost + 1,
        )
    return v * alpha


def _cast(e: Expr, dtype: torch.dtype) -> Expr:
    return e if isinstance(e, Op) and e.dtype == dtype else Op("cast", (e,), dtype)


def _compute_dtype(node: fx.Node) -> torch.dtype:
    vals = [
        _val(a) if isinstance(a, fx.Node) else a
        for a in node.args
        if isinstance(a, (fx.Node, int, float, bool))
    ]
    vals = [2 if isinstance(v, torch.SymInt) else v for v in vals]  # only its type matters
    try:
        if len(vals) >= 2:
            return torch.result_type(*vals[:2])
        first = vals[0]
        if not isinstance(first, torch.Tensor):
            raise TypeError(f"no dtype for {first!r}")
        return first.dtype
    except Exception as e:
        raise Unsupported(f"type promotion: {e}") from e


for _name, _targets in {
    "add": (aten.add.Tensor, aten.add.Scalar),
    "sub": (aten.sub.Tensor, aten.sub.Scalar),
    "mul": (aten.mul.Tensor, aten.mul.Scalar),
    "maximum": (aten.maximum.default,),
    "minimum": (aten.minimum.default,),
    "neg": (aten.neg.default,),
    "exp": (aten.exp.default,),
    "log": (aten.log.default,),
    "sqrt": (aten.sqrt.default,),
    "rsqrt": (aten.rsqrt.default,),
    "abs": (aten.abs.default,),
    "sin": (aten.sin.default,),
    "cos": (aten.cos.default,),
    "tanh": (aten.tanh.default,),
    "sigmoid": (aten.sigmoid.default,),
    "relu": (aten.relu.default,),
    "erf": (aten.erf.default,),
    "log1p": (aten.log1p.default,),
    "expm1": (aten.expm1.default,),
    "reciprocal": (aten.reciprocal.default,),
    "silu": (aten.silu.default,),
    "sign": (aten.sign.default,),
    "logical_and": (aten.logical_and.default,),
    "logical_or": (aten.logical_or.default,),
    "logical_not": (aten.logical_not.default,),
    "bitwise_and": (aten.bitwise_and.Tensor, aten.bitwise_and.Scalar),
    "bitwise_or": (aten.bitwise_or.Tensor, aten.bitwise_or.Scalar),
    "bitwise_xor": (aten.bitwise_xor.Tensor, aten.bitwise_xor.Scalar),
}.items():
    register(*_targets)(_pointwise(_name))

for _name, _targets in {
    "eq": (aten.eq.Tensor, aten.eq.Scalar),
    "ne": (aten.ne.Tensor, aten.ne.Scalar),
    "lt": (aten.lt.Tensor, aten.lt.Scalar),
    "le": (aten.le.Tensor, aten.le.Scalar),
    "gt": (aten.gt.Tensor, aten.gt.Scalar),
    "ge": (aten.ge.Tensor, aten.ge.Scalar),
}.items():
    register(*_targets)(_pointwise(_name))


@register(aten.div.Tensor, aten.div.Scalar)
def _div(ctx: _Lowering, node: fx.Node, a: Any, b: Any) -> _Value:
    if not _val(node).dtype.is_floating_point:
        raise Unsupported("integer division")
    return _pointwise("div", lambda out: out)(ctx, node, a, b)


# Heuristic: integer powers up to this are multiplications (torch does x*x and x*x*x too);
# beyond, a float power is libdevice's pow (Triton's interpreter: see codegen._HELPERS["_pow"]).
MAX_POWER_PRODUCTS = 4


def _power(v: Expr, n: int, dtype: torch.dtype) -> Expr:
    """`v ** n` (n >= 1) by repeated squaring; equal subtrees are computed once."""
    if n == 1:
        return v
    half = _power(v, n // 2, dtype)
    sq = Op("mul", (half, half), dtype)
    return Op("mul", (sq, v), dtype) if n % 2 else sq


@register(aten.pow.Tensor_Scalar)
def _pow(ctx: _Lowering, node: fx.Node, a: _Value, exponent: Any) -> _Value:
    out = _val(node)
    size = _shape(out)
    if isinstance(exponent, (SymScalar, complex)) or isinstance(exponent, bool):
        raise Unsupported(f"pow with exponent {exponent!r}")
    if not out.dtype.is_floating_point:
        if a.dtype == torch.bool or not isinstance(exponent, int) or exponent < 0:
            raise Unsupported(f"integer pow with exponent {exponent!r}")
        fa = _broadcast_fn(a, size, out.dtype)
        if exponent == 0:
            one = Const(1, out.dtype)
            return _Value(size, out.dtype, lambda idx: one)
        return _Value(
            size, out.dtype, lambda idx: _power(fa(idx), exponent, out.dtype), cost=a.cost + 4
        )
    dt = out.dtype
    fa = _broadcast_fn(a, size, dt)
    e = float(exponent)

    def fn(idx: Sequence[sympy.Expr]) -> Expr:
        v = fa(idx)
        if e == 0:  # pow(x, 0) is 1, also for NaN
            return Const(1.0, dt)
        if e == 0.5:
            return Op("sqrt", (v,), dt)
        if e == -0.5:
            return Op("rsqrt", (v,), dt)
        if e.is_integer() and abs(e) <= MAX_POWER_PRODUCTS:
            p = _power(v, int(abs(e)), dt)
            return p if e > 0 else Op("div", (Const(1.0, dt), p), dt)
        return Op("pow", (v, Const(e, dt)), dt)

    return _Value(size, dt, fn, cost=a.cost + 4)


@register(aten.pow.Tensor_Tensor, aten.pow.Scalar)
def _pow_tensor(ctx: _Lowering, node: fx.Node, base: Any, exponent: Any) -> _Value:
    out = _val(node)
    if not out.dtype.is_floating_point:
        raise Unsupported("integer pow with a tensor exponent")
    if any(isinstance(v, (SymScalar, complex)) for v in (base, exponent)):
        raise Unsupported("pow of a symbolic size or a complex number")
    return _pointwise("pow", lambda o: o)(ctx, node, base, exponent)


@register(aten.div.Tensor_mode, aten.div.Scalar_mode)
def _div_mode(
    ctx: _Lowering, node: fx.Node, a: Any, b: Any, *, rounding_mode: str | None = None
) -> _Value:
    out = _val(node)
    if rounding_mode is None:
        return _div(ctx, node, a, b)
    if not out.dtype.is_floating_point:
        name = "floordiv" if rounding_mode == "floor" else "truncdiv"
        return _pointwise(name, lambda o: o)(ctx, node, a, b)
    if rounding_mode == "floor":  # torch's is fmod-based (1 // 0.1 == 9): no exact template
        raise Unsupported("floor division of floating-point values")
    quotient = _pointwise("div", lambda o: o)(ctx, node, a, b)
    return _Value(
        quotient.size,
        out.dtype,
        lambda idx: Op("trunc", (quotient.fn(idx),), out.dtype),
        cost=quotient.cost + 1,
    )


@register(aten.remainder.Tensor, aten.remainder.Scalar, aten.fmod.Tensor, aten.fmod.Scalar)
def _remainder(ctx: _Lowering, node: fx.Node, a: Any, b: Any) -> _Value:
    if _val(node).dtype.is_floating_point:  # torch's are fmod-based: no exact template
        raise Unsupported("remainder of floating-point values")
    name = "remainder" if node.target in (aten.remainder.Tensor, aten.remainder.Scalar) else "fmod"
    return _pointwise(name, lambda o: o)(ctx, node, a, b)


@register(aten.__lshift__.Scalar, aten.__rshift__.Scalar)
def _shift(ctx: _Lowering, node: fx.Node, a: _Value, amount: Any) -> _Value:
    out = _val(node)
    if out.dtype in (torch.bool, *FLOAT_TYPES) or not isinstance(amount, int):
        raise Unsupported(f"shift of {out.dtype} by {amount!r}")
    bits = torch.iinfo(out.dtype).bits
    if node.target == aten.__lshift__.Scalar:
        if not 0 <= amount < bits:  # torch: every bit shifted out
            zero = Const(0, out.dtype)
            return _Value(_shape(out), out.dtype, lambda idx: zero)
        return _pointwise("lshift", lambda o: o)(ctx, node, a, amount)
    amount = amount if 0 <= amount < bits else bits - 1  # torch: the sign fills every bit
    return _pointwise("rshift", lambda o: o)(ctx, node, a, amount)


@register(aten.floor.default, aten.ceil.default, aten.trunc.default, aten.round.default)
def _rounding(ctx: _Lowering, node: fx.Node, a: _Value) -> _Value:
    if not _val(node).dtype.is_floating_point:
        return a  # integers are their own floor, ceil, trunc and round
    return _pointwise(str(node.target).split(".")[1])(ctx, node, a)


@register(aten.isnan.default, aten.isinf.default)
def _isnan(ctx: _Lowering, node: fx.Node, a: _Value) -> _Value:
    if not a.dtype.is_floating_point:
        false = Const(False, torch.bool)
        return _Value(_shape(_val(node)), torch.bool, lambda idx: false)
    name = "isnan" if node.target == aten.isnan.default else "isinf"
    return _pointwise(name, lambda o: a.dtype)(ctx, node, a)


@register(aten.bitwise_not.default)
def _bitwise_not(ctx: _Lowering, node: fx.Node, a: _Value) -> _Value:
    if a.dtype == torch.bool:
        return _pointwise("logical_not")(ctx, node, a)
    return _pointwise("bitwise_not")(ctx, node, a)


@register(aten.gelu.default)
def _gelu(ctx: _Lowering, node: fx.Node, a: _Value, approximate: str = "none") -> _Value:
    return _pointwise("gelu" if approximate == "none" else "gelu_tanh")(ctx, node, a)


@register(aten.where.self)
def _where(ctx: _Lowering, node: fx.Node, c: Any, a: Any, b: Any) -> _Value:
    out = _val(node)
    size = _shape(out)
    fc = _broadcast_fn(c, size, torch.bool)
    fa, fb = _broadcast_fn(a, size, out.dtype), _broadcast_fn(b, size, out.dtype)
    return _Value(
        size,
        out.dtype,
        lambda idx: Op("where", (fc(idx), fa(idx), fb(idx)), out.dtype),
        cost=_cost(c, a, b),
    )


@register(aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default)
def _clamp(ctx: _Lowering, node: fx.Node, a: _Value, lo: Any = None, hi: Any = None) -> _Value:
    out = _val(node)
    if node.target == aten.clamp_max.default:
        lo, hi = None, lo
    if isinstance(lo, SymScalar) or isinstance(hi, SymScalar):
        raise Unsupported("clamp to a symbolic size")
    fa = _broadcast_fn(a, _shape(out), out.dtype)

    def fn(idx: Sequence[sympy.Expr]) -> Expr:
        e = fa(idx)
        if lo is not None:
            e = Op("clamp_min", (e, Const(lo, out.dtype)), out.dtype)
        if hi is not None:
            e = Op("clamp_max", (e, Const(hi, out.dtype)), out.dtype)
        return e

    return _Value(_shape(out), out.dtype, fn, cost=a.cost + 2)


@register(aten._to_copy.default, torch.ops.prims.convert_element_type.default, aten.clone.default)
def _to_copy(ctx: _Lowering, node: fx.Node, a: _Value, *args: Any, **kwargs: Any) -> _Value:
    out = _val(node)
    assert isinstance(node.args[0], fx.Node), node.format_node()
    src = _val(node.args[0])
    if out.device != src.device or out.layout != torch.strided:
        raise Unsupported("device or layout change")
    return _Value(_shape(out), out.dtype, _broadcast_fn(a, _shape(out), out.dtype), cost=a.cost + 1)


@register(aten.full.default, aten.scalar_tensor.default)
def _full(ctx: _Lowering, node: fx.Node, *args: Any, **kwargs: Any) -> _Value:
    out = _val(node)
    value = args[1] if node.target == aten.full.default else args[0]
    if isinstance(value, SymScalar):
        raise Unsupported("fill with a symbolic size")
    c = Const(value, out.dtype)
    return _Value(_shape(out), out.dtype, lambda idx: c)


@register(torch.ops.prims.iota.default)
def _iota(
    ctx: _Lowering, node: fx.Node, length: int, *, start: int, step: int, **kwargs: Any
) -> _Value:
    out = _val(node)
    if isinstance(start, SymScalar) or isinstance(step, SymScalar):
        raise Unsupported("iota with a symbolic start or step")
    return _Value(_shape(out), out.dtype, lambda idx: IndexValue(start + step * idx[0], out.dtype))


# -- views: index transforms --


def _view_of(a: _Value, size: Sequence[Size], fn: IndexFn) -> _Value:
    return _Value(tuple(static_or_expr(s) for s in size), a.dtype, fn, cost=a.cost)


@register(aten.view.default, aten._unsafe_view.default, aten.reshape.default, view=True)
def _reshape(ctx: _Lowering, node: fx.Node, a: _Value, shape: Sequence[int]) -> _Value:
    size = _shape(_val(node))
    if size == a.size:
        return a
    strides = contiguous_strides(size)

    def fn(idx: Sequence[sympy.Expr]) -> Expr:
        flat = flat_index(idx, strides)
        src = []
        for s, st in zip(a.size, contiguous_strides(a.size), strict=True):
            src.append(sympy.Integer(0) if at_most_one(s) else mod(floordiv(flat, st, {}), s, {}))
        return a.fn(src)

    return _view_of(a, size, fn)


@register(aten.permute.default, view=True)
def _permute(ctx: _Lowering, node: fx.Node, a: _Value, dims: Sequence[int]) -> _Value:
    dims = [d % len(a.size) for d in dims]
    inverse = [dims.index(d) for d in range(len(dims))]
    return _view_of(a, [a.size[d] for d in dims], lambda idx: a.fn([idx[i] for i in inverse]))


@register(aten.t.default, view=True)
def _t(ctx: _Lowering, node: fx.Node, a: _Value) -> _Value:
    return _permute(ctx, node, a, list(range(len(a.size)))[::-1])


@register(aten.transpose.int, view=True)
def _transpose(ctx: _Lowering, node: fx.Node, a: _Value, d0: int, d1: int) -> _Value:
    dims = list(range(len(a.size)))
    d0, d1 = d0 % len(dims), d1 % len(dims)
    dims[d0], dims[d1] = dims[d1], dims[d0]
    return _permute(ctx, node, a, dims)


@register(aten.expand.default, view=True)
def _expand(ctx: _Lowering, node: fx.Node, a: _Value, shape: Sequence[int]) -> _Value:
    size = _shape(_val(node))
    return _view_of(a, size, _broadcast_fn(a, size, a.dtype))


@register(
    aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, view=True
)
def _squeeze(ctx: _Lowering, node: fx.Node, a: _Value, *args: Any) -> _Value:
    return _reshape(ctx, node, a, _shape(_val(node)))


@register(aten.alias.default, view=True)
def _alias(ctx: _Lowering, node: fx.Node, a: _Value) -> _Value:
    return a


@register(aten.slice.Tensor, view=True)
def _slice(
    ctx: _Lowering,
    node: fx.Node,
    a: _Value,
    dim: int = 0,
    start: Any = None,
    end: Any = None,
    step: int = 1,
) -> _Value:
    dim %= len(a.size)
    start = 0 if start is None else start
    if isinstance(start, SymScalar) or isinstance(step, SymScalar):
        raise Unsupported("slice with a symbolic start or step")
    if not is_static(a.size[dim]):
        if start != 0:  # clamping to a symbolic size would need a guard
            raise Unsupported("slice of a symbolic dim at a nonzero start")
    else:
        start = max(start + a.size[dim], 0) if start < 0 else min(start, a.size[dim])
    size = _shape(_val(node))

    def fn(idx: Sequence[sympy.Expr]) -> Expr:
        src = list(idx)
        src[dim] = start + step * idx[dim]
        return a.fn(src)

    return _view_of(a, size, fn)


@register(aten.select.int, view=True)
def _select(ctx: _Lowering, node: fx.Node, a: _Value, dim: int, index: int) -> _Value:
    dim %= len(a.size)
    if isinstance(index, SymScalar) or (index < 0 and not is_static(a.size[dim])):
        raise Unsupported("select at a symbolic index")
    index = index + a.size[dim] if index < 0 else index
    return _view_of(
        a, _shape(_val(node)), lambda idx: a.fn([*idx[:dim], sympy.Integer(index), *idx[dim:]])
    )


@register(aten.split_with_sizes.default, aten.split.Tensor, view=True)
def _split(ctx: _Lowering, node: fx.Node, a: _Value, sizes: Any, dim: int = 0) -> tuple:
    dim %= len(a.size)
    out, start = [], 0
    for part in _val(node):
        n = static_or_expr(part.shape[dim])

        def fn(idx: Sequence[sympy.Expr], start: int = start) -> Expr:
            src = list(idx)
            src[dim] = start + idx[dim]
            return a.fn(src)

        out.append(_view_of(a, _shape(part), fn))
        start += n
    return tuple(out)


@register(operator.getitem)
def _getitem(ctx: _Lowering, node: fx.Node, parts: Any, i: int) -> _Value:
    if not isinstance(parts, tuple):
        raise Unsupported("getitem of an ATen result")
    return parts[i]


# -- reductions --


_REDUCE_KIND = {
    aten.sum.dim_IntList: "sum",
    aten.sum.default: "sum",
    aten.amax.default: "max",
    aten.amin.default: "min",
    aten.prod.dim_int: "prod",
    aten.prod.default: "prod",
    aten.any.dim: "any",
    aten.any.dims: "any",
    aten.any.default: "any",
    aten.all.dim: "all",
    aten.all.dims: "all",
    aten.all.default: "all",
    aten.argmax.default: "argmax",
    aten.argmin.default: "argmin",
}
# Heuristic: a scan keeps its whole row in registers (one pass), so rows are capped at the
# length codegen reduces in registers (passes.codegen.PERSISTENT_RNUMEL; longer: ATen).
MAX_SCAN_RNUMEL = 2048


@register(*_REDUCE_KIND)
def _reduce(
    ctx: _Lowering, node: fx.Node, a: _Value, dims: Any = None, keepdim: bool = False, **kwargs: Any
) -> Computed:
    out = _val(node)
    nd = len(a.size)
    if isinstance(dims, int):
        dims = [dims]
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        dims = list(range(nd))
    dims = tuple(sorted({d % max(nd, 1) for d in dims})) if nd else ()
    kind = _REDUCE_KIND[node.target]  # type: ignore[index]
    if kind != "sum" and any(a.size[d] == 0 for d in dims):
        raise Unsupported(f"{kind} over an empty dim")
    if kind in ("argmax", "argmin"):
        if a.dtype == torch.bool:
            raise Unsupported(f"{kind} of bool values")
        fn = a.fn  # compared in its own type; the result is an int64 index
    elif kind in ("any", "all"):
        fa = a.fn
        zero = Const(0, a.dtype)
        fn = lambda idx: Op("ne", (fa(idx), zero), torch.bool)  # noqa: E731
    else:
        acc = out.dtype
        fn = a.fn if a.dtype == acc else (lambda idx: Op("cast", (a.fn(idx),), acc))
    red = ReductionInfo(a.size, dims, kind)
    shape, stride = _reduction_layout(ctx, node, out)
    return Computed(node.name, NodeKind.REDUCTION, shape, stride, out.dtype, fn, red, node)


def _reduction_layout(
    ctx: _Lowering, node: fx.Node, out: torch.Tensor
) -> tuple[tuple[Size, ...], tuple[Size, ...]]:
    """A reduction-shaped member's shape and the strides it is stored with: eager's when it is a
    graph output laid out plainly (no offset, no overlap), else contiguous."""
    shape, strides = _shape(out), _strides(out)
    if node in ctx.outputs and _offset_is_zero(out) and _non_overlapping(shape, strides):
        return shape, strides
    return shape, contiguous_strides(shape)


@register(aten.cumsum.default, aten.cumprod.default)
def _scan(ctx: _Lowering, node: fx.Node, a: _Value, dim: int, *, dtype: Any = None) -> Computed:
    """An inclusive scan along `dim`: a reduction-shaped member whose every element is stored
    (rows x = the other dims, r = `dim`), computed in registers (see MAX_SCAN_RNUMEL)."""
    out = _val(node)
    if not a.size:
        return _Value((), out.dtype, _broadcast_fn(a, (), out.dtype))  # type: ignore[return-value]
    dim %= len(a.size)
    n = a.size[dim]
    if not is_static(n) or int(n) > MAX_SCAN_RNUMEL or int(n) == 0:
        raise Unsupported(f"scan over a dim of size {n}")
    kind = "cumsum" if node.target == aten.cumsum.default else "cumprod"
    fn = a.fn if a.dtype == out.dtype else (lambda idx: Op("cast", (a.fn(idx),), out.dtype))
    red = ReductionInfo(a.size, (dim,), kind)
    shape, stride = _reduction_layout(ctx, node, out)
    return Computed(node.name, NodeKind.REDUCTION, shape, stride, out.dtype, fn, red, node)
