"""Training entries on the ATen path whose backward eager's own autograd records.

Each test runs a program eagerly and through aotc on identical fresh random inputs and compares
outputs, gradients and what autograd lets a caller do afterwards. Where the plan says
`eager_autograd`, the call runs the forward graph with grad on and every ATen call records its
own node (Note [Eager autograd on the ATen path] in aotc/eagerautograd.py); where the program's
autograd graph is not what the forward graph would record (a custom Function, `no_grad` inside)
or the partition saves less than eager, the entry keeps its compiled pair.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import aotc

MODES = ("trace", "default", "torch_compile")
ROOT = Path(__file__).resolve().parents[2]


def compiled(fn: Any, mode: str, **options: Any) -> Any:
    torch._dynamo.reset()
    if mode == "trace":
        return aotc.compile(fn, capture="trace", cache=False, **options)
    if mode == "default":
        return aotc.compile(fn, cache=False, **options)
    return torch.compile(fn, backend="aotc")


def replays(fn: Any) -> bool:
    """Whether the entries of `fn` (an aotc.compile result) let eager's autograd record."""
    plans = [r.program.plan for r in aotc.inspect(fn)]
    assert plans, "nothing was compiled"
    return all(p.eager_autograd for p in plans)


def warm(fn: Any, *args: torch.Tensor) -> None:
    """Strict capture compiles on the second call: two calls, gradients discarded."""
    for _ in range(2):
        out = fn(*args)
        (out if isinstance(out, torch.Tensor) else out[0]).sum().backward()
    for a in args:
        a.grad = None


def fresh(*shapes: tuple[int, ...], grad: tuple[bool, ...]) -> list[torch.Tensor]:
    return [torch.randn(s, requires_grad=g) for s, g in zip(shapes, grad)]


def clones(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_(t.requires_grad) for t in ts]


def replaying(
    fn: Any, mode: str, *shapes: tuple[int, ...], grad: tuple[bool, ...]
) -> tuple[Any, list[torch.Tensor], list[torch.Tensor]]:
    """`fn` compiled and warmed (its entry replaying), fresh inputs and their clones for eager."""
    comp = compiled(fn, mode)
    warm(comp, *fresh(*shapes, grad=grad))
    assert replays(comp)
    ins = fresh(*shapes, grad=grad)
    return comp, ins, clones(ins)


def compare(fn: Any, mode: str, *shapes: tuple[int, ...], grad: tuple[bool, ...], **opts: Any):
    """Runs `fn` eagerly and compiled on the same fresh inputs; compares the loss, the inputs'
    gradients and the root node's type. Returns the compiled function."""
    comp = compiled(fn, mode, **opts)
    warm(comp, *fresh(*shapes, grad=grad))
    ins = fresh(*shapes, grad=grad)
    ref_ins = clones(ins)
    out, ref = comp(*ins), fn(*ref_ins)
    torch.testing.assert_close(out, ref)
    assert out.requires_grad == ref.requires_grad
    out.sum().backward()
    ref.sum().backward()
    for a, b in zip(ins, ref_ins):
        if b.grad is None:
            assert a.grad is None
        else:
            torch.testing.assert_close(a.grad, b.grad)
    return comp, out, ref


@pytest.mark.parametrize("mode", MODES)
def test_tiny_step_records_eager_nodes(mode: str) -> None:
    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (x * y).sum()

    comp, out, ref = compare(f, mode, (4,), (4,), grad=(True, False))
    assert type(out.grad_fn).__name__ == type(ref.grad_fn).__name__ == "SumBackward0"
    if mode != "torch_compile":
        assert replays(comp)


@pytest.mark.parametrize("mode", MODES)
def test_mlp_with_cross_entropy_matches_eager(mode: str) -> None:
    torch.manual_seed(0)
    lin1, lin2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 5)
    target = torch.randint(0, 5, (6,))

    def f(x: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(lin2(torch.relu(lin1(x))), target)

    compiled_f = compiled(f, mode)
    warm(compiled_f, torch.randn(6, 8))
    for p in (*lin1.parameters(), *lin2.parameters()):
        p.grad = None
    x = torch.randn(6, 8)
    out = compiled_f(x)
    out.backward()
    got = [p.grad.clone() for p in (*lin1.parameters(), *lin2.parameters())]
    for p in (*lin1.parameters(), *lin2.parameters()):
        p.grad = None
    ref = f(x)
    ref.backward()
    torch.testing.assert_close(out, ref)
    for g, p in zip(got, (*lin1.parameters(), *lin2.parameters())):
        torch.testing.assert_close(g, p.grad)


class _RoundSTE(torch.autograd.Function):
    """Rounds in the forward, passes the gradient through unchanged (a straight-through
    estimator: differentiating its forward ops would give zeros)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.round()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g * 3


@pytest.mark.parametrize("mode", MODES)
def test_custom_function_keeps_the_compiled_pair(mode: str) -> None:
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (_RoundSTE.apply(x * 2) * w).sum()

    comp, _, _ = compare(f, mode, (5,), (5,), grad=(True, True))
    if mode != "torch_compile":
        assert not replays(comp)


@pytest.mark.parametrize("mode", MODES)
def test_no_grad_inside_keeps_eager_gradients(mode: str) -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            s = x.norm()
        return (x * s).sum()

    comp, _, _ = compare(f, mode, (6,), grad=(True,))
    if mode == "trace":
        assert not replays(comp)


@pytest.mark.parametrize("mode", MODES)
def test_detach_and_outputs_without_grad(mode: str) -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (x * x.detach()).sum(), (x * 2).detach(), x.argmax()

    comp = compiled(f, mode)
    warm(comp, *fresh((5,), grad=(True,)))
    (x,) = fresh((5,), grad=(True,))
    (xr,) = clones([x])
    got, ref = comp(x), f(xr)
    assert type(got) is tuple and len(got) == len(ref)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)
        assert a.requires_grad == b.requires_grad
    got[0].backward()
    ref[0].backward()
    torch.testing.assert_close(x.grad, xr.grad)


@pytest.mark.parametrize("mode", ("trace", "default"))
def test_a_partition_that_saves_less_keeps_the_pair(mode: str) -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return x.sin().cos().exp().sum()

    comp, _, _ = compare(f, mode, (16,), grad=(True,), memory_budget=0)
    assert not replays(comp)
    plain, _, _ = compare(f, mode, (16,), grad=(True,))
    assert replays(plain)


def _pow_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (x.pow(3) * y).sum()


@pytest.mark.parametrize("mode", ("trace", "default"))
def test_what_autograd_allows_afterwards(mode: str) -> None:
    comp, (x, y), (xr, yr) = replaying(_pow_step, mode, (4,), (4,), grad=(True, False))
    # retain_graph: two backwards accumulate as in eager
    out, ref = comp(x, y), _pow_step(xr, yr)
    out.backward(retain_graph=True)
    out.backward()
    ref.backward(retain_graph=True)
    ref.backward()
    torch.testing.assert_close(x.grad, xr.grad)
    # without it, the second backward raises eager's error
    for fn, a, b in ((comp, x, y), (_pow_step, xr, yr)):
        o = fn(a, b)
        o.backward()
        with pytest.raises(RuntimeError, match="second time"):
            o.backward()
    # double backward
    (g,) = torch.autograd.grad(comp(x, y), x, create_graph=True)
    (gr,) = torch.autograd.grad(_pow_step(xr, yr), xr, create_graph=True)
    torch.testing.assert_close(g, gr)
    (gg,) = torch.autograd.grad(g.sum(), x)
    (ggr,) = torch.autograd.grad(gr.sum(), xr)
    torch.testing.assert_close(gg, ggr)
    # a saved input written after the call: eager's version check
    for fn, a, b in ((comp, x, y), (_pow_step, xr, yr)):
        o = fn(a, b)
        b.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            o.backward()


@pytest.mark.parametrize("mode", ("trace", "default"))
def test_saved_tensor_hooks_see_eager_saves(mode: str) -> None:
    comp = compiled(_pow_step, mode)
    warm(comp, *fresh((4,), (4,), grad=(True, False)))
    x, y = fresh((4,), (4,), grad=(True, False))
    counts = []
    for fn in (comp, _pow_step):
        seen: list[tuple[int, ...]] = []

        def pack(t: torch.Tensor, seen: list[tuple[int, ...]] = seen) -> torch.Tensor:
            seen.append(tuple(t.shape))
            return t * 1  # a copy: the backward must use what unpack returns

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn(x, y)
        out.backward()
        counts.append(sorted(seen))
        x.grad = None
    assert counts[0] == counts[1]


@pytest.mark.parametrize("mode", ("trace", "default"))
def test_dropout_draws_as_eager(mode: str) -> None:
    w = torch.randn(8, 8, requires_grad=True)

    def f(x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x @ w, p=0.5, training=True).tanh().sum()

    comp = compiled(f, mode)
    warm(comp, torch.randn(3, 8))
    w.grad = None
    x = torch.randn(3, 8)
    torch.manual_seed(7)
    out = comp(x)
    out.backward()
    got = w.grad.clone()
    w.grad = None
    torch.manual_seed(7)
    ref = f(x)
    ref.backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(got, w.grad)


def test_dynamic_sizes_in_the_default_mode() -> None:
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x @ w).relu().mean()

    comp = compiled(f, "default")
    w = torch.randn(4, 3, requires_grad=True)
    for n in (2, 3, 5, 7):
        x = torch.randn(n, 4)
        w.grad = None
        comp(x, w).backward()
        got = w.grad.clone()
        w.grad = None
        f(x, w).backward()
        torch.testing.assert_close(got, w.grad)


_CACHED = """
import torch, aotc
def f(x, y):
    return (x.sin() * y).sum()
g = aotc.compile(f, capture="trace")
torch.manual_seed(0)
x, y = torch.randn(5, requires_grad=True), torch.randn(5)
for _ in range(2):
    g(x, y).backward()
x.grad = None
out = g(x, y)
out.backward()
ok = torch.allclose(x.grad, x.detach().cos() * y)
(record,) = aotc.inspect(g)
print(record.is_cache_hit, record.program.plan.eager_autograd, type(out.grad_fn).__name__, ok)
"""


def test_cache_hits_and_exports_keep_eager_autograd(tmp_path: Path) -> None:
    import os

    env = dict(os.environ, AOTC_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    runs = [
        subprocess.run(
            [sys.executable, "-c", _CACHED], capture_output=True, text=True, env=env, check=True
        ).stdout.split()[-4:]
        for _ in range(2)
    ]
    assert runs == [
        ["False", "True", "SumBackward0", "True"],
        ["True", "True", "SumBackward0", "True"],
    ]

    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (x.sin() * y).sum()

    x, y = torch.randn(5, requires_grad=True), torch.randn(5)
    loaded = aotc.load(aotc.export(f, x, y, path=tmp_path / "art"))
    x2, y2 = fresh((5,), (5,), grad=(True, False))
    out = loaded(x2, y2)
    out.backward()
    assert type(out.grad_fn).__name__ == "SumBackward0"
    torch.testing.assert_close(x2.grad, x2.detach().cos() * y2)


@pytest.mark.parametrize("mode", ("trace", "default"))
def test_batch_norm_buffers_versions_and_gradients(mode: str) -> None:
    """Writes into buffers without history keep eager's autograd: the running statistics, the
    step counter and their versions are eager's after every step."""
    import copy

    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU()
    )
    ref = copy.deepcopy(net)
    comp = compiled(net, mode)
    for _ in range(3):
        x = torch.randn(2, 3, 6, 6)
        out, want = comp(x).square().mean(), ref(x).square().mean()
        out.backward()
        want.backward()
        torch.testing.assert_close(out, want)
        for p, q in zip(net.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
        for b, c in zip(net.buffers(), ref.buffers()):
            torch.testing.assert_close(b, c)
            assert b._version == c._version
    assert replays(comp)


@pytest.mark.parametrize("mode", ("trace", "default"))
def test_written_inputs_keep_eager_version_checks(mode: str) -> None:
    def write_after(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = (x * w).sum()  # saves w, then writes it: eager's backward refuses
        w.add_(1)
        return y

    def write_before(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        w.add_(1)
        return (x * w).sum()  # saves the written w: runs

    for fn, refuses in ((write_after, True), (write_before, False)):
        comp = compiled(fn, mode)
        for _ in range(2):  # compiled (strict mode: on the second call), no backward
            comp(*fresh((3,), (3,), grad=(True, False)))
        # A backward eager refuses is the compiled pair's to refuse (`AutogradPlan.refused`).
        assert replays(comp) == (not refuses)
        x, w = fresh((3,), (3,), grad=(True, False))
        xr, wr = clones([x, w])
        out, ref = comp(x, w), fn(xr, wr)
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(w, wr)
        assert w._version == wr._version
        if refuses:
            for o in (out, ref):
                with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                    o.backward()
        else:
            out.backward()
            ref.backward()
            torch.testing.assert_close(x.grad, xr.grad)


@pytest.mark.parametrize("mode", ("trace", "default"))
def test_an_output_returned_twice_and_an_input_without_gradient(mode: str) -> None:
    def twice(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = (x.detach() * w).sum()  # x requires grad and gets none
        return y, y

    comp, (x, w), (xr, wr) = replaying(twice, mode, (3,), (3,), grad=(True, True))
    got, ref = comp(x, w), twice(xr, wr)
    assert got[0] is got[1] and ref[0] is ref[1]
    torch.testing.assert_close(got[0], ref[0])
    got[0].backward()
    ref[0].backward()
    assert x.grad is None and xr.grad is None
    torch.testing.assert_close(w.grad, wr.grad)


def _conv_bn(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    y = F.batch_norm(F.conv2d(x, w, padding=1), None, None, g, b, training=True)
    return F.relu(y).mean((2, 3))


_W = torch.randn(8, 8, requires_grad=True)
_CHECKED = {
    "layer_norm_gelu": (
        lambda x, w, g: F.gelu(F.layer_norm(x, (6,), g) @ w),
        ((4, 6), (6, 5), (6,)),
        (True, True, True),
    ),
    "conv_batch_norm": (
        _conv_bn,
        ((2, 3, 5, 5), (4, 3, 3, 3), (4,), (4,)),
        (False, True, True, True),
    ),
    "softmax_views": (
        lambda x, w: torch.softmax((x.t() @ w).view(-1, 2), -1).expand(3, -1, -1) * 2,
        ((5, 4), (5, 6)),
        (True, True),
    ),
    "dropout": (
        lambda x: F.dropout(x @ _W, p=0.5, training=True).tanh().sum(),
        ((3, 8),),
        (False,),
    ),
}


@pytest.mark.parametrize("name", sorted(_CHECKED))
def test_recorded_results_decide_as_meta_kernels(name: str, monkeypatch: Any) -> None:
    """The check answers each op with meta tensors of the trace's recorded results
    (`_RecordedResults`) instead of running its meta kernel; the autograd graph and the saved
    bytes it finds must be the meta kernels' exactly, and the program still matches eager."""
    from aotc import eagerautograd as ea

    real_replay, recorded = ea._replay, ea._RecordedResults

    class Kernels(recorded):  # type: ignore[misc, valid-type]
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
            return func(*args, **(kwargs or {}))

    pairs = []

    def both(*args: Any) -> Any:
        found = real_replay(*args)
        monkeypatch.setattr(ea, "_RecordedResults", Kernels)
        try:
            pairs.append((found, real_replay(*args)))
        finally:
            monkeypatch.setattr(ea, "_RecordedResults", recorded)
        return found

    monkeypatch.setattr(ea, "_replay", both)
    fn, shapes, grad = _CHECKED[name]
    torch.manual_seed(0)
    comp = compiled(fn, "trace")
    warm(comp, *fresh(*shapes, grad=grad))
    # Dropout keeps the pair (its partition saves less than eager's mask and result).
    assert replays(comp) == (name != "dropout")
    assert pairs and all(a == b and a is not None for a, b in pairs)
    ins = fresh(*shapes, grad=grad)
    ref_ins = clones(ins)
    torch.manual_seed(1)
    out = comp(*ins)
    torch.manual_seed(1)
    ref = fn(*ref_ins)
    torch.testing.assert_close(out, ref)
    out.sum().backward()
    ref.sum().backward()
    for a, b in zip(ins, ref_ins):
        assert (a.grad is None) == (b.grad is None)
        if b.grad is not None:
            torch.testing.assert_close(a.grad, b.grad)
