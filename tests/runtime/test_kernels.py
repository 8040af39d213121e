"""The kernel runtime: cache reuse across signatures, logged ATen fallback, buffer reuse."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import aotc
import aotc.runtime.kernels as rk
from aotc.passes import codegen
from aotc.passes.kernelize import lower_graph
from tests.conftest import assert_matches_eager
from tests.triton_helpers import needs_interpreter

pytestmark = needs_interpreter


def test_kernel_cache_reused_across_signatures() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return (x * 3).sin()

    first = aotc.compile(f, backend="triton")
    first(torch.randn(5, 7))
    n = len(rk._KERNELS)
    second = aotc.compile(f, backend="triton")  # a separate compile: same source, same kernel
    torch.testing.assert_close(second(x := torch.randn(5, 7)), f(x))
    assert aotc.inspect(first)[0].kernels[0].key == aotc.inspect(second)[0].kernels[0].key
    assert len(rk._KERNELS) == n


def test_codegen_failure_falls_back_to_aten(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise codegen.CodegenError("no template")

    monkeypatch.setattr("aotc.passes.kernelize.generate_kernel", broken)
    with caplog.at_level(logging.WARNING, logger="aotc.kernels"):
        compiled = assert_matches_eager(
            lambda x: x.exp() + 1, lambda: torch.randn(4, 3), backward=False, backend="triton"
        )
    assert "could not generate a kernel" in caplog.text
    assert [len(r.kernels) for r in aotc.inspect(compiled)] == [0]


def test_launch_failure_falls_back_to_aten(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(kernel: object, args: object) -> None:
        raise RuntimeError("launch failed")

    monkeypatch.setattr(rk, "launch", broken)
    with caplog.at_level(logging.WARNING, logger="aotc.kernels"):
        assert_matches_eager(
            lambda x: (x * 1.5).cos().sum(-1),
            lambda: torch.randn(4, 9),
            backward=False,
            backend="triton",
        )
    assert "running its ops as ATen calls" in caplog.text
    rk._FAILED.clear()


def test_intermediate_buffers_share_storage() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        # each reduction reads the previous result along its reduced dim, so none can share a
        # kernel; a, b, c have the same layout and a's lifetime ends before c's starts
        a = x.sin().sum(1).tanh()
        b = (a[:, None] * x).sum(0).tanh()
        c = (b[:, None] * x).sum(0).tanh()
        return (c[:, None] * x).sum(0)

    assert_matches_eager(fn, lambda: torch.randn(6, 6), backward=False, backend="triton")
    graph = make_fx(fn)(torch.randn(6, 6))
    compiled = lower_graph(graph, interpret=True)
    pooled = [
        s
        for step in compiled.steps
        if isinstance(step, rk.KernelStep)
        for s in step.outputs
        if s.slot is not None
    ]
    assert len(pooled) >= 3 and compiled.num_slots < len(pooled)
    x = torch.randn(6, 6)
    torch.testing.assert_close(compiled.callable(x)[0], fn(x))


def test_candidate_configs_interpreter_picks_one() -> None:
    k = rk.KernelSource("k", "", True, (), (), 10, 300, 512, "cpu", 0, 0)
    assert len(rk.candidate_configs(k, on_cuda=False)) == 1
    assert len(rk.candidate_configs(k, on_cuda=True)) > 1
