"""Fast path (runtime/fastpath.py): which entries get a generated call, and that it gives eager's
results, including the calls it hands to the general path (autocast). Strict mode: these tests
read the entries of aotc's own dispatcher (the default mode runs the same entries behind Dynamo's
guards)."""

from __future__ import annotations

import pytest
import torch

import aotc
from tests.conftest import assert_matches_eager


def one_out(x, w):
    return (x @ w).relu().sum()


def tuple_out(x, w):
    y = x @ w
    return (
        y.sin(),
        y.argmax(),
        3,
        x,
    )  # differentiable, integer (not differentiable), constant, input


def tree_out(x, w):
    y = x @ w
    return {"a": y.cos(), "b": [y.sum(), y.detach() * 2]}


def swapped_args(x, w):
    return w.t() @ x.t()  # graph args in leaf order; output a fresh tensor


def returns_view(x, w):
    return (x @ w).t(), x[0]  # a view of an intermediate and a view of an input: general path


def mutates(x, w):
    x.add_(1)
    return x @ w


def make():
    return torch.randn(5, 4), torch.randn(4, 3, requires_grad=True)


def make_grad_x():
    return torch.randn(5, 4, requires_grad=True), torch.randn(4, 3, requires_grad=True)


def is_fast(compiled) -> list[bool]:
    return [hasattr(e.call, "__aotc_source__") for e in compiled._dispatch.entries]


@pytest.mark.parametrize("fn", [one_out, tuple_out, tree_out, swapped_args])
@pytest.mark.parametrize("make_args", [make, make_grad_x])
def test_direct_plans_take_fast_path_and_match_eager(fn, make_args):
    compiled = assert_matches_eager(fn, make_args, runs=3, capture="trace")
    with torch.no_grad():
        assert_matches_eager(fn, make_args, compiled=compiled, backward=False)
    assert is_fast(compiled) == [True, True]


def test_plans_with_fixups_take_general_path():
    compiled = assert_matches_eager(returns_view, make, runs=2, capture="trace")
    assert is_fast(compiled) == [False]


def test_buffer_writes_of_a_replaying_entry_are_generated():
    """Note [Generated buffer writes]: a replaying entry whose only fix-up is a write into an
    input that needs no grad gets a generated call; the write, the version and the gradients
    are eager's."""
    compiled = assert_matches_eager(mutates, make, runs=3, capture="trace")
    assert is_fast(compiled) == [True]
    assert "write_buffers" in compiled._dispatch.entries[0].call.__aotc_source__
    x, w = make()
    x_ref, w_ref = x.clone(), w.detach().clone().requires_grad_()
    out, ref = compiled(x, w), mutates(x_ref, w_ref)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(x, x_ref)
    assert x._version == x_ref._version == 1
    out.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(w.grad, w_ref.grad)


def test_buffer_writes_keep_the_general_path_with_the_pair(pair):
    compiled = assert_matches_eager(
        mutates, make, runs=2, backward=False, capture="trace", cache=False
    )
    assert is_fast(compiled) == [False]


def test_autocast_call_goes_through_general_path():
    compiled = aotc.compile(one_out, capture="trace")
    x, w = make()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = compiled(x, w)
        want = one_out(x, w)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    assert all(is_fast(compiled))


@pytest.fixture
def pair(monkeypatch):
    """Entries keep their compiled pair (autograd node) even where eager's autograd could record
    the backward (Note [Eager autograd on the ATen path] in aotc/eagerautograd.py)."""
    from aotc import pipeline

    monkeypatch.setattr(pipeline, "_eager_autograd", lambda plan, *args: plan)


def test_generated_call_runs_the_forward_under_eager_autograd():
    compiled = aotc.compile(one_out, capture="trace")
    x, w = make()
    compiled(x, w).backward()
    (entry,) = compiled._dispatch.entries
    assert entry.plan.eager_autograd
    assert "d = fwd(*leaves)" in entry.call.__aotc_source__
    out = compiled(x, w)
    assert type(out.grad_fn).__name__ == "SumBackward0"
    assert_matches_eager(one_out, make, compiled=compiled)


def test_generated_call_inlines_indices(pair):
    compiled = aotc.compile(one_out, capture="trace", cache=False)
    x, w = make()
    compiled(x, w).backward()
    (entry,) = compiled._dispatch.entries
    # Every output is differentiable: no holder list (Note [No holder when every output is
    # differentiable] in runtime/autograd.py).
    assert "apply(None, *leaves)" in entry.call.__aotc_source__
    assert "return d[0]" in entry.call.__aotc_source__


def test_generated_call_keeps_holder_for_raw_outputs(pair):
    """An output autograd must not return (an integer argmax) comes back through the holder."""
    compiled = aotc.compile(tuple_out, capture="trace", cache=False)
    x, w = make()
    got = compiled(x, w)
    assert "apply(h := [], *leaves)" in compiled._dispatch.entries[0].call.__aotc_source__
    assert got[1].dtype == torch.int64 and not got[1].requires_grad
    assert got[3] is x
    assert_matches_eager(tuple_out, make)
