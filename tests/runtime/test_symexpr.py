"""Symbolic sizes as plain text (runtime/symexpr.py): the grammar a loaded artifact accepts, and
sympy size expressions that evaluate, as text and without sympy, to the values sympy gives."""

from __future__ import annotations

import random

import pytest
import sympy
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._sympy.functions import FloorDiv, ModularIndexing, PythonMod

from aotc.runtime import codec, records
from aotc.runtime.symexpr import SizeExpr, names, size_expr, symbols_of
from aotc.runtime.symsizes import compile_sizes

assert records.RUNTIME_RECORDS  # registers SizeExpr with the codec
S = [sympy.Symbol(f"s{i}", integer=True, positive=True) for i in range(3)]


@pytest.mark.parametrize(
    ("text", "symbols"),
    [
        ("7", set()),
        ("s0", {"s0"}),
        ("((4 * s37) + (8 * s14 * s37))", {"s14", "s37"}),
        ("(-1 * s0) + s1 // 2 - s2 % 3", {"s0", "s1", "s2"}),
        ("(s0 ** 2)", {"s0"}),
        ("max(1, ((s46 + 1) // 2))", {"s46"}),
        ("min(s0, s1, 4)", {"s0", "s1"}),
    ],
)
def test_grammar_accepts_sizes(text, symbols):
    assert names(text) == symbols
    assert SizeExpr(text).symbols == symbols


@pytest.mark.parametrize(
    "text",
    [
        "__import__('os').getpid()",
        "print(1)",
        "s0.bit_length()",
        "s0[0]",
        "'s0'",
        "1.5 * s0",
        "True",
        "s0 / 2",
        "s0 ** s1",
        "s0 ** 1000",
        "lambda: 1",
        "_secret",
        "s0 if s1 else 2",
        "(s0, s1)",
        "max",
        "max(s0)",
        "max(s0, key=s1)",
        "max(*s0, 1)",
        "abs(s0, 1)",
        "s0 < s1",
        "",
        "s0 +",
        "x" * 5000,
    ],
)
def test_grammar_refuses_other_python(text):
    with pytest.raises(ValueError, match="size expression"):
        SizeExpr(text)


def test_codec_round_trip_checks_the_text():
    e = SizeExpr("(s0 * 4)")
    assert codec.decode(codec.encode(e)) == e
    bad = codec.encode(e)
    bad["f"]["text"] = "open('x')"
    with pytest.raises(ValueError, match="outside the grammar"):
        codec.decode(bad)


def _tree(draw_ops: list[int], leaves: list[int]) -> sympy.Expr:
    """A random size expression over S from two lists of choices."""
    rng = random.Random(hash((tuple(draw_ops), tuple(leaves))))

    def leaf() -> sympy.Expr:
        k = rng.randrange(5)
        return S[k] if k < 3 else sympy.Integer(rng.randrange(1, 9))

    expr = leaf()
    for op in draw_ops:
        other = leaf()
        match op:
            case 0:
                expr = expr + other
            case 1:
                expr = expr * other
            case 2:
                expr = expr - other
            case 3:
                expr = FloorDiv(expr, other)
            case 4:
                expr = PythonMod(expr, other)
            case 5:
                expr = ModularIndexing(expr, 1, other)
            case 6:
                expr = sympy.Max(expr, other) if rng.random() < 0.5 else sympy.Min(expr, other)
            case _:
                expr = expr**2
    return expr


@settings(max_examples=120, deadline=None)
@given(
    st.lists(st.integers(0, 7), min_size=1, max_size=6),
    st.lists(st.integers(0, 99), min_size=1, max_size=3),
    st.tuples(st.integers(1, 50), st.integers(1, 50), st.integers(1, 50)),
)
def test_text_evaluates_like_sympy(ops, seed, values):
    expr = _tree(ops, seed)
    try:
        plain = size_expr(expr)
    except ValueError:
        return  # outside the grammar: refused when written (the program is not exported)
    # All symbols at once: a partial `subs` lets torch's PythonMod simplify a half-substituted
    # expression wrongly (PythonMod((-6 - 4*s2)**2, 6) evaluates to 0; at s2 = 1 it is 100 % 6).
    want = int(expr.xreplace({s: sympy.Integer(v) for s, v in zip(S, values, strict=True)}))
    if isinstance(plain, int):
        assert plain == want
        return
    assert plain.symbols <= {"s0", "s1", "s2"}
    fn = compile_sizes([plain], ["s0", "s1", "s2"])
    assert fn(values) == (want,)


def test_symints_and_ints():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    s = env.create_unbacked_symint()
    assert size_expr(3) == 3
    assert size_expr(sympy.Integer(5)) == 5
    text = size_expr(s * 2 + 1)
    assert isinstance(text, SizeExpr) and symbols_of((text, 4)) == {str(s.node.expr)}
    with pytest.raises(ValueError):
        size_expr(True)
    with pytest.raises(ValueError, match="cannot evaluate"):
        size_expr(S[0] / 3)
