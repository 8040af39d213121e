"""Helpers for the Triton backend tests: run a function through aotc with backend="triton"
(the interpreter on CPU, CUDA under `gpu`) and compare with eager on fresh random inputs."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import pytest
import torch

import aotc

# CPU kernels run in Triton's interpreter on every machine, CUDA or not, whatever
# TRITON_INTERPRET says (see Note [Interpreter-safe Triton] in passes/codegen.py); the "cuda"
# variants (marker gpu) compile them for the GPU.
needs_interpreter = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton (its interpreter)"
)

DEVICES = [
    pytest.param("cpu", marks=needs_interpreter),
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ],
    ),
]


def num_kernels(compiled: Any) -> list[int]:
    """Generated kernels per compiled signature."""
    return [len(rec.kernels) for rec in aotc.inspect(compiled)]


def assert_closer(fn: Callable[..., Any], args: list[torch.Tensor], **options: Any) -> Any:
    """Low precision: the compiled result is at least about as close to an fp64 reference as
    eager's (forward outputs, and gradients when the inputs require grad)."""
    compiled = aotc.compile(fn, backend="triton", **options)
    ref_args = [a.detach().double().requires_grad_(a.requires_grad) for a in args]
    runs = []
    for call, call_args in (
        (fn, args),
        (compiled, [a.detach().clone().requires_grad_(a.requires_grad) for a in args]),
        (fn, ref_args),
    ):
        out = call(*call_args)
        grads: list[torch.Tensor] = []
        if any(a.requires_grad for a in call_args):
            torch.manual_seed(5)
            cot = torch.randn(out.shape, dtype=torch.float64).to(out.device, out.dtype)
            grads = list(torch.autograd.grad(out, [a for a in call_args if a.requires_grad], cot))
        runs.append([out.detach(), *grads])
    eager, got, ref = runs
    for e, g, r in zip(eager, got, ref, strict=True):
        assert g.dtype == e.dtype and g.shape == e.shape
        err_e = (e.double() - r).abs().max().item() if e.numel() else 0.0
        err_g = (g.double() - r).abs().max().item() if g.numel() else 0.0
        scale = r.abs().max().item() if r.numel() else 0.0
        # "about as close": within 1.5x of eager's error plus one ulp-ish slack of the dtype
        slack = torch.finfo(e.dtype).eps * max(scale, 1.0)
        assert err_g <= 1.5 * err_e + slack, f"compiled err {err_g} vs eager err {err_e}"
    return compiled
