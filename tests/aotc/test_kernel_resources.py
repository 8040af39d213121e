"""Per-kernel registers, spills, shared memory, warps, stages and occupancy on sm_90 and sm_80
(compiled without a GPU, runtime/cuda_check.py) in `aotc explain`, the dump (09_kernels/) and
the AOTC_LOG=kernels log."""

from __future__ import annotations

import logging
import pathlib

import pytest
import torch
import torch.nn.functional as F

import aotc
from aotc.cli import explain_text
from tests.triton_helpers import needs_interpreter

pytestmark = needs_interpreter


def _layernorm_gelu(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.gelu(F.layer_norm(x, (x.shape[-1],), w)).sum(-1)


def _rows(text: str, kernels: list[str]) -> list[str]:
    return [line for line in text.splitlines() if any(line.strip().startswith(k) for k in kernels)]


def _check_table(text: str, kernels: list[str]) -> None:
    assert "regs" in text and "spill st/ld B" in text and "occupancy" in text
    rows = _rows(text, kernels)
    for target in ("sm_90", "sm_80"):
        mine = [r for r in rows if f" {target} " in r]
        assert len(mine) == len(kernels), text  # one row per kernel and target
        assert not any("FAILED" in r for r in mine), text


def test_explain_shows_kernel_resources() -> None:
    compiled = aotc.compile(_layernorm_gelu, backend="triton", cache=False)
    x, w = torch.randn(6, 40, requires_grad=True), torch.randn(40, requires_grad=True)
    compiled(x, w).sum().backward()
    (rec,) = aotc.inspect(compiled)
    text = explain_text([(compiled, rec, None)])
    assert "generated Triton kernels" in text
    _check_table(text, [k.name for k in rec.kernels])


def test_dump_writes_kernel_resources(tmp_path: pathlib.Path) -> None:
    compiled = aotc.compile(
        lambda x: torch.softmax(x * 2, -1), backend="triton", cache=False, dump_dir=str(tmp_path)
    )
    compiled(torch.randn(5, 33))
    (rec,) = aotc.inspect(compiled)
    (table,) = tmp_path.rglob("09_kernels/resources.txt")
    text = table.read_text()
    assert text.startswith("# stage: kernel resources")
    _check_table(text, [k.name for k in rec.kernels])


def test_log_kernels_includes_resources(caplog: pytest.LogCaptureFixture) -> None:
    compiled = aotc.compile(lambda x: (x.sin() * 3).sum(0), backend="triton", cache=False)
    with caplog.at_level(logging.INFO, logger="aotc.kernels"):
        compiled(torch.randn(7, 9))
    (rec,) = aotc.inspect(compiled)
    assert "kernel resources" in caplog.text
    _check_table(caplog.text, [k.name for k in rec.kernels])
