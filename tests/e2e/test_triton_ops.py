"""Ops that run inside generated Triton kernels (not as ATen calls), forward and backward,
against eager: RMSNorm, pow, integer division/remainder/bitwise ops, rounding, argmax/argmin,
any/all/prod, cumsum/cumprod, cat, gather, index, index_select, embedding. Each test checks that
the op's nodes run in kernels (passes.kernel_figures) and that no group fell back to ATen."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from aotc.passes.kernelize import KERNEL_LISTENERS
from aotc.runtime.kernels import CompiledGraph
from tests.conftest import assert_matches_eager
from tests.triton_helpers import needs_interpreter

pytestmark = needs_interpreter


@pytest.fixture
def graphs() -> Iterator[list[CompiledGraph]]:
    seen: list[CompiledGraph] = []
    KERNEL_LISTENERS.append(seen.append)
    yield seen
    KERNEL_LISTENERS.remove(seen.append)


def check(
    graphs: list[CompiledGraph],
    caplog: pytest.LogCaptureFixture,
    fn: Callable[..., Any],
    make_args: Callable[[], Any],
    ops: tuple[str, ...],
    **options: Any,
) -> None:
    """`fn` matches eager through backend="triton", and no node of `ops` (ATen op names, e.g.
    "aten.cat") runs as an ATen call in any graph."""
    with caplog.at_level("WARNING", logger="aotc.kernels"):
        assert_matches_eager(fn, make_args, backend="triton", **options)
    assert "ATen calls" not in caplog.text, caplog.text
    assert graphs, "nothing was lowered to kernels"
    for graph in graphs:
        assert graph.figures is not None and graph.kernels
        fallback = [op for op, _ in graph.figures.fallback_ops if op.startswith(ops)]
        assert not fallback, f"{fallback} ran as ATen calls: {graph.figures.format()}"


def test_rmsnorm_is_one_kernel_each_way(graphs, caplog) -> None:
    def rmsnorm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    check(
        graphs,
        caplog,
        rmsnorm,
        lambda: (torch.randn(6, 37, requires_grad=True), torch.randn(37, requires_grad=True)),
        ("aten.pow", "aten.mean", "aten.sum", "aten.rsqrt", "aten.mul"),
    )
    fwd = graphs[0]
    assert len(fwd.kernels) == 1
    assert fwd.figures is not None and fwd.figures.kernel_bytes == fwd.figures.min_bytes


@pytest.mark.parametrize("exponent", [2, 3, 1.0, -1, 0, 0.5, -0.5, 2.5, -1.7, 7])
def test_pow_scalar_exponents(graphs, caplog, exponent: float) -> None:
    check(
        graphs,
        caplog,
        lambda x: (x.abs() + 0.1).pow(exponent) + x.pow(2.0),
        lambda: torch.randn(5, 7, requires_grad=True),
        ("aten.pow",),
    )


def test_pow_tensor_exponents_and_negative_bases(graphs, caplog) -> None:
    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # negative bases to integer powers keep their sign; to fractional powers give NaN
        return torch.pow(x, y.round()) + torch.pow(x.abs(), y) + 2.0**y + torch.pow(x, 0.5)

    check(
        graphs,
        caplog,
        f,
        lambda: (torch.randn(4, 9) * 3, torch.randn(4, 9) * 2),
        ("aten.pow",),
        backward=False,
    )


def test_integer_ops(graphs, caplog) -> None:
    def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (
            a // b
            + a % b
            + torch.div(a, b, rounding_mode="trunc")
            + torch.fmod(a, b)
            + (a & b)
            + (a | 3)
            + (a ^ b)
            + (~a)
            + (a << 3)
            + (a >> 1)
            + a.pow(3)
        )

    def args() -> tuple[torch.Tensor, torch.Tensor]:
        b = torch.randint(1, 7, (5, 6)) * torch.where(torch.rand(5, 6) < 0.5, -1, 1)
        return torch.randint(-50, 50, (5, 6)), b

    check(
        graphs,
        caplog,
        f,
        args,
        ("aten.div", "aten.remainder", "aten.fmod", "aten.bitwise", "aten.__", "aten.pow"),
        backward=False,
    )


def test_rounding_and_classification(graphs, caplog) -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        y = x * 2.5
        inf = torch.where(x > 1, float("inf"), x)
        return (
            y.floor()
            + y.ceil()
            + y.trunc()
            + y.round()
            + torch.div(y, 0.7, rounding_mode="trunc")
            + inf.isinf()
            + (inf - inf).isnan()
        )

    def args() -> torch.Tensor:
        x = torch.randn(6, 8)
        x[0, :4] = torch.tensor([0.2, 0.6, -0.2, -0.6])  # ties of round at +-0.5, +-1.5
        return x

    check(
        graphs,
        caplog,
        f,
        args,
        ("aten.floor", "aten.ceil", "aten.trunc", "aten.round", "aten.is", "aten.div"),
        backward=False,
    )


def _magnitudes(dtype: torch.dtype) -> torch.Tensor:
    """Random values of every magnitude from 1e-30 to ~30 (both signs), with zeros, the
    boundaries of the ops' cases and non-finite values."""
    mags = 10.0 ** torch.empty(5, 40, dtype=torch.float64).uniform_(-30, 1.5)
    signs = torch.where(torch.rand(5, 40) < 0.5, -1.0, 1.0).to(torch.float64)
    x = (mags * signs).to(dtype)
    special = [0.0, -0.0, 1e-10, -1e-10, 1e-6, -1e-6, 20.0, -20.0, 88.0, -88.0]
    x[0, : len(special)] = torch.tensor(special, dtype=dtype)
    x[1, :3] = torch.tensor([float("inf"), float("-inf"), float("nan")], dtype=dtype)
    return x.requires_grad_()


# Relative: ~2 ulp of float32; ~4 ulp of float64 (mish composes three ops, each within 1-2)
_ULPS = {torch.float32: 2.5e-7, torch.float64: 1e-15}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_tanh_log1p_expm1_and_what_is_built_on_them_keep_small_values(graphs, caplog, dtype):
    """tanh, log1p and expm1 were `2/(1+exp(-2x))-1`, `log(1+x)`, `exp(x)-1`: 0 for x = 1e-10,
    and softplus(-20), logsigmoid(20), mish(-20) 0 instead of ~2e-9 (Note [Accurate tanh, log1p
    and expm1]). Each within a few ulp of eager, relative, at every magnitude (no absolute slack)."""

    def f(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (
            torch.tanh(x),
            torch.log1p(x.abs()),
            torch.log1p(-x.abs().clamp(max=0.5)),
            torch.expm1(x.clamp(max=80.0)),
            F.softplus(x),
            F.logsigmoid(x),
            F.mish(x),
            F.celu(x),
        )

    rel = _ULPS[dtype]
    check(
        graphs,
        caplog,
        f,
        lambda: _magnitudes(dtype),
        ("aten.tanh", "aten.log1p", "aten.expm1"),
        rtol=rel,
        atol=0.0,
        grad_tol=(1e-5, 1e-6),  # sums of eight gradients, of order 1
    )


def test_factories_of_another_dtype_run_in_kernels(graphs, caplog) -> None:
    """`full`/`scalar_tensor` whose dtype differs from the tensor they meet (the dtype pinned from
    a `set_default_dtype` inside the program, Note [Factory ops follow the default dtype]): the
    kernel cast the literal (`2.5.to(tl.float64)`, an AttributeError) and fell back to ATen."""

    def f(x: torch.Tensor) -> torch.Tensor:
        torch.set_default_dtype(torch.float64)
        try:
            a, b = torch.scalar_tensor(2.5), torch.full((3, 5), 0.1)
        finally:
            torch.set_default_dtype(torch.float32)
        return (a + x) * b + torch.scalar_tensor(1.5, dtype=torch.float16) * x

    check(graphs, caplog, f, lambda: torch.randn(3, 5, requires_grad=True), ("aten.full",))


def test_round_of_a_negative_half_is_negative_zero(graphs, caplog) -> None:
    """round(-0.5) is -0.0 in eager (nearbyint); the kernel gave +0.0. Signs of zeros compared."""

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.round(x) * 1.0

    def args() -> torch.Tensor:
        x = torch.randn(4, 9)
        x[0] = torch.tensor([-0.5, -0.4, -0.0, 0.0, 0.5, -1.5, 2.5, -2.5, float("nan")])
        return x

    check(graphs, caplog, f, args, ("aten.round",), backward=False)
    compiled = torch.compile(f, backend="aotc", options={"backend": "triton"})
    x = args()
    assert torch.equal(torch.signbit(compiled(x)), torch.signbit(f(x)))


@pytest.mark.parametrize("n", [7, 3000])  # persistent and looped rows
def test_argmax_argmin_ties_and_nan(graphs, caplog, n: int) -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x.argmax(-1), x.argmin(0, keepdim=True), x.argmax(), x.round().argmax(-1)

    def args() -> torch.Tensor:
        x = torch.randn(5, n)
        x[1, 3] = float("nan")  # the first NaN is the max and the min
        x[1, 5] = float("nan")
        x[2, :] = 1.0  # all equal: the first index
        return x

    check(graphs, caplog, f, args, ("aten.argmax", "aten.argmin"), backward=False)


def test_integer_argmax_any_all_prod(graphs, caplog) -> None:
    def f(a: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (
            a.argmax(1),
            (a > 0).any(1),
            (a > -3).all(0),
            a.any(),
            x.prod(-1),
            (x * 2).prod(0, keepdim=True),
        )

    check(
        graphs,
        caplog,
        f,
        lambda: (torch.randint(-5, 5, (6, 9)), torch.rand(6, 9, requires_grad=True) + 0.5),
        ("aten.argmax", "aten.any", "aten.all", "aten.prod"),
    )


def test_cumulative_ops(graphs, caplog) -> None:
    def f(x: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (x * 2).cumsum(-1) * 3, (x.abs() + 0.5).cumprod(0), a.cumsum(1), x.cumsum(0)

    check(
        graphs,
        caplog,
        f,
        lambda: (torch.randn(5, 37, requires_grad=True), torch.randint(-9, 9, (4, 6))),
        ("aten.cumsum", "aten.cumprod"),
    )


def test_cat(graphs, caplog) -> None:
    def f(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, ...]:
        wide = torch.cat([a.sin(), b * 2, c.t()], dim=1).relu() + torch.cat([a, a.cos(), a], 1)
        return wide, torch.cat([b, b.exp()], 0)[3:8] * 2

    check(
        graphs,
        caplog,
        f,
        lambda: (
            torch.randn(5, 3, requires_grad=True),
            torch.randn(5, 4, requires_grad=True),
            torch.randn(2, 5, requires_grad=True),
        ),
        ("aten.cat",),
    )


def test_gather_index_select_and_advanced_index(graphs, caplog) -> None:
    def f(x: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (
            (x * 2).gather(1, i),
            x.index_select(0, j.remainder(6)) + 1,
            x[j],  # negative indices count from the end
            x[j, 1:3].exp(),
            x.t()[:, j],
        )

    check(
        graphs,
        caplog,
        f,
        lambda: (
            torch.randn(6, 5, requires_grad=True),
            torch.randint(0, 5, (6, 3)),
            torch.tensor([4, -1, 0, 2, -6]),
        ),
        ("aten.gather", "aten.index_select", "aten.index.Tensor"),
        backward=False,
    )


def test_embedding_forward(graphs, caplog) -> None:
    def f(w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        e = F.embedding(ids, w)
        return F.layer_norm(e, (e.shape[-1],)) * 2

    check(
        graphs,
        caplog,
        f,
        lambda: (torch.randn(11, 8, requires_grad=True), torch.randint(0, 11, (3, 4))),
        ("aten.embedding",),
    )


def test_traffic_figures_around_an_aten_call(graphs) -> None:
    """Forward of `(x @ w).relu() * 2`: the mm is an ATen call (reads x and w, writes its
    output); one kernel reads the mm output once and writes the result once, which is the
    kernels' minimum given the mm; the graph's minimum is x, w and the output."""
    import aotc

    compiled = aotc.compile(lambda x, w: (x @ w).relu() * 2, backend="triton", cache=False)
    x, w = torch.randn(6, 5), torch.randn(5, 7)
    torch.testing.assert_close(compiled(x, w), (x @ w).relu() * 2)
    (fwd,) = graphs
    f = fwd.figures
    assert f is not None and len(fwd.kernels) == 1
    mm_out = out = 6 * 7 * 4
    assert f.kernel_bytes == mm_out + out == f.fusion_min_bytes
    assert f.aten_bytes == (6 * 5 + 5 * 7) * 4 + mm_out
    assert f.min_bytes == (6 * 5 + 5 * 7) * 4 + out
    assert f.coverage == 1.0 and "aten.mm" not in dict(f.fallback_ops)


def test_cat_read_through_a_reshape_and_bicubic(graphs, caplog) -> None:
    """A cat input read through a reshape gets an index the simplifier rewrites with negative
    intermediate values; its `%` must round like Python's on every backend (found by the
    OpInfo sweep: bicubic interpolation)."""

    def f(a: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = torch.cat([a[:, None] + 1, 2 - a[:, None]]).view(2, 3) * -0.75
        up = F.interpolate(x, size=(3, 5), mode="bicubic", align_corners=True)
        return w, up

    check(
        graphs,
        caplog,
        f,
        lambda: (torch.rand(3), torch.randn(2, 3, 4, 4, requires_grad=True)),
        ("aten.cat", "aten.index.Tensor"),
    )


def test_cat_of_head_views_indexes_each_input_in_its_range(graphs, caplog) -> None:
    """Attention's q, k, v gradients, each a [B, H, T, D] tensor viewed as [B, T, H*D], cat into
    the qkv gradient: each input's index is simplified knowing its own range (Note [Cat inputs
    in their own range] in passes/lowering_gather.py), so the kernel keeps no `(i - begin)`
    floor/mod terms (on an H200 they made this cat ~5x slower than its memory traffic)."""
    b, h, t, d = 2, 3, 5, 4

    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        heads = [x.permute(0, 2, 1, 3).reshape(b, t, h * d) for x in (q, k, v)]
        return torch.cat(heads, -1) * 2

    check(
        graphs,
        caplog,
        f,
        lambda: tuple(torch.randn(b, h, t, d, requires_grad=True) for _ in range(3)),
        ("aten.cat",),
    )
    sources = [k.source for g in graphs for k in g.kernels if "cat" in k.name]
    assert sources
    for src in sources:
        body = src.split("def ", 1)[1]
        assert f"% {h * d} + {h * d})" not in body, src
        assert f"+ {3 * h * d}) % {3 * h * d}" not in body, src
