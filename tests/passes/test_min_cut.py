"""The min-cut partitioner and the cleanup passes: fewest saved bytes, only eligible recomputes,
memory budget monotone, gradients exact."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

import aotc
from aotc.passes.cleanup import (
    eliminate_common_subexpressions,
    eliminate_dead_code,
    remove_noop_views,
)
from aotc.passes.descriptors import FwdOutput, PrimalInput
from aotc.passes.ir import StageGraph
from aotc.passes.recompute import RecomputePolicy, can_recompute
from tests.conftest import assert_matches_eager


def _record(fn, *args, **options):
    torch._dynamo.reset()  # torch 2.11 counts recompiles per code object, across objects
    compiled = aotc.compile(fn, check_invariants=True, **options)
    out = compiled(*args)
    out.backward() if out.dim() == 0 else out.sum().backward()
    return compiled.records[0]


def chain(x):
    for _ in range(4):
        x = x.sin().cos() * 2
    return x.sum()


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


def test_pointwise_chain_saves_only_the_input_when_it_fuses():
    # With Triton kernels the recomputed chain folds into the backward's kernel: save x alone.
    # (With ATen calls it would be a pass over memory per op: tests/passes/test_recompute_cost.py)
    x = torch.randn(37, 29, requires_grad=True)
    record = _record(chain, x, backend="triton")
    part = record.partition
    assert [s.producer for s in part.saved] == ["input"]
    assert part.saved_bytes == x.numel() * 4
    assert part.simple_bytes > part.saved_bytes
    assert part.recomputed  # the chain runs again in the backward
    assert_matches_eager(
        chain, lambda: (torch.randn(37, 29, requires_grad=True),), backend="triton", runs=1
    )


def test_min_cut_never_saves_more_than_simple_plan():
    for fn, args in ((chain, (torch.randn(8, 8, requires_grad=True),)), (ln_gelu, _ln_args())):
        part = _record(fn, *args).partition
        assert part.saved_bytes <= part.simple_bytes <= part.save_everything_bytes


def test_recomputed_nodes_are_eligible_and_matmuls_are_not_recomputed():
    record = _record(ln_gelu, *_ln_args())
    part = record.partition
    nodes = {n.name: n for n in record.joint.graph.nodes}
    policy = RecomputePolicy()
    for name in part.recomputed:
        assert can_recompute(nodes[name], policy), f"{name} ({nodes[name].target}) recomputed"
    assert not any(nodes[n].target == torch.ops.aten.mm.default for n in part.recomputed)


def test_memory_budget_monotone_and_exact():
    budgets = [1.0, 0.8, 0.6, 0.4, 0.2, 0.05]
    saved = []
    for budget in budgets:
        record = _record(ln_gelu, *_ln_args(), memory_budget=budget)
        saved.append(record.partition.saved_bytes)
        assert_matches_eager(ln_gelu, _ln_args, memory_budget=budget, runs=1)
    assert saved == sorted(saved, reverse=True), saved
    assert saved[-1] < saved[0]  # a small budget recomputes matmuls to save less
    low = _record(ln_gelu, *_ln_args(), memory_budget=0.05).partition
    assert low.unbanned and "budget" in low.format()


def test_memory_budget_in_bytes():
    full = _record(ln_gelu, *_ln_args()).partition.saved_bytes
    part = _record(ln_gelu, *_ln_args(), memory_budget=full // 2).partition
    assert part.budget_bytes == full // 2
    assert part.saved_bytes < full


@pytest.mark.parametrize("bad", [0.0, 1.5, -3, "half", True])
def test_bad_memory_budget_names_the_option(bad):
    with pytest.raises(ValueError, match="memory_budget"):
        aotc.compile(chain, memory_budget=bad)


def test_saved_views_are_saved_as_their_base():
    def f(x, w):
        return (x @ w.t()).sum()

    part = _record(
        f, torch.randn(5, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True)
    ).partition
    assert all(s.producer in ("input",) or "t.default" not in s.producer for s in part.saved)


def test_random_ops_are_never_recomputed():
    def f(x):
        return (F.dropout(x.sin(), 0.5, training=True) * 3).sum()

    assert_matches_eager(f, lambda: (torch.randn(20, 7, requires_grad=True),))
    record = _record(f, torch.randn(20, 7, requires_grad=True))
    from aotc.passes.recompute import is_random

    assert not any(is_random(n) for n in record.partition.backward.module.graph.nodes)


def test_partition_report_lists_saved_values_with_sources():
    record = _record(ln_gelu, *_ln_args())
    part = record.partition
    text = part.format()
    assert "save everything" in text and "simple plan" in text
    assert any("test_min_cut.py" in s.source for s in part.saved if s.producer != "input")
    assert record.saved_bytes == part.saved_bytes == sum(s.nbytes for s in part.saved)
    for s in part.saved:
        assert s.name in text and str(s.nbytes) in text


# ---------------------------------------------------------------- cleanup passes


def _stage(fn, *args) -> StageGraph:
    from torch.fx.experimental.proxy_tensor import make_fx

    module = make_fx(fn)(*args)
    n_in = len([n for n in module.graph.nodes if n.op == "placeholder"])
    n_out = len(next(n for n in reversed(module.graph.nodes) if n.op == "output").args[0])
    return StageGraph(
        module,
        tuple(PrimalInput(i) for i in range(n_in)),
        tuple(FwdOutput(i) for i in range(n_out)),
    )


def _targets(graph: StageGraph) -> list[str]:
    return [str(n.target) for n in graph.module.graph.nodes if n.op == "call_function"]


def test_cse_merges_repeated_ops_and_keeps_random_ones():
    def f(x):
        return (x.sin() + x.sin(), torch.rand_like(x) + torch.rand_like(x))

    x = torch.randn(3)
    before = _stage(f, x)
    after = eliminate_common_subexpressions(before)
    assert _targets(after).count("aten.sin.default") == 1
    assert _targets(after).count("aten.rand_like.default") == 2
    assert _targets(before).count("aten.sin.default") == 2  # input record unchanged
    torch.testing.assert_close(after.module(x)[0], f(x)[0])


def test_dce_drops_unused_but_keeps_random():
    g = fx.Graph()
    x = g.placeholder("x")
    g.call_function(torch.ops.aten.cos.default, (x,))
    g.call_function(torch.ops.aten.rand_like.default, (x,))
    out = g.call_function(torch.ops.aten.sin.default, (x,))
    g.output((out,))
    graph = StageGraph(fx.GraphModule(torch.nn.Module(), g), (PrimalInput(0),), (FwdOutput(0),))
    after = eliminate_dead_code(graph)
    assert "aten.cos.default" not in _targets(after)
    assert "aten.rand_like.default" in _targets(after)


def test_noop_views_are_removed():
    def f(x):
        y = x.view(3, 4).expand(3, 4).sin()
        return (y.reshape(12),)

    x = torch.randn(3, 4)
    after = remove_noop_views(_stage(f, x))
    targets = _targets(after)
    assert "aten.expand.default" not in targets and "aten.view.default" in targets
    torch.testing.assert_close(after.module(x)[0], f(x)[0])


def test_view_chains_that_come_back_read_their_start():
    # Linear's backward: the input gradient reads t(t(w)); the weight gradient is a view chain
    # of an mm, left alone where it is an output (aliasing of outputs is user-visible).
    def f(x, w):
        a = x.t().t().sin()
        b = w.view(12).view(3, 4).permute(1, 0).permute(1, 0)
        c = x.unsqueeze(0).squeeze(0)
        return (a + b.cos() + c, w.t().t())

    x, w = torch.randn(3, 4), torch.randn(3, 4)
    before = _stage(f, x, w)
    after = eliminate_dead_code(remove_noop_views(before))
    targets = _targets(after)
    for op in ("aten.view.default", "aten.permute.default", "aten.unsqueeze.default"):
        assert op not in targets, targets
    assert targets.count("aten.t.default") == 2  # only the returned chain w.t().t()
    for got, want in zip(after.module(x, w), f(x, w)):
        torch.testing.assert_close(got, want)


def test_view_chains_that_do_not_come_back_stay():
    def f(x):
        return (x.t().contiguous().t().sin(), x.view(4, 3).view(2, 6).sin())

    x = torch.randn(3, 4)
    after = remove_noop_views(_stage(f, x))
    targets = _targets(after)
    assert targets.count("aten.t.default") == 2 and targets.count("aten.view.default") == 2
    for got, want in zip(after.module(x), f(x)):
        torch.testing.assert_close(got, want)


def test_linear_backward_runs_no_double_transposes():
    # On the ATen executor every view in the backward is an ATen call; t(t(w)) is w.
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    x = torch.randn(5, 8, requires_grad=True)
    compiled = aotc.compile(model)
    compiled(x).sum().backward()
    bw = aotc.inspect(compiled)[0].partition.backward.module.graph
    returned = set(next(n for n in reversed(bw.nodes) if n.op == "output").all_input_nodes)
    for node in bw.nodes:
        if node.target == torch.ops.aten.t.default and node not in returned:
            src = node.args[0]
            assert not (isinstance(src, fx.Node) and src.target == torch.ops.aten.t.default), (
                node.format_node()
            )
    assert_matches_eager(model, lambda: (torch.randn(5, 8, requires_grad=True),))
