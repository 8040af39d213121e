"""Memory: saved tensors die after backward, compiled functions and their entries are
collectable, and repeated training steps keep the number of live tensors flat."""

from __future__ import annotations

import gc
import weakref

import torch

import aotc


def step(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return ((x @ w1).tanh() @ w2).sin().sum()


def make() -> tuple[torch.Tensor, ...]:
    return (
        torch.randn(16, 8),
        torch.randn(8, 6, requires_grad=True),
        torch.randn(6, 4, requires_grad=True),
    )


def test_saved_tensors_freed_after_backward():
    compiled = aotc.compile(step)
    args = make()
    compiled(*args)  # compile outside the hooks
    saved: list[weakref.ref] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(weakref.ref(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = compiled(*args)
    alive_before = [r for r in saved if r() is not None]
    assert alive_before, "the compiled forward saved nothing"
    loss.backward()
    del loss
    gc.collect()
    # Inputs the backward reads (w1, w2, x) stay alive with their owners; everything else dies.
    inputs = {id(a) for a in args}
    leaked = [r() for r in saved if r() is not None and id(r()) not in inputs]
    assert not leaked, [tuple(t.shape) for t in leaked]


def test_compiled_function_and_entries_are_collectable():
    def fresh():
        def f(x, w):
            return (x @ w).relu().sum()

        return f

    compiled = aotc.compile(fresh(), capture="trace")
    x, w = torch.randn(3, 4), torch.randn(4, 2, requires_grad=True)
    compiled(x, w).backward()
    with torch.no_grad():
        compiled(x, w)
    refs = [weakref.ref(compiled)]
    for record in aotc.inspect(compiled):
        refs += [weakref.ref(record.forward), weakref.ref(record.joint)]
    for e in compiled._dispatch.entries:  # the graph callables and autograd.Function classes
        refs += [weakref.ref(e._fwd)] + ([weakref.ref(e._fn)] if e._fn is not None else [])
    del compiled, record, e
    aotc.cache_flush()  # a queued cache store holds the record until written
    gc.collect()
    alive = [r() for r in refs if r() is not None]
    assert not alive, [type(a).__name__ for a in alive]


def test_default_mode_graphs_are_freed_with_dynamos_cache():
    """In the default capture mode Dynamo's cache entries (on the function's code object) hold
    the compiled graphs, as for torch.compile: they go with `torch._dynamo.reset()`."""
    import torch._dynamo

    def fresh():
        def f(x, w):
            return (x @ w).relu().sum()

        return f

    compiled = aotc.compile(fresh())
    x, w = torch.randn(3, 4), torch.randn(4, 2, requires_grad=True)
    compiled(x, w).backward()
    with torch.no_grad():
        compiled(x, w)
    refs = [weakref.ref(compiled)]
    for record in aotc.inspect(compiled):
        refs += [weakref.ref(record.forward), weakref.ref(record.joint)]
    del compiled, record
    torch._dynamo.reset()
    aotc.cache_flush()  # a queued cache store holds the record until written
    gc.collect()
    alive = [r() for r in refs if r() is not None]
    assert not alive, [type(a).__name__ for a in alive]


def test_compiled_module_is_collectable():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
    compiled = aotc.compile(model)
    compiled(torch.randn(2, 4)).sum().backward()
    refs = [weakref.ref(compiled), weakref.ref(model)]
    del compiled, model
    gc.collect()
    assert all(r() is None for r in refs)


def live_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))


def test_training_steps_do_not_grow_live_tensors():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    compiled = aotc.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 8), torch.randn(32, 4)

    def train(n: int) -> None:
        for _ in range(n):
            opt.zero_grad()
            torch.nn.functional.mse_loss(compiled(x), y).backward()
            opt.step()

    train(10)
    after_10 = live_tensors()
    train(200)
    assert live_tensors() <= after_10


class _LiveDuring(torch.utils._python_dispatch.TorchDispatchMode):
    """Records, at every op, which of `refs` still point at a live tensor."""

    def __init__(self, refs: list[weakref.ref]) -> None:
        super().__init__()
        self.refs, self.seen = refs, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.seen.append((str(func), [r() is not None for r in self.refs]))
        return func(*args, **(kwargs or {}))


def _saved_lifetimes(capture: str, retain: bool) -> list[tuple[str, list[bool]]]:
    compiled = aotc.compile(lambda x: x.sin().exp().tanh().sum(), capture=capture)
    x = torch.randn(256, requires_grad=True)
    compiled(x).backward()
    saved: list[weakref.ref] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t is not x:  # x lives on in the caller either way
            saved.append(weakref.ref(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = compiled(x)
    assert saved, "the compiled forward saved no intermediate"
    mode = _LiveDuring(saved)
    with mode:
        loss.backward(retain_graph=retain)
    assert mode.seen, "the backward ran no op"
    return mode.seen


def test_backward_frees_each_saved_value_at_its_last_use():
    # Note [Boxed backward]: like eager, which frees a node's saved values once that node ran,
    # the compiled backward drops each saved value after the last op reading it, not at its end.
    # The backward's last op, `add_`, accumulates x.grad after the node: look before it.
    for capture in ("trace", "dynamo"):
        seen = [(op, alive) for op, alive in _saved_lifetimes(capture, retain=False)]
        assert seen[-1][0] == "aten.add_.Tensor", seen
        assert all(seen[0][1]), seen  # alive when the backward starts
        assert not any(seen[-2][1]), (capture, seen)  # freed before the node's last op
    # With retain_graph=True the node keeps them (a second backward needs them).
    kept = _saved_lifetimes("trace", retain=True)
    assert all(kept[-2][1]), kept
