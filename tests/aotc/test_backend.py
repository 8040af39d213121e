"""torch.compile(backend="aotc") on small functions and modules, against eager."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

import aotc.backend
from aotc.backend import aotc_backend


def test_torch_compile_with_aotc_backend_matches_eager():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    ref = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    ref.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend=aotc_backend)
    x = torch.randn(5, 6)
    out = compiled(x)
    want = ref(x)
    torch.testing.assert_close(out, want)
    out.sum().backward()
    want.sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_backend_resolves_by_name_after_install():
    torch._dynamo.reset()
    from torch._dynamo.backends.registry import list_backends

    if "aotc" not in list_backends(exclude_tags=()):
        import pytest

        pytest.skip("aotc is not installed in this environment (entry point not registered)")

    def f(x, y):
        y.add_(1)
        return (x * y).sin()

    compiled = torch.compile(f, backend="aotc")
    x = torch.randn(4, requires_grad=True)
    y1, y2 = torch.randn(4), None
    y2 = y1.clone()
    out = compiled(x, y1)
    want = f(x, y2)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(y1, y2)


def test_backend_name_resolves_in_a_fresh_process_without_import(tmp_path):
    import os
    import subprocess
    import sys

    from torch._dynamo.backends.registry import list_backends

    if "aotc" not in list_backends(exclude_tags=()):
        import pytest

        pytest.skip("aotc is not installed in this environment (entry point not registered)")
    script = tmp_path / "script.py"
    script.write_text(
        "import sys, torch\n"
        "assert 'aotc' not in sys.modules\n"
        "f = torch.compile(lambda x: (x * 2).sin(), backend='aotc')\n"
        "x = torch.randn(3)\n"
        "torch.testing.assert_close(f(x), (x * 2).sin())\n"
        "print(dict(sys.modules['aotc.backend'].stats))\n"
    )
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "'ahead': 1" in done.stdout


def test_options_pass_through_torch_compile(tmp_path):
    torch._dynamo.reset()

    def f(x, w):
        return (x @ w).tanh().sum()

    compiled = torch.compile(
        f, backend="aotc", options={"dump": str(tmp_path), "partitioner": "simple"}
    )
    x, w = torch.randn(4, 5), torch.randn(5, 3, requires_grad=True)
    compiled(x, w).backward()
    folders = list(tmp_path.iterdir())
    assert len(folders) == 1
    assert "# plan: simple" in (folders[0] / "03_partition.txt").read_text()
    with pytest.raises(Exception, match="unknown option"):
        torch._dynamo.reset()
        torch.compile(f, backend="aotc", options={"no_such_option": 1})(x, w)


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_inductor_modes_are_accepted_and_ignored(mode, caplog):
    """Code switching `backend="inductor"` to "aotc" may keep its `mode=`: compiled as usual."""
    torch._dynamo.reset()

    def f(x, w):
        return (x @ w).tanh().sum()

    compiled = torch.compile(f, backend="aotc", mode=mode)
    x = torch.randn(4, 5)
    w1 = torch.randn(5, 3, requires_grad=True)
    w2 = w1.detach().clone().requires_grad_()
    with caplog.at_level("WARNING", logger="aotc.graphs"):
        got = compiled(x, w2)
    want = f(x, w1)
    torch.testing.assert_close(got, want)
    got.backward()
    want.backward()
    torch.testing.assert_close(w2.grad, w1.grad)
    with pytest.raises(Exception, match="unknown mode"):
        torch._dynamo.reset()
        torch.compile(f, backend="aotc", mode="turbo")(x, w1)


def test_graph_breaks_compile_each_subgraph_ahead():
    torch._dynamo.reset()
    before = dict(aotc.backend.stats)
    calls = []

    def f(x, w):
        y = (x @ w).relu()
        calls.append(1)  # a side effect Dynamo cannot trace: graph break
        torch._dynamo.graph_break()
        return (y * w.sum()).logsumexp(-1).sum()

    compiled = torch.compile(f, backend="aotc")
    x, w = torch.randn(4, 4), torch.randn(4, 4, requires_grad=True)
    got = compiled(x, w)
    (g,) = torch.autograd.grad(got, w)
    want = f(x, w)
    (gw,) = torch.autograd.grad(want, w)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(g, gw)
    assert aotc.backend.stats["ahead"] - before.get("ahead", 0) == 2
    assert aotc.backend.stats["fallback"] == before.get("fallback", 0)


def test_backend_relies_on_dynamo_guards_and_lifts_buffers():
    """BatchNorm's parameters and buffers arrive as Dynamo graph inputs; running stats are
    copied back; the returned callable runs its one entry without aotc guards."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8))
    ref = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8))
    ref.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend="aotc")
    for _ in range(2):
        x = torch.randn(5, 6)
        torch.testing.assert_close(compiled(x), ref(x))
    for (name, b), (_, r) in zip(model.named_buffers(), ref.named_buffers()):
        torch.testing.assert_close(b, r, msg=lambda m, name=name: f"{name}: {m}")
    assert int(model[1].num_batches_tracked) == 2


def test_backend_called_directly_with_a_plain_fake_mode():
    """Outside Dynamo (a plain fake mode, no ShapeEnv) the graph still compiles ahead, and the
    returned callable runs its one entry: no aotc dispatcher, no aotc guard per call."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    gm = torch.fx.symbolic_trace(lambda x: x.sin() * 2)
    mode = FakeTensorMode()
    x = torch.randn(3)
    fake = mode.from_tensor(x)
    gm.graph.find_nodes(op="placeholder")[0].meta["example_value"] = fake
    run = aotc_backend(gm, [fake])
    torch.testing.assert_close(run(x), x.sin() * 2)
    assert run.aotc_graph.records[0].name == "dynamo_graph"
    assert not hasattr(run, "aotc_compiled")  # the lazy fallback path was not taken
