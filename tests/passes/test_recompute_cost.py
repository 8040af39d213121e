"""The backend-aware recompute cost model: with ATen calls the default partition saves no more
than eager and runs no non-free op twice; with Triton fused pointwise chains are recomputed and
values a backward matmul reads are not; a memory budget recomputes cheapest-per-byte first on
either executor; the report prices every recomputed value."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import aotc
from aotc.passes.descriptors import FwdOutput, GradOutput, PrimalInput, TangentInput
from aotc.passes.ir import StageGraph
from aotc.passes.partition import RecomputeReason, partition
from aotc.passes.recompute import CostKind, Executor, executor_for
from aotc.runtime.schema import FwdOut, GraphArg
from tests.conftest import assert_matches_eager


def chain(x):
    for _ in range(3):
        x = x.sin().cos() * 2
    return x.exp().sum()


def ln_gelu(x, w, b, w1, w2):
    return (F.gelu(F.layer_norm(x, (32,), w, b) @ w1) @ w2).sum()


def _ln_args():
    return (
        torch.randn(16, 32, requires_grad=True),
        torch.randn(32, requires_grad=True),
        torch.randn(32, requires_grad=True),
        torch.randn(32, 64, requires_grad=True),
        torch.randn(64, 32, requires_grad=True),
    )


def cross_entropy(logits, target):
    return F.cross_entropy(logits, target)


def attention(x, wq, wk):
    q, k = x @ wq, x @ wk
    att = (q @ k.transpose(-2, -1) * 0.25).masked_fill(torch.ones(8, 8).triu(1).bool(), -1e9)
    return (att.softmax(-1) @ x).tanh().sum()


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x))).mean()


def _programs():
    torch.manual_seed(0)
    module = ConvBN()
    return [
        ("chain", chain, lambda: (torch.randn(9, 7, requires_grad=True),)),
        ("ln_gelu", ln_gelu, _ln_args),
        (
            "cross_entropy",
            cross_entropy,
            lambda: (torch.randn(6, 10, requires_grad=True), torch.randint(0, 10, (6,))),
        ),
        (
            "attention",
            attention,
            lambda: (
                torch.randn(8, 16, requires_grad=True),
                torch.randn(16, 16, requires_grad=True),
                torch.randn(16, 16, requires_grad=True),
            ),
        ),
        ("conv_bn", module, lambda: (torch.randn(2, 3, 6, 6, requires_grad=True),)),
    ]


def _saved_bytes_seen_by_hooks(fn, args) -> int:
    """Bytes of the distinct storages autograd saves during one step (what stays alive between
    forward and backward), measured the same way for eager and for the compiled function."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    out.backward()
    return sum(storages.values())


@pytest.mark.parametrize("name", [p[0] for p in _programs()])
def test_aten_default_saves_at_most_eager_and_duplicates_no_work(name):
    _, fn, make = next(p for p in _programs() if p[0] == name)
    compiled = aotc.compile(fn, backend="aten", check_invariants=True)
    torch.manual_seed(1)
    eager_bytes = _saved_bytes_seen_by_hooks(fn, make())
    torch.manual_seed(1)
    aotc_bytes = _saved_bytes_seen_by_hooks(compiled, make())
    assert 0 < aotc_bytes <= eager_bytes, (aotc_bytes, eager_bytes)
    part = compiled.records[0].partition
    assert part.executor is Executor.ATEN
    assert part.recompute_seconds == 0.0
    assert len(part.recomputations) == len(part.recomputed)
    for r in part.recomputations:
        assert r.cost.kind is CostKind.FREE and r.reason is RecomputeReason.FREE, r.format()
    # Every op that moves data runs once: the forward and backward graphs hold no more of them
    # than the joint graph.
    joint = compiled.records[0].partitioned_joint.module.graph

    def work(graph):
        return sorted(
            str(n.target)
            for n in graph.nodes
            if n.op == "call_function"
            and isinstance(n.target, torch._ops.OpOverload)
            and not n.target.is_view
        )

    split = work(part.forward.module.graph) + work(part.backward.module.graph)
    for target in set(split):
        assert split.count(target) <= work(joint).count(target), target
    assert_matches_eager(fn, make, backend="aten", runs=1)


def test_triton_recomputes_fused_chains_from_the_input():
    x = torch.randn(37, 29, requires_grad=True)
    compiled = aotc.compile(chain, backend="aten")
    compiled(x).backward()
    joint = compiled.records[0].partitioned_joint
    aten = compiled.records[0].partition
    triton = partition(joint, executor=Executor.TRITON)
    assert [s.producer for s in triton.saved] == ["input"]
    assert triton.saved_bytes == x.numel() * 4 < aten.saved_bytes
    assert triton.recomputations and triton.recompute_seconds == 0.0
    assert all(r.cost.kind in (CostKind.FUSED, CostKind.FREE) for r in triton.recomputations)
    assert "fuses into a backward kernel" in triton.format()


def test_triton_end_to_end_recomputes_the_chain():
    compiled = assert_matches_eager(
        chain, lambda: (torch.randn(5, 4, requires_grad=True),), backend="triton", runs=1
    )
    part = compiled.records[0].partition
    assert part.executor is Executor.TRITON
    assert [s.producer for s in part.saved] == ["input"]


def test_triton_saves_values_a_backward_matmul_reads():
    def f(x, w):
        return (x.sin() @ w).sum()  # the backward's mm for w's gradient reads sin(x)

    x, w = torch.randn(8, 6, requires_grad=True), torch.randn(6, 5, requires_grad=True)
    compiled = aotc.compile(f, backend="aten")
    compiled(x, w).backward()
    triton = partition(compiled.records[0].partitioned_joint, executor=Executor.TRITON)
    assert "sin" not in triton.recomputed  # sin (or its transpose) is saved, not recomputed
    assert {"aten.sin.default", "aten.t.default"} & {s.producer for s in triton.saved}


def test_memory_budget_recomputes_on_aten_cheapest_per_byte_first():
    full = aotc.compile(ln_gelu, backend="aten")
    full(*_ln_args()).backward()
    base = full.records[0].partition
    saved = [base.saved_bytes]
    for budget in (0.8, 0.6, 0.4, 0.05):
        compiled = assert_matches_eager(
            ln_gelu, _ln_args, backend="aten", memory_budget=budget, runs=1
        )
        part = compiled.records[0].partition
        saved.append(part.saved_bytes)
        for r in part.recomputations:
            assert r.reason is RecomputeReason.FREE or r.cost.seconds > 0
            assert f"recomputed {r.name}:" in part.format() and "costs" in r.format()
    assert saved == sorted(saved, reverse=True) and saved[-1] < saved[0], saved
    low = aotc.compile(ln_gelu, backend="aten", memory_budget=0.05)
    low(*_ln_args()).backward()
    part = low.records[0].partition
    assert part.recompute_seconds > 0
    kinds = {r.name: r.cost.kind for r in part.recomputations if r.reason is RecomputeReason.BUDGET}
    assert CostKind.KERNEL in kinds.values()
    # Pointwise ops cost less per byte than matmuls, so they are unbanned first.
    order = [n for n in part.unbanned]
    first_matmul = next((i for i, n in enumerate(order) if kinds.get(n) is CostKind.MATMUL), None)
    if first_matmul is not None:
        assert all(kinds.get(n) is not CostKind.MATMUL for n in order[:first_matmul])
        assert any(kinds.get(n) is CostKind.KERNEL for n in order[:first_matmul])


def test_aten_budget_recomputes_pointwise_chain():
    compiled = assert_matches_eager(
        chain, lambda: (torch.randn(9, 7, requires_grad=True),), memory_budget=0.2, runs=1
    )
    part = compiled.records[0].partition
    assert part.executor is Executor.ATEN and part.unbanned
    assert part.saved_bytes <= part.budget_bytes
    assert any(r.reason is RecomputeReason.BUDGET for r in part.recomputations)
    assert "to meet the memory budget" in part.format()


def _joint(fn, *args, n_primals: int, n_fwd: int) -> StageGraph:
    module = make_fx(fn)(*args)
    return StageGraph(
        module,
        tuple(PrimalInput(GraphArg(i)) for i in range(n_primals))
        + tuple(TangentInput(FwdOut(i)) for i in range(len(args) - n_primals)),
        tuple(FwdOutput(FwdOut(i)) for i in range(n_fwd))
        + tuple(GradOutput(GraphArg(i)) for i in range(n_primals)),
    )


def test_backward_only_values_feeding_saved_ones_are_not_run_twice():
    # c = cos(x) is only needed by the backward, both directly (t * c) and through the small
    # s = (c * a).sum(1). Bytes alone would save {x, s}: s is computed in the forward (running
    # cos there) and c again in the backward from x. On ATen that is an extra pass; the
    # partition saves c instead.
    def joint(x, t):
        a = x.exp()
        c = x.cos()
        s = (c * a).sum(1, keepdim=True)
        return a, t * c + s

    graph = _joint(joint, torch.randn(64, 32), torch.randn(64, 32), n_primals=1, n_fwd=1)
    aten = partition(graph, executor=Executor.ATEN)
    fwd_targets = [str(n.target) for n in aten.forward.module.graph.nodes]
    bwd_targets = [str(n.target) for n in aten.backward.module.graph.nodes]
    assert not ("aten.cos.default" in fwd_targets and "aten.cos.default" in bwd_targets)
    assert aten.recompute_seconds == 0.0
    x, t = torch.randn(64, 32), torch.randn(64, 32)
    fwd = aten.forward.module(x)
    (grad,) = aten.backward.module(*fwd[1:], t)
    torch.testing.assert_close(grad, joint(x, t)[1])


@pytest.mark.parametrize(
    ("backend", "interpret", "device", "expected"),
    [
        ("aten", False, "cpu", Executor.ATEN),
        ("aten", True, "cuda", Executor.ATEN),
        ("auto", True, "cpu", Executor.ATEN),
        ("auto", False, "cuda", Executor.TRITON),
        ("triton", True, "cpu", Executor.TRITON),
        ("triton", False, "cpu", Executor.ATEN),
        ("triton", False, "cuda", Executor.TRITON),
        ("auto", False, None, Executor.ATEN),
    ],
)
def test_executor_follows_backend_selection(backend, interpret, device, expected):
    dev = torch.device(device) if device is not None else None
    assert executor_for(backend, interpret, dev) is expected


def test_partition_report_prices_recomputed_values():
    compiled = aotc.compile(chain, backend="aten", memory_budget=0.3)
    compiled(torch.randn(9, 7, requires_grad=True)).backward()
    part = compiled.records[0].partition
    text = part.format()
    assert "executor: aten" in text and "estimated cost" in text
    for r in part.recomputations:
        line = next(ln for ln in text.splitlines() if ln.startswith(f"recomputed {r.name}:"))
        assert "costs" in line and f"saves {r.nbytes} B" in line
        if r.cost.kind is CostKind.KERNEL:
            assert f"{r.cost.traffic} B traffic" in line
