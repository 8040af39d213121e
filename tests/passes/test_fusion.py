"""Fusion patterns on CPU through Triton's interpreter, against eager on fresh random inputs,
with structural assertions on the number of generated kernels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from aotc.passes.codegen import PERSISTENT_RNUMEL
from tests.conftest import assert_matches_eager
from tests.triton_helpers import DEVICES, assert_closer, needs_interpreter, num_kernels


def chain10(x: torch.Tensor) -> torch.Tensor:
    y = x * 2.0
    y = y + 1.0
    y = y.sin()
    y = y * y
    y = y - 0.5
    y = y.exp()
    y = y.sqrt()
    y = y.neg()
    y = y.tanh()
    return y.relu() + x


@pytest.mark.parametrize("device", DEVICES)
def test_pointwise_chain_is_one_kernel(device: str) -> None:
    compiled = assert_matches_eager(
        chain10, lambda: torch.randn(37, 11, device=device), backward=False, backend="triton"
    )
    assert num_kernels(compiled) == [1]


@pytest.mark.parametrize("device", DEVICES)
def test_softmax_forward_is_one_kernel(device: str) -> None:
    compiled = assert_matches_eager(
        lambda x: torch.softmax(x, -1),
        lambda: torch.randn(6, 37, device=device),
        backward=False,
        backend="triton",
    )
    assert num_kernels(compiled) == [1]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(5, 3, 37), (1, 1, 1), (7, 1), (0, 5), (3, 2500), (2, 4200)])
def test_softmax_fwd_bwd(device: str, shape: tuple[int, ...]) -> None:
    assert_matches_eager(
        lambda x: torch.softmax(x, -1),
        lambda: torch.randn(*shape, device=device, requires_grad=True),
        backend="triton",
    )


@pytest.mark.parametrize("device", DEVICES)
def test_log_softmax_and_cross_entropy(device: str) -> None:
    assert_matches_eager(
        lambda x, t: F.cross_entropy(x, t),
        lambda: (
            torch.randn(9, 13, device=device, requires_grad=True),
            torch.randint(0, 13, (9,), device=device),
        ),
        backend="triton",
    )


@pytest.mark.parametrize("device", DEVICES)
def test_layer_norm_fwd_bwd(device: str) -> None:
    compiled = assert_matches_eager(
        lambda x, w, b: F.layer_norm(x, (24,), w, b),
        lambda: (
            torch.randn(3, 5, 24, device=device, requires_grad=True),
            torch.randn(24, device=device, requires_grad=True),
            torch.randn(24, device=device, requires_grad=True),
        ),
        backend="triton",
    )
    assert num_kernels(compiled)[0] >= 1


@pytest.mark.parametrize("device", DEVICES)
def test_rms_norm_fwd_bwd(device: str) -> None:
    def rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    assert_matches_eager(
        rms_norm,
        lambda: (
            torch.randn(7, 19, device=device, requires_grad=True),
            torch.randn(19, device=device, requires_grad=True),
        ),
        backend="triton",
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["sum0", "sum1", "mean", "amax", "var", "sum_all"])
def test_reductions_fwd_bwd(device: str, op: str) -> None:
    fns = {
        "sum0": lambda x: (x * x).sum(0),
        "sum1": lambda x: x.exp().sum(1, keepdim=True),
        "mean": lambda x: x.mean(-1),
        "amax": lambda x: x.amax(-1) * 2,
        "var": lambda x: x.var(-1),
        "sum_all": lambda x: x.sin().sum(),
    }
    assert_matches_eager(
        fns[op], lambda: torch.randn(13, 29, device=device, requires_grad=True), backend="triton"
    )


@pytest.mark.parametrize("device", DEVICES)
def test_looped_reduction(device: str) -> None:
    compiled = assert_matches_eager(
        lambda x: torch.softmax(x, -1),
        lambda: torch.randn(3, PERSISTENT_RNUMEL + 52, device=device),
        backward=False,
        backend="triton",
    )
    src = "\n".join(k.source for rec in __import__("aotc").inspect(compiled) for k in rec.kernels)
    assert "(looped)" in src


@pytest.mark.parametrize("device", DEVICES)
def test_noncontiguous_and_broadcast_inputs(device: str) -> None:
    def fn(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return (x.t() * y + z).sigmoid().sum(-1)

    assert_matches_eager(
        fn,
        lambda: (
            torch.randn(11, 6, device=device, requires_grad=True),
            torch.randn(6, 1, device=device, requires_grad=True),
            torch.randn(11, device=device)[::2].clone()[:1].expand(11) * 0 + 1,
        ),
        backend="triton",
    )


@pytest.mark.parametrize("device", DEVICES)
def test_views_slices_reshapes(device: str) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        a, b = x.split(3, dim=1)
        y = (a * b).reshape(3, 5).t()
        return y.unsqueeze(0).expand(2, 5, 3).sum(-1) + x[1:4, 2:3].sum()

    assert_matches_eager(
        fn, lambda: torch.randn(10, 6, device=device)[::2].requires_grad_(), backend="triton"
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_softmax_and_layer_norm(device: str, dtype: torch.dtype) -> None:
    x = torch.randn(6, 45, device=device).to(dtype).requires_grad_()
    assert_closer(lambda x: torch.softmax(x * 3, -1), [x])
    w = torch.randn(45, device=device).to(dtype).requires_grad_()
    assert_closer(lambda x, w: F.layer_norm(x, (45,), w), [x, w])
    assert_closer(chain10, [x.detach()])


@needs_interpreter
def test_horizontal_fusion_of_independent_loops() -> None:
    compiled = assert_matches_eager(
        lambda x, y: (x.sin() + 1, y.cos() * 2),
        lambda: (torch.randn(8, 9), torch.randn(72)),
        backward=False,
        backend="triton",
    )
    assert num_kernels(compiled) == [1]


@pytest.mark.parametrize("device", DEVICES)
def test_transposed_read_tiles_2d(device: str) -> None:
    compiled = assert_matches_eager(
        lambda x, y: x.t().sin() + y,
        lambda: (torch.randn(37, 19, device=device), torch.randn(19, 37, device=device)),
        backward=False,
        backend="triton",
    )
    [kernel] = __import__("aotc").inspect(compiled)[0].kernels
    assert kernel.tiled and "2-D tiles" in kernel.source


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cols", [7, 2100, 4200])
def test_amax_propagates_nan(device: str, cols: int) -> None:
    def make() -> torch.Tensor:
        x = torch.randn(3, cols, device=device)
        x[1, cols // 2] = float("nan")
        return x

    assert_matches_eager(lambda x: (x.amax(-1), x.amin(0)), make, backward=False, backend="triton")


@needs_interpreter
def test_sum_over_empty_dim() -> None:
    assert_matches_eager(
        lambda x, w, b: F.linear(x, w, b),
        lambda: (
            torch.randn(0, 3, requires_grad=True),
            torch.randn(4, 3, requires_grad=True),
            torch.randn(4, requires_grad=True),
        ),
        backend="triton",
    )


@needs_interpreter
def test_random_ops_keep_their_order() -> None:
    """A dropout whose output nothing reads still draws before the randn after it (Note [Random
    ops keep their order] in passes/fusion.py; found by the fuzzer, seed 35448)."""

    def f(a: torch.Tensor) -> torch.Tensor:
        v = torch.where(a > 0, a, -a)
        torch.nn.functional.dropout(v, 0.5, training=True)
        return (v * torch.randn(2, 3, 4, dtype=a.dtype)).sum()

    assert_matches_eager(
        f, lambda: torch.randn(2, 3, 4, dtype=torch.float64), backward=False, backend="triton"
    )
