"""Fast op bindings (Note [Fast op bindings] in runtime/launch.py): a graph op runs through
torch's generated binding only where a dry run proves it dispatches the same overload with the
same arguments; factories, mutating ops and overloads the binding would not pick keep `_op`;
graphs give the same results either way."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from aotc.options import CompileOptions
from aotc.runtime import launch
from aotc.runtime.launch import fast_binding, make_callable

aten = torch.ops.aten


def _graph(fn, *args) -> fx.GraphModule:
    return make_fx(fn)(*args)


def _node(module: fx.GraphModule, target) -> fx.Node:
    return next(n for n in module.graph.nodes if n.target is target)


def _forget(monkeypatch) -> None:
    """A process that has made no verdicts yet (Note [Binding verdicts across processes])."""
    monkeypatch.setattr(launch, "_BINDINGS", {})
    monkeypatch.setattr(launch, "_PROVEN", {})


def test_bindings_are_kept_only_for_the_same_overload():
    def f(x, y):
        a = aten.mul.Tensor(x, y)
        b = aten.mul.Tensor(a, 2.0)  # a Python float where the schema has a Tensor
        c = aten.mul.Scalar(b, 3)  # torch.mul(b, 3) would dispatch mul.Tensor: keep _op
        d = aten.sum.dim_IntList(c, [0], True)
        e = aten.expand.default(d, [4, 3])  # a method only (Tensor.expand)
        return (aten.add.Tensor(e, x, alpha=2),)

    module = _graph(f, torch.randn(4, 3), torch.randn(4, 3))
    nodes = [n for n in module.graph.nodes if n.op == "call_function"]
    bound = {str(n.target): fast_binding(n) for n in nodes}
    assert bound["aten.mul.Scalar"] is None
    assert bound["aten.mul.Tensor"] is torch._C._VariableFunctions.mul
    assert bound["aten.sum.dim_IntList"] is torch._C._VariableFunctions.sum
    assert bound["aten.expand.default"] is torch._C.TensorBase.expand
    assert bound["aten.add.Tensor"] is torch._C._VariableFunctions.add
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    torch.testing.assert_close(make_callable(module)(x, y)[0], f(x, y)[0])
    source = make_callable(module).__aotc_source__
    assert "alpha=2" in source


def test_factories_and_mutating_ops_keep_op():
    def f(x):
        z = aten.zeros.default([3], dtype=torch.float32, device=torch.device("cpu"))
        return aten.add_.Tensor(z, x)

    module = _graph(f, torch.randn(3))
    assert fast_binding(_node(module, aten.zeros.default)) is None
    add_ = next(n for n in module.graph.nodes if n.target is aten.add_.Tensor)
    assert fast_binding(add_) is None


def test_symbolic_sizes_need_a_static_verdict(monkeypatch):
    # Overload resolution sees Python types, never sizes: a verdict from a static dry run holds
    # for symbolic graphs too, but a symbolic graph cannot be the dry run itself.
    module = make_fx(lambda t: (aten.sin.default(t),), tracing_mode="symbolic")(torch.randn(5, 3))
    node = _node(module, aten.sin.default)
    _forget(monkeypatch)
    assert fast_binding(node) is None
    assert not launch._PROVEN  # undecided: nothing to keep for the next process
    launch._BINDINGS.clear()
    static = _graph(lambda t: (aten.sin.default(t),), torch.randn(2, 2))
    assert fast_binding(_node(static, aten.sin.default)) is torch._C._VariableFunctions.sin
    assert fast_binding(node) is torch._C._VariableFunctions.sin
    x = torch.randn(7, 3)
    torch.testing.assert_close(make_callable(module)(x)[0], x.sin())


def test_verdicts_are_cached_per_overload_and_argument_kinds(monkeypatch):
    _forget(monkeypatch)
    module = _graph(lambda x: aten.cos.default(aten.cos.default(x)), torch.randn(3))
    nodes = [n for n in module.graph.nodes if n.target is aten.cos.default]
    assert fast_binding(nodes[0]) is fast_binding(nodes[1]) is torch._C._VariableFunctions.cos
    assert len([k for k in launch._BINDINGS if k[0] is aten.cos.default]) == 1


def test_multi_output_ops_run_through_bindings():
    def f(x, w, b):
        out, mean, rstd = aten.native_layer_norm.default(x, [3], w, b, 1e-5)
        return out * 2, mean, rstd

    args = (torch.randn(4, 3), torch.randn(3), torch.randn(3))
    module = _graph(f, *args)
    assert fast_binding(_node(module, aten.native_layer_norm.default)) is not None
    for got, want in zip(make_callable(module)(*args), f(*args)):
        torch.testing.assert_close(got, want)


def test_verdicts_reach_the_next_process_through_the_cache_dir(tmp_path, monkeypatch):
    """Note [Binding verdicts across processes]: a compile stores its verdicts, signed, in the
    cache directory; a new process loads them and runs no dry run for them. A file that is not
    signed with this user's secret is ignored."""
    import os

    import aotc
    from aotc import persist

    def f(x, y):
        return (x * y).sin().sum(-1)

    def make():
        return torch.randn(4, 3, requires_grad=True), torch.randn(4, 3)

    d = str(tmp_path)
    _forget(monkeypatch)
    monkeypatch.setattr(persist, "_VERDICTS_READ", set())
    monkeypatch.setattr(persist, "_VERDICTS_STORED", {})
    x, y = make()
    torch.testing.assert_close(aotc.compile(f, cache_dir=d, capture="trace")(x, y), f(x, y))
    aotc.cache_flush()
    (name,) = [n for n in os.listdir(d) if n.endswith(".signed")]
    proven = dict(launch._PROVEN)
    assert any(k.startswith("aten.mul.Tensor|") and v == 0 for k, v in proven.items())

    _forget(monkeypatch)  # the next process
    monkeypatch.setattr(persist, "_VERDICTS_READ", set())
    monkeypatch.setattr(persist, "_VERDICTS_STORED", {})

    def no_dry_run(*args):  # type: ignore[no-untyped-def]
        raise AssertionError("a stored verdict was proven again")

    monkeypatch.setattr(launch, "_verified_binding", no_dry_run)
    x, y = torch.randn(5, 2, requires_grad=True), torch.randn(5, 2)  # a miss: a cold compile
    torch.testing.assert_close(aotc.compile(f, cache_dir=d, capture="trace")(x, y), f(x, y))
    assert launch._PROVEN == proven

    with open(os.path.join(d, name), "r+b") as fh:  # edited: the signature no longer holds
        data = fh.read().replace(b'"aten.sin.default', b'"aten.cos.default')
        fh.seek(0)
        fh.write(data)
    _forget(monkeypatch)
    monkeypatch.setattr(persist, "_VERDICTS_READ", set())
    persist.load_verdicts(CompileOptions.from_env(cache_dir=d))
    assert launch._PROVEN == {}


def _nll(x, t):
    out, total = aten.nll_loss_forward.default(
        aten._log_softmax.default(x, 1, False), t, None, 1, -100
    )
    return (out,)


def _ce_inputs():
    return torch.randn(6, 5, requires_grad=True), torch.randint(0, 5, (6,))


def test_one_result_of_a_loss_runs_through_eagers_composite(monkeypatch):
    """Note [Bindings of one result]: `nll_loss_forward` read only through its first result runs
    as `torch._C._nn.nll_loss`, with no tuple and no getitem; values, the autograd node a call
    with grad on records, and gradients are `_op`'s."""
    _forget(monkeypatch)
    monkeypatch.setattr(launch, "_PARTS", {})
    x, t = _ce_inputs()
    module = _graph(_nll, x.detach(), t)
    fn = make_callable(module)
    assert "nll_loss(" in fn.__aotc_source__ and "getitem(" not in fn.__aotc_source__
    assert any(k.endswith("|part 0") and v == 0 for k, v in launch._PROVEN.items())
    (got,) = fn(x, t)
    (want,) = _nll(x, t)
    assert (
        type(got.grad_fn) is type(want.grad_fn) and type(got.grad_fn).__name__ == "NllLossBackward0"
    )
    torch.testing.assert_close(got, want)
    (gx,) = torch.autograd.grad(got, x)
    (wx,) = torch.autograd.grad(want, x)
    torch.testing.assert_close(gx, wx)


def test_both_results_read_keep_op(monkeypatch):
    _forget(monkeypatch)
    monkeypatch.setattr(launch, "_PARTS", {})

    def f(x, t):
        out, total = aten.nll_loss_forward.default(x, t, None, 1, -100)
        return out, total

    x, t = _ce_inputs()
    module = _graph(f, x.detach(), t)
    fn = make_callable(module)
    assert "nll_loss(" not in fn.__aotc_source__
    for got, want in zip(fn(x, t), f(x, t)):
        torch.testing.assert_close(got, want)


def test_a_composite_that_is_not_that_result_is_refused(monkeypatch):
    """The dry run refuses a table entry whose binding returns another result (the identity
    check) or sends another op (the dispatch check): `_op` and getitem stay."""
    x, t = _ce_inputs()
    module = _graph(_nll, x.detach(), t)
    wrong = {
        ("aten::nll_loss_forward", "default", 0): ("_VariableFunctions", "neg"),
        ("aten::nll_loss_forward", "default", 1): ("_nn", "nll_loss"),
    }

    def g(x, t):
        out, total = aten.nll_loss_forward.default(
            aten._log_softmax.default(x, 1, False), t, None, 1, -100
        )
        return (total,)

    module_total = _graph(g, x.detach(), t)
    for key, where in wrong.items():
        _forget(monkeypatch)
        monkeypatch.setattr(launch, "_PARTS", {})
        monkeypatch.setattr(launch, "_PART_CANDIDATES", {key: where})
        m = module if key[2] == 0 else module_total
        node = _node(m, aten.nll_loss_forward.default)
        assert launch.part_binding(node, key[2]) is None
        fn = make_callable(m)
        assert "getitem(" in fn.__aotc_source__
        assert any(k.endswith(f"|part {key[2]}") and v == -1 for k, v in launch._PROVEN.items())
        for got, want in zip(fn(x, t), (_nll if m is module else g)(x, t)):
            torch.testing.assert_close(got, want)
