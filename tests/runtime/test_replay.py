"""The replayed forward's writes done in place (Note [Buffers written in place] in
runtime/replay.py): which writes qualify, and that calls doing them give eager's buffers,
versions and gradients on every path (generated call, general path, cache hit, export)."""

from __future__ import annotations

import copy
import operator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import aotc
from aotc.runtime.replay import fwd_only, writable_in_place

aten = torch.ops.aten


class ConvBN(torch.nn.Module):
    def __init__(self, twice: bool = False) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(4)
        self.twice = twice

    def forward(self, x: torch.Tensor) -> Any:
        y = F.relu(self.bn(self.conv(x))).square().mean()
        return (y, y) if self.twice else y


def _train_and_compare(
    net: torch.nn.Module, comp: Any, steps: int = 3, shape: tuple[int, ...] = (2, 3, 6, 6)
) -> None:
    """Steps `comp` (compiled from `net`) and an eager twin of `net` on the same fresh inputs:
    losses, gradients, buffers and buffer versions match after every step."""
    ref = copy.deepcopy(net)
    start = [b._version - c._version for b, c in zip(net.buffers(), ref.buffers())]
    for _ in range(steps):
        x = torch.randn(shape)
        got, want = comp(x), ref(x)
        if isinstance(got, tuple):
            assert got[0] is got[1]
            got, want = got[0], want[0]
        torch.testing.assert_close(got, want)
        got.backward()
        want.backward()
        for p, q in zip(net.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
        for b, c, v in zip(net.buffers(), ref.buffers(), start):
            torch.testing.assert_close(b, c, rtol=0, atol=0)
            assert b._version - v == c._version


def _plans(comp: Any) -> list[Any]:
    plans = [r.program.plan for r in aotc.inspect(comp)]
    assert plans, "nothing was compiled"
    return plans


def _compiled(net: torch.nn.Module, mode: str, **options: Any) -> Any:
    torch._dynamo.reset()
    capture = {"trace": "trace", "default": "dynamo"}[mode]
    comp = aotc.compile(net, capture=capture, **{"cache": False, **options})
    for _ in range(2):  # strict capture compiles on the second call
        comp(torch.randn(2, 3, 6, 6))
    return comp


@pytest.mark.parametrize("mode", ("trace", "default"))
def test_batch_norm_runs_in_place_on_its_buffers(mode: str) -> None:
    torch.manual_seed(0)
    net = ConvBN()
    comp = _compiled(net, mode)
    (plan,) = _plans(comp)
    assert plan.eager_autograd
    # running_mean, running_var (one BatchNorm op) and num_batches_tracked (`add_`)
    assert len(plan.writes_in_place) == 3
    (entry,) = _entries(comp)
    source = entry.call.__aotc_source__
    assert "write_buffers((), (), vs)" in source, source
    _train_and_compare(net, comp)


def test_general_path_skips_the_writes_done_in_place() -> None:
    """An entry returning one output twice takes `CompiledEntry._run` with the replay."""
    torch.manual_seed(0)
    net = ConvBN(twice=True)
    comp = _compiled(net, "trace")
    (plan,) = _plans(comp)
    assert plan.eager_autograd and len(plan.writes_in_place) == 3
    (entry,) = _entries(comp)
    assert not hasattr(entry.call, "__aotc_source__")
    _train_and_compare(net, comp)


def test_autocast_call_takes_the_pair_and_copies() -> None:
    """Under autocast the call runs the compiled pair, whose forward is functional: the
    epilogue copies every new value (nothing is skipped) and the buffers match eager's."""
    torch.manual_seed(0)
    net = ConvBN()
    comp = _compiled(net, "trace")
    assert len(_plans(comp)[0].writes_in_place) == 3
    ref = copy.deepcopy(net)
    start = [b._version - c._version for b, c in zip(net.buffers(), ref.buffers())]
    x = torch.randn(2, 3, 6, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = comp(x), ref(x)
    torch.testing.assert_close(got, want)
    for b, c, v in zip(net.buffers(), ref.buffers(), start):
        torch.testing.assert_close(b, c)
        assert b._version - v == c._version


def test_cache_hit_and_export_write_in_place(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = ConvBN()
    first = _compiled(net, "trace", cache=True, cache_dir=str(tmp_path / "cache"))
    assert len(_plans(first)[0].writes_in_place) == 3
    again = _compiled(net, "trace", cache=True, cache_dir=str(tmp_path / "cache"))
    records = aotc.inspect(again)
    assert records and all(r.is_cache_hit for r in records)
    assert len(records[0].program.plan.writes_in_place) == 3
    _train_and_compare(net, again)
    path = aotc.export(net, torch.randn(2, 3, 6, 6), path=tmp_path / "art")
    bound = copy.deepcopy(net)
    loaded = aotc.load(path, module=bound)
    _train_and_compare(bound, loaded)


def _entries(comp: Any) -> list[Any]:
    """The entries running `comp`'s compiled programs (found by their plans)."""
    import gc

    from aotc.runtime.wrappers import CompiledEntry

    plans = [id(p) for p in _plans(comp)]
    return [o for o in gc.get_objects() if type(o) is CompiledEntry and id(o.plan) in plans]


class Stats(torch.nn.Module):
    """Buffers a program updates itself, without history."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(6, 6)
        self.kind = kind
        self.register_buffer("ema", torch.zeros(6))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "counter":
            y = self.lin(x)
            self.count.add_(1)
        elif self.kind == "read_then_write":  # the old ema is read before the writes
            y = self.lin(x + self.ema)
            self.ema.add_(0.5)
            self.count.add_(1)
        else:  # "write_then_read": the new ema is read, so its copy stays
            self.ema.mul_(0.9).add_(1)
            y = self.lin(x) * self.ema
        return y.sum()


@pytest.mark.parametrize("mode", ("trace", "default"))
@pytest.mark.parametrize(
    ("kind", "n_in_place"), [("counter", 1), ("read_then_write", 2), ("write_then_read", 0)]
)
def test_buffers_a_program_updates(mode: str, kind: str, n_in_place: int) -> None:
    torch.manual_seed(0)
    net = Stats(kind)
    torch._dynamo.reset()
    comp = aotc.compile(net, capture={"trace": "trace", "default": "dynamo"}[mode], cache=False)
    _train_and_compare(net, comp, shape=(4, 6))
    (plan,) = _plans(comp)
    assert plan.eager_autograd and len(plan.writes_in_place) == n_in_place


# The rule itself, on hand-made forward graphs (fake tensors in the placeholders' vals).


def _graph(build: Any, *vals: torch.Tensor) -> tuple[fx.GraphModule, list[fx.Node]]:
    graph = fx.Graph()
    xs = []
    for k, v in enumerate(vals):
        p = graph.placeholder(f"arg{k}")
        p.meta["val"] = v
        xs.append(p)
    outs = build(graph, *xs)
    graph.output(tuple(outs))
    for node in graph.nodes:
        if node.op == "call_function" and "val" not in node.meta:
            args = fx.node.map_arg(node.args, lambda n: n.meta["val"])
            node.meta["val"] = node.target(*args)
    return fx.GraphModule(torch.nn.Module(), graph), xs


def _fake(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def test_a_counter_step_is_written_in_place() -> None:
    def build(g: fx.Graph, x: fx.Node, w: fx.Node) -> list[fx.Node]:
        y = g.call_function(aten.mul.Tensor, (x, w))  # reads w before its write
        return [y, g.call_function(aten.add.Tensor, (w, 1))]

    with FakeTensorMode():
        module, _ = _graph(build, _fake(3), _fake(3))
    assert writable_in_place(module, 2, [(1, 1)])[0] == ((1, 1),)
    graph = fwd_only(module, 2, ((1, 1),))
    targets = [n.target for n in graph.nodes if n.op == "call_function"]
    assert targets == [aten.mul.Tensor, aten.add_.Tensor]
    outs = graph.output_node().args[0]
    assert outs[1].op == "placeholder"  # the written input is its own new value


def test_a_reader_after_the_write_keeps_the_copy() -> None:
    def build(g: fx.Graph, x: fx.Node, w: fx.Node) -> list[fx.Node]:
        step = g.call_function(aten.add.Tensor, (w, 1))
        y = g.call_function(aten.mul.Tensor, (x, w))  # reads the old w after the op
        return [y, step]

    with FakeTensorMode():
        module, _ = _graph(build, _fake(3), _fake(3))
    assert writable_in_place(module, 2, [(1, 1)])[0] == ()


@pytest.mark.parametrize(
    "case", ["new_value_read", "view_reader", "dtype_changes", "tensor_operand", "not_contiguous"]
)
def test_writes_that_keep_the_copy(case: str) -> None:
    def build(g: fx.Graph, x: fx.Node, w: fx.Node) -> list[fx.Node]:
        if case == "new_value_read":  # `w.add_(1); return x * w`
            step = g.call_function(aten.add.Tensor, (w, 1))
            return [g.call_function(aten.mul.Tensor, (x, step)), step]
        if case == "view_reader":  # a view of the old w is read after the write
            v = g.call_function(aten.view.default, (w, [3]))
            step = g.call_function(aten.add.Tensor, (w, 1))
            return [g.call_function(aten.mul.Tensor, (x, v)), step]
        if case == "dtype_changes":
            return [
                g.call_function(aten.mul.Tensor, (x, 2)),
                g.call_function(aten.add.Tensor, (w, 0.5)),
            ]
        if case == "tensor_operand":
            return [
                g.call_function(aten.mul.Tensor, (x, 2)),
                g.call_function(aten.add.Tensor, (w, x)),
            ]
        return [g.call_function(aten.mul.Tensor, (x, 2)), g.call_function(aten.add.Tensor, (w, 1))]

    with FakeTensorMode():
        w = _fake(3, dtype=torch.int64) if case == "dtype_changes" else _fake(3)
        if case == "not_contiguous":
            w = _fake(6)[::2]
        module, _ = _graph(build, _fake(3), w)
    assert writable_in_place(module, 2, [(1, 1)])[0] == ()


def _batch_norm_graph(g: fx.Graph, x: fx.Node, mean: fx.Node, var: fx.Node) -> list[fx.Node]:
    bn = g.call_function(
        aten._native_batch_norm_legit_functional.default,
        (x, None, None, mean, var, True, 0.1, 1e-5),
    )
    return [g.call_function(operator.getitem, (bn, k)) for k in (0, 3, 4)]


def test_batch_norm_writes_both_statistics_or_neither() -> None:
    with FakeTensorMode():
        module, _ = _graph(_batch_norm_graph, _fake(2, 4, 3, 3), _fake(4), _fake(4))
    assert writable_in_place(module, 3, [(1, 1)])[0] == ()  # running_var's copy stays: no rewrite
    both, _ = writable_in_place(module, 3, [(1, 1), (2, 2)])
    assert both == ((1, 1), (2, 2))
    graph = fwd_only(module, 3, both)
    targets = [n.target for n in graph.nodes if n.op == "call_function"]
    assert targets == [aten._native_batch_norm_legit.default, operator.getitem]
    out = graph.output_node().args[0]
    assert [o.op for o in out] == ["call_function", "placeholder", "placeholder"]


def test_in_place_batch_norm_values_are_the_functional_ones() -> None:
    """The rewritten graph, run on real tensors, gives the functional graph's values: the
    running statistics end where the functional op's new values are."""
    with FakeTensorMode():
        module, _ = _graph(_batch_norm_graph, _fake(2, 4, 3, 3), _fake(4), _fake(4))
    x, mean, var = torch.randn(2, 4, 3, 3), torch.randn(4), torch.rand(4) + 0.5
    want = module(x, mean.clone(), var.clone())
    graph = fwd_only(module, 3, ((1, 1), (2, 2)))
    rewritten = fx.GraphModule(module, graph)
    m2, v2 = mean.clone(), var.clone()
    got = rewritten(x, m2, v2)
    assert got[1] is m2 and got[2] is v2
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
