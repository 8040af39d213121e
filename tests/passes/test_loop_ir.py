"""Index simplification (see Note [Index simplification] in passes/loop_ir.py), checked against
brute-force evaluation over every index in range."""

from __future__ import annotations

import itertools

import sympy

from aotc.passes.loop_ir import (
    FloorDiv,
    ModIdx,
    contiguous_strides,
    flat_index,
    index_symbol,
    simplify,
    unflatten,
)

X, R = index_symbol("x"), index_symbol("r")


def _eval(e: sympy.Expr, env: dict[sympy.Symbol, int]) -> int:
    if e.is_Integer:
        return int(e)
    if e.is_Symbol:
        return env[e]
    if e.is_Add:
        return sum(_eval(a, env) for a in e.args)
    if e.is_Mul:
        out = 1
        for a in e.args:
            out *= _eval(a, env)
        return out
    if isinstance(e, FloorDiv):
        return _eval(e.args[0], env) // int(e.args[1])
    if isinstance(e, ModIdx):
        return _eval(e.args[0], env) % int(e.args[1])
    raise AssertionError(e)


def test_row_kernel_indices_of_a_3d_value_simplify_to_the_row() -> None:
    b, t, c = 3, 5, 7
    ranges = {X: b * t, R: c}
    i0, i1, i2 = unflatten(X * c + R, (b, t, c), ranges)
    assert (simplify(i0, ranges), simplify(i1, ranges), simplify(i2, ranges)) == (
        FloorDiv(X, t),
        ModIdx(X, t),
        R,
    )
    row = simplify(flat_index([i0, i1, 0], contiguous_strides((b, t, 1))), ranges)
    assert row == X


def test_simplified_indices_equal_brute_force() -> None:
    for size in [(4, 6), (3, 1, 5), (2, 3, 4)]:
        n = 1
        for s in size:
            n *= s
        for cols in [d for d in range(1, n + 1) if n % d == 0]:
            ranges = {X: n // cols, R: cols}
            idx = unflatten(X * cols + R, size, ranges)
            flat = simplify(flat_index(idx, contiguous_strides(size)), ranges)
            for x, r in itertools.product(range(n // cols), range(cols)):
                assert _eval(flat, {X: x, R: r}) == x * cols + r


def test_symbolic_sizes_simplify_without_guards():
    """Sizes as sympy expressions over positive size symbols (see Note [Symbolic sizes]): the
    gcd rule and the row recombination hold for every value of the symbol, checked by brute
    force on small values."""
    from aotc.passes.fusion import RINDEX, XINDEX
    from aotc.passes.loop_ir import flat_index, floordiv, mod, simplify, unflatten
    from aotc.runtime.symsizes import size_code

    s0 = sympy.Symbol("s0", integer=True, positive=True)
    ranges = {XINDEX: 2 * s0, RINDEX: 16}
    assert floordiv(16 * XINDEX + RINDEX, 16 * s0, ranges) == floordiv(XINDEX, s0, ranges)
    idx = unflatten(16 * XINDEX + RINDEX, [2, s0, 16], ranges)
    row = simplify(flat_index(idx[:2], [s0, 1]), ranges)  # a (2, s0, 1) reduction result
    assert row == simplify(flat_index(unflatten(XINDEX, [2, s0], ranges), [s0, 1]), ranges)
    exprs = [
        floordiv(16 * XINDEX + RINDEX, 16 * s0, ranges),
        mod(16 * XINDEX + RINDEX, 16 * s0, ranges),
        *idx,
        row,
    ]
    fns = [eval(f"lambda s0, xindex, rindex: {size_code(e)}") for e in exprs]
    for n in (2, 3, 5):
        for x, r in itertools.product(range(2 * n), range(16)):
            flat = 16 * x + r
            want = [flat // (16 * n), flat % (16 * n), flat // (16 * n) % 2, flat // 16 % n, r, x]
            assert [f(n, x, r) for f in fns] == want
