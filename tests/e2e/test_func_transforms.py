"""torch.func and aotc (issue #17), differential against eager on fresh random inputs.

Two directions, in each capture mode (`aotc.compile` through Dynamo, `capture="trace"`, and
`torch.compile(backend="aotc")`):
- transforms over a compiled function: grad, grad_and_value, vjp, jvp, jacrev, jacfwd, hessian,
  vmap, vmap(grad) per-sample gradients, functional_call over a compiled module. The compiled
  function is also called outside the transform first, so a cached entry exists (it must not
  serve the transformed call).
- compiled functions whose body calls torch.func transforms (grad, vmap, jacrev, vjp, jvp,
  functional_call, vmap(grad) per-sample gradients of an MLP): they compile (the test checks aotc
  compiled a graph) and match eager's outputs, gradients through them, input mutations and
  aliasing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import func, nn

import aotc
from tests.conftest import assert_matches_eager

MODES = ("dynamo", "trace", "torch.compile")


class _Counting:
    """torch.compile's "aotc" backend, counting the graphs it is handed."""

    def __init__(self) -> None:
        self.graphs = 0
        self.backend = torch._dynamo.lookup_backend("aotc")

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.graphs += 1
        return self.backend(gm, example_inputs)


def _compile(fn: Any, mode: str) -> Any:
    torch._dynamo.reset()
    if mode == "dynamo":
        return aotc.compile(fn, check_invariants=True)
    if mode == "trace":
        return aotc.compile(fn, capture="trace", check_invariants=True)
    return torch.compile(fn, backend="aotc")


def _graphs_compiled(compiled: Any, counter: _Counting | None) -> int:
    if counter is not None:
        return counter.graphs
    return len(aotc.inspect(compiled))


# ------------------------------------------------------- transforms over a compiled function


def _scalar(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (torch.tanh(x * w) * x.cos()).sum()


def _vector(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.sin(x * w) + x.exp() * w


def _args() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(5, requires_grad=True), torch.randn(5, requires_grad=True)


def _batched_args() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(3, 5, requires_grad=True), torch.randn(3, 5, requires_grad=True)


# name -> (transform of (scalar fn, vector fn), make_args)
_OVER: dict[str, tuple[Callable[[Any, Any], Callable[..., Any]], Callable[[], Any]]] = {
    "grad": (lambda s, v: func.grad(s, argnums=(0, 1)), _args),
    "grad_and_value": (lambda s, v: func.grad_and_value(s), _args),
    "vjp": (
        lambda s, v: lambda x, w: func.vjp(v, x, w)[1](torch.linspace(-1, 1, 5)),
        _args,
    ),
    "jvp": (
        lambda s, v: lambda x, w: func.jvp(v, (x, w), (torch.ones(5), torch.linspace(0, 1, 5))),
        _args,
    ),
    "jacrev": (lambda s, v: func.jacrev(v, argnums=1), _args),
    "jacfwd": (lambda s, v: func.jacfwd(v), _args),
    "hessian": (lambda s, v: func.hessian(s), _args),
    "vmap": (lambda s, v: func.vmap(v), _batched_args),
    "vmap_grad": (lambda s, v: func.vmap(func.grad(s, argnums=1)), _batched_args),
    "vmap_vmap": (lambda s, v: func.vmap(func.vmap(v, in_dims=(0, None))), _batched_args),
}


@pytest.mark.parametrize("name", list(_OVER))
@pytest.mark.parametrize("mode", MODES)
def test_transform_over_compiled(mode: str, name: str) -> None:
    transform, make_args = _OVER[name]
    c_scalar, c_vector = _compile(_scalar, mode), _compile(_vector, mode)
    # Plain calls first: each compiled function has a cached entry for these shapes.
    assert_matches_eager(_scalar, _args, compiled=c_scalar, runs=1)
    assert_matches_eager(_vector, _args, compiled=c_vector, runs=1)
    assert_matches_eager(
        transform(_scalar, _vector), make_args, compiled=transform(c_scalar, c_vector)
    )
    # And the compiled functions still work outside the transform afterwards.
    assert_matches_eager(_vector, _args, compiled=c_vector, runs=1)


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 3)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x))) * self.scale


@pytest.mark.parametrize("mode", MODES)
def test_per_sample_grads_of_compiled_module(mode: str) -> None:
    """vmap(grad(functional_call(compiled module))): per-sample gradients, as in the torch.func
    tutorial, against the same over the eager module."""
    torch.manual_seed(0)
    model = _MLP()
    compiled = _compile(model, mode)
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.detach() for k, v in model.named_buffers()}

    def per_sample(module: nn.Module) -> Callable[..., Any]:
        def loss(p: dict, b: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            out = func.functional_call(module, (p, b), (x.unsqueeze(0),))
            return F.cross_entropy(out, y.unsqueeze(0))

        return func.vmap(func.grad(loss), in_dims=(None, None, 0, 0))

    for _ in range(2):
        x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
        assert torch.allclose(compiled(x), model(x), atol=1e-6)  # a cached entry exists
        got = per_sample(compiled)(params, buffers, x, y)
        want = per_sample(model)(params, buffers, x, y)
        assert got.keys() == want.keys() == params.keys()
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)
    # functional_call with other parameters, no transform: the compiled module reads them.
    other = {k: torch.randn_like(v) for k, v in params.items()}
    x = torch.randn(6, 4)
    torch.testing.assert_close(
        func.functional_call(compiled, other, (x,)),
        func.functional_call(model, other, (x,)),
        rtol=1e-5,
        atol=1e-6,
    )
    torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-6)  # originals back


@pytest.mark.parametrize("mode", MODES)
def test_transform_over_compiled_mutation(mode: str) -> None:
    """A compiled function that mutates an input, under vmap and grad: eager's mutation of the
    (batched) input, and eager's gradient."""

    def f(x: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        buf.add_(x.detach())
        return (x.sin() * buf).sum()

    compiled = _compile(f, mode)

    def make() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(4, requires_grad=True), torch.randn(4)

    assert_matches_eager(f, make, compiled=compiled, runs=1)
    assert_matches_eager(lambda x, b: func.grad(f)(x, b), make, compiled=func.grad(compiled))

    def make_batched() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(3, 4), torch.randn(3, 4)

    assert_matches_eager(
        lambda x, b: func.vmap(f)(x, b), make_batched, compiled=func.vmap(compiled), backward=False
    )


# ---------------------------------------------------- compiled bodies that call transforms


def _body_grad(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return func.grad(lambda w: torch.sin(x * w).sum())(w) * 2


def _body_grad_argnums(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    gx, gw = func.grad(lambda x, w: (torch.tanh(x @ w) ** 2).sum(), argnums=(0, 1))(x, w)
    return gx.cos(), gw


def _body_grad_and_value(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    g, v = func.grad_and_value(lambda w: torch.sin(x * w).sum())(w)
    return g, v


def _body_vmap(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return func.vmap(lambda r: r * w + r.sin())(x).cos()


def _body_jacrev(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return func.jacrev(lambda w: torch.tanh(x * w))(w)


def _body_jacfwd(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return func.jacfwd(lambda w: torch.tanh(x * w))(w)


def _body_vjp(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    out, pull = func.vjp(lambda w: torch.tanh(x * w), w)
    return pull(out.detach().cos())[0] + out


def _body_jvp(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return func.jvp(lambda w: torch.tanh(x * w), (w,), (torch.ones_like(w),))


def _body_hessian(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return func.hessian(lambda w: (torch.sin(x * w) * w).sum())(w)


_BODIES = {
    f.__name__.removeprefix("_body_"): f
    for f in (
        _body_grad,
        _body_grad_argnums,
        _body_grad_and_value,
        _body_vmap,
        _body_jacrev,
        _body_jacfwd,
        _body_vjp,
        _body_jvp,
        _body_hessian,
    )
}


@pytest.mark.parametrize("name", list(_BODIES))
@pytest.mark.parametrize("mode", MODES)
def test_compiled_body_calls_transform(mode: str, name: str) -> None:
    fn = _BODIES[name]
    counter = _Counting() if mode == "torch.compile" else None
    compiled = torch.compile(fn, backend=counter) if counter else _compile(fn, mode)
    torch._dynamo.reset()

    def make() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(5), torch.randn(5, requires_grad=True)

    assert_matches_eager(fn, make, compiled=compiled, runs=3)
    assert _graphs_compiled(compiled, counter) >= 1  # aotc compiled it, no eager fallback


@pytest.mark.parametrize("mode", MODES)
def test_compiled_per_sample_grads_of_mlp(mode: str) -> None:
    """The whole per-sample-gradient step (vmap(grad(functional_call))) inside the compiled
    function, with parameters passed in; gradients of a loss of the per-sample gradients flow
    back to the parameters (second order, through the compiled graph)."""
    torch.manual_seed(0)
    model = _MLP()
    names = [k for k, _ in model.named_parameters()]

    def step(x: torch.Tensor, y: torch.Tensor, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        params = dict(zip(names, flat))

        def loss(p: dict, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
            out = func.functional_call(model, p, (xi.unsqueeze(0),))
            return F.cross_entropy(out, yi.unsqueeze(0))

        grads = func.vmap(func.grad(loss), in_dims=(None, 0, 0))(params, x, y)
        return tuple(grads[k].norm(dim=tuple(range(1, grads[k].dim()))) for k in names)

    counter = _Counting() if mode == "torch.compile" else None
    compiled = torch.compile(step, backend=counter) if counter else _compile(step, mode)
    torch._dynamo.reset()

    def make() -> tuple[torch.Tensor, ...]:
        ps = [p.detach().clone().requires_grad_() for p in model.parameters()]
        return (torch.randn(6, 4), torch.randint(0, 3, (6,)), *ps)

    assert_matches_eager(step, make, compiled=compiled, rtol=1e-5, atol=1e-5)
    assert _graphs_compiled(compiled, counter) >= 1


@pytest.mark.parametrize("mode", MODES)
def test_compiled_body_transform_with_input_mutation(mode: str) -> None:
    """torch.func.grad inside, an input mutated with its result, and an output that is a view of
    an input: the epilogue writes the mutation back and the view aliases as in eager."""

    def f(x: torch.Tensor, w: torch.Tensor, buf: torch.Tensor) -> tuple[torch.Tensor, ...]:
        g = func.grad(lambda w: (torch.sin(x * w) * w).sum())(w)
        buf.add_(g)
        return g.exp(), buf.view(-1, 1), x[1:]

    counter = _Counting() if mode == "torch.compile" else None
    compiled = torch.compile(f, backend=counter) if counter else _compile(f, mode)
    torch._dynamo.reset()

    def make() -> tuple[torch.Tensor, ...]:
        return torch.randn(5), torch.randn(5, requires_grad=True), torch.randn(5)

    assert_matches_eager(f, make, compiled=compiled, runs=3)
    assert _graphs_compiled(compiled, counter) >= 1


@pytest.mark.parametrize("mode", MODES)
def test_compiled_body_transform_then_stale_backward(mode: str) -> None:
    """grad inside, then the input it saved is modified in place: the forward runs, and the
    backward raises eager's error (eager refuses it too: a saved value changed)."""

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        g = func.grad(lambda w: torch.sin(x * w).sum())(w)
        x.add_(1)
        return g.exp()

    compiled = _compile(f, mode)
    x, w = torch.randn(4, 3), torch.randn(3, requires_grad=True)
    xe, we = x.clone(), w.detach().clone().requires_grad_()
    got, want = compiled(x, w), f(xe, we)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(x, xe)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        want.sum().backward()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        got.sum().backward()


@pytest.mark.parametrize("mode", ("dynamo", "trace"))
def test_body_transform_under_saved_tensor_hooks_fails_as_eager(mode: str) -> None:
    """torch.func.grad refuses to run under saved-tensor hooks (save_on_cpu) in eager; the
    compiled function raises an error saying so, and leaves no hooks disabled behind."""
    compiled = _compile(_body_grad, mode)
    x, w = torch.randn(5), torch.randn(5, requires_grad=True)
    with torch.autograd.graph.save_on_cpu():
        with pytest.raises(RuntimeError, match="saved tensor hooks"):
            _body_grad(x, w)
        with pytest.raises(RuntimeError, match="saved tensor hooks") as info:
            compiled(x, w)
    assert "Eager PyTorch rejects" not in str(info.value)
    assert torch._C._autograd._saved_tensors_hooks_get_disabled_error_message() is None
    assert torch._C._functorch.get_dynamic_layer_stack_depth() == 0
    # The state is clean: the same compiled function works outside the hooks.
    assert_matches_eager(
        _body_grad, lambda: (torch.randn(5), torch.randn(5, requires_grad=True)), compiled=compiled
    )


@pytest.mark.parametrize("mode", MODES)
def test_compiled_body_transform_called_under_saved_tensor_hooks(mode: str) -> None:
    """Compiled without hooks, then called under save_on_cpu: eager refuses that call (grad
    inside), so the compiled entry does too, also when loaded from the disk cache; calls outside
    the hooks still run. A body with only vmap/jvp (which accept hooks) runs under them."""
    x, w = torch.randn(5), torch.randn(5, requires_grad=True)
    for attempt in range(2):  # the second compiled function's entry comes from the disk cache
        compiled = _compile(_body_grad, mode)
        torch.testing.assert_close(compiled(x, w), _body_grad(x, w))
        if mode != "torch.compile" and attempt == 1:
            assert aotc.inspect(compiled)[-1].is_cache_hit
        with torch.autograd.graph.save_on_cpu():
            with pytest.raises(RuntimeError, match="saved tensor hooks"):
                _body_grad(x, w)
            with pytest.raises(RuntimeError, match="saved tensor hooks"):
                compiled(x, w)
        torch.testing.assert_close(compiled(x, w), _body_grad(x, w))
    compiled = _compile(_body_vmap, mode)
    compiled(x, w)
    with torch.autograd.graph.save_on_cpu():
        torch.testing.assert_close(compiled(x, w), _body_vmap(x, w))


@pytest.mark.parametrize(
    "options",
    [{"capture": "trace", "dynamic": True}, {"dynamic": True}, {"backend": "triton"}],
    ids=["trace-dynamic", "dynamo-dynamic", "trace-triton"],
)
def test_compiled_body_transform_dynamic_sizes_and_triton(options: dict[str, Any]) -> None:
    """A body calling grad under symbolic sizes (one entry for every size) and with generated
    Triton kernels (CPU: Triton's interpreter)."""
    torch._dynamo.reset()
    options = {"capture": "trace", **options} if "backend" in options else options
    compiled = aotc.compile(_body_hessian if "backend" in options else _body_grad, **options)
    fn = _body_hessian if "backend" in options else _body_grad
    for n in (5, 7, 9):

        def make(n: int = n) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.randn(n), torch.randn(n, requires_grad=True)

        assert_matches_eager(fn, make, compiled=compiled, runs=1)
    if options.get("dynamic"):
        assert len(aotc.inspect(compiled)) == 1
