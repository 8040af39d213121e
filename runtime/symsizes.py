"""Symbolic sizes at run time: bind a graph's size symbols to the call's sizes, evaluate sizes.

Records: `SymSource` (where one size symbol is read from the graph's arguments).
Requires: the symbols of a lowered graph (passes.lowering.LoweredGraph.symbols) and the
placeholders' traced values (`meta["val"]`: tensors with SymInt sizes/strides, SymInts).
Ensures: `bind_symbols` finds, for every symbol, a placeholder size, stride or SymInt argument
that is exactly that symbol (else ValueError: the graph then runs as ATen calls);
`read_symbols` reads their values from a call's arguments without touching the ShapeEnv;
`compile_sizes` turns sympy size expressions into one Python function of those values, so a call
evaluates all sizes of a step with one function call (no sympy at run time).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import sympy
import torch

from aotc.runtime.symexpr import SizeExpr


class SymKind(enum.Enum):
    SIZE = "size"
    STRIDE = "stride"
    SCALAR = "scalar"  # a SymInt placeholder (e.g. a size saved for the backward)


@dataclass(frozen=True, slots=True)
class SymSource:
    symbol: str
    kind: SymKind
    arg: int  # placeholder position
    dim: int  # for SIZE/STRIDE


def bind_symbols(
    placeholder_vals: Sequence[Any], symbols: Sequence[sympy.Symbol]
) -> tuple[SymSource, ...]:
    found: dict[sympy.Symbol, SymSource] = {}

    def note(expr: sympy.Expr, kind: SymKind, arg: int, dim: int) -> None:
        if expr.is_Symbol and expr not in found:
            found[expr] = SymSource(str(expr), kind, arg, dim)

    for i, val in enumerate(placeholder_vals):
        if isinstance(val, torch.SymInt):
            note(val.node.expr, SymKind.SCALAR, i, 0)
        elif isinstance(val, torch.Tensor):
            for d, s in enumerate(val.shape):
                if isinstance(s, torch.SymInt):
                    note(s.node.expr, SymKind.SIZE, i, d)
            for d, s in enumerate(val.stride()):
                if isinstance(s, torch.SymInt):
                    note(s.node.expr, SymKind.STRIDE, i, d)
    missing = [str(s) for s in symbols if s not in found]
    if missing:
        raise ValueError(
            f"size symbols {missing} are not a size, stride or SymInt argument of the graph"
        )
    return tuple(found[s] for s in symbols)


def read_symbols(sources: Sequence[SymSource], args: Sequence[Any]) -> tuple[int, ...]:
    out = []
    for src in sources:
        a = args[src.arg]
        if src.kind is SymKind.SIZE:
            out.append(a.shape[src.dim])
        elif src.kind is SymKind.STRIDE:
            out.append(a.stride(src.dim))
        else:
            out.append(int(a))
    return tuple(out)


def size_code(e: Any) -> str:
    """Python source of an integer size expression (ints, size symbols, +, *, floor division,
    modulo, max/min;
    or a `SizeExpr`, runtime.symexpr, whose text was checked when it was made)."""
    if isinstance(e, int):
        return str(e)
    if isinstance(e, SizeExpr):
        return f"({e.text})"
    if e.is_Integer:
        return str(int(e))
    if e.is_Symbol:
        return str(e)
    if e.is_Add:
        return "(" + " + ".join(size_code(a) for a in e.args) + ")"
    if e.is_Mul:
        return "(" + " * ".join(size_code(a) for a in e.args) + ")"
    if e.is_Pow and e.exp.is_Integer and int(e.exp) >= 0:
        return f"({size_code(e.base)} ** {int(e.exp)})"
    name = type(e).__name__
    if name in ("FloorDiv",) and len(e.args) == 2:
        return f"({size_code(e.args[0])} // {size_code(e.args[1])})"
    if name in ("Max", "Min") and len(e.args) >= 2:  # e.g. the stride of a strided slice
        return f"{name.lower()}({', '.join(size_code(a) for a in e.args)})"
    if name in ("ModIdx", "PythonMod") and len(e.args) == 2:
        return f"({size_code(e.args[0])} % {size_code(e.args[1])})"
    raise ValueError(f"cannot evaluate size expression {e} at run time")


def compile_sizes(
    exprs: Sequence[Any], symbols: Sequence[str]
) -> Callable[[Sequence[int]], tuple[int, ...]]:
    """One function from the symbols' values (in `symbols` order) to the values of `exprs`."""
    body = ", ".join(size_code(e) for e in exprs)
    unpack = f"({', '.join(symbols)},) = values\n    " if symbols else ""
    src = f"def sizes(values):\n    {unpack}return ({body}{',' if exprs else ''})\n"
    scope: dict[str, Any] = {}
    exec(compile(src, "<aotc sizes>", "exec"), scope)  # noqa: S102 - generated from sympy above
    sizes: Callable[[Sequence[int]], tuple[int, ...]] = scope["sizes"]
    return sizes
