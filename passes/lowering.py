"""Lower a decomposed ATen graph to loop-IR nodes: the schedulable units of kernel generation.

Stage: `lower(module) -> LoweredGraph`.
Requires: a functional, decomposed ATen fx graph (passes.decompose) with `meta["val"]` on nodes.
Ensures: `LoweredGraph.items` lists, in a valid execution order, one `Computed` node per value
that must be materialized (graph outputs, inputs of extern calls, reductions, values read by
several consumers whose recompute is not cheap) and one `Extern` per node that stays an ATen call
(matmul, attention, RNG, anything lowering does not know, graph outputs that are views). Every
other value is inlined into its consumers' `fn`, so views and pointwise chains cost no memory.
Sizes and strides are ints, or sympy expressions over the ShapeEnv's symbols when the graph was
traced with symbolic sizes (read from `SymInt.node.expr`, never compared: see Note [Symbolic
sizes] in passes.loop_ir); `LoweredGraph.symbols` names them.

Worked example, `y = (x * 2).exp(); return y.sum(-1), y` with x: float[4, 5]:

    Computed exp   POINTWISE size=(4, 5)  fn(i) = exp(Load(x, 5*i0 + i1) * 2)
    Computed sum_1 REDUCTION size=(4,) over (4, 5) dims=(1,)  fn(i) = Load(exp, 5*i0 + i1)
"""

from __future__ import annotations

import enum
import logging
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch import fx

from aotc.passes.loop_ir import (
    Const,
    Expr,
    IndexFn,
    IndexValue,
    Load,
    Op,
    Size,
    at_most_one,
    contiguous_strides,
    dense_order,
    flat_index,
    floordiv,
    index_symbol,
    is_static,
    loads_of,
    mod,
    size_symbols,
    static_or_expr,
)
from aotc.runtime.steps import non_overlapping

aten = torch.ops.aten
log = logging.getLogger("aotc.kernels")

# Heuristic: a value read by several consumers is recomputed in each (not stored) when its
# expression has at most this many nodes; pointwise chains in the examples are below it.
MAX_INLINE_NODES = 24
# Heuristic: an expression this large is stored instead of inlined further (bounds source size).
MAX_EXPR_NODES = 200

FLOAT_TYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
KERNEL_TYPES = FLOAT_TYPES + (torch.int64, torch.int32, torch.bool, torch.int8, torch.uint8)


class NodeKind(enum.Enum):
    POINTWISE = "pointwise"
    REDUCTION = "reduction"


@dataclass(frozen=True)
class ReductionInfo:
    src_size: tuple[Size, ...]  # the size of the reduced input
    dims: tuple[int, ...]  # reduced dims of src_size, sorted
    # "sum", "max", "min", "prod", "any", "all", "argmax", "argmin"; or a scan, "cumsum" or
    # "cumprod", whose result has every element (size == src_size, see is_scan)
    kind: str

    @property
    def is_scan(self) -> bool:
        return self.kind in ("cumsum", "cumprod")

    @property
    def outer(self) -> tuple[Size, ...]:
        return tuple(s for d, s in enumerate(self.src_size) if d not in self.dims)

    @property
    def reduced(self) -> tuple[Size, ...]:
        return tuple(s for d, s in enumerate(self.src_size) if d in self.dims)


@dataclass
class Computed:
    """A value computed by a generated kernel and stored to its own buffer."""

    name: str  # buffer name == the fx node's name
    kind: NodeKind
    size: tuple[Size, ...]
    stride: tuple[Size, ...]  # layout of the stored buffer
    dtype: torch.dtype
    fn: IndexFn  # POINTWISE: over `size`; REDUCTION: over `reduction.src_size`
    reduction: ReductionInfo | None
    origin: fx.Node
    reads: tuple[str, ...] = ()  # buffers the fn loads (sorted)
    cone: tuple[fx.Node, ...] = ()  # fx nodes to run as ATen if its kernel fails (graph order)

    @property
    def numel(self) -> Size:
        return _prod(self.size)

    @property
    def nbytes(self) -> Size:
        return self.numel * _itemsize(self.dtype)


@dataclass
class Extern:
    """An fx node that runs as an ATen call."""

    name: str
    node: fx.Node
    reads: tuple[str, ...]


Item = Computed | Extern


@dataclass
class LoweredGraph:
    module: fx.GraphModule
    items: list[Item]  # execution order
    buffers: dict[str, tuple[tuple[Size, ...], tuple[Size, ...], int, torch.dtype]]
    outputs: list[object]  # per graph output: a buffer name (str) or a constant
    placeholders: list[str]
    aliases: dict[str, str]  # fx node name -> buffer name, where they differ (ATen args)

    @property
    def symbols(self) -> tuple[sympy.Symbol, ...]:
        """The size symbols of the graph's buffers, sorted by name (empty for static sizes)."""
        syms: set[sympy.Symbol] = set()
        for size, stride, _, _ in self.buffers.values():
            syms |= size_symbols((*size, *stride))
        return tuple(sorted(syms, key=str))


class Unsupported(Exception):
    pass


@dataclass(frozen=True)
class SymScalar:
    """A SymInt argument of an op (a size computed in the graph) as a sympy expression."""

    expr: sympy.Expr


@dataclass
class _Value:
    size: tuple[Size, ...]
    dtype: torch.dtype
    fn: IndexFn
    buffer: str | None = None  # set once materialized
    cost: int = 1  # expression nodes of fn


def _prod(xs: Sequence[Size]) -> Size:
    out: Size = 1
    for x in xs:
        out = out * (x if isinstance(x, sympy.Basic) and not x.is_Integer else int(x))
    return out


def _shape(val: torch.Tensor) -> tuple[Size, ...]:
    return tuple(static_or_expr(s) for s in val.shape)


def _strides(val: torch.Tensor) -> tuple[Size, ...]:
    return tuple(static_or_expr(s) for s in val.stride())


def _offset_is_zero(val: torch.Tensor) -> bool:
    off = static_or_expr(val.storage_offset())
    return is_static(off) and int(off) == 0


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _val(node: fx.Node) -> Any:
    return node.meta.get("val")


class _Lowering:
    def __init__(self, module: fx.GraphModule, view_outputs: frozenset[int] | None) -> None:
        self.module = module
        self.items: list[Item] = []
        self.env: dict[fx.Node, Any] = {}
        self.buffers: dict[str, tuple[tuple[Size, ...], tuple[Size, ...], int, torch.dtype]] = {}
        self.aliases: dict[str, str] = {}  # fx node name -> the buffer holding its value
        out_node = next(n for n in reversed(module.graph.nodes) if n.op == "output")
        self.outputs = set(out_node.all_input_nodes)
        self.out_node = out_node
        returned = (
            out_node.args[0] if isinstance(out_node.args[0], (list, tuple)) else (out_node.args[0],)
        )
        positions = view_output_positions(module) if view_outputs is None else view_outputs
        self.view_outputs = {returned[i] for i in positions if isinstance(returned[i], fx.Node)}

    # -- materialization --
    def buffer_value(self, name: str, val: torch.Tensor) -> _Value:
        return self.buffer_of(name, _shape(val), _strides(val), val.dtype)

    def buffer_of(
        self, name: str, size: tuple[Size, ...], stride: tuple[Size, ...], dtype: torch.dtype
    ) -> _Value:
        # Kernels index from the tensor's data pointer, which includes its storage offset.
        self.buffers[name] = (size, stride, 0, dtype)

        def fn(idx: Sequence[sympy.Expr]) -> Expr:
            return Load(name, flat_index(idx, stride))

        return _Value(size, dtype, fn, buffer=name)

    def realize(self, node: fx.Node) -> str:
        value = self.env[node]
        if isinstance(value, _Value) and value.buffer is not None:
            return value.buffer
        if not isinstance(value, _Value):
            raise Unsupported(f"{node.name} is not a tensor value")
        val = _val(node)
        stride = _strides(val) if node in self.outputs else contiguous_strides(value.size)
        if not _offset_is_zero(val) or not _non_overlapping(value.size, stride):
            stride = contiguous_strides(value.size)
        comp = Computed(
            node.name, NodeKind.POINTWISE, value.size, stride, value.dtype, value.fn, None, node
        )
        self.add_computed(comp)
        self.env[node] = self.buffer_of(node.name, value.size, stride, value.dtype)
        return node.name

    def add_computed(self, comp: Computed) -> None:
        shape = comp.reduction.src_size if comp.reduction else comp.size
        syms = [index_symbol(f"i{d}") for d in range(len(shape))]
        comp.reads = tuple(sorted({ld.buf for ld in loads_of(comp.fn(syms))}))
        comp.cone = _cone(comp.origin, set(comp.reads))
        self.buffers[comp.name] = (comp.size, comp.stride, 0, comp.dtype)
        self.items.append(comp)

    def extern(self, node: fx.Node) -> None:
        reads = []
        for inp in node.all_input_nodes:
            value = self.env.get(inp)
            lazy = isinstance(value, tuple) or (isinstance(value, _Value) and value.buffer is None)
            if lazy and is_view_node(inp):
                self.extern(inp)  # a view feeding an ATen call stays an ATen view, no copy
                reads.append(inp.name)
            elif isinstance(value, _Value):
                buf = self.realize(inp)
                reads.append(buf)
                if buf != inp.name:  # e.g. a no-op reshape: the node's value is that buffer
                    self.aliases[inp.name] = buf
            elif inp.op != "placeholder" or isinstance(_val(inp), torch.Tensor):
                reads.append(inp.name)
        self.items.append(Extern(node.name, node, tuple(sorted(set(reads)))))
        val = _val(node)
        if isinstance(val, torch.Tensor):
            self.env[node] = self.buffer_value(node.name, val)
        else:
            self.env[node] = node.name  # a tuple or scalar produced by ATen

    # -- driver --
    def run(self) -> LoweredGraph:
        placeholders = []
        for node in self.module.graph.nodes:
            if node.op == "placeholder":
                placeholders.append(node.name)
                val = _val(node)
                self.env[node] = (
                    self.buffer_value(node.name, val)
                    if isinstance(val, torch.Tensor)
                    else node.name
                )
            elif node.op == "output":
                continue
            else:
                self.lower_node(node)
        outputs: list[object] = []
        returned = self.out_node.args[0]
        for value in returned if isinstance(returned, (list, tuple)) else (returned,):
            if isinstance(value, fx.Node):
                outputs.append(
                    self.realize(value) if isinstance(self.env[value], _Value) else value.name
                )
            else:
                outputs.append(value)
        return LoweredGraph(
            self.module, self.items, self.buffers, outputs, placeholders, self.aliases
        )

    def lower_node(self, node: fx.Node) -> None:
        val = _val(node)
        lowering = LOWERINGS.get(node.target)
        is_view_out = node in self.view_outputs and is_view_node(node)
        if node.op == "get_attr":
            self.items.append(Extern(node.name, node, ()))
            self.env[node] = (
                self.buffer_value(node.name, val) if isinstance(val, torch.Tensor) else node.name
            )
            return
        devices = {
            v.device
            for v in [val, *[_val(a) for a in node.all_input_nodes]]
            if isinstance(v, torch.Tensor)
        }
        if (
            lowering is None
            or is_view_out
            or len(devices) > 1
            or not isinstance(val, (torch.Tensor, tuple, list))
            or (isinstance(val, torch.Tensor) and val.dtype not in KERNEL_TYPES)
        ):
            self.extern(node)
            return
        try:
            args = [self._arg(a) for a in node.args]
            kwargs = {k: self._arg(v) for k, v in node.kwargs.items()}
            result = lowering(self, node, *args, **kwargs)
        except Unsupported as e:
            log.debug("%s stays an ATen call: %s", node.format_node(), e)
            self.extern(node)
            return
        if isinstance(result, Computed):
            self.add_computed(result)
            self.env[node] = self.buffer_of(node.name, result.size, result.stride, result.dtype)
            return
        self.env[node] = result
        if isinstance(result, _Value):
            n_users = len(node.users)
            if result.cost > MAX_EXPR_NODES or (n_users > 1 and result.cost > MAX_INLINE_NODES):
                self.realize(node)

    def _arg(self, a: Any) -> Any:
        if isinstance(a, fx.Node) and isinstance(_val(a), torch.SymInt):
            return SymScalar(_val(a).node.expr)
        if isinstance(a, torch.SymInt):
            return SymScalar(a.node.expr)
        if isinstance(a, fx.Node):
            v = self.env[a]
            if not isinstance(v, (_Value, tuple, list)):
                raise Unsupported(f"argument {a.name} is not a tensor lowering understands")
            return v
        if isinstance(a, (list, tuple)):
            return type(a)(self._arg(x) for x in a)
        return a


def is_view_node(node: fx.Node) -> bool:
    """A view op, or an element of a multi-output view op (`unbind(x)[2]`, a split part): as a
    graph output it must stay an ATen view, or its storage offset would be lost."""
    target = node.target
    if target is operator.getitem:
        if not isinstance(node.args[0], fx.Node):
            return False
        target = node.args[0].target
    return target in VIEW_OPS or (isinstance(target, torch._ops.OpOverload) and target.is_view)


def _non_overlapping(size: Sequence[Size], stride: Sequence[Size]) -> bool:
    """No two indices share an element (gaps allowed): each stride covers the smaller dims.
    With symbolic sizes: only layouts provably dense (see loop_ir.dense_order)."""
    if not all(is_static(v) for v in (*size, *stride)):
        return dense_order(size, stride) is not None
    return non_overlapping([int(v) for v in size], [int(v) for v in stride])


def _is_dense(size: Sequence[int], stride: Sequence[int]) -> bool:
    """A permutation of a contiguous layout (size-1 dims may have any stride)."""
    dims = sorted((st, s) for s, st in zip(size, stride) if s > 1)
    expect = 1
    for st, s in dims:
        if st != expect:
            return False
        expect = st * s
    return True


def _cone(origin: fx.Node, stops: set[str]) -> tuple[fx.Node, ...]:
    seen: set[fx.Node] = set()
    stack = [origin]
    while stack:
        n = stack.pop()
        if n in seen or n.op == "placeholder" or (n.name in stops and n is not origin):
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    order = {n: i for i, n in enumerate(origin.graph.nodes)}
    return tuple(sorted(seen, key=order.__getitem__))


def lower(module: fx.GraphModule, view_outputs: frozenset[int] | None = None) -> LoweredGraph:
    """`view_outputs`: positions of graph outputs that are views in the graph before
    decomposition (they stay ATen views so aliasing matches eager); default: the view nodes
    among this graph's outputs."""
    return _Lowering(module, view_outputs).run()


def view_output_positions(module: fx.GraphModule) -> frozenset[int]:
    out = next(n for n in reversed(module.graph.nodes) if n.op == "output")
    returned = out.args[0] if isinstance(out.args[0], (list, tuple)) else (out.args[0],)
    return frozenset(
        i
        for i, v in enumerate(returned)
        if isinstance(v, fx.Node) and _returns_alias(v) and v.target != aten._unsafe_view.default
    )  # that one returns a fresh tensor


def _returns_alias(node: fx.Node) -> bool:
    """A view of an input by the op's schema (`Tensor(a)` returns: unbind, select, unfold, ...),
    or by lowering's own list; a getitem of a multi-output view op is a view too. Such graph
    outputs stay ATen views so the runtime can regenerate their aliasing (their storage offset
    into the base included)."""
    if is_view_node(node):
        return True
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return any(
        r.alias_info is not None and not r.alias_info.is_write for r in target._schema.returns
    )


# ---- op lowerings ----------------------------------------------------------------------------

Lowering = Callable[..., Any]
LOWERINGS: dict[object, Lowering] = {}
VIEW_OPS: set[object] = set()


def register(*targets: object, view: bool = False) -> Callable[[Lowering], Lowering]:
    def deco(fn: Lowering) -> Lowering:
        for t in targets:
            LOWERINGS[t] = fn
            if view:
                VIEW_OPS.add(t)
        return fn

    return deco


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
    shape, strides = _shape(out), _strides(out)
    stride = (
        strides
        if node in ctx.outputs and _offset_is_zero(out) and _non_overlapping(shape, strides)
        else contiguous_strides(shape)
    )
    return Computed(node.name, NodeKind.REDUCTION, shape, stride, out.dtype, fn, red, node)


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
    shape, strides = _shape(out), _strides(out)
    stride = (
        strides
        if node in ctx.outputs and _offset_is_zero(out) and _non_overlapping(shape, strides)
        else contiguous_strides(shape)
    )
    return Computed(node.name, NodeKind.REDUCTION, shape, stride, out.dtype, fn, red, node)


from aotc.passes import lowering_gather as _lowering_gather  # noqa: E402, F401 - registers ops
