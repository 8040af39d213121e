"""Custom operators that write their inputs (`torch.library.custom_op(mutates_args=...)`) compile
in every capture mode and backend, as torch's functional `auto_functionalized` (Note [Custom
operators that write their inputs] in aotc/customops.py): outputs, gradients, written buffers
and written user inputs (through views too) against eager, on fresh inputs each step."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import aotc


@torch.library.custom_op("aotc_test_writes::add_into", mutates_args=("out",))
def add_into(x: torch.Tensor, out: torch.Tensor) -> None:
    out.add_(x)


@add_into.register_fake
def _(x, out):
    return None


@torch.library.custom_op("aotc_test_writes::scale_both", mutates_args=("a", "b"))
def scale_both(a: torch.Tensor, b: torch.Tensor, s: float) -> torch.Tensor:
    a.mul_(s)
    b.mul_(s)
    return a + b


@scale_both.register_fake
def _(a, b, s):
    return torch.empty_like(a)


class _Writes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("acc", torch.zeros(3, 4))

    def forward(self, x: torch.Tensor, ext: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        add_into(y.detach()[0], self.acc[1])  # a view of a buffer
        add_into(torch.ones(2), ext[:, 1])  # a view of the caller's tensor
        a, b = y.detach().clone(), torch.ones(3, 4)  # intermediates
        r = scale_both(a, b, 3.0)
        return (y * r).sum() + a.sum() + b.sum() + self.acc.sum()


def _equal(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.equal(got, want), (got, want)


def _compiled(model: nn.Module, how: str) -> object:
    if how == "torch.compile":
        torch._dynamo.reset()
        return torch.compile(model, backend="aotc")
    if how == "dynamo":
        torch._dynamo.reset()
    backend = "triton" if how == "triton" else "auto"
    capture = "dynamo" if how == "dynamo" else "trace"
    return aotc.compile(model, capture=capture, backend=backend, cache=False)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("how", ["trace", "dynamo", "torch.compile", "triton"])
def test_custom_operators_that_write_their_inputs_match_eager(how, monkeypatch):
    if how == "triton":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(0)
    model = _Writes()
    eager = copy.deepcopy(model)
    compiled = _compiled(model, how)
    for _ in range(3):
        x = torch.randn(3, 4)
        ext, ext_ref = torch.zeros(2, 3), torch.zeros(2, 3)
        want, got = eager(x, ext_ref), compiled(x, ext)
        want.backward()
        got.backward()
        same = torch.testing.assert_close if how == "triton" else _equal  # fused: rounding
        same(got, want)
        assert torch.equal(ext, ext_ref) and ext[0, 1] == 1
        same(model.acc, eager.acc)
        for p, q in zip(eager.parameters(), model.parameters()):
            same(q.grad, p.grad)
    if how in ("trace", "triton"):
        assert len(aotc.inspect(compiled)) == 1
        assert "auto_functionalized" in aotc.inspect(compiled)[0].program.forward.code
