"""Lowerings of ops that read their inputs at computed positions: cat (each input in its own
range, masked loads) and gather, index, index_select, embedding (at positions read from an index
tensor, see Note [Data-dependent indices] in passes.loop_ir). Registered into
`passes.lowering.LOWERINGS` when that module is imported.

Worked example, `torch.cat([a, b * 2], 1)` with a: float[3, 5], b: float[3, 2]:

    fn(i0, i1) = where(5 <= i1, Load(b, 2*i0 + i1 - 5, mask=5 <= i1) * 2,
                       Load(a, 5*i0 + i1, mask=i1 < 5))

and `x.gather(1, i)` with i: int64[3, 2]:

    fn(i0, i1) = Indirect(g0, Load(i, 2*i0 + i1), 5, Load(x, 5*i0 + g0, mask=0 <= g0 < 5))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sympy
import torch
from torch import fx

from aotc.passes.loop_ir import (
    Const,
    Expr,
    IndexValue,
    Indirect,
    Op,
    Size,
    data_symbol,
    index_symbol,
    map_indices,
    simplify,
    with_mask,
)
from aotc.passes.lowering import _Lowering, _shape, _val, _Value, register
from aotc.passes.lowering_ir import Unsupported
from aotc.passes.lowering_ops import _broadcast_fn, _cost

aten = torch.ops.aten

# Heuristic: each input of a cat is one masked load (and one `where`) per element; beyond this
# many inputs the expression grows past what inlining should carry, and ATen's cat copies.
MAX_CAT_INPUTS = 16


@register(aten.cat.default)
def _cat(ctx: _Lowering, node: fx.Node, tensors: Sequence[Any], dim: int = 0) -> _Value:
    out = _val(node)
    size = _shape(out)
    if not size:
        raise Unsupported("cat of 0-d tensors")
    dim %= len(size)
    pieces: list[tuple[Size, Size, Any]] = []
    start: Size = 0
    for t in tensors:
        if not isinstance(t, _Value):
            raise Unsupported("cat of a value lowering does not hold")
        if len(t.size) == 1 and t.size[0] == 0 and len(size) != 1:
            continue  # torch skips legacy empty 1-D inputs
        n = t.size[dim]
        if n != 0:
            pieces.append((start, n, _broadcast_fn(t, t.size, out.dtype)))
        start = start + n
    if not pieces or len(pieces) > MAX_CAT_INPUTS:
        raise Unsupported(f"cat of {len(pieces)} non-empty inputs")
    # Note [Cat inputs in their own range]: each input's value over its own index symbols, each
    # in its range (the cat dim's in [0, n)), its indices simplified with those ranges; a call
    # substitutes the output's index into it. Without the ranges an input reached through views
    # keeps `((i - begin) // n) % m`-style terms no later simplification can drop (it does not
    # know the load's mask bounds `i - begin`): a GPT block's qkv-gradient cat spent ~5x its
    # memory time on index arithmetic on an H200.
    syms = [index_symbol(f"{node.name}_i{d}") for d in range(len(size))]
    bound = [_in_range(read, syms, size, dim, n) for _, n, read in pieces]

    def fn(idx: Sequence[sympy.Expr]) -> Expr:
        e: Expr | None = None
        for first, (begin, n, read) in enumerate(pieces):
            local = list(idx)
            local[dim] = idx[dim] - begin
            conds = [idx[dim] >= begin] if first else []
            if first < len(pieces) - 1:
                conds.append(idx[dim] < begin + n)
            cond = sympy.And(*conds)
            simplified = bound[first]
            if simplified is not None:
                at = dict(zip(syms, local, strict=True))

                def put(ix: Any, at: dict[sympy.Symbol, sympy.Expr] = at) -> Any:
                    return ix.subs(at, simultaneous=True)

                value = map_indices(simplified, put)
            else:
                value = read(local)
            value = with_mask(value, cond)
            e = (
                value
                if e is None
                else Op("where", (IndexValue(cond, torch.bool), value, e), out.dtype)
            )
        assert e is not None
        return e

    return _Value(size, out.dtype, fn, cost=_cost(*tensors) + len(pieces))


def _in_range(
    read: Any, syms: list[sympy.Symbol], size: Sequence[Size], dim: int, n: Size
) -> Expr | None:
    """One cat input's value at `syms`, simplified knowing each symbol's range; None where
    simplification cannot handle an index (the caller reads at the output's index instead)."""
    ranges = {s: (n if d == dim else size[d]) for d, s in enumerate(syms)}
    try:
        value = read(syms)
        if _has_indirect(value):
            return None  # its data symbol is named after the index it reads: keep them per call
        return map_indices(value, lambda ix: simplify(ix, ranges))
    except (ValueError, TypeError):
        return None


def _has_indirect(e: Expr) -> bool:
    if isinstance(e, Indirect):
        return True
    return isinstance(e, Op) and any(_has_indirect(a) for a in e.args)


def _gathered(
    ctx: _Lowering, a: _Value, idx: list[sympy.Expr], dims: Sequence[int], values: Sequence[Expr]
) -> Expr:
    """`a` at `idx` with each dim in `dims` indexed by the matching int64 value."""
    syms = [data_symbol(v, d) for d, v in zip(dims, values, strict=True)]
    src = list(idx)
    for d, g in zip(dims, syms, strict=True):
        src[d] = g
    valid = sympy.And(
        *[c for d, g in zip(dims, syms, strict=True) for c in (g >= 0, g < a.size[d])]
    )
    body = with_mask(a.fn(src), valid)
    for d, g, v in reversed(list(zip(dims, syms, values, strict=True))):
        body = Indirect(g, v, a.size[d], body)
    return body


def _index_value(index: _Value, size: tuple[Size, ...], wrap: Size | None) -> Any:
    """The int64 index function of an index tensor broadcast to `size`; with `wrap`, negative
    values count from the end (aten.index)."""
    if index.dtype not in (torch.int64, torch.int32):
        raise Unsupported(f"an index tensor of {index.dtype}")
    read = _broadcast_fn(index, size, torch.int64)
    if wrap is None:
        return read
    zero, n = Const(0, torch.int64), Const(wrap, torch.int64)

    def fn(idx: Sequence[sympy.Expr]) -> Expr:
        v = read(idx)
        return Op(
            "where",
            (Op("lt", (v, zero), torch.bool), Op("add", (v, n), torch.int64), v),
            torch.int64,
        )

    return fn


@register(aten.gather.default)
def _gather(
    ctx: _Lowering, node: fx.Node, a: _Value, dim: int, index: _Value, **kwargs: Any
) -> _Value:
    size = _shape(_val(node))
    if not a.size:
        raise Unsupported("gather from a 0-d tensor")
    dim %= len(a.size)
    value = _index_value(index, size, None)
    return _Value(
        size,
        a.dtype,
        lambda idx: _gathered(ctx, a, list(idx), [dim], [value(idx)]),
        cost=_cost(a, index) + 1,
    )


@register(aten.index_select.default)
def _index_select(ctx: _Lowering, node: fx.Node, a: _Value, dim: int, index: _Value) -> _Value:
    size = _shape(_val(node))
    if not a.size:
        raise Unsupported("index_select of a 0-d tensor")
    dim %= len(a.size)
    value = _index_value(index, index.size, None)
    return _Value(
        size,
        a.dtype,
        lambda idx: _gathered(
            ctx, a, list(idx), [dim], [value(list(idx[dim : dim + len(index.size)]))]
        ),
        cost=_cost(a, index) + 1,
    )


@register(aten.embedding.default)
def _embedding(
    ctx: _Lowering, node: fx.Node, weight: _Value, indices: _Value, *args: Any
) -> _Value:
    size = _shape(_val(node))
    if len(weight.size) != 2:
        raise Unsupported("embedding with a weight that is not 2-D")
    value = _index_value(indices, indices.size, None)
    return _Value(
        size,
        weight.dtype,
        lambda idx: _gathered(
            ctx, weight, [sympy.Integer(0), idx[-1]], [0], [value(list(idx[:-1]))]
        ),
        cost=_cost(weight, indices) + 1,
    )


@register(aten.index.Tensor)
def _index(ctx: _Lowering, node: fx.Node, a: _Value, indices: Sequence[Any]) -> _Value:
    """Advanced indexing with integer index tensors (None for a full dim): the index tensors
    broadcast to a shape B, which replaces the indexed dims where they are adjacent, else leads."""
    size = _shape(_val(node))
    dims = [d for d, t in enumerate(indices) if t is not None]
    if not dims or any(not isinstance(indices[d], _Value) for d in dims):
        raise Unsupported("index with no index tensor, or one lowering does not hold")
    nb = len(size) - (len(a.size) - len(dims))
    adjacent = dims == list(range(dims[0], dims[-1] + 1))
    lead = dims[0] if adjacent else 0
    bshape = size[lead : lead + nb]
    values = [_index_value(indices[d], bshape, a.size[d]) for d in dims]

    def fn(idx: Sequence[sympy.Expr]) -> Expr:
        b_idx = list(idx[lead : lead + nb])
        rest = iter([*idx[:lead], *idx[lead + nb :]])
        src = [sympy.Integer(0) if d in dims else next(rest) for d in range(len(a.size))]
        return _gathered(ctx, a, src, dims, [v(b_idx) for v in values])

    return _Value(size, a.dtype, fn, cost=_cost(a, *[indices[d] for d in dims]) + len(dims))
