"""Outputs that get no gradient (Note [Absent gradients] in runtime/absent.py): the compiled
backward computes what eager's does when the loss uses only some outputs, never a zero tangent
times an infinite derivative (NaN), differential against eager on fresh random inputs."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import aotc
from tests.triton_helpers import needs_interpreter

MODES = ["trace", "default", pytest.param("triton", marks=needs_interpreter)]


def _compile(f: Callable, mode: str) -> Callable:
    torch._dynamo.reset()
    if mode == "trace":
        return aotc.compile(f, capture="trace", check_invariants=True)
    if mode == "triton":
        return aotc.compile(f, capture="trace", backend="triton", check_invariants=True)
    return aotc.compile(f, check_invariants=True)


def _grads(f: Callable, make: Callable, used: list[int], seed: int) -> list:
    torch.manual_seed(seed)
    args = make()
    outs = f(*args)
    loss = sum(outs[k].float().sum() for k in used)
    loss.backward()
    return [None if a.grad is None else a.grad.clone() for a in args if a.is_leaf]


def _sqrt_beside_a_product(x, y):
    return x.sqrt() * y, x * 2


def _sqrt_inputs():
    x = torch.rand(5)
    x[torch.randint(0, 5, (2,))] = 0.0  # sqrt's derivative is infinite there
    return x.requires_grad_(), torch.randn(5, requires_grad=True)


def _unbound_rows(x):
    a, b, c = x.unbind(0)
    return a.log(), b * 3, c.sum()


def _log_rows_inputs():
    x = torch.randn(3, 4).abs()
    x[0, 1] = 0.0
    return (x.requires_grad_(),)


def _written_max(x):
    v = x.amax(0)
    v.fill_(0.5)  # the saved max changed: its backward divides by a zero count
    return x[0] * 1, v


def _max_inputs():
    return (torch.randn(3, 4, requires_grad=True),)


PROGRAMS = {
    "sqrt_beside_a_product": (_sqrt_beside_a_product, _sqrt_inputs, 2),
    "unbound_rows": (_unbound_rows, _log_rows_inputs, 3),
    "written_max": (_written_max, _max_inputs, 2),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_only_some_outputs_get_a_gradient(name, mode):
    f, make, n = PROGRAMS[name]
    compiled = _compile(f, mode)
    for used in [[k] for k in range(n)] + [list(range(n))]:
        for seed in (0, 1):
            try:
                want = _grads(f, make, used, seed)
            except (
                RuntimeError
            ) as e:  # eager refuses (a saved value changed in place): so must aotc
                assert "modified by an inplace" in str(e)
                with pytest.raises(RuntimeError, match="modified by an inplace"):
                    _grads(compiled, make, used, seed)
                continue
            got = _grads(compiled, make, used, seed)
            assert len(got) == len(want)
            for g, w in zip(got, want, strict=True):
                assert (g is None) == (w is None), (used, got, want)
                if w is not None:
                    torch.testing.assert_close(g, w, equal_nan=True)


def test_one_call_backward_per_output_in_turn():
    """retain_graph: the first backward uses one output (a pruned graph), the second the other
    (another); together they sum to eager's."""
    f = _sqrt_beside_a_product
    compiled = _compile(f, "trace")
    results = []
    for fn in (f, compiled):
        torch.manual_seed(3)
        x, y = _sqrt_inputs()
        a, b = fn(x, y)
        b.sum().backward(retain_graph=True)
        first = x.grad.clone()
        a.sum().backward()
        results.append((first, x.grad.clone(), y.grad.clone()))
    for g, w in zip(*results, strict=True):
        torch.testing.assert_close(g, w, equal_nan=True)


def test_pruned_graph_keeps_present_sums_and_zeros_for_mixed_nodes():
    from torch.fx.experimental.proxy_tensor import make_fx

    from aotc.runtime.absent import absent_backward
    from aotc.runtime.launch import make_callable

    def backward(saved, t0, t1):
        a = t0 / saved  # inf where saved is 0
        b = t1 * 2
        both = torch.ops.aten.add.Tensor(a, b)
        only_t1 = torch.ops.aten.sub.Tensor(a, b)
        stacked = torch.stack([a, b])
        return both, only_t1, stacked, a

    args = (torch.tensor([0.0, 1.0]), torch.ones(2), torch.ones(2))
    graph = make_fx(backward)(*args)
    pruned = absent_backward(graph, 2, frozenset({0}))
    assert pruned is not None
    both, only_t1, stacked, a = make_callable(pruned)(args[0], None, args[2])
    torch.testing.assert_close(both, torch.full((2,), 2.0))
    torch.testing.assert_close(only_t1, torch.full((2,), -2.0))
    torch.testing.assert_close(stacked, torch.stack([torch.zeros(2), torch.full((2,), 2.0)]))
    assert a is None
