"""Higher-order gradients through compiled functions (create_graph=True), against eager.

Each test runs the same program eagerly and through aotc (strict capture, the default Dynamo
capture, and torch.compile's backend) on identical fresh random inputs and compares every
gradient, including which ones are None. See Note [Double backward] in aotc/higher_order.py.
"""

from __future__ import annotations

import copy
import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import aotc

MODES = ("trace", "default", "torch_compile")


def compiled(fn: Any, mode: str) -> Any:
    torch._dynamo.reset()
    if mode == "trace":
        return aotc.compile(fn, capture="trace")
    if mode == "default":
        return aotc.compile(fn)
    return torch.compile(fn, backend="aotc")


def close(a: object, b: object, tol: float = 1e-4) -> None:
    if a is None or b is None:
        assert a is None and b is None, (a, b)
        return
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    assert a.requires_grad == b.requires_grad
    torch.testing.assert_close(a, b, atol=tol, rtol=tol)


class Critic(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(6, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.l2 = torch.nn.Linear(16, 16)
        self.l3 = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.leaky_relu(self.norm(self.l1(x)), 0.2)
        h = F.gelu(self.l2(h)) + torch.tanh(h)
        return self.l3(h)


def _wgan_gp_steps(critic: torch.nn.Module, run: Callable[..., Any], seed: int) -> list[Any]:
    """WGAN-GP critic updates: Wasserstein loss plus the gradient penalty on interpolates."""
    opt = torch.optim.Adam(critic.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(seed)
    history = []
    for _ in range(3):
        real = torch.randn(8, 6, generator=gen)
        fake = torch.randn(8, 6, generator=gen) * 2 + 1
        eps = torch.rand(8, 1, generator=gen)
        x_hat = (eps * real + (1 - eps) * fake).requires_grad_()
        (grads,) = torch.autograd.grad(run(x_hat).sum(), x_hat, create_graph=True)
        penalty = ((grads.norm(2, dim=1) - 1) ** 2).mean()
        loss = run(fake).mean() - run(real).mean() + 10 * penalty
        opt.zero_grad()
        loss.backward()
        history.append((loss.detach(), [p.grad.clone() for p in critic.parameters()]))
        opt.step()
    history.append([p.detach().clone() for p in critic.parameters()])
    return history


@pytest.mark.parametrize("mode", MODES)
def test_gradient_penalty_training_loop(mode: str) -> None:
    torch.manual_seed(1)
    eager = Critic()
    ours = copy.deepcopy(eager)
    expected = _wgan_gp_steps(eager, eager, seed=7)
    got = _wgan_gp_steps(ours, compiled(ours, mode), seed=7)
    for (e_loss, e_grads), (g_loss, g_grads) in zip(expected[:-1], got[:-1]):
        close(e_loss, g_loss)
        for a, b in zip(e_grads, g_grads):
            close(a, b)
    for a, b in zip(expected[-1], got[-1]):
        close(a, b)


def _mlp(params: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    w1, b1, w2, b2 = params
    h = torch.tanh(F.linear(x, w1, b1))
    return F.mse_loss(F.linear(h, w2, b2), y)


def _maml(loss: Callable[..., torch.Tensor], params: list[torch.Tensor], seed: int) -> list[Any]:
    gen = torch.Generator().manual_seed(seed)
    outer = torch.zeros(())
    for _ in range(2):  # tasks
        xs, ys = torch.randn(5, 3, generator=gen), torch.randn(5, 2, generator=gen)
        xq, yq = torch.randn(5, 3, generator=gen), torch.randn(5, 2, generator=gen)
        fast = params
        for _ in range(2):  # inner steps, differentiated through
            grads = torch.autograd.grad(loss(fast, xs, ys), fast, create_graph=True)
            fast = [p - 0.1 * g for p, g in zip(fast, grads)]
        outer = outer + loss(fast, xq, yq)
    grads = torch.autograd.grad(outer, params)
    return [outer.detach(), *grads]


@pytest.mark.parametrize("mode", MODES)
def test_maml_inner_outer_loop(mode: str) -> None:
    torch.manual_seed(2)
    params = [
        (torch.randn(8, 3) * 0.5).requires_grad_(),
        torch.zeros(8, requires_grad=True),
        (torch.randn(2, 8) * 0.5).requires_grad_(),
        torch.zeros(2, requires_grad=True),
    ]
    expected = _maml(_mlp, params, seed=3)
    got = _maml(compiled(_mlp, mode), params, seed=3)
    for a, b in zip(expected, got):
        close(a, b)


def _flat_mlp(theta: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    w1 = theta[:12].view(4, 3)
    w2 = theta[12:].view(1, 4)
    return (torch.sigmoid(x @ w1.t()) @ w2.t()).pow(2).sum()


@pytest.mark.parametrize("mode", MODES)
def test_hessian_vector_product_and_full_hessian(mode: str) -> None:
    torch.manual_seed(3)
    theta = torch.randn(16, requires_grad=True)
    x = torch.randn(6, 3)
    v = torch.randn(16)
    fn = compiled(_flat_mlp, mode)

    def hvp(f: Callable[..., torch.Tensor]) -> torch.Tensor:
        (g,) = torch.autograd.grad(f(theta, x), theta, create_graph=True)
        (hv,) = torch.autograd.grad(g @ v, theta)
        return hv

    def hessian(f: Callable[..., torch.Tensor]) -> torch.Tensor:
        (g,) = torch.autograd.grad(f(theta, x), theta, create_graph=True)
        rows = [torch.autograd.grad(g[i], theta, retain_graph=True)[0] for i in range(16)]
        return torch.stack(rows)

    close(hvp(_flat_mlp), hvp(fn))
    full = hessian(fn)
    close(hessian(_flat_mlp), full)
    close(full, full.t())  # a Hessian is symmetric
    reference = torch.autograd.functional.hessian(lambda t: _flat_mlp(t, x), theta.detach())
    close(reference, full)


@pytest.mark.parametrize("mode", MODES)
def test_third_order_gradient(mode: str) -> None:
    torch.manual_seed(4)

    def f(x: torch.Tensor) -> torch.Tensor:
        return (torch.sin(x) * torch.exp(0.3 * x) + x.pow(3)).sum()

    fn = compiled(f, mode)
    x = torch.randn(7, requires_grad=True)

    def third(g: Callable[..., torch.Tensor]) -> list[torch.Tensor]:
        (d1,) = torch.autograd.grad(g(x), x, create_graph=True)
        (d2,) = torch.autograd.grad(d1.sum(), x, create_graph=True)
        (d3,) = torch.autograd.grad(d2.sum(), x, create_graph=True)
        return [d1, d2, d3]

    for a, b in zip(third(f), third(fn)):
        close(a, b)


@pytest.mark.parametrize("mode", MODES)
def test_unused_gradients_stay_none(mode: str) -> None:
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x * x).sum() + (w * 3).sum()

    fn = compiled(f, mode)
    x, w = torch.randn(4, requires_grad=True), torch.randn(4, requires_grad=True)

    def run(g: Callable[..., torch.Tensor]) -> tuple[Any, ...]:
        gx, gw = torch.autograd.grad(g(x, w), (x, w), create_graph=True)
        return torch.autograd.grad(gx.sum() + gw.sum(), (x, w), allow_unused=True)

    for a, b in zip(run(f), run(fn)):
        close(a, b)


@pytest.mark.parametrize("mode", ("trace", "default"))
def test_input_mutation_and_aliased_output(mode: str) -> None:
    def f(x: torch.Tensor, w: torch.Tensor, steps: torch.Tensor) -> Any:
        steps.add_(1)
        y = torch.tanh(x @ w)
        return (y * y).sum(), y.view(-1)

    fn = compiled(f, mode)
    torch.manual_seed(5)
    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(4, 2, requires_grad=True)

    def run(g: Callable[..., Any]) -> list[Any]:
        steps = torch.zeros(())
        loss, flat = g(x, w, steps)
        gx, gw = torch.autograd.grad(loss + flat.sum(), (x, w), create_graph=True)
        second = torch.autograd.grad((gx.pow(2).sum() + gw.pow(2).sum()), (x, w))
        return [steps, flat.detach(), gx, gw, *second]

    for a, b in zip(run(f), run(fn)):
        close(a, b)


@pytest.mark.parametrize("mode", ("trace", "default"))
def test_random_ops_are_replayed(mode: str) -> None:
    """Dropout's mask is recomputed from the generator state of the call: the same numbers, and
    the user's random stream is left as eager leaves it."""

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = F.dropout(torch.tanh(x @ w), 0.5, training=True)
        return (h * h).sum() + torch.rand(()) * 0  # a second draw after the dropout

    fn = compiled(f, mode)
    x, w = torch.randn(4, 3, requires_grad=True), torch.randn(3, 5, requires_grad=True)

    def run(g: Callable[..., torch.Tensor]) -> list[torch.Tensor]:
        torch.manual_seed(11)
        gx, gw = torch.autograd.grad(g(x, w), (x, w), create_graph=True)
        second = torch.autograd.grad(gx.pow(2).sum() + gw.sum(), (x, w))
        return [gx, gw, *second, torch.rand(3)]  # the stream after: as eager's

    for a, b in zip(run(f), run(fn)):
        close(a, b)


def test_input_modified_after_the_call_is_refused() -> None:
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x * w).sum()

    fn = aotc.compile(f, capture="trace")
    x, w = torch.randn(4, requires_grad=True), torch.randn(4)
    out = fn(x, w)
    w.mul_(2)
    with pytest.raises(RuntimeError, match="modified"):
        torch.autograd.grad(out, x, create_graph=True)
    # Eager refuses this program too (sigmoid's input x * w saved w through mul).
    out = f(x, w)
    w.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(out, x, create_graph=True)


@pytest.mark.parametrize("mode", ("trace", "default"))
def test_retain_graph_semantics(mode: str) -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x).sum()

    fn = compiled(f, mode)
    x = torch.randn(3, requires_grad=True)
    for g in (f, fn):
        out = g(x)
        torch.autograd.grad(out, x, retain_graph=True)
        (d1,) = torch.autograd.grad(out, x, create_graph=True)
        close(torch.autograd.grad(d1.sum(), x)[0], torch.exp(x).detach())
        out = g(x)
        torch.autograd.grad(out, x)
        with pytest.raises(RuntimeError, match="second time"):
            torch.autograd.grad(out, x, create_graph=True)


def test_graph_args_are_released_after_backward() -> None:
    """The node keeps its graph args only as long as autograd keeps its saved values."""

    def f(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.relu(h @ w)

    fn = aotc.compile(f, capture="trace")
    x, w = torch.randn(4, 3, requires_grad=True), torch.randn(3, 3, requires_grad=True)
    h = x * 2
    ref = weakref.ref(h)
    out = fn(h, w)
    del h
    out.sum().backward()
    gc.collect()
    assert ref() is None  # `out` (and its graph) are alive, the intermediate input is not
    assert out.grad_fn is not None


def test_double_backward_after_a_cache_hit(tmp_path: Any) -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return (torch.cos(x) * x).sum()

    x = torch.randn(6, requires_grad=True)
    first = aotc.compile(f, capture="trace", cache_dir=str(tmp_path))
    first(x)
    second = aotc.compile(f, capture="trace", cache_dir=str(tmp_path))
    (d1,) = torch.autograd.grad(second(x), x, create_graph=True)
    assert second.records[0].is_cache_hit
    (d2,) = torch.autograd.grad(d1.sum(), x)
    (e1,) = torch.autograd.grad(f(x), x, create_graph=True)
    (e2,) = torch.autograd.grad(e1.sum(), x)
    close(e1, d1)
    close(e2, d2)


def test_dynamic_shapes_double_backward() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return (torch.tanh(x) ** 2).mean()

    fn = aotc.compile(f, capture="trace", dynamic=True)
    for n in (4, 7):
        x = torch.randn(n, 3, requires_grad=True)
        (d1,) = torch.autograd.grad(fn(x), x, create_graph=True)
        (d2,) = torch.autograd.grad(d1.pow(2).sum(), x)
        (e1,) = torch.autograd.grad(f(x), x, create_graph=True)
        (e2,) = torch.autograd.grad(e1.pow(2).sum(), x)
        close(e1, d1)
        close(e2, d2)


@pytest.mark.parametrize("mode", ("trace", "default"))
def test_no_reference_cycle_through_a_mutated_input(mode: str) -> None:
    """The entry writes into `h`, so `h`'s history holds the node: the node must not hold `h`
    (a cycle through C++ that Python's collector cannot free), even without a backward."""

    def f(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h.mul_(2)
        return (h * w).sum()

    fn = compiled(f, mode)
    x, w = torch.randn(8, requires_grad=True), torch.randn(8, requires_grad=True)
    refs = []
    for _ in range(2):
        h = x * 1
        out = fn(h, w)
        refs.append(weakref.ref(h))
        del h, out
    gc.collect()
    assert all(r() is None for r in refs)


def test_recomputed_input_modified_after_the_call_is_refused_by_name(monkeypatch) -> None:
    """`b` is not saved (tanh saves its output), but the compiled pair's differentiable backward
    recomputes from it: modified after the call, the double backward refuses, naming it (eager,
    which needs only tanh's output, would run; a documented limit, never a silent difference).
    An entry whose backward eager's autograd records runs it as eager does."""

    def f(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x + b).sum()

    natural = aotc.compile(f, capture="trace", cache=False)
    x, b = torch.randn(4, requires_grad=True), torch.randn(4)
    natural(x, b)
    out = natural(x, b)
    assert aotc.inspect(natural)[0].program.plan.eager_autograd
    want = f(x, b)
    b.add_(1)
    (d1,) = torch.autograd.grad(out, x, create_graph=True)
    (e1,) = torch.autograd.grad(want, x, create_graph=True)
    close(e1, d1)

    from aotc import pipeline

    monkeypatch.setattr(pipeline, "_eager_autograd", lambda plan, *args: plan)
    fn = aotc.compile(f, capture="trace", cache=False)
    x, b = torch.randn(4, requires_grad=True), torch.randn(4)
    out = fn(x, b)
    b.add_(1)
    with pytest.raises(aotc.UnsupportedError, match="input 'b' was modified"):
        torch.autograd.grad(out, x, create_graph=True)
    out = fn(x, b)  # unchanged since the call: runs
    (d1,) = torch.autograd.grad(out, x, create_graph=True)
    (e1,) = torch.autograd.grad(f(x, b), x, create_graph=True)
    close(e1, d1)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("mode", ("trace", "default"))
def test_backward_create_graph_on_a_module_and_autograd_functional(mode: str) -> None:
    """`loss.backward(create_graph=True)` accumulates differentiable .grads (a gradient-norm
    penalty on the parameters); torch.autograd.functional.hessian/hvp over a compiled function."""
    torch.manual_seed(6)
    eager = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    ours = copy.deepcopy(eager)
    run = compiled(ours, mode)
    x = torch.randn(2, 3)

    def penalty(module: torch.nn.Module, call: Any) -> list[Any]:
        call(x).sum().backward(create_graph=True)
        grads = [p.grad for p in module.parameters()]
        total = sum((g**2).sum() for g in grads)
        return [*grads, *torch.autograd.grad(total, list(module.parameters()), allow_unused=True)]

    for a, b in zip(penalty(eager, eager), penalty(ours, run)):
        close(a, b)

    def f(v: torch.Tensor) -> torch.Tensor:
        return (v.sin() * v.cos().exp()).sum()

    fn = compiled(f, mode)
    v = torch.randn(5)
    hess = torch.autograd.functional.hessian
    close(hess(f, v), hess(fn, v))
    hvp = torch.autograd.functional.hvp
    for a, b in zip(hvp(f, v, torch.ones(5)), hvp(fn, v, torch.ones(5))):
        close(a, b)


def test_triton_backend_double_backward() -> None:
    """The differentiable backward compiles with the entry's backend (Triton's interpreter on
    CPU)."""

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (torch.tanh(x @ w) * torch.sigmoid(x @ w)).sum()

    fn = aotc.compile(f, capture="trace", backend="triton")
    x, w = torch.randn(4, 3, requires_grad=True), torch.randn(3, 5, requires_grad=True)

    def run(g: Callable[..., torch.Tensor]) -> list[torch.Tensor]:
        gx, gw = torch.autograd.grad(g(x, w), (x, w), create_graph=True)
        return [gx, gw, *torch.autograd.grad(gx.pow(2).sum() + gw.norm(), (x, w))]

    for a, b in zip(run(f), run(fn)):
        close(a, b)


class _OnceScaled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * 2 * x


def _once_then_more(x, y):
    return _OnceScaled.apply(x).sin().sum() + (x.pow(3) + y.exp()).sum()


def _second_order(fn, how, seed):
    """What a second derivative through `fn` gives: (values, None-ness) or eager's error text."""
    torch.manual_seed(seed)
    x, y = torch.randn(5, requires_grad=True), torch.randn(5, requires_grad=True)
    gx, gy = torch.autograd.grad(fn(x, y), (x, y), create_graph=True)
    try:
        if how == "backward of gx":
            gx.sum().backward()
            return x.grad, y.grad
        if how == "backward of gy":  # no path through the once-differentiable backward
            gy.sum().backward()
            return x.grad, y.grad
        if how == "grad of gx towards x":  # the error node leads elsewhere: eager computes
            return torch.autograd.grad(gx.sum(), (x, y), allow_unused=True)
        return torch.autograd.grad(gx.sum(), y)  # unused, without allow_unused
    except RuntimeError as e:
        return str(e).split("\n")[0]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "how", ["backward of gx", "backward of gy", "grad of gx towards x", "grad of gx towards y"]
)
def test_once_differentiable_backward_is_refused_where_eager_refuses_it(mode, how):
    """A `@once_differentiable` backward inside the program: eager's error exactly where eager
    raises it (a backward reaching its results), the other second derivatives as eager's (Note
    [Once-differentiable backwards] in aotc/oncediff.py); aotc returned a second derivative
    through it."""
    fn = compiled(_once_then_more, mode)
    for seed in range(2):
        want, got = _second_order(_once_then_more, how, seed), _second_order(fn, how, seed)
        if isinstance(want, str):
            assert got == want
        else:
            assert not isinstance(got, str), got
            for g, w in zip(got, want, strict=True):
                close(g, w, tol=1e-6)
    if how == "backward of gx":
        assert "once_differentiable" in _second_order(_once_then_more, how, 0)
