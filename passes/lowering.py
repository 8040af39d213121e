"""Lower a decomposed ATen graph to loop-IR nodes: the schedulable units of kernel generation.

Stage: `lower(module) -> LoweredGraph` (records: passes/lowering_ir.py). The op table: this
module holds the registry (`LOWERINGS`, `register`); the lowerings of the ops are in
passes/lowering_ops.py and passes/lowering_gather.py, imported at the end to register them.
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

import dataclasses
import logging
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch import fx

from aotc.passes.loop_ir import (
    Expr,
    IndexFn,
    Load,
    Size,
    contiguous_strides,
    dense_order,
    flat_index,
    index_symbol,
    is_static,
    loads_of,
    static_or_expr,
)
from aotc.passes.lowering_ir import (
    Computed,
    Extern,
    Item,
    LoweredGraph,
    NodeKind,
    SymScalar,
    Unsupported,
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


@dataclass
class _Value:
    size: tuple[Size, ...]
    dtype: torch.dtype
    fn: IndexFn
    buffer: str | None = None  # set once materialized
    cost: int = 1  # expression nodes of fn


def _shape(val: torch.Tensor) -> tuple[Size, ...]:
    return tuple(static_or_expr(s) for s in val.shape)


_LAYOUT_READERS = frozenset({torch.ops.aten.as_strided.default})


def _strides(val: torch.Tensor) -> tuple[Size, ...]:
    return tuple(static_or_expr(s) for s in val.stride())


def _offset_is_zero(val: torch.Tensor) -> bool:
    off = static_or_expr(val.storage_offset())
    return is_static(off) and int(off) == 0


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
        # Graph outputs eager returns as tensors of their own (`_unsafe_view`, decomposed to a
        # view: `reshape` of a non-contiguous tensor): never an ATen view of a kernel's buffer,
        # which autograd would mark as a view made inside the autograd Function (fuzz seed 33425).
        self.fresh_outputs = {
            n for n in returned if isinstance(n, fx.Node) and n not in self.view_outputs
        }

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

    def realize(self, node: fx.Node, eager_layout: bool = False) -> str:
        """`eager_layout`: lay the buffer out with eager's strides even when it is not a graph
        output (the input of a random op: see `extern`)."""
        value = self.env[node]
        if isinstance(value, _Value) and value.buffer is not None:
            return value.buffer
        if not isinstance(value, _Value):
            raise Unsupported(f"{node.name} is not a tensor value")
        val = _val(node)
        keep = eager_layout or node in self.outputs
        stride = _strides(val) if keep else contiguous_strides(value.size)
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
        reads = tuple(sorted({ld.buf for ld in loads_of(comp.fn(syms))}))
        comp = dataclasses.replace(comp, reads=reads, cone=_cone(comp.origin, set(reads)))
        self.buffers[comp.name] = (comp.size, comp.stride, 0, comp.dtype)
        self.items.append(comp)

    def extern(self, node: fx.Node) -> None:
        # Ops whose result depends on their input's memory layout, not only its values: a
        # random op fills its result in memory order and `rand_like(x)` lays it out as x
        # (preserve_format); `as_strided` reads x's memory through the strides eager's x has.
        # Such an input must have eager's strides, or the values land on other elements.
        seeded = node.target in _LAYOUT_READERS or (
            isinstance(node.target, torch._ops.OpOverload)
            and torch.Tag.nondeterministic_seeded in node.target.tags
        )
        reads = []
        for inp in node.all_input_nodes:
            value = self.env.get(inp)
            lazy = isinstance(value, tuple) or (isinstance(value, _Value) and value.buffer is None)
            if lazy and is_view_node(inp) and inp not in self.fresh_outputs:
                self.extern(inp)  # a view feeding an ATen call stays an ATen view, no copy
                reads.append(inp.name)
            elif isinstance(value, _Value):
                buf = self.realize(inp, eager_layout=seeded)
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
            self.module,
            tuple(self.items),
            self.buffers,
            tuple(outputs),
            tuple(placeholders),
            self.aliases,
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


# The op table: importing these registers every op's lowering.
from aotc.passes import lowering_gather as _lowering_gather  # noqa: E402, F401 - registers ops
from aotc.passes import lowering_ops as _lowering_ops  # noqa: E402, F401 - registers ops
