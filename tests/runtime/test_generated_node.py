"""The generated autograd node (Note [Generated node] in runtime/autograd.py): which plans get one,
and that it behaves as eager does (outputs, gradients, saved-value version checks, sizes saved
for dynamic shapes, double backward, several outputs), against the generic node it replaces."""

from __future__ import annotations

import pytest
import torch

import aotc
import aotc.runtime.autograd as autograd_rt
from tests.conftest import assert_matches_eager


def mul_sum(x, y):
    return (x * y).sum()


def maximum(x, w):  # eager saves x and w; the partition saves a mask: both inputs are watched
    return torch.maximum(x, w).sin().sum()


def several(x, w):  # outputs: differentiable, integer, differentiable
    y = x * w
    return y.sin(), y.argmax(), (y * 2).cos()


def second_grad(x, w):  # x.grad's own graph: needs the graph args for a double backward
    return (x * x * w).sum()


def make():
    return torch.randn(6, requires_grad=True), torch.randn(6)


def make_both():
    return torch.randn(6, requires_grad=True), torch.randn(6, requires_grad=True)


def _nodes(compiled) -> list[type]:
    return [e._fn for e in compiled._dispatch.entries if e._fn is not None]


@pytest.mark.parametrize("fn", [mul_sum, maximum, several, second_grad])
@pytest.mark.parametrize("make_args", [make, make_both])
@pytest.mark.parametrize("dynamic", [False, True])
def test_generated_node_matches_eager(fn, make_args, dynamic):
    compiled = assert_matches_eager(fn, make_args, capture="trace", dynamic=dynamic, cache=False)
    nodes = _nodes(compiled)
    assert nodes
    assert all(hasattr(node.forward, "__aotc_source__") for node in nodes)


def test_saved_input_is_not_watched_twice():
    """mul_sum saves y as it is: autograd's own check on unpacking covers it (no watch)."""
    compiled = aotc.compile(mul_sum, capture="trace", cache=False)
    x, y = make()
    compiled(x, y).backward()
    (entry,) = compiled._dispatch.entries
    assert entry.plan.autograd.watch == ()
    source = entry._fn.forward.__aotc_source__
    assert "aotc_watch" not in source


@pytest.mark.parametrize("fn", [mul_sum, maximum])
def test_input_changed_after_call_refused_like_eager(fn):
    compiled = aotc.compile(fn, capture="trace", cache=False)
    for side in (fn, compiled):
        x, y = make()
        out = side(x, y)
        with torch.no_grad():
            y.add_(1) if fn is mul_sum else x.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.backward()


def test_double_backward_through_generated_node():
    compiled = aotc.compile(second_grad, capture="trace", cache=False)
    grads = []
    for side in (second_grad, compiled):
        torch.manual_seed(0)
        x, w = make_both()
        (gx,) = torch.autograd.grad(side(x, w), x, create_graph=True)
        gx.sum().backward()
        grads.append((gx.detach(), x.grad, w.grad))
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("fn", [mul_sum, maximum, several, second_grad])
def test_generated_equals_generic(fn, monkeypatch):
    """The same program through the generic node gives the same values and gradients."""
    results = []
    for generate in (True, False):
        if not generate:
            monkeypatch.setattr(autograd_rt, "GENERATED_NODES", False)
        compiled = aotc.compile(fn, capture="trace", cache=False)
        torch.manual_seed(0)
        x, w = make_both()
        out = compiled(x, w)
        outs = out if isinstance(out, tuple) else (out,)
        loss = sum(o.float().sum() for o in outs if o.requires_grad)
        loss.backward()
        assert all(hasattr(n.forward, "__aotc_source__") == generate for n in _nodes(compiled))
        results.append(([o.detach() for o in outs], x.grad, w.grad))
    torch.testing.assert_close(results[0], results[1])
