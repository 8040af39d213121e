"""Symbolic sizes as plain data: integer expressions over size symbols, as checked text.

Records: `SizeExpr` (one integer expression over a graph's size symbols, e.g. "(s0 * s1)").
Stage: `size_expr(value) -> int | SizeExpr` (compiler side: an int, a SymInt or a sympy size
expression of a lowered graph to its plain form); `SizeExpr(text)` (load side: checks the text
against the grammar below, or raises ValueError).
Requires: expressions built from integers, size symbols, +, -, *, floor division, modulo, max,
min and small constant powers (what `runtime.symsizes.size_code` writes; anything else is refused with
ValueError when encoding, so the program is not exported).
Ensures: a `SizeExpr` holds only text of the grammar (checked on construction, so a decoded
artifact cannot smuggle other code into the size functions that `runtime.symsizes.compile_sizes`
builds from it); `names` lists the symbols it reads. Evaluating one needs no sympy: the symbolic
runner (runtime/kernels.py) turns a step's expressions into one Python function of the symbols'
values, as for a freshly lowered graph.

Note [Size expressions as text]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A lowered graph with symbolic sizes (dynamic=True, backend="triton") carries sympy expressions:
each kernel's xnumel/rnumel and size arguments, each buffer's size and strides, the strides the
kernels index their inputs with, the strides ATen results are brought to. An exported artifact
stores each as the Python text of the expression in a restricted grammar

    expr := int | symbol | expr (+ | - | * | // | %) expr | -expr | expr ** int | ( expr )
          | max(expr, expr, ...) | min(expr, expr, ...)
    symbol := an identifier naming one of the graph's size symbols (`GraphProgram.symbols`:
              where its value is read from the call's arguments)

and the loader checks each text with Python's parser against that grammar before any of it is
compiled. The symbols' values come from the call's argument sizes exactly as in a compiled
function (`runtime.symsizes.read_symbols`), and the shape guard the artifact stores says which
sizes the program admits (checked per call before anything runs).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any

MAX_TEXT = 4000  # characters: expressions aotc writes are far shorter
MAX_POWER = 64

_OPS = (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Mod, ast.Pow)
_FNS = ("max", "min")  # the only calls: max(a, b, ...), min(a, b, ...)


@dataclass(frozen=True, slots=True)
class SizeExpr:
    """An integer size expression over a graph's size symbols (Note [Size expressions as text])."""

    text: str

    def __post_init__(self) -> None:
        names(self.text)  # raises ValueError outside the grammar

    @property
    def symbols(self) -> frozenset[str]:
        return names(self.text)

    def __str__(self) -> str:
        return self.text


def names(text: str) -> frozenset[str]:
    """The symbols `text` reads; ValueError when it is not an expression of the grammar."""
    if not isinstance(text, str) or not text or len(text) > MAX_TEXT:
        raise ValueError(f"size expression {str(text)[:40]!r} is empty, too long or not text")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, RecursionError, MemoryError) as e:
        raise ValueError(f"size expression {text[:60]!r} does not parse ({e})") from None
    found: set[str] = set()
    stack: list[ast.AST] = [tree.body]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.BinOp) and isinstance(node.op, _OPS):
            if isinstance(node.op, ast.Pow) and not _small_int(node.right):
                raise ValueError(f"size expression {text[:60]!r}: powers take a small constant")
            stack += [node.left, node.right]
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            stack.append(node.operand)
        elif isinstance(node, ast.Constant) and type(node.value) is int:
            pass
        elif isinstance(node, ast.Name) and not node.id.startswith("_") and node.id not in _FNS:
            found.add(node.id)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in _FNS
            and len(node.args) >= 2
            and not node.keywords
            and not any(isinstance(a, ast.Starred) for a in node.args)
        ):
            stack += node.args
        else:
            raise ValueError(
                f"size expression {text[:60]!r} uses {type(node).__name__}, which is outside the "
                "grammar of sizes (integers, size symbols, + - * // %, max, min, constant powers)"
            )
    return frozenset(found)


def _small_int(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Constant) and type(node.value) is int and 0 <= node.value <= MAX_POWER
    )


def size_expr(value: Any) -> int | SizeExpr:
    """The plain form of a size: an int, or a `SizeExpr` for a sympy expression or SymInt with
    free symbols. Raises ValueError for an expression outside the grammar (compiler side: this
    imports `runtime.symsizes`, which writes the text)."""
    if isinstance(value, bool):
        raise ValueError(f"size {value!r} is a bool")
    if isinstance(value, (int, SizeExpr)):
        return value
    node = getattr(value, "node", None)  # a SymInt: its sympy expression
    expr = node.expr if node is not None and hasattr(node, "expr") else value
    if getattr(expr, "is_Integer", False):
        return int(expr)
    if not hasattr(expr, "free_symbols"):
        raise ValueError(f"size {value!r} is neither an int nor a size expression")
    from aotc.runtime.symsizes import size_code

    return SizeExpr(size_code(expr))


def symbols_of(values: Any) -> frozenset[str]:
    """The symbols read by the `SizeExpr`s in `values` (nested tuples and lists)."""
    if isinstance(values, SizeExpr):
        return values.symbols
    if isinstance(values, (tuple, list)):
        out: frozenset[str] = frozenset()
        for v in values:
            out |= symbols_of(v)
        return out
    return frozenset()


__all__ = ["SizeExpr", "names", "size_expr", "symbols_of"]
