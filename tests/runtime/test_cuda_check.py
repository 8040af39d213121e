"""Compiling generated kernels for sm_90 and sm_80 without a GPU (runtime/cuda_check.py): the
launch signatures match what a CUDA launch passes, real kernels compile to cubins with resource
figures, a kernel the compiler rejects is reported (and fails the suite's check), and the kernel
module of a CUDA kernel is a compiler function whatever TRITON_INTERPRET says."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import aotc
from aotc.runtime import cuda_check as cc
from aotc.runtime import kernels as rk
from tests.triton_helpers import needs_interpreter

pytestmark = needs_interpreter


def _kernels(fn, *args, **options) -> list[rk.KernelSource]:
    compiled = aotc.compile(fn, backend="triton", **options)
    out = compiled(*args)
    if isinstance(out, torch.Tensor) and out.requires_grad:
        out.sum().backward()
    return [k.for_cuda for rec in aotc.inspect(compiled) for k in rec.kernels]


def test_pointer_types_are_tritons() -> None:
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    for dtype, name in cc._POINTER_TYPES.items():
        t = torch.empty(4, dtype=dtype)
        assert native_specialize_impl(BaseBackend, t, False, True, True)[0] == f"*{name}"


def test_launch_signatures_static_kernel() -> None:
    (kernel,) = _kernels(lambda x: torch.softmax(x.half() * 2, -1), torch.randn(37, 50))
    assert kernel.device == "cuda" and "_round_bf16" not in kernel.source
    launches = cc.launch_signatures(kernel)
    configs = rk.cuda_configs(kernel)
    assert [sig.config for sig in launches if sig.aligned] == configs
    assert all(sig.sizes == (kernel.xnumel, kernel.rnumel) for sig in launches)
    assert [sig.aligned for sig in launches].count(False) == 1
    assert launches[0].pointers == ("fp32", "fp16")  # x in, the fp16 softmax out


def test_launch_signatures_symbolic_kernel() -> None:
    kernels = _kernels(lambda x: (x * 2).sin(), torch.randn(6, 5), dynamic=True)
    (kernel,) = [k for k in kernels if not isinstance(k.xnumel, int)]
    widths = {sig.sizes for sig in cc.launch_signatures(kernel, cc.Target.SM90)}
    assert any(max(s) < 2**31 for s in widths) and any(min(s) >= 2**31 for s in widths)
    assert "do_not_specialize" in kernel.source  # sizes are not value-specialized on CUDA


def test_generated_kernels_compile_for_hopper_and_ampere() -> None:
    def ln(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.layer_norm(x, (x.shape[-1],), w) * 2

    x, w = torch.randn(7, 300, requires_grad=True), torch.randn(300, requires_grad=True)
    kernels = _kernels(ln, x, w)
    results = cc.compile_kernels(kernels, every_config=False)
    assert {(r.kernel, r.target) for r in results} == {
        (k.name, t) for k in kernels for t in cc.DEFAULT_TARGETS
    }
    for r in results:
        assert r.ok, r.format()
        assert r.resources is not None and 0 < r.resources.registers <= 255
        assert r.resources.num_warps == r.launch.config[2]
        assert "xnumel: i32" in r.signature and "*fp32" in r.signature
    table = cc.resources_table(results)
    assert "sm_90" in table and "sm_80" in table and "regs" in table


def test_a_kernel_the_compiler_rejects_is_reported(tmp_path: object) -> None:
    (kernel,) = _kernels(lambda x: x * 3, torch.randn(5, 3))
    # tl.arange needs a power-of-two range: Triton's compiler rejects this, the launch would fail
    bad_source = kernel.source.replace("tl.arange(0, XBLOCK)", "tl.arange(0, XBLOCK - 1)")
    bad = dataclasses.replace(kernel, source=bad_source)
    results = cc.compile_kernels([bad], every_config=False)
    assert results and all(not r.ok for r in results)
    assert "power of 2" in (results[0].error or "") or "arange" in (results[0].error or "")

    from tests.gpu_compile_check import GpuCompileCheck

    class Graph:
        gpu_kernels = (bad,)

    check = GpuCompileCheck(lambda: "tests/runtime/test_cuda_check.py::this")
    check.record(Graph())
    reports, summary = check.finish()
    assert reports and "does not compile for sm_90" in reports[0] and "this" in reports[0]
    assert "failed" in summary
    source = reports[0].rsplit("source: ", 1)[1].strip()
    assert os.path.isfile(source)
    shutil.rmtree(os.path.dirname(source))  # the report's folder is the user's to keep


def test_occupancy_limits() -> None:
    # 255 registers x 64 threads: 16320 registers per 2-warp block -> 4 blocks, 8 of 64 warps
    assert cc.occupancy(cc.Target.SM90, 255, 0, 2) == (0.125, "registers")
    assert cc.occupancy(cc.Target.SM90, 32, 0, 8) == (1.0, "warps")
    occ, limiter = cc.occupancy(cc.Target.SM80, 32, 80 * 1024, 4)
    assert limiter == "shared memory" and occ == pytest.approx(2 * 4 / 64)


def test_cuda_kernel_module_is_compiled_whatever_the_interpreter_switch() -> None:
    """TRITON_INTERPRET=1 in the environment (set before triton is imported) must not turn a
    CUDA kernel into an interpreter function, nor does its absence stop CPU kernels."""
    script = textwrap.dedent(
        """
        import os
        os.environ["TRITON_INTERPRET"] = "1"
        import triton, torch, aotc
        from aotc.runtime import kernels as rk
        from triton.runtime.jit import JITFunction
        from triton.runtime.interpreter import InterpretedFunction
        f = aotc.compile(lambda x: torch.softmax(x * 2, -1), backend="triton", cache=False)
        x = torch.randn(3, 5)
        torch.testing.assert_close(f(x), torch.softmax(x * 2, -1))
        cpu = aotc.inspect(f)[0].kernels[0]
        assert isinstance(rk.load_kernel(cpu), InterpretedFunction)
        assert isinstance(rk.load_kernel(cpu.for_cuda), JITFunction)
        print("ok")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
