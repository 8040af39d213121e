"""Control-flow operators (`torch.cond`, `while_loop`, `map`, `scan`, `associative_scan`) in
compiled programs, against eager on fresh inputs: both branches of one compiled graph, gradients
bit for bit (CPU, ATen calls), in the default capture mode, through `torch.compile(backend="aotc")`
and in the strict mode (Note [Control-flow operators in a trace] in aotc/hopcalls.py), which
refuses by name what it cannot trace."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch._higher_order_ops.utils as hop_utils
import torch.nn as nn
from torch._higher_order_ops.associative_scan import associative_scan
from torch._higher_order_ops.map import map as hop_map
from torch._higher_order_ops.scan import scan
from torch._higher_order_ops.while_loop import while_loop

import aotc
import aotc.backend
from aotc.runtime.errors import UnsupportedError

MODES = ["default", "trace", "torch_compile"]
CACHE = os.environ.get("CF_CACHE") == "1"


def _compile(fn: Any, mode: str, **options: Any) -> Any:
    if mode == "torch_compile":
        torch._dynamo.reset()
        return torch.compile(fn, backend="aotc", options=dict(cache=CACHE, **options))
    capture = {"capture": "trace"} if mode == "trace" else {}
    return aotc.compile(fn, cache=CACHE, **capture, **options)


@pytest.fixture(autouse=True)
def _compiled_not_eager(request: pytest.FixtureRequest) -> Any:
    """Every Dynamo graph of these tests is compiled by aotc, none run eagerly instead (a
    refused graph would still match eager), except where a test says so."""
    before = aotc.backend.stats["eager"]
    yield
    if "runs_eagerly" not in request.keywords:
        assert aotc.backend.stats["eager"] == before, "a graph ran eagerly instead of compiled"


def _leaves(*trees: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(trees) if isinstance(t, torch.Tensor)]


def _check(
    fn: Callable[..., Any], compiled: Callable[..., Any], inputs: list[torch.Tensor]
) -> None:
    """Outputs, input gradients (None vs a tensor too) and `requires_grad` equal to eager's."""
    ours = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    expected, got = fn(*inputs), compiled(*ours)
    want, have = _leaves(expected), _leaves(got)
    assert len(want) == len(have)
    for a, b in zip(want, have):
        assert a.requires_grad == b.requires_grad
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    floats = [(a, b) for a, b in zip(want, have) if a.requires_grad]
    if floats:
        sum(a.sum() for a, _ in floats).backward()  # type: ignore[union-attr]
        sum(b.sum() for _, b in floats).backward()  # type: ignore[union-attr]
    for a, b in zip(inputs, ours):
        assert (a.grad is None) == (b.grad is None)
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0)


def _branchy(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = torch.cond(
        x.sum() > 0, lambda a, b: (a * b).sin(), lambda a, b: (a + b).cos() * a, (x, y)
    )
    return out * y


@pytest.mark.parametrize("mode", MODES)
def test_cond_takes_either_branch_of_one_graph(mode: str) -> None:
    compiled = _compile(_branchy, mode)
    for sign in (1, -1, 1, -1):
        x = (torch.randn(5).abs() * sign).requires_grad_()
        _check(_branchy, compiled, [x, torch.randn(5, requires_grad=True)])
    records = aotc.inspect(compiled) if mode != "torch_compile" else []
    assert len(records) <= 1  # the predicate is read at run time: no recompile per branch


@pytest.mark.parametrize("mode", MODES)
def test_cond_without_grad(mode: str) -> None:
    compiled = _compile(_branchy, mode)
    for sign in (1, -1):
        x = torch.randn(3, 4).abs() * sign
        with torch.no_grad():
            _check(_branchy, compiled, [x, torch.randn(3, 4)])


class _Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.cond(
            x.mean() > 0, lambda t: self.a(t).relu(), lambda t: self.b(t).tanh() * 2, (x,)
        )
        return (h * x).sum(-1)


@pytest.mark.parametrize("mode", ["default", "torch_compile"])
def test_cond_branches_reading_parameters(mode: str) -> None:
    model = _Gated()
    ours = copy.deepcopy(model)
    compiled = _compile(ours, mode)
    for sign in (1, -1, -1, 1):
        x = (torch.randn(3, 6).abs() * sign).requires_grad_()
        _check(model, compiled, [x])
        for (name, p), q in zip(model.named_parameters(), ours.parameters()):
            assert (p.grad is None) == (q.grad is None), name
            if p.grad is not None:
                torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=name)


def test_strict_mode_refuses_branches_reading_parameters_by_name() -> None:
    compiled = aotc.compile(_Gated(), capture="trace", cache=False)
    with pytest.raises(
        UnsupportedError, match=r"torch\.cond at .*test_control_flow.py.*default capture"
    ):
        compiled(torch.randn(3, 6))


@pytest.mark.parametrize("mode", MODES)
def test_cond_on_a_symbolic_size(mode: str) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.cond(x.shape[0] > 4, lambda t: t.sin(), lambda t: t.cos(), (x,)) * x

    compiled = _compile(fn, mode, dynamic=True)
    for n in (3, 6, 7, 2):
        _check(fn, compiled, [torch.randn(n, requires_grad=True)])


def test_cond_returning_a_nested_structure_in_strict_mode() -> None:
    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = torch.cond(
            x.sum() > 0,
            lambda d: {"p": d["a"] * 2, "q": (d["b"].sin(),)},
            lambda d: {"p": d["a"] * d["b"], "q": (d["b"].cos(),)},
            ({"a": x, "b": y},),
        )
        return out["p"] + out["q"][0]

    compiled = _compile(fn, "trace")
    for sign in (1, -1):
        x = (torch.randn(4).abs() * sign).requires_grad_()
        _check(fn, compiled, [x, torch.randn(4, requires_grad=True)])


@pytest.mark.parametrize("mode", MODES)
def test_scan_and_map(mode: str) -> None:
    def fn(init: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
        carry, ys = scan(lambda c, x: (c * x + 1, (c * x).tanh()), init, xs)
        mapped = hop_map(lambda row, w: row * w, xs, init)
        return carry.sum() + ys.sum() + mapped.sum()

    compiled = _compile(fn, mode)
    _check(
        fn, compiled, [torch.randn(3, requires_grad=True), torch.randn(5, 3, requires_grad=True)]
    )


@pytest.mark.parametrize("mode", MODES)
def test_associative_scan(mode: str) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return associative_scan(lambda a, b: a + b, x, dim=0, combine_mode="generic")

    with torch.no_grad():
        _check(fn, _compile(fn, mode), [torch.randn(6, 3)])


def _loop(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return while_loop(  # type: ignore[no-any-return]
        lambda i, a: a.sum() < 100, lambda i, a: (i + 1, a * 2 + 1), (torch.tensor(0), x)
    )


@pytest.mark.parametrize("mode", ["default", "torch_compile"])
def test_while_loop(mode: str) -> None:
    compiled = _compile(_loop, mode)
    for scale in (1.0, 10.0, 0.01):
        _check(_loop, compiled, [torch.rand(4) * scale])


def test_while_loop_in_strict_mode() -> None:
    # its trace needs symbolic sizes (a fresh symbol for the iteration count)
    compiled = _compile(_loop, "trace", dynamic=True)
    for scale in (1.0, 10.0):
        _check(_loop, compiled, [torch.rand(4) * scale])
    static = _compile(_loop, "trace")
    with pytest.raises(
        UnsupportedError, match=r"while_loop at .*test_control_flow.py.*dynamic=True"
    ):
        static(torch.rand(4))


@pytest.mark.runs_eagerly
def test_branch_modifying_its_input_without_grad() -> None:
    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.cond(
            y.sum() > 0, lambda a, b: a.add_(1) * b, lambda a, b: a.mul_(2) + b, (x, y)
        )

    compiled = _compile(fn, "default")  # functionalization refuses it: the graph runs eagerly
    for sign in (1, -1):
        x, y = torch.randn(5), torch.randn(5).abs() * sign
        ours = x.clone()
        with torch.no_grad():
            try:
                expected = fn(x, y)
            except Exception as e:  # torch 2.11's eager refuses the branch's write (2.13 runs it)
                with pytest.raises(type(e)):
                    compiled(ours, y)
                continue
            got = compiled(ours, y)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        torch.testing.assert_close(ours, x, rtol=0, atol=0)  # the input was modified as in eager
    strict = _compile(fn, "trace")
    with pytest.raises(UnsupportedError, match=r"torch\.cond at "), torch.no_grad():
        strict(torch.randn(5), torch.randn(5))


def test_torch_calls_outside_a_trace_keep_their_own_path() -> None:
    # torch 2.13's operators compile through `_hop_compile_and_call`, 2.11's call torch.compile
    has_hop_call = hasattr(hop_utils, "_hop_compile_and_call")
    owner, name = (hop_utils, "_hop_compile_and_call") if has_hop_call else (torch, "compile")
    original = getattr(owner, name)
    compiled = _compile(_branchy, "trace")
    x, y = torch.randn(4, requires_grad=True), torch.randn(4)
    _check(_branchy, compiled, [x, y])
    assert getattr(owner, name) is original  # restored after the trace


def test_graphs_with_cond_are_cached_with_their_branches(tmp_path: Any) -> None:
    # the default mode: Dynamo's graph keys the entry, subgraphs included (strict mode's key
    # trace cannot describe the branches: not cached)
    model = _Gated()
    results = []
    for _ in range(2):  # a cold compile, then a hit of the stored entry
        torch._dynamo.reset()
        compiled = aotc.compile(model, cache=True, cache_dir=str(tmp_path))
        for sign in (1, -1):
            _check(model, compiled, [(torch.randn(3, 6).abs() * sign).requires_grad_()])
        aotc.cache_flush()
        results.append([r.is_cache_hit for r in aotc.inspect(compiled)])
    assert results[0] and not any(results[0])
    assert results[1] and all(results[1])


def test_export_and_load_a_graph_with_cond(tmp_path: Any) -> None:
    x, y = torch.randn(5, requires_grad=True), torch.randn(5)
    loaded = aotc.load(aotc.export(_branchy, x, y, path=str(tmp_path / "cond")))
    for sign in (1, -1):
        _check(_branchy, loaded, [(torch.randn(5).abs() * sign).requires_grad_(), y])
