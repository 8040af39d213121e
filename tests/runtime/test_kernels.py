"""The kernel runtime: cache reuse across signatures, logged ATen fallback, buffer reuse."""

from __future__ import annotations

import logging

import pytest
import torch

import aotc
import runtime.kernels as rk
from passes import codegen
from tests.conftest import assert_matches_eager


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


def test_codegen_failure_falls_back_to_aten(monkeypatch: pytest.MonkeyPatch,
                                            caplog: pytest.LogCaptureFixture) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise codegen.CodegenError("no template")

    monkeypatch.setattr("passes.kernelize.generate_kernel", broken)
    with caplog.at_level(logging.WARNING, logger="aotc.kernels"):
        compiled = assert_matches_eager(lambda x: x.exp() + 1, lambda: torch.randn(4, 3),
                                        backward=False, backend="triton")
    assert "could not generate a kernel" in caplog.text
    assert [len(r.kernels) for r in aotc.inspect(compiled)] == [0]


def test_launch_failure_falls_back_to_aten(monkeypatch: pytest.MonkeyPatch,
                                           caplog: pytest.LogCaptureFixture) -> None:
    def broken(kernel: object, args: object) -> None:
        raise RuntimeError("launch failed")

    monkeypatch.setattr(rk, "launch", broken)
    with caplog.at_level(logging.WARNING, logger="aotc.kernels"):
        assert_matches_eager(lambda x: (x * 1.5).cos().sum(-1), lambda: torch.randn(4, 9),
                             backward=False, backend="triton")
    assert "running its ops as ATen calls" in caplog.text
    rk._FAILED.clear()


def test_intermediate_buffers_share_storage() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        # four reductions in a row: their intermediates have disjoint lifetimes
        a = (x.sin().sum(0) + 1).exp()
        b = (a.cos() * x).sum(0)
        c = (b.sin() * x).sum(0)
        return (c.exp() * x).sum(0)

    compiled = assert_matches_eager(fn, lambda: torch.randn(6, 5), backward=False,
                                    backend="triton")
    assert [len(r.kernels) for r in aotc.inspect(compiled)][0] >= 2


def test_candidate_configs_interpreter_picks_one() -> None:
    k = rk.KernelSource("k", "", True, (), (), 10, 300, 512, "cpu", 0, 0)
    assert len(rk.candidate_configs(k, on_cuda=False)) == 1
    assert len(rk.candidate_configs(k, on_cuda=True)) > 1
