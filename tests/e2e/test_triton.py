"""The examples' training steps through generated Triton kernels (interpreter on CPU; CUDA
under `gpu`), against eager."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import aotc
from examples.gpt_block import Block
from examples.mlp import MLP
from tests.conftest import assert_module_matches_eager
from tests.triton_helpers import DEVICES, needs_interpreter


@pytest.mark.parametrize("device", DEVICES)
def test_mlp_training_step(device: str) -> None:
    compiled = assert_module_matches_eager(
        lambda: MLP(37, 16, 5).to(device),
        lambda: (torch.randn(6, 37, device=device),),
        steps=2,
        backend="triton",
    )
    recs = aotc.inspect(compiled)
    assert recs and all(rec.kernels for rec in recs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sdpa", [True, False])
def test_gpt_block_training_step(device: str, sdpa: bool) -> None:
    compiled = assert_module_matches_eager(
        lambda: Block(16, 2, use_sdpa=sdpa).to(device),
        lambda: (torch.randn(2, 5, 16, device=device),),
        steps=2,
        backend="triton",
    )
    assert all(len(rec.kernels) >= 4 for rec in aotc.inspect(compiled))


def test_backend_aten_generates_no_kernels() -> None:
    compiled = aotc.compile(lambda x: x.sin().sum(), backend="aten")
    compiled(torch.randn(3))
    assert [len(r.kernels) for r in aotc.inspect(compiled)] == [0]


def test_backend_auto_uses_aten_on_cpu() -> None:
    compiled = aotc.compile(lambda x: F.gelu(x) * 2, backend="auto")
    compiled(torch.randn(3))
    assert [len(r.kernels) for r in aotc.inspect(compiled)] == [0]


@needs_interpreter
def test_dump_lists_kernels(tmp_path: object) -> None:
    compiled = aotc.compile(
        lambda x: torch.softmax(x, -1), backend="triton", dump_dir=str(tmp_path)
    )
    compiled(torch.randn(3, 4))
    import pathlib

    files = list(pathlib.Path(str(tmp_path)).rglob("09_kernels/*.py"))
    assert len(files) == 1 and "@triton.jit" in files[0].read_text()
    assert "bytes_read=" in files[0].read_text()


@needs_interpreter
def test_gpt_block_with_dropout_training_step() -> None:
    # native_dropout stays an ATen call (same RNG stream as eager); its mask math fuses
    assert_module_matches_eager(
        lambda: Block(16, 2, dropout=0.1, use_sdpa=False),
        lambda: (torch.randn(2, 5, 16),),
        steps=2,
        backend="triton",
    )


@pytest.mark.parametrize("device", DEVICES)
def test_looped_reductions_over_long_rows(device: str, caplog: pytest.LogCaptureFixture) -> None:
    """Rows longer than the persistent limit loop over r in the kernel: softmax and LayerNorm,
    forward and backward, run as generated kernels (no ATen fallback) and match eager."""
    from tests.conftest import assert_matches_eager

    def ln_softmax(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.softmax(F.layer_norm(x, (x.shape[-1],), w, b), dim=-1)

    n = 4200  # > the persistent row limit, not a power of two
    with caplog.at_level("WARNING", logger="aotc.kernels"):
        compiled = assert_matches_eager(
            ln_softmax,
            lambda: (
                torch.randn(3, n, device=device, requires_grad=True),
                torch.randn(n, device=device, requires_grad=True),
                torch.randn(n, device=device, requires_grad=True),
            ),
            rtol=1e-5,
            atol=1e-5,
            backend="triton",
        )
    assert "ATen calls instead" not in caplog.text
    sources = [k.source for rec in aotc.inspect(compiled) for k in rec.kernels]
    assert any("for roffset in range(" in s for s in sources)


@pytest.mark.parametrize(
    "first,interpret",
    [("triton", None), ("torch._dynamo", None), ("triton", "0")],
    ids=["triton-first", "dynamo-first", "interpret-0"],
)
def test_backend_choice_does_not_depend_on_import_order(first: str, interpret: str | None) -> None:
    """In a fresh process, importing triton or torch._dynamo (which imports triton) before aotc,
    with TRITON_INTERPRET unset or 0, still runs CPU graphs as generated kernels (in Triton's
    interpreter), with no warning, matching eager."""
    import os
    import subprocess
    import sys

    script = (
        f"import {first}\n"
        "import logging, torch, aotc\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "def f(x, w):\n"
        "    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w\n"
        "c = aotc.compile(f, backend='triton', cache=False)\n"
        "x, w = torch.randn(4, 33, requires_grad=True), torch.randn(33, requires_grad=True)\n"
        "out = c(x, w)\n"
        "torch.testing.assert_close(out, f(x, w))\n"
        "out.sum().backward()\n"
        "print([len(r.kernels) for r in aotc.inspect(c)])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret is not None:
        env["TRITON_INTERPRET"] = interpret
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    counts = eval(out.stdout.strip().splitlines()[-1])  # noqa: S307 - our own print
    assert counts and all(n >= 1 for n in counts), out.stdout
    assert "interpreter" not in out.stderr and "ATen calls" not in out.stderr, out.stderr


@needs_interpreter
@pytest.mark.parametrize(
    "view",
    [
        lambda t: t.unbind(0)[2],
        lambda t: t.select(0, 2),
        lambda t: t[1:3],
        lambda t: t.unfold(0, 2, 1)[1],
        lambda t: t.split(1)[3],
    ],
    ids=["unbind", "select", "slice", "unfold", "split"],
)
def test_view_outputs_of_intermediates_keep_their_offset(view) -> None:
    """An output that is a view of an intermediate at a storage offset (select/unbind row 2)
    stays an ATen view of the kernel's result, so its values and aliasing are eager's."""
    from tests.conftest import assert_matches_eager

    def fn(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = a * 3
        return view(t), t

    assert_matches_eager(fn, lambda: torch.randn(4, 3, requires_grad=True), backend="triton")
