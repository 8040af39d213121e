"""Property tests of kernel generation: random programs of pointwise ops, broadcasts, views and
reductions, lowered and fused, against eager; every loop-IR node is in exactly one group."""

from __future__ import annotations

from collections.abc import Callable

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

from aotc.passes.decompose import decompose
from aotc.passes.fusion import plan_fusion
from aotc.passes.kernelize import lower_graph
from aotc.passes.lowering import lower
from tests.triton_helpers import needs_interpreter

pytestmark = needs_interpreter

UNARY: list[Callable[[torch.Tensor], torch.Tensor]] = [
    torch.sin,
    torch.tanh,
    torch.sigmoid,
    torch.relu,
    lambda t: t * 0.5 + 1,
    torch.neg,
    lambda t: torch.exp(-t.abs()),
]
REDUCE: list[Callable[[torch.Tensor], torch.Tensor]] = [
    lambda t: t.sum(-1, keepdim=True),
    lambda t: t.amax(-1, keepdim=True),
    lambda t: t.mean(0, keepdim=True),
    lambda t: t.sum(0, keepdim=True) * 0.1,
]


@st.composite
def programs(draw: st.DrawFn) -> tuple[list[tuple[str, int, int, int]], tuple[int, int]]:
    shape = (draw(st.integers(1, 9)), draw(st.integers(1, 9)))
    steps = []
    for i in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(["unary", "binary", "reduce", "transpose"]))
        steps.append(
            (kind, draw(st.integers(0, 6)), draw(st.integers(0, i)), draw(st.integers(0, i)))
        )
    return steps, shape


def _build(steps: list[tuple[str, int, int, int]]) -> Callable[..., tuple[torch.Tensor, ...]]:
    def fn(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        values = [x + y]
        for kind, op, a, b in steps:
            u, v = values[a], values[b]
            if kind == "unary":
                values.append(UNARY[op % len(UNARY)](u))
            elif kind == "binary":
                values.append(
                    u * v + v
                    if u.shape == v.shape
                    or u.numel() == 1
                    or v.numel() == 1
                    or u.shape[0] == v.shape[0]
                    or u.shape[1] == v.shape[1]
                    else u
                )
            elif kind == "reduce":
                values.append(REDUCE[op % len(REDUCE)](u))
            else:
                values.append(u.t() if u.shape[0] == u.shape[1] else u.contiguous())
        return tuple(values[-3:])

    return fn


@settings(
    max_examples=15, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(programs())
def test_random_programs_match_eager(program: tuple[list, tuple[int, int]]) -> None:
    steps, shape = program
    fn = _build(steps)
    x, y = torch.randn(shape), torch.randn(shape[1])
    graph = make_fx(fn)(x, y)
    lowered = lower(decompose(graph))
    plan = plan_fusion(lowered)
    names = [m.name for g in plan.groups for m in g.members]
    assert sorted(names) == sorted(item.name for item in lowered.items)  # each node once
    compiled = lower_graph(graph, interpret=True)
    for got, want in zip(compiled.callable(x, y), fn(x, y), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
