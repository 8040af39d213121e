"""Loop-level IR: index expressions and scalar computations, the vocabulary of lowering.

A value of the graph is known by its `size`, its dtype and a function from an index (one sympy
expression per dimension) to a scalar `Expr`: the computation of one element. Views, permutes,
broadcasts, slices and reshapes are index transforms, so reading an input through them never
materializes anything: `permute(x, [1, 0])[i, j]` is `Load("x", j * stride0 + i * stride1)`.

Requires: static sizes (ints). Ensures: index expressions use only integer symbols with known
ranges, `+`, `*`, `FloorDiv` and `ModIdx`, simplified with those ranges (see Note [Index
simplification]).

# Note [Index simplification]
Reading a value of size (B, T, C) inside a row kernel (x over B*T rows, r over C) starts from
the flat index `x*C + r` and unflattens it: `i0 = (x*C + r) // (T*C) % B`, `i1 = (x*C + r) // C
% T`, `i2 = (x*C + r) % C`. With `0 <= r < C` and `0 <= x < B*T` these simplify to
`x // T`, `x % T` and `r`, and the flat index of a (B, T, 1) reduction result,
`T*(x // T) + x % T`, to `x`: the scheduler fuses a consumer with a reduction exactly when its
read index simplifies to the reduction's own row `x`. A failed simplification only costs fusion.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import sympy
import torch


class FloorDiv(sympy.Function):
    is_integer = True
    nargs = 2


class ModIdx(sympy.Function):
    is_integer = True
    nargs = 2


Ranges = dict[sympy.Symbol, int]  # symbol -> exclusive upper bound; lower bound is 0


def index_symbol(name: str) -> sympy.Symbol:
    return sympy.Symbol(name, integer=True, nonnegative=True)


def bounds(e: sympy.Expr, ranges: Ranges) -> tuple[int, int]:
    """Inclusive integer bounds of a non-negative index expression."""
    if e.is_Integer:
        return int(e), int(e)
    if e.is_Symbol:
        return 0, max(ranges.get(e, 2**62) - 1, 0)
    if e.is_Add:
        lo = hi = 0
        for a in e.args:
            alo, ahi = bounds(a, ranges)
            lo, hi = lo + alo, hi + ahi
        return lo, hi
    if e.is_Mul:
        lo = hi = 1
        for a in e.args:
            alo, ahi = bounds(a, ranges)
            cands = (lo * alo, lo * ahi, hi * alo, hi * ahi)
            lo, hi = min(cands), max(cands)
        return lo, hi
    if isinstance(e, FloorDiv):
        lo, hi = bounds(e.args[0], ranges)
        d = int(e.args[1])
        return lo // d, hi // d
    if isinstance(e, ModIdx):
        lo, hi = bounds(e.args[0], ranges)
        d = int(e.args[1])
        return (lo, hi) if 0 <= lo and hi < d else (0, d - 1)
    raise ValueError(f"index expression {e} has an unknown form")


def _coeff(term: sympy.Expr) -> int:
    c, _ = term.as_coeff_Mul()
    return int(c) if c.is_Integer else 1


def _split(terms: Sequence[sympy.Expr], g: int) -> tuple[list[sympy.Expr], list[sympy.Expr]]:
    big = [t for t in terms if _coeff(t) % g == 0 and not t.is_Integer]
    small = [t for t in terms if t not in big]
    return big, small


def floordiv(e: sympy.Expr, d: int, ranges: Ranges) -> sympy.Expr:
    if d == 1:
        return e
    if e.is_Integer:
        return sympy.Integer(int(e) // d)
    lo, hi = bounds(e, ranges)
    if lo >= 0 and hi < d:
        return sympy.Integer(0)
    if isinstance(e, FloorDiv):
        return floordiv(e.args[0], int(e.args[1]) * d, ranges)
    terms = list(sympy.Add.make_args(e))
    whole = [t for t in terms if _coeff(t) % d == 0 and not t.is_Integer]
    if whole:
        rest = sympy.Add(*[t for t in terms if t not in whole])
        return sympy.Add(*[t / d for t in whole]) + floordiv(rest, d, ranges)
    for g in sorted({math.gcd(d, _coeff(t)) for t in terms}, reverse=True):
        if g <= 1:
            continue
        big, small = _split(terms, g)
        slo, shi = bounds(sympy.Add(*small), ranges)
        if big and slo >= 0 and shi < g:
            return floordiv(sympy.Add(*[t / g for t in big]), d // g, ranges)
    return FloorDiv(e, sympy.Integer(d))


def mod(e: sympy.Expr, d: int, ranges: Ranges) -> sympy.Expr:
    if d == 1:
        return sympy.Integer(0)
    if e.is_Integer:
        return sympy.Integer(int(e) % d)
    terms = [t for t in sympy.Add.make_args(e) if t.is_Integer or _coeff(t) % d != 0]
    e = sympy.Add(*terms)
    lo, hi = bounds(e, ranges)
    if lo >= 0 and hi < d:
        return e
    for g in sorted({math.gcd(d, _coeff(t)) for t in terms}, reverse=True):
        if g <= 1:
            continue
        big, small = _split(terms, g)
        rest = sympy.Add(*small)
        slo, shi = bounds(rest, ranges)
        if big and slo >= 0 and shi < g:
            return g * mod(sympy.Add(*[t / g for t in big]), d // g, ranges) + rest
    return ModIdx(e, sympy.Integer(d))


def simplify(e: sympy.Expr, ranges: Ranges) -> sympy.Expr:
    """Rebuild `e` bottom-up with the range-aware rules (see Note [Index simplification])."""
    if e.is_Integer or e.is_Symbol:
        return e
    if isinstance(e, FloorDiv):
        return floordiv(simplify(e.args[0], ranges), int(e.args[1]), ranges)
    if isinstance(e, ModIdx):
        return mod(simplify(e.args[0], ranges), int(e.args[1]), ranges)
    if e.is_Mul:
        return sympy.Mul(*[simplify(a, ranges) for a in e.args])
    if e.is_Add:
        return _recombine(sympy.Add(*[simplify(a, ranges) for a in e.args]))
    raise ValueError(f"index expression {e} has an unknown form")


def _recombine(e: sympy.Expr) -> sympy.Expr:
    """`a*(y // a) + y % a` -> `y` and `a*((y // a) % b) + y % a` -> `y % (a*b)`."""
    changed = True
    while changed and e.is_Add:
        changed = False
        terms = list(e.args)
        for t in terms:
            k, m = t.as_coeff_Mul()
            if not isinstance(m, ModIdx):
                continue
            y, a = m.args
            for u in terms:
                ku, mu = u.as_coeff_Mul()
                if ku != k * a:
                    continue
                if mu == FloorDiv(y, a):
                    repl = k * y
                elif isinstance(mu, ModIdx) and mu.args[0] == FloorDiv(y, a):
                    repl = k * ModIdx(y, a * mu.args[1])
                else:
                    continue
                rest = [v for v in terms if v is not t and v is not u]
                e = sympy.Add(*rest, repl)
                changed = True
                break
            if changed:
                break
    return e


def contiguous_strides(size: Sequence[int]) -> tuple[int, ...]:
    out, acc = [], 1
    for s in reversed(size):
        out.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(out))


def flat_index(index: Sequence[sympy.Expr], strides: Sequence[int], offset: int = 0) -> sympy.Expr:
    return sympy.Integer(offset) + sympy.Add(
        *[i * s for i, s, in zip(index, strides, strict=True)]
    )


def unflatten(flat: sympy.Expr, size: Sequence[int], ranges: Ranges) -> list[sympy.Expr]:
    """The multi-index of a row-major flat index into `size`."""
    out = []
    for s, st in zip(size, contiguous_strides(size), strict=True):
        out.append(sympy.Integer(0) if s <= 1 else mod(floordiv(flat, st, ranges), s, ranges))
    return out


# ---- scalar computations -------------------------------------------------------------------

@dataclass(frozen=True)
class Load:
    buf: str  # name of a materialized buffer (placeholder, extern output, or kernel output)
    index: sympy.Expr  # element offset into the buffer's storage


@dataclass(frozen=True)
class Const:
    value: float | int | bool
    dtype: torch.dtype


@dataclass(frozen=True)
class IndexValue:
    index: sympy.Expr  # an index used as a number (iota, masks)
    dtype: torch.dtype


@dataclass(frozen=True)
class Op:
    name: str  # a key of passes.codegen's op templates
    args: tuple[Expr, ...]
    dtype: torch.dtype  # result dtype (torch semantics; half types compute in fp32)


Expr = Load | Const | IndexValue | Op

IndexFn = Callable[[Sequence[sympy.Expr]], Expr]


def expr_size(e: Expr, limit: int = 10_000) -> int:
    """Number of nodes of an expression tree (shared subtrees counted each time)."""
    if isinstance(e, Op):
        return 1 + sum(expr_size(a, limit) for a in e.args)
    return 1


def loads_of(e: Expr) -> list[Load]:
    out: list[Load] = []
    stack: list[Expr] = [e]
    while stack:
        cur = stack.pop()
        if isinstance(cur, Load):
            out.append(cur)
        elif isinstance(cur, Op):
            stack.extend(cur.args)
    return out
