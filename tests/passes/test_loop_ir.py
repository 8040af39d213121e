"""Index simplification (see Note [Index simplification] in passes/loop_ir.py), checked against
brute-force evaluation over every index in range."""

from __future__ import annotations

import itertools

import sympy

from passes.loop_ir import (
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
        FloorDiv(X, t), ModIdx(X, t), R)
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
