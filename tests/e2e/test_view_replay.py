"""Aliased outputs are rebuilt with eager's own view ops (Note [Replayed views] in
runtime/viewreplay.py): the same autograd nodes as eager's views, the same values, strides and
gradients, in both capture modes, and in an exported artifact."""

from __future__ import annotations

import pytest
import torch

import aotc

CAPTURES = ["dynamo", "trace"]


def _views(x):
    y = x * 2
    return (
        x.view(-1),
        x.t(),
        x[0],
        x[:, 1:],
        x.unsqueeze(0).expand(2, 3, 4),
        x.unbind(0)[1],
        x.split(2, dim=1)[1],
        x.T,
        x.diagonal(),
        y.view(4, 3),
        y.transpose(0, 1)[1:],
        y.unfold(1, 2, 1),
        y,
    )


def _names(outs):
    return [o.grad_fn.name() if o.grad_fn is not None else None for o in outs]


@pytest.mark.parametrize("capture", CAPTURES)
def test_aliased_outputs_have_eagers_autograd_nodes_and_values(capture):
    compiled = aotc.compile(_views, capture=capture)
    for _ in range(2):
        x = torch.randn(3, 4, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        want, got = _views(x), compiled(x2)
        assert _names(got[:-1]) == _names(want[:-1])
        for w, g in zip(want, got):
            torch.testing.assert_close(g, w)
            assert g.stride() == w.stride() and (g._base is None) == (w._base is None)
        weights = [torch.randn(w.shape) for w in want]
        sum((w * k).sum() for w, k in zip(want, weights)).backward()
        sum((g * k).sum() for g, k in zip(got, weights)).backward()
        torch.testing.assert_close(x2.grad, x.grad)


@pytest.mark.parametrize("capture", CAPTURES)
def test_writing_a_replayed_multi_output_view_is_refused_like_eager(capture):
    def f(x):
        return x.unbind(0)

    compiled = aotc.compile(f, capture=capture)
    x = torch.randn(2, 3, requires_grad=True) * 1
    for fn in (f, compiled):
        out = fn(x)
        assert out[0].grad_fn.name() == "UnbindBackward0"
        with pytest.raises(RuntimeError, match="multiple views"):
            out[0].mul_(2)


@pytest.mark.parametrize("capture", CAPTURES)
def test_view_of_a_base_changed_in_place_afterwards_keeps_eagers_values(capture):
    def f(x):
        y = x * 2
        w = y.view(-1)
        y.t_()  # the view chain no longer leads from y to w: rebuilt from its geometry
        z = x.view(-1)
        return w * 1, z, y

    compiled = aotc.compile(f, capture=capture)
    x = torch.randn(2, 3)
    for w, g in zip(f(x), compiled(x)):
        torch.testing.assert_close(g, w)
        assert g.stride() == w.stride()


@pytest.mark.parametrize("capture", CAPTURES)
def test_views_made_under_no_grad_have_no_node(capture):
    def f(x):
        with torch.no_grad():
            a = x.view(-1)
        return a, x[1:]

    compiled = aotc.compile(f, capture=capture)
    x = torch.randn(3, 2, requires_grad=True)
    want, got = f(x), compiled(x)
    assert _names(got) == _names(want) == [None, "SliceBackward0"]
    assert [g.requires_grad for g in got] == [w.requires_grad for w in want]


def test_exported_artifact_replays_the_views(tmp_path):
    def f(x):
        return x[0], (x * 3).t()

    x = torch.randn(2, 3, requires_grad=True)
    loaded = aotc.load(aotc.export(f, x, path=tmp_path / "art"))
    got, want = loaded(x), f(x)
    assert _names(got) == _names(want) == ["SelectBackward0", "TBackward0"]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
