"""Partition soundness: the backward reads only saved values and tangents, forward then backward
equals the joint graph, random ops stay in the forward, saved bytes are reported."""

from __future__ import annotations

import pytest
import torch

import aotc
from aotc.passes.descriptors import SavedInput, TangentInput


def _compile(fn, *args, **options):
    compiled = aotc.compile(fn, check_invariants=True, **options)
    out = compiled(*args)
    (record,) = aotc.inspect(compiled)
    return record, out


def test_backward_reads_only_saved_and_tangents():
    def f(x, w):
        return torch.nn.functional.gelu(x @ w).sum()

    record, _ = _compile(f, torch.randn(7, 5), torch.randn(5, 3, requires_grad=True))
    part = record.partition
    assert all(isinstance(d, SavedInput | TangentInput) for d in part.backward.inputs)
    names = {n.name for n in part.backward.placeholders()}
    for node in part.backward.module.graph.nodes:
        for inp in node.all_input_nodes:
            assert inp.op != "placeholder" or inp.name in names


def test_forward_then_backward_equals_joint():
    def f(x, w):
        return (x.sin() @ w).tanh()

    x, w = torch.randn(6, 4, requires_grad=True), torch.randn(4, 3, requires_grad=True)
    record, _ = _compile(f, x, w)
    tangent = torch.randn(6, 3)
    joint_out = record.joint(x.detach(), w.detach(), tangent)
    fwd = record.forward(x.detach(), w.detach())
    n_fwd = 1
    grads = record.backward(*fwd[n_fwd:], tangent)
    torch.testing.assert_close(fwd[0], joint_out[0])
    torch.testing.assert_close(grads[0], joint_out[1])
    torch.testing.assert_close(grads[1], joint_out[2])


def test_random_ops_run_once_in_forward():
    def f(x):
        return torch.nn.functional.dropout(x, 0.3, training=True).sum()

    record, _ = _compile(f, torch.randn(10, requires_grad=True))
    from aotc.passes.partition import is_random

    fwd_nodes = record.partition.forward.module.graph.nodes
    assert any(is_random(n) for n in fwd_nodes)
    assert not any(is_random(n) for n in record.partition.backward.module.graph.nodes)


def test_saved_values_report():
    def f(x, w):
        return (x @ w).relu().sum()

    record, _ = _compile(f, torch.randn(8, 4), torch.randn(4, 2, requires_grad=True))
    part = record.partition
    assert part.saved_bytes == sum(s.nbytes for s in part.saved) > 0
    text = part.format()
    assert "# stage: partition" in text and "saved" in text
    for s in part.saved:
        assert s.name in text


_lib = torch.library.Library("aotc_test_seeded", "DEF")  # noqa: TOR901
_seeded = (torch.Tag.nondeterministic_seeded,)
_lib.define("attn(Tensor x) -> Tensor", tags=_seeded)
_lib.define(
    "attn_backward(Tensor grad, Tensor x, Tensor philox_seed, Tensor philox_offset) -> Tensor",
    tags=_seeded,
)


def _attn(x: torch.Tensor) -> torch.Tensor:
    return x * x.sigmoid()


def _attn_backward(
    grad: torch.Tensor, x: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor
) -> torch.Tensor:
    s = x.sigmoid()
    return grad * (s + x * s * (1 - s))


for _key in ("CPU", "Meta"):
    _lib.impl("attn", _attn, _key)
    _lib.impl("attn_backward", _attn_backward, _key)


def _attn_setup(ctx, inputs, output):  # type: ignore[no-untyped-def]
    ctx.save_for_backward(inputs[0])


def _attn_grad(ctx, grad):  # type: ignore[no-untyped-def]
    seed = torch.zeros((), dtype=torch.int64)
    return torch.ops.aotc_test_seeded.attn_backward(grad, ctx.saved_tensors[0], seed, seed)


torch.library.register_autograd("aotc_test_seeded::attn", _attn_grad, setup_context=_attn_setup)


@pytest.mark.parametrize("capture", ["dynamo", "trace"])
def test_random_backward_op_runs_in_backward(capture):
    """A backward op tagged nondeterministic_seeded that is handed the forward's seed (CUDA's
    efficient and cuDNN attention backwards) reads a tangent: it runs in the backward, and the
    forward takes the graph args alone (it once pulled the op and the tangent into the forward,
    and the strict trace refused it as a backward draw)."""

    def f(x, w):
        return torch.ops.aotc_test_seeded.attn(x @ w).sum(0)

    x, w = torch.randn(5, 4), torch.randn(4, 3, requires_grad=True)
    record, out = _compile(f, x, w, capture=capture)
    part = record.partition
    assert len(part.forward.placeholders()) == 2
    assert not any(
        n.target is torch.ops.aotc_test_seeded.attn_backward.default
        for n in part.forward.module.graph.nodes
    )
    assert any(
        n.target is torch.ops.aotc_test_seeded.attn_backward.default
        for n in part.backward.module.graph.nodes
    )
    out.backward(torch.ones(3))
    w2 = w.detach().clone().requires_grad_()
    f(x, w2).backward(torch.ones(3))
    torch.testing.assert_close(w.grad, w2.grad)
