"""Regression tests for the classes of silent difference from eager of issue #13: autograd flags
and graph structure, aliasing and mutation, the Triton backend's views, error texts, programs
aotc used to refuse although eager runs them, concurrency and the cache. Each test compares with
eager through `assert_matches_eager` (outputs, requires_grad, is_leaf, grad_fn presence,
gradients with None vs zeros, storage sharing, input shapes/strides/versions), or checks the
error eager raises at the same point."""

from __future__ import annotations

import pytest
import torch

import aotc
from tests.conftest import assert_matches_eager


def leaf(*shape: int, rg: bool = True) -> torch.Tensor:
    return torch.randn(*shape, requires_grad=rg)


def nonleaf(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, requires_grad=True) * 1.0


def dynamo(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="aotc")


# ------------------------------------------------------------ autograd flags and graph structure


def test_1_output_computed_under_no_grad_does_not_require_grad():
    def f(x, w):
        with torch.no_grad():
            y = x @ w
        return y

    assert_matches_eager(f, lambda: (torch.randn(3, 4), leaf(4, 2)))
    out = aotc.compile(f)(torch.randn(3, 4), leaf(4, 2))
    assert not out.requires_grad and out.grad_fn is None and out.is_leaf


def test_2_view_under_no_grad_of_an_intermediate_is_a_leaf():
    def f(x):
        y = x * 2
        with torch.no_grad():
            v = y.view(-1)
        return v, y

    # eager's v requires grad without a grad_fn, so a backward through it fails in eager too
    assert_matches_eager(f, lambda: (leaf(3, 3),), backward=False)
    for fn in (f, aotc.compile(f)):
        x = leaf(3, 3)
        v, y = fn(x)
        assert v.requires_grad and v.grad_fn is None and v.is_leaf and v._base is y
        y.sum().backward()
        torch.testing.assert_close(x.grad, torch.full((3, 3), 2.0))


def test_3_detached_input_is_no_view_and_can_be_written():
    def f(a):
        return a.detach()

    assert_matches_eager(f, lambda: (leaf(3),))
    a = leaf(3)
    out = aotc.compile(f)(a)
    assert not out.requires_grad and not out._is_view() and out._base is None
    out.zero_()  # eager allows this; a view made under no_grad would refuse it
    assert torch.equal(a.detach(), torch.zeros(3)) and a._version == 1


def test_4_gradient_stops_at_a_leaf_made_inside():
    def f(w):
        v = w.detach().requires_grad_()
        return v.t()

    assert_matches_eager(f, lambda: (leaf(3, 2),))
    w = leaf(3, 2)
    aotc.compile(f)(w).sum().backward()
    assert w.grad is None


def test_5_output_of_a_leaf_made_inside_requires_grad():
    def f(a):
        v = a.detach().requires_grad_()
        return v * 2

    assert_matches_eager(f, lambda: (torch.randn(3),))
    out = aotc.compile(f)(torch.randn(3))
    assert out.requires_grad and out.grad_fn is not None
    out.sum().backward()  # reaches the inner leaf only, as in eager


def test_5b_new_leaf_created_inside_is_returned_as_in_eager():
    def f(x):
        return x + 1, torch.zeros(3, requires_grad=True)

    assert_matches_eager(f, lambda: (torch.randn(3),))


def test_6_buffer_written_under_no_grad_keeps_no_history():
    def f(buf, w):
        with torch.no_grad():
            buf.add_(w)
        buf.mul_(0.9)
        return buf

    assert_matches_eager(f, lambda: (torch.randn(3), leaf(3)))


def test_7_dynamo_output_before_input_comes_to_require_grad():
    def f(a0, a1):
        v1 = a0 * 2.5
        a0.mul_(a1)
        return v1

    assert_matches_eager(f, lambda: (torch.randn(3), leaf(3)), compiled=dynamo(f))


def test_8_inputs_only_unused_outputs_depend_on_get_no_gradient():
    def f(a, b):
        return a * 2, b * 3

    compiled = aotc.compile(f)
    for fn in (f, compiled):
        a, b = leaf(3), leaf(3)
        fn(a, b)[0].sum().backward()
        assert a.grad is not None and b.grad is None
    # with a partially shared input: c gets a gradient, d none
    g = aotc.compile(lambda c, d: (c * d.detach(), c + d))
    c, d = leaf(3), leaf(3)
    g(c, d)[0].sum().backward()
    assert c.grad is not None and d.grad is None


def test_enable_grad_inside_a_call_under_no_grad():
    def f(x, w):
        y = x * 2
        with torch.enable_grad():
            z = x * w
        return y, z

    compiled = aotc.compile(f)
    x, w = leaf(3), leaf(3)
    with torch.no_grad():
        want = f(x, w)
        got = compiled(x, w)
    for g, e in zip(got, want):
        assert (g.requires_grad, g.grad_fn is None) == (e.requires_grad, e.grad_fn is None)
        torch.testing.assert_close(g.detach(), e.detach())
    got[1].sum().backward()
    torch.testing.assert_close(w.grad, x.detach())

    def g(x):
        with torch.set_grad_enabled(True):
            return x.sin()

    compiled = aotc.compile(g)
    with torch.no_grad():
        out = compiled(leaf(3))
    assert out.requires_grad and out.grad_fn is not None


# ------------------------------------------------------------------------ aliasing and mutation


def two_views(rg: bool = False, nl: bool = False):
    def make():
        base = torch.randn(3, 2, 2, requires_grad=rg)
        if nl:
            base = base * 1
        return base[0], base[2]

    return make


def test_9_metadata_mutation_of_one_of_two_aliased_inputs():
    def f(a, b):
        b.t_()
        return a + 1

    assert_matches_eager(f, two_views())

    def g(a, b, w):
        b.t_()
        a.mul_(w)
        return (a * b).sum()

    def make():
        return (*two_views()(), leaf(2, 2))

    assert_matches_eager(g, make)


def test_10_view_of_the_second_of_two_aliased_inputs_reaches_the_base():
    def f(a, b):
        return b[1:]

    assert_matches_eager(f, two_views(rg=True))


def test_11_detached_output_shares_storage_with_its_source_output():
    def f(a):
        v = a * 2
        return v, v.detach()

    assert_matches_eager(f, lambda: (leaf(3),))
    v, d = aotc.compile(f)(leaf(3))
    d.zero_()
    assert torch.equal(v.detach(), torch.zeros(3))


MULTI_VIEWS = {
    "unbind": lambda x: x.unbind(0),
    "split": lambda x: x.split(1),
    "chunk": lambda x: x.chunk(3),
}


@pytest.mark.parametrize("op", sorted(MULTI_VIEWS))
@pytest.mark.parametrize("of_input", [True, False])
def test_12_outputs_of_multi_output_views_refuse_in_place_like_eager(op, of_input):
    def f(a):
        return MULTI_VIEWS[op](a if of_input else a * 2)

    assert_matches_eager(f, lambda: (nonleaf(3, 2),))
    for fn in (f, aotc.compile(f)):
        outs = fn(nonleaf(3, 2))
        with pytest.raises(RuntimeError, match="is a view and is being modified inplace"):
            outs[1].mul_(2)


def test_13_backward_eager_refuses_is_refused():
    def f(a):
        a[:].relu_()
        a.add_(1)
        return a

    compiled = aotc.compile(f)
    for fn in (f, compiled):
        out = fn(nonleaf(3))  # the forward runs in eager
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()

    def g(a, w):  # only the output whose backward meets the stale value is refused
        y = a + w * 2
        z = a.sin()
        a.mul_(2)
        return y, z

    for fn in (g, aotc.compile(g)):
        y, z = fn(nonleaf(3), leaf(3))
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            z.sum().backward(retain_graph=True)
        y.sum().backward()


def test_14_metadata_mutations_bump_the_version_each_time():
    def f(a):
        a.t_()
        a.t_()
        a.t_()
        a.t_()
        return a + 1

    assert_matches_eager(f, lambda: (torch.randn(3, 2),))
    a = torch.randn(3, 2)
    aotc.compile(f)(a)
    assert a._version == 4


# ------------------------------------------------------------------------------ triton backend


@pytest.mark.parametrize(
    "view",
    [
        lambda y: y.unbind(0)[2],
        lambda y: y.split(1)[1],
        lambda y: y[2],
        lambda y: y[1:, 1],
        lambda y: y.diagonal(1),
        lambda y: y.narrow(1, 1, 2).t(),
    ],
)
def test_15_triton_views_with_a_storage_offset(view):
    def f(a):
        return view(a * 3)

    assert_matches_eager(f, lambda: (leaf(3, 4),), backend="triton")


# ----------------------------------------------------------------------------------- error text


def test_16_each_error_says_what_is_true_for_it():
    """Strict mode's errors (the default mode graph-breaks on these and runs them eagerly)."""

    def tolist(x):
        return torch.tensor(x.tolist()) * 2

    def numpy(x):
        return torch.from_numpy(x.numpy()) * 2

    def leaf_in_place(x):
        return x.add_(1)

    cases = [
        (tolist, torch.randn(3), "`.tolist()`"),
        (numpy, torch.randn(3), "`.numpy()`"),
        (leaf_in_place, leaf(3), "Eager PyTorch raises the same error here"),
    ]
    for fn, x, text in cases:
        with pytest.raises(aotc.UnsupportedError) as info:
            aotc.compile(fn, capture="trace")(x)
        message = str(info.value)
        assert text in message, message
        if fn is not leaf_in_place:
            assert "Eager PyTorch rejects" not in message and "raises the same" not in message

    lib = torch.library.Library("aotc_test13", "DEF")  # noqa: TOR901
    lib.define("bump(Tensor(a!) x) -> ()")
    lib.define("alias(Tensor(a) x) -> Tensor(a)")

    def bump(x: torch.Tensor) -> None:
        x.add_(1)

    lib.impl("bump", bump, "CompositeExplicitAutograd")
    lib.impl("alias", lambda x: x.view(-1), "CompositeExplicitAutograd")

    def custom(x):
        torch.ops.aotc_test13.bump(x)
        return x * 2

    # Note [Custom operators that write their inputs]: compiled, with eager's write-back
    x, ref = torch.randn(3), None
    ref = x.clone()
    assert torch.equal(aotc.compile(custom, capture="trace")(x), custom(ref))
    assert torch.equal(x, ref)

    def returns_alias(x):
        return torch.ops.aotc_test13.alias(x) * 2

    with pytest.raises(aotc.UnsupportedError, match="custom operator mutates or aliases") as info:
        aotc.compile(returns_alias, capture="trace")(torch.randn(3))
    assert "aotc_test13::alias" in str(info.value)


# ---------------------------------------------------------- programs eager runs, aotc refused


def test_17_detached_write_into_a_leaf_that_requires_grad():
    def f(a):
        a.detach().zero_()
        return a * 2

    assert_matches_eager(f, lambda: (leaf(3),))


@pytest.mark.filterwarnings("ignore:Use of .* on expanded tensors is deprecated")
@pytest.mark.parametrize(
    "write",
    [
        lambda y, m, v: y.zero_(),
        lambda y, m, v: y.fill_(2.0),
        lambda y, m, v: y.masked_fill_(m, 1.0),
        lambda y, m, v: y.index_put_((torch.tensor([0, 2]),), v),
    ],
)
def test_18_writes_into_expanded_tensors_that_eager_accepts(write):
    def f(x, m, v):
        write(x.expand(3, 4), m, v)
        return x * 1

    def make():
        return torch.randn(1, 4), torch.rand(3, 4) > 0.5, torch.randn(4)

    assert_matches_eager(f, make)


def test_18_writes_into_expanded_tensors_that_eager_refuses():
    def f(x, y):
        x.expand(3, 4).add_(y)
        return x

    for fn in (f, aotc.compile(f)):
        with pytest.raises(RuntimeError, match="unsupported operation"):
            fn(torch.randn(1, 4), torch.randn(3, 4))


def _overlapping_view():
    base = torch.randn(10)
    return base, base.as_strided((3, 3), (2, 1))  # elements 2, 4 and 6 are addressed twice


@pytest.mark.parametrize("write", ["mul_", "add_", "copy_"])
@pytest.mark.parametrize("mode", ["trace", "torch_compile"])
def test_18_writes_into_a_tensor_that_overlaps_itself_are_refused(write, mode):
    """`x.mul_(2)` on a view whose indices share elements (not through stride 0, which eager
    checks): eager doubles shared elements twice, the functional graph once (Note [Writes into a
    tensor that overlaps itself]). Refused by op and line instead of a silent difference."""

    def f(x, y):
        getattr(x, write)(y if write != "mul_" else 2)
        return x

    compiled = dynamo(f) if mode == "torch_compile" else aotc.compile(f, capture="trace")
    _, x = _overlapping_view()
    with pytest.raises(aotc.UnsupportedError, match=rf"{write}.*several indices address the same"):
        compiled(x, torch.randn(3, 3))


def test_18_order_free_writes_into_a_tensor_that_overlaps_itself_match_eager():
    """The same views written with one value everywhere (`fill_`, `zero_`), and written where no
    two indices share an element (`x[:, ::2]`): eager's results, in every capture mode."""

    def f(base, x):
        x.fill_(3.0)
        x[1].zero_()
        base[::3].mul_(2)  # strided, not overlapping
        return base * 1, x + 1

    for mode in ("trace", "dynamo"):
        assert_matches_eager(f, _overlapping_view, capture=mode, backward=False)


def test_19_unused_random_op():
    def f(a):
        v = a * 2
        torch.rand_like(v)
        return a + 1, torch.rand(2)

    assert_matches_eager(f, lambda: (leaf(3),))


def test_20_dynamo_detached_write_through_aliased_inputs():
    def f(b, c):
        b.detach().zero_()
        return b, c

    def make():
        base = leaf(2, 3)
        return base.view(-1), base[1]

    assert_matches_eager(f, make, compiled=dynamo(f))


def test_21_dynamic_in_place_squeeze_and_size_output():
    def f(a):
        a.squeeze_(0)
        return a * 2

    compiled = aotc.compile(f, dynamic=True)
    for shape in [(4, 3), (1, 3), (5, 3)]:
        assert_matches_eager(f, lambda s=shape: (torch.randn(*s),), compiled=compiled)

    def g(x):
        return x.shape[0], x * 2

    compiled = aotc.compile(g, dynamic=True)
    for n in (4, 6):
        assert compiled(torch.randn(n, 3))[0] == n


@pytest.mark.parametrize("capture", ["trace", "dynamo"])
def test_gradient_from_a_zero_backward_formula_is_zeros_not_none(capture):
    """copysign's backward for `other` returns zeros without reading the cotangent: eager
    accumulates zeros (not None), and so must the compiled call (found by the OpInfo sweep)."""

    def f(a, b):
        return torch.copysign(a, b) * 2

    def make():
        return leaf(3), leaf(3)

    assert_matches_eager(f, make, capture=capture)
    a, b = make()
    aotc.compile(f, capture=capture)(a, b).sum().backward()
    assert b.grad is not None and not b.grad.any()


def _factories_under_float64(x):
    torch.set_default_dtype(torch.float64)
    try:
        made = (
            torch.ones(3),
            torch.zeros(3),
            torch.full((3,), 1.5),
            torch.arange(0.0, 3.0),
            torch.linspace(0, 1, 3),
            torch.scalar_tensor(2.5),
            torch.empty(3).fill_(0.25),
            torch.rand(3),
            torch.randn(3),
        )
    finally:
        torch.set_default_dtype(torch.float32)
    return [m + x for m in made], torch.ones(3) * x  # the last one: float32 again


@pytest.mark.parametrize("mode", ["trace", "dynamo", "torch_compile"])
def test_factory_calls_after_set_default_dtype_inside_keep_its_dtype(mode, tmp_path):
    """`torch.set_default_dtype(torch.float64)` inside the program: eager's factory calls after it
    make float64 tensors. Their nodes had no dtype and took the call's float32 when the graph ran
    (Note [Factory ops follow the default dtype]); a disk-cache hit keeps the dtypes."""
    f = _factories_under_float64

    def make():
        return (leaf(3),)  # float32: each sum has the factory's dtype

    for _ in range(2):  # the second compile reads the first one's cache entry
        torch._dynamo.reset()
        compiled = (
            torch.compile(f, backend="aotc", options=dict(cache_dir=str(tmp_path)))
            if mode == "torch_compile"
            else aotc.compile(f, capture=mode, cache_dir=str(tmp_path))
        )
        assert_matches_eager(f, make, compiled=compiled)
        assert torch.get_default_dtype() == torch.float32
    if mode == "trace":
        assert "cache_load" in aotc.inspect(compiled)[0].stage_seconds


def test_promotion_to_a_default_dtype_the_program_set_is_refused():
    """`torch.arange(3) / 2` computes in the default dtype and has no dtype to pin: refused by
    name and line rather than computed in the call's default (float32 for eager's float64)."""

    def f(x):
        torch.set_default_dtype(torch.float64)
        try:
            z = torch.arange(3) / 2
        finally:
            torch.set_default_dtype(torch.float32)
        return z + x

    with pytest.raises(
        aotc.UnsupportedError, match=r"aten.div.Tensor \(at .*torch.arange\(3\) / 2"
    ):
        aotc.compile(f, capture="trace")(torch.randn(3))
    assert torch.get_default_dtype() == torch.float32
