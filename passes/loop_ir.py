"""Loop-level IR: index expressions and scalar computations, the vocabulary of lowering.

A value of the graph is known by its `size`, its dtype and a function from an index (one sympy
expression per dimension) to a scalar `Expr`: the computation of one element. Views, permutes,
broadcasts, slices and reshapes are index transforms, so reading an input through them never
materializes anything: `permute(x, [1, 0])[i, j]` is `Load("x", j * stride0 + i * stride1)`.

Requires: sizes and strides are ints, or sympy expressions over the ShapeEnv's size symbols
(positive integers; see Note [Symbolic sizes]). Ensures: index expressions use only integer
symbols with known ranges, size symbols, `+`, `*`, `FloorDiv` and `ModIdx`, simplified with those
ranges (see Note [Index simplification]).

# Note [Index simplification]
Reading a value of size (B, T, C) inside a row kernel (x over B*T rows, r over C) starts from
the flat index `x*C + r` and unflattens it: `i0 = (x*C + r) // (T*C) % B`, `i1 = (x*C + r) // C
% T`, `i2 = (x*C + r) % C`. With `0 <= r < C` and `0 <= x < B*T` these simplify to
`x // T`, `x % T` and `r`, and the flat index of a (B, T, 1) reduction result,
`T*(x // T) + x % T`, to `x`: the scheduler fuses a consumer with a reduction exactly when its
read index simplifies to the reduction's own row `x`. A failed simplification only costs fusion.

# Note [Symbolic sizes]
With `dynamic=True` a size is a sympy expression over the ShapeEnv's symbols (`s0`, declared
positive integers; the ShapeEnv specializes sizes 0 and 1, so a symbol is at least 2). Lowering
never compares a SymInt (that would add a guard): it reads `SymInt.node.expr` and reasons here
with sympy only. A fact about symbolic sizes is used only when sympy proves it for every value of
the symbols (`known_nonneg`); otherwise the rule is not applied (less simplification, less
fusion, never a wrong index). The bounds of a size symbol are the symbol itself, so
`x*C + r` with `r < C` still simplifies under `// C` when `C` is symbolic. In `unflatten` the
leading dim of a symbolic size is not reduced modulo its size: every flat index built there is
below the numel (lanes past it are masked).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeAlias

import sympy
import torch


class FloorDiv(sympy.Function):
    is_integer = True
    nargs = 2


class ModIdx(sympy.Function):
    is_integer = True
    nargs = 2


Ranges = dict[sympy.Symbol, "Size"]  # symbol -> exclusive upper bound; lower bound is 0
Size: TypeAlias = int | sympy.Expr  # a size or stride: an int, or an expression over size symbols
_UNKNOWN = 2**62


def is_static(s: Size) -> bool:
    return isinstance(s, int) or (isinstance(s, sympy.Basic) and s.is_Integer)


def static_or_expr(s: object) -> Size:
    """An int for a concrete size (also a SymInt holding a constant), else the SymInt's sympy
    expression. Never compares the SymInt, so no guard is added to the ShapeEnv."""
    if isinstance(s, torch.SymInt):
        e = s.node.expr
        return int(e) if e.is_Integer else e
    if isinstance(s, sympy.Basic):
        return int(s) if s.is_Integer else s
    return int(s)  # type: ignore[call-overload]


def known_nonneg(e: Size) -> bool:
    """`e >= 0` for every value of the size symbols (False when sympy cannot prove it)."""
    if isinstance(e, int):
        return e >= 0
    if e.is_Integer:
        return int(e) >= 0
    return sympy.expand(e).is_nonnegative is True


def known_lt(a: Size, b: Size) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a < b
    return known_nonneg(b - a - 1)


def at_most_one(s: Size) -> bool:
    """A size of at most 1; a symbolic size is never taken to be (see Note [Symbolic sizes])."""
    return bool(s <= 1) if is_static(s) else False


def at_least_one(s: Size) -> Size:
    return max(int(s), 1) if is_static(s) else s


def size_symbols(sizes: Sequence[Size]) -> set[sympy.Symbol]:
    out: set[sympy.Symbol] = set()
    for s in sizes:
        if isinstance(s, sympy.Basic):
            out |= s.free_symbols
    return out


def index_symbol(name: str) -> sympy.Symbol:
    return sympy.Symbol(name, integer=True, nonnegative=True)


def bounds(e: sympy.Expr, ranges: Ranges) -> tuple[Size, Size]:
    """Inclusive bounds of a non-negative index expression (ints, or sympy expressions over size
    symbols when sizes are symbolic; see Note [Symbolic sizes])."""
    if e.is_Integer:
        return int(e), int(e)
    if e.is_Symbol:
        if e in ranges:
            ub = ranges[e]
            return (0, max(int(ub) - 1, 0)) if is_static(ub) else (0, ub - 1)
        if e.is_positive:  # a size symbol: its bounds are itself
            return e, e
        return 0, _UNKNOWN - 1
    if e.is_Add:
        lo = hi = 0
        for a in e.args:
            alo, ahi = bounds(a, ranges)
            lo, hi = lo + alo, hi + ahi
        return lo, hi
    if e.is_Mul:
        parts = [bounds(a, ranges) for a in e.args]
        if all(isinstance(v, int) for p in parts for v in p):
            lo = hi = 1
            for alo, ahi in parts:
                cands = (lo * alo, lo * ahi, hi * alo, hi * ahi)
                lo, hi = min(cands), max(cands)
            return lo, hi
        if not all(known_nonneg(lo) for lo, _ in parts):
            return -_UNKNOWN, _UNKNOWN
        lo, hi = 1, 1
        for alo, ahi in parts:
            lo, hi = lo * alo, hi * ahi
        return lo, hi
    if e.is_Pow and e.exp.is_Integer and int(e.exp) > 0:  # a size symbol squared
        return bounds(sympy.Mul(*[e.base] * int(e.exp), evaluate=False), ranges)
    if isinstance(e, (FloorDiv, ModIdx)):
        lo, hi = bounds(e.args[0], ranges)
        d = e.args[1]
        if isinstance(e, ModIdx):
            return (lo, hi) if known_nonneg(lo) and known_lt(hi, d) else (0, d - 1)
        if d.is_Integer and isinstance(lo, int) and isinstance(hi, int):
            return lo // int(d), hi // int(d)
        if not known_nonneg(lo):
            return -_UNKNOWN, _UNKNOWN
        return 0, (hi // int(d) if d.is_Integer and isinstance(hi, int) else hi)
    raise ValueError(f"index expression {e} has an unknown form")


def _divides(d: sympy.Expr, t: sympy.Expr) -> sympy.Expr | None:
    """`t / d` when it is a polynomial in the symbols (so `t` is a multiple of `d`), else None."""
    q = sympy.cancel(t / d)
    return q if sympy.fraction(q)[1] == 1 else None


def _floordiv_symbolic(e: sympy.Expr, d: sympy.Expr, ranges: Ranges) -> sympy.Expr:
    lo, hi = bounds(e, ranges)
    if known_nonneg(lo) and known_lt(hi, d):
        return sympy.Integer(0)
    if isinstance(e, FloorDiv):
        return _floordiv_any(e.args[0], e.args[1] * d, ranges)
    terms = list(sympy.Add.make_args(e))
    whole = {t: q for t in terms if (q := _divides(d, t)) is not None}
    if whole:
        rest = sympy.Add(*[t for t in terms if t not in whole])
        return sympy.Add(*whole.values()) + _floordiv_any(rest, d, ranges)
    for g, big, _rest in _common_factors(terms, d, ranges):  # (g*a + b) // (g*m) = a // m
        return _floordiv_any(sympy.Add(*[_divides(g, t) for t in big]), _divides(g, d), ranges)
    return FloorDiv(e, d)


def _mod_symbolic(e: sympy.Expr, d: sympy.Expr, ranges: Ranges) -> sympy.Expr:
    e = sympy.Add(*[t for t in sympy.Add.make_args(e) if _divides(d, t) is None])
    lo, hi = bounds(e, ranges)
    if known_nonneg(lo) and known_lt(hi, d):
        return e
    for g, big, rest in _common_factors(list(sympy.Add.make_args(e)), d, ranges):
        # (g*a + b) % (g*m) = g*(a % m) + b when 0 <= b < g
        return (
            g * _mod_any(sympy.Add(*[_divides(g, t) for t in big]), _divides(g, d), ranges) + rest
        )
    return ModIdx(e, d)


def _common_factors(
    terms: list[sympy.Expr], d: sympy.Expr, ranges: Ranges
) -> list[tuple[sympy.Expr, list[sympy.Expr], sympy.Expr]]:
    """Factors `g` of `d` (a term's gcd with `d`, not 1) splitting `terms` into multiples of `g`
    and a rest provably in [0, g): the symbolic form of the gcd rule of `floordiv`/`mod`."""
    out = []
    for t in terms:
        try:
            g = sympy.gcd(t, d)
        except (sympy.PolynomialError, sympy.polys.polyerrors.PolificationFailed):
            continue
        if g == 1 or g == d or _divides(g, d) is None:
            continue
        big = [u for u in terms if _divides(g, u) is not None and not u.is_Integer]
        rest = sympy.Add(*[u for u in terms if u not in big])
        lo, hi = bounds(rest, ranges)
        if big and known_nonneg(lo) and known_lt(hi, g):
            out.append((g, big, rest))
            break
    return out


def _floordiv_any(e: sympy.Expr, d: Size, ranges: Ranges) -> sympy.Expr:
    return floordiv(e, int(d), ranges) if is_static(d) else _floordiv_symbolic(e, d, ranges)


def _mod_any(e: sympy.Expr, d: Size, ranges: Ranges) -> sympy.Expr:
    return mod(e, int(d), ranges) if is_static(d) else _mod_symbolic(e, d, ranges)


def _coeff(term: sympy.Expr) -> int:
    c, _ = term.as_coeff_Mul()
    return int(c) if c.is_Integer else 1


def _split(terms: Sequence[sympy.Expr], g: int) -> tuple[list[sympy.Expr], list[sympy.Expr]]:
    big = [t for t in terms if _coeff(t) % g == 0 and not t.is_Integer]
    small = [t for t in terms if t not in big]
    return big, small


def floordiv(e: sympy.Expr, d: Size, ranges: Ranges) -> sympy.Expr:
    if not is_static(d):
        return _floordiv_symbolic(e, d, ranges)
    d = int(d)
    if d == 1:
        return e
    if e.is_Integer:
        return sympy.Integer(int(e) // d)
    lo, hi = bounds(e, ranges)
    if known_nonneg(lo) and known_lt(hi, d):
        return sympy.Integer(0)
    if isinstance(e, FloorDiv):
        return _floordiv_any(e.args[0], e.args[1] * d, ranges)
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
        if big and known_nonneg(slo) and known_lt(shi, g):
            return floordiv(sympy.Add(*[t / g for t in big]), d // g, ranges)
    return FloorDiv(e, sympy.Integer(d))


def mod(e: sympy.Expr, d: Size, ranges: Ranges) -> sympy.Expr:
    if not is_static(d):
        return _mod_symbolic(e, d, ranges)
    d = int(d)
    if d == 1:
        return sympy.Integer(0)
    if e.is_Integer:
        return sympy.Integer(int(e) % d)
    terms = [t for t in sympy.Add.make_args(e) if t.is_Integer or _coeff(t) % d != 0]
    e = sympy.Add(*terms)
    lo, hi = bounds(e, ranges)
    if known_nonneg(lo) and known_lt(hi, d):
        return e
    for g in sorted({math.gcd(d, _coeff(t)) for t in terms}, reverse=True):
        if g <= 1:
            continue
        big, small = _split(terms, g)
        rest = sympy.Add(*small)
        slo, shi = bounds(rest, ranges)
        if big and known_nonneg(slo) and known_lt(shi, g):
            return g * mod(sympy.Add(*[t / g for t in big]), d // g, ranges) + rest
    return ModIdx(e, sympy.Integer(d))


def simplify(e: sympy.Expr, ranges: Ranges) -> sympy.Expr:
    """Rebuild `e` bottom-up with the range-aware rules (see Note [Index simplification])."""
    if e is sympy.true or e is sympy.false:
        return e
    if isinstance(e, (sympy.core.relational.Relational, sympy.logic.boolalg.BooleanFunction)):
        return e.func(*[simplify(a, ranges) for a in e.args])  # a mask: simplify its sides
    if e.is_Integer or e.is_Symbol or (e.is_Pow and e.exp.is_Integer and e.base.is_positive):
        return e  # a Pow here is a size symbol's power (symbolic strides)
    if isinstance(e, FloorDiv):
        return _floordiv_any(simplify(e.args[0], ranges), e.args[1], ranges)
    if isinstance(e, ModIdx):
        return _mod_any(simplify(e.args[0], ranges), e.args[1], ranges)
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
                if not a.is_Integer:  # symbolic `a`: compare u / (k*a) instead
                    ku, mu = k * a, sympy.cancel(u / (k * a))
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


def contiguous_strides(size: Sequence[Size]) -> tuple[Size, ...]:
    out, acc = [], 1
    for s in reversed(size):
        out.append(acc)
        acc = acc * at_least_one(s)
    return tuple(reversed(out))


def dense_order(size: Sequence[Size], stride: Sequence[Size]) -> list[int] | None:
    """The dims of a dense layout (a permutation of a contiguous one; size-1 dims anywhere) from
    the innermost out, or None if not provably dense. Symbolic strides are matched by structural
    equality with the running product of sizes."""
    if all(is_static(v) for v in (*size, *stride)):
        dims = sorted(
            (int(st), d) for d, (s, st) in enumerate(zip(size, stride)) if not at_most_one(s)
        )
        step = 1
        for st, d in dims:
            if st != step:
                return None
            step = st * int(size[d])
        return [d for _, d in dims]
    left = [d for d, s in enumerate(size) if not at_most_one(s)]
    order: list[int] = []
    expect: Size = 1
    while left:
        hit = next((d for d in left if sympy.sympify(stride[d] - expect) == 0), None)
        if hit is None:
            return None
        order.append(hit)
        left.remove(hit)
        expect = expect * size[hit]
    return order


def flat_index(index: Sequence[sympy.Expr], strides: Sequence[Size], offset: int = 0) -> sympy.Expr:
    return sympy.Integer(offset) + sympy.Add(*[i * s for i, s in zip(index, strides, strict=True)])


def unflatten(flat: sympy.Expr, size: Sequence[Size], ranges: Ranges) -> list[sympy.Expr]:
    """The multi-index of a row-major flat index (below the numel) into `size`."""
    out = []
    for d, (s, st) in enumerate(zip(size, contiguous_strides(size), strict=True)):
        if at_most_one(s):
            out.append(sympy.Integer(0))
        elif d == 0 and not is_static(s):  # see Note [Symbolic sizes]
            out.append(floordiv(flat, st, ranges))
        else:
            out.append(mod(floordiv(flat, st, ranges), s, ranges))
    return out


# ---- scalar computations -------------------------------------------------------------------


@dataclass(frozen=True)
class Load:
    buf: str  # name of a materialized buffer (placeholder, extern output, or kernel output)
    index: sympy.Expr  # element offset into the buffer's storage
    # An index condition (a sympy boolean over index and data symbols): the element is read
    # only where it holds, elsewhere the value is 0 (cat reads each input in its own range).
    mask: sympy.Basic | None = None


@dataclass(frozen=True)
class Const:
    value: float | int | bool
    dtype: torch.dtype


@dataclass(frozen=True)
class IndexValue:
    index: sympy.Expr  # an index used as a number (iota, masks); or an index condition (bool)
    dtype: torch.dtype


@dataclass(frozen=True)
class Op:
    name: str  # a key of passes.codegen's op templates
    args: tuple[Expr, ...]
    dtype: torch.dtype  # result dtype (torch semantics; half types compute in fp32)


@dataclass(frozen=True)
class Indirect:
    """`body` with the data symbol `symbol` bound to the integer value of `index`: an index read
    from a tensor (gather, index, embedding). See Note [Data-dependent indices]."""

    symbol: sympy.Symbol  # data_symbol(index, dim)
    index: Expr  # an int64 value; valid values are 0 <= value < size
    size: Size  # the extent of the dim it indexes
    body: Expr  # its loads that use `symbol` are masked by 0 <= symbol < size


Expr = Load | Const | IndexValue | Op | Indirect

IndexFn = Callable[[Sequence[sympy.Expr]], Expr]

# Note [Data-dependent indices]
# `x.gather(1, i)`, `x[i]` and `embedding(i, w)` read `x` at an index that is a *value*: the
# lowering binds a fresh data symbol `g` to that value (`Indirect(g, value, size, body)`) and
# builds `body` by calling the input's index function with `g` in the indexed dim, so views of
# the input compose as usual and the body's loads have `g` in their index expressions. Every such
# load is masked by `0 <= g < size` (`with_mask`): an index out of range reads nothing. Eager
# raises on such an index; a kernel cannot raise, so the generated code asserts the range with
# `tl.device_assert` (active in Triton's interpreter and in kernels compiled with TRITON_DEBUG=1)
# and otherwise yields 0 for it (see docs/status.md). Index simplification knows `g < size`;
# fusion never inlines a producer or reads a reduction result at a data-dependent index in a way
# it cannot check: such reads simply do not simplify to the row and stay separate kernels.


def data_symbol(value: Expr, dim: int) -> sympy.Symbol:
    """The data symbol bound to `value` indexing dim `dim` (see Note [Data-dependent indices]);
    printed as a kernel variable of the same name. Named after the value itself, so the same
    value gives the same symbol however often an index function runs, and two values never
    share one (equal loads under different bindings would otherwise be merged)."""
    digest = hashlib.sha256(f"{value!r}/{dim}".encode()).hexdigest()[:10]
    return sympy.Symbol(f"gidx_{digest}", integer=True)


def with_mask(e: Expr, cond: sympy.Basic) -> Expr:
    """`e` with every load made conditional on `cond` (see Load.mask)."""
    if cond is sympy.true:
        return e
    if isinstance(e, Load):
        mask = cond if e.mask is None else sympy.And(e.mask, cond)
        return Load(e.buf, e.index, mask)
    if isinstance(e, Op):
        return Op(e.name, tuple(with_mask(a, cond) for a in e.args), e.dtype)
    if isinstance(e, Indirect):
        return Indirect(e.symbol, with_mask(e.index, cond), e.size, with_mask(e.body, cond))
    return e


def map_indices(e: Expr, f: Callable[[sympy.Basic], sympy.Basic]) -> Expr:
    """`e` with `f` applied to every index expression and index condition in it (load
    indices and masks, index values, the index of an `Indirect` and its body)."""
    if isinstance(e, Load):
        return Load(e.buf, f(e.index), None if e.mask is None else f(e.mask))
    if isinstance(e, IndexValue):
        return IndexValue(f(e.index), e.dtype)
    if isinstance(e, Op):
        return Op(e.name, tuple(map_indices(a, f) for a in e.args), e.dtype)
    if isinstance(e, Indirect):
        return Indirect(e.symbol, map_indices(e.index, f), e.size, map_indices(e.body, f))
    return e


def expr_size(e: Expr, limit: int = 10_000) -> int:
    """Number of nodes of an expression tree (shared subtrees counted each time)."""
    if isinstance(e, Op):
        return 1 + sum(expr_size(a, limit) for a in e.args)
    if isinstance(e, Indirect):
        return 1 + expr_size(e.index, limit) + expr_size(e.body, limit)
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
        elif isinstance(cur, Indirect):
            stack.extend((cur.index, cur.body))
    return out
