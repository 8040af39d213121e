"""Symbolic sizes in the Triton lowering: one `dynamic=True` artifact runs generated kernels for
every batch size / sequence length it admits (CPU: Triton's interpreter). Compared with eager on
outputs and gradients; one compiled record, kernels generated, each kernel source compiled once,
launched at several sizes, and the lowering adds no guard to the ShapeEnv."""

from __future__ import annotations

import importlib.util
import logging

import pytest
import torch
import torch.nn.functional as F

import aotc
import aotc.api
import aotc.runtime.kernels as rk
from examples.gpt_block import Block
from tests.conftest import assert_matches_eager, assert_module_matches_eager
from tests.triton_helpers import needs_interpreter

pytestmark = needs_interpreter


@pytest.fixture
def compiles(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Triton compiles (kernel module loads) per kernel source key, in a fresh kernel cache."""
    counts: dict[str, int] = {}
    real = importlib.util.spec_from_file_location
    monkeypatch.setattr(rk, "_KERNELS", {})

    def spec(name: str, *args: object, **kwargs: object) -> object:
        if name.startswith("aotc_kernel_"):
            key = name.removeprefix("aotc_kernel_")
            counts[key] = counts.get(key, 0) + 1
        return real(name, *args, **kwargs)

    monkeypatch.setattr(rk.importlib.util, "spec_from_file_location", spec)
    return counts


def _check_kernels(
    compiled: object, compiles: dict[str, int], caplog: pytest.LogCaptureFixture
) -> None:
    recs = aotc.inspect(compiled)
    assert len(recs) == 1, "one symbolic record serves every size"
    kernels = list(recs[0].kernels)
    assert len(kernels) > 0
    # symbolic sizes reach the kernels: as size parameters of their indices, or as their
    # (symbolic) xnumel / rnumel
    assert any(
        k.symbols or not isinstance(k.xnumel, int) or not isinstance(k.rnumel, int) for k in kernels
    ), "symbolic sizes are kernel parameters"
    keys = {k.key for k in kernels}
    assert set(compiles) == keys and all(n == 1 for n in compiles.values()), compiles
    # each kernel ran at more than one size (its launches are keyed by the actual sizes)
    launched = {}
    for key, _, x, r in rk._BEST:
        launched.setdefault(key, set()).add((x, r))
    assert any(len(launched.get(k, ())) > 1 for k in keys)
    assert "failed" not in caplog.text and "could not generate" not in caplog.text, caplog.text


def _run(fn, make, sizes, compiles, caplog, **tol):
    compiled = aotc.compile(fn, dynamic=True, backend="triton", check_invariants=True)
    with caplog.at_level(logging.WARNING, logger="aotc.kernels"):
        for size in sizes:
            assert_matches_eager(fn, lambda size=size: make(size), runs=1, compiled=compiled, **tol)
    _check_kernels(compiled, compiles, caplog)
    return compiled


def chain(x, y):
    return ((x * 2).sin() + y).relu().exp() * 0.5 - torch.tanh(x)


def test_pointwise_chain(compiles, caplog):
    _run(
        chain,
        lambda b: (torch.randn(b, 6, requires_grad=True), torch.randn(6, requires_grad=True)),
        [3, 5, 8, 2],
        compiles,
        caplog,
    )


def test_softmax_batch_and_sequence(compiles, caplog):
    """Rows of symbolic length: batch and sequence dims both symbolic."""
    _run(
        lambda x: x.softmax(-1),
        lambda s: (torch.randn(s[0], s[1], s[1] + 1, requires_grad=True),),
        [(2, 3), (3, 5), (4, 2)],
        compiles,
        caplog,
    )


def test_layer_norm(compiles, caplog):
    w, b = torch.randn(12, requires_grad=True), torch.randn(12, requires_grad=True)
    _run(
        lambda x, w, b: F.layer_norm(x, (12,), w, b),
        lambda n: (torch.randn(n, 12, requires_grad=True), w, b),
        [3, 7, 5],
        compiles,
        caplog,
        atol=1e-5,
        rtol=1e-5,
    )


def test_mlp(compiles, caplog):
    w1 = torch.randn(16, 8, requires_grad=True)
    w2 = torch.randn(8, 4, requires_grad=True)

    def mlp(x, w1, w2):
        return (F.gelu(x @ w1).softmax(-1) @ w2).sum(0).mean()

    _run(
        mlp, lambda b: (torch.randn(b, 16, requires_grad=True), w1, w2), [3, 6, 4], compiles, caplog
    )


def test_gpt_block_sequence_lengths(compiles, caplog):
    lengths = iter([3, 5, 7])
    with caplog.at_level(logging.WARNING, logger="aotc.kernels"):
        compiled = assert_module_matches_eager(
            lambda: Block(16, 2, use_sdpa=False),
            lambda: (torch.randn(2, next(lengths), 16),),
            steps=3,
            dynamic=True,
            backend="triton",
            lr=0.0,
        )  # lr=0: every step compares at the initial weights
    _check_kernels(compiled, compiles, caplog)


def test_no_guard_added_by_the_lowering(monkeypatch):
    """The Triton lowering reads SymInts' expressions and never compares them: the guard
    expression of a dynamic compilation is the same as with the ATen backend."""
    seen: list[str | None] = []
    real = aotc.api.guard_expression
    monkeypatch.setattr(
        aotc.api, "guard_expression", lambda m, f: seen.append(real(m, f)) or seen[-1]
    )
    for backend in ("aten", "triton"):
        compiled = aotc.compile(
            lambda x: (x - x.amax(-1, keepdim=True)).exp().sum(0),
            dynamic=True,
            backend=backend,
            capture="trace",  # aotc's own symbolic dispatch (aotc.api.guard_expression)
        )
        compiled(torch.randn(3, 5, requires_grad=True))
    assert len(seen) == 2 and seen[0] == seen[1]


def test_unhandled_size_expression_falls_back_per_kernel(caplog):
    """A view to `s0 // 2` rows (torch's FloorDiv in a size) is not printed as a kernel index:
    that group runs as ATen calls, logged, and results still match for every size."""

    def f(x):
        return (x.view(-1, 2) * 2).sum(-1) + 1

    compiled = aotc.compile(f, dynamic=True, backend="triton")
    with caplog.at_level(logging.WARNING, logger="aotc.kernels"):
        for n in (4, 6, 10):
            assert_matches_eager(
                f, lambda n=n: (torch.randn(n, requires_grad=True),), runs=1, compiled=compiled
            )
    assert len(aotc.inspect(compiled)) == 1
    assert "running its ops as ATen calls" in caplog.text


def test_torch_compile_dynamic_runs_kernels(compiles, caplog):
    import torch._dynamo

    import aotc.backend

    torch._dynamo.reset()

    def f(x, w):
        return F.layer_norm(x @ w, (8,)).softmax(-1)

    before = aotc.backend.stats["ahead"]
    compiled = torch.compile(f, backend="aotc", dynamic=True, options={"backend": "triton"})
    w = torch.randn(4, 8, requires_grad=True)
    with caplog.at_level(logging.WARNING, logger="aotc.kernels"):
        for b in (3, 5, 7):
            assert_matches_eager(
                f, lambda b=b: (torch.randn(b, 4, requires_grad=True), w), runs=1, compiled=compiled
            )
    assert aotc.backend.stats["ahead"] - before == 1
    assert compiles and all(n == 1 for n in compiles.values())
    assert "failed" not in caplog.text and "could not generate" not in caplog.text
