"""Threads: concurrent first calls compile once; every thread gets eager's results."""

from __future__ import annotations

import threading

import torch

import aotc

THREADS = 8


def step(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return ((x @ w1).tanh() @ w2).pow(2).mean()


def run_threads(target, n: int = THREADS) -> list[object]:
    barrier = threading.Barrier(n)
    results: list[object] = [None] * n
    errors: list[BaseException] = []

    def body(i: int) -> None:
        try:
            barrier.wait()
            results[i] = target(i)
        except BaseException as e:  # noqa: BLE001 reported below with the thread's traceback
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    if errors:
        raise errors[0]
    return results


def inputs(i: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(i)
    return (
        torch.randn(9, 7, generator=g),
        torch.randn(7, 5, generator=g).requires_grad_(),
        torch.randn(5, 3, generator=g).requires_grad_(),
    )


def check(compiled, i: int) -> None:
    args = inputs(i)
    ref = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
    for _ in range(3):
        loss = compiled(*args)
        loss.backward()
        want = step(*ref)
        want.backward()
        torch.testing.assert_close(loss, want)
        for a, r in zip(args[1:], ref[1:]):
            torch.testing.assert_close(a.grad, r.grad)


def test_first_call_from_eight_threads_compiles_once():
    compiled = aotc.compile(step)
    run_threads(lambda i: check(compiled, i))
    assert len(aotc.inspect(compiled)) == 1


def test_different_functions_compile_concurrently():
    def other(x, w1, w2):
        return (x @ w1).sigmoid().sum() + w2.sum()

    def other_ref(i):
        args = inputs(i)
        got = compiled_b(*args)
        torch.testing.assert_close(got, other(*args))

    compiled_a, compiled_b = aotc.compile(step), aotc.compile(other)
    run_threads(lambda i: check(compiled_a, i) if i % 2 else other_ref(i))
    # One signature each. Dynamo may compile a frame again when another thread was compiling
    # while its guards ran ("Unexpected recompilation", with any backend); those repeats are
    # the same graph, served from aotc's cache.
    for compiled in (compiled_a, compiled_b):
        records = aotc.inspect(compiled)
        assert len({r.signature for r in records}) == 1
        assert all("trace" not in r.stage_seconds for r in records[1:])


def test_module_from_threads_under_no_grad_and_grad():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 6), torch.nn.GELU(), torch.nn.Linear(6, 2))
    compiled = aotc.compile(model)
    # Eager references first: eager use of the module while it compiles would read the fake
    # parameters the trace swaps in (see Note [Lifted reads and swaps across threads]).
    want = [model(inputs(i)[0]) for i in range(THREADS)]

    def body(i: int) -> None:
        with torch.no_grad() if i % 2 else torch.enable_grad():
            got = compiled(inputs(i)[0])
        torch.testing.assert_close(got, want[i])
        assert got.requires_grad == (i % 2 == 0)

    run_threads(body)
    records = aotc.inspect(compiled)  # one grad-enabled, one no_grad signature (see above)
    assert len({(r.signature, r.training) for r in records}) == 2


class Counter(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.lin = torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps.add_(1)
        return self.lin(x).relu()


def test_concurrent_calls_keep_every_buffer_update():
    """8 threads x 5 calls of a module that counts its calls: eager ends at 40, and so must aotc
    (issue #13: updates were lost). Entries that mutate nothing take no lock."""
    module = Counter()
    compiled = aotc.compile(module, capture="trace")
    compiled(torch.randn(4, 32))  # compile once
    module.steps.zero_()

    def five_calls(i: int) -> None:
        for _ in range(5):
            compiled(torch.randn(4, 32))

    run_threads(five_calls)
    assert int(module.steps) == THREADS * 5
    (entry,) = compiled._compiled._dispatch.entries
    from aotc.runtime.wrappers import MUTATION_LOCK

    # The general path takes the lock, or the generated call of a replaying entry holds it
    # around its buffer writes (Note [Generated buffer writes] in runtime/fastpath.py).
    generated = getattr(entry.call, "aotc_hit_body", None)
    assert entry.call == entry._call_locked or generated[1]["lock"] is MUTATION_LOCK
    pure = aotc.compile(step, capture="trace")
    pure(*inputs(0))
    (pure_entry,) = pure._dispatch.entries
    assert pure_entry.call != pure_entry._call_locked
