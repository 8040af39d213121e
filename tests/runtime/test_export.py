"""aotc.export / aotc.load: exported artifacts run like eager (differential, fresh inputs), load
without the compiler, and refuse artifacts that do not fit this process."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import aotc
from aotc.runtime.artifact import ArtifactError
from aotc.runtime.errors import GuardError
from tests.conftest import _assert_tensor_equal, assert_matches_eager
from tests.triton_helpers import needs_interpreter

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _export_load(fn, args, tmp_path, name="art", module=None, **options):
    path = aotc.export(fn, *args, path=tmp_path / name, **options)
    return aotc.load(path, module=module)


# --------------------------------------------------------------------------- functions


def mlp_step(x, w1, b, w2):
    h = torch.tanh(x @ w1 + b)
    return (h @ w2).softmax(-1), h.sum()


def mlp_args():
    return (
        torch.randn(4, 3),
        torch.randn(3, 5, requires_grad=True),
        torch.randn(5, requires_grad=True),
        torch.randn(5, 2, requires_grad=True),
    )


def test_function_training_matches_eager(tmp_path):
    loaded = _export_load(mlp_step, mlp_args(), tmp_path)
    assert loaded.artifact.backward is not None
    assert_matches_eager(mlp_step, mlp_args, compiled=loaded, runs=3)
    out, _ = loaded(*mlp_args())
    assert type(out.grad_fn).__name__.startswith("AotcFunction")  # one autograd node


def test_function_inference_matches_eager(tmp_path):
    with torch.no_grad():
        loaded = _export_load(mlp_step, mlp_args(), tmp_path)
        assert loaded.artifact.backward is None
        assert_matches_eager(mlp_step, mlp_args, compiled=loaded, backward=False)
    with pytest.raises(GuardError, match="grad mode"):
        loaded(*mlp_args())  # exported under no_grad, called with grad on


def update_stats(x, running, count):
    running.mul_(0.9).add_(x.mean(0), alpha=0.1)  # a buffer update (input mutation)
    count.add_(1)
    return x - running, x.view(-1)  # a fresh output and a view of an input


def stats_args():
    return torch.randn(6, 4, requires_grad=True), torch.randn(4), torch.zeros((), dtype=torch.long)


def test_input_mutation_and_aliasing(tmp_path):
    example = stats_args()
    before = [t.detach().clone() for t in example]
    loaded = _export_load(update_stats, example, tmp_path)
    for t, b in zip(example, before):  # export traces; it never runs the program
        assert torch.equal(t, b)
    assert_matches_eager(update_stats, stats_args, compiled=loaded, runs=3)


def test_signature_mismatch_is_explained(tmp_path):
    loaded = _export_load(mlp_step, mlp_args(), tmp_path)
    x, w1, b, w2 = mlp_args()
    with pytest.raises(GuardError, match=r"x shape \(4, 3\) -> \(7, 3\).*export it\s+again"):
        loaded(torch.randn(7, 3), w1, b, w2)
    with pytest.raises(GuardError, match="arguments shaped"):
        loaded(x, w1, b)


def test_dynamic_sizes(tmp_path):
    def f(x, w):
        return (x @ w).relu().sum(0) * x.shape[0]

    def args(n):
        return lambda: (torch.randn(n, 3), torch.randn(3, 4, requires_grad=True))

    loaded = _export_load(f, args(5)(), tmp_path, dynamic=True)
    assert loaded.artifact.dynamic and loaded.artifact.shape_guard is not None
    for n in (5, 2, 9):
        assert_matches_eager(f, args(n), compiled=loaded, runs=1)
    with pytest.raises(GuardError, match="dtype"):
        loaded(torch.randn(3, 3, dtype=torch.float64), torch.randn(3, 4, requires_grad=True))


def test_closure_tensors_are_refused(tmp_path):
    w = torch.randn(3, 3)

    def f(x):
        return x @ w

    with pytest.raises(ArtifactError, match="reads tensors it does not take as arguments"):
        aotc.export(f, torch.randn(2, 3), path=tmp_path / "art")


# --------------------------------------------------------------------------- modules


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 8)
        self.norm = torch.nn.BatchNorm1d(8)  # running stats: buffers the forward updates
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.head(torch.relu(self.norm(self.lin(x))))


def _train_and_compare(eager, bound, loaded, steps=3, train=True):
    for step in range(steps):
        x = torch.randn(5, 3)
        want, got = eager(x), loaded(x)
        _assert_tensor_equal(got, want, f"step {step} output", 1e-5, 1e-5)
        if train:
            want.sum().backward()
            got.sum().backward()
        for (name, pw), (_, pg) in zip(eager.named_parameters(), bound.named_parameters()):
            if train:
                torch.testing.assert_close(pg.grad, pw.grad, rtol=1e-4, atol=1e-5, msg=name)
                with torch.no_grad():
                    pw -= 0.1 * pw.grad
                    pg -= 0.1 * pg.grad
                pw.grad = pg.grad = None
        for (name, bw), (_, bg) in zip(eager.named_buffers(), bound.named_buffers()):
            torch.testing.assert_close(bg, bw, msg=name)


def test_module_training_binds_at_load(tmp_path):
    torch.manual_seed(0)
    eager = Net()
    path = aotc.export(Net(), torch.randn(5, 3), path=tmp_path / "net")
    with pytest.raises(ArtifactError, match=r"module=m.*|self\.lin\.weight"):
        aotc.load(path)
    bound = copy.deepcopy(eager)
    loaded = aotc.load(path, module=bound)
    assert "self.norm.running_mean" in loaded.artifact.state_names
    _train_and_compare(eager, bound, loaded)
    bound.eval()
    with pytest.raises(GuardError, match="training"):
        loaded(torch.randn(5, 3))


def test_module_inference(tmp_path):
    torch.manual_seed(0)
    eager = Net().eval()
    bound = copy.deepcopy(eager)
    with torch.no_grad():
        path = aotc.export(Net().eval(), torch.randn(5, 3), path=tmp_path / "net")
        loaded = aotc.load(path, module=bound)
        _train_and_compare(eager, bound, loaded, train=False)


def test_module_attribute_is_checked(tmp_path):
    m = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LeakyReLU(0.2))
    path = aotc.export(m, torch.randn(2, 3), path=tmp_path / "m")
    bound = copy.deepcopy(m)
    loaded = aotc.load(path, module=bound)
    x = torch.randn(2, 3)
    torch.testing.assert_close(loaded(x), m(x))
    bound[1].negative_slope = 0.5
    with pytest.raises(GuardError, match="negative_slope"):
        loaded(x)


# --------------------------------------------------------------------------- Triton backend


@needs_interpreter
def test_triton_backend_cpu(tmp_path):
    def f(x, w):
        y = x * torch.sigmoid(x) + 1.0
        return (y @ w).softmax(-1), y.sum(0)

    def args():
        return torch.randn(8, 16, requires_grad=True), torch.randn(16, 4, requires_grad=True)

    path = aotc.export(f, *args(), path=tmp_path / "tri", backend="triton")
    kernels = os.listdir(os.path.join(path, "kernels"))
    assert kernels and all(k.endswith(".py") for k in kernels)
    loaded = aotc.load(path)
    assert loaded.artifact.forward_kernels is not None
    assert_matches_eager(f, args, compiled=loaded, runs=2, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- refusals


def _edit_manifest(path, **changes):
    file = os.path.join(path, "manifest.json")
    with open(file) as f:
        manifest = json.load(f)
    manifest.update(changes)
    with open(file, "w") as f:
        json.dump(manifest, f)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"version": 99}, "format version 99.*Export it again"),
        ({"torch": "1.0.0"}, "exported with torch '1.0.0'.*export it again"),
        ({"device": "tpu"}, "device kind 'tpu'"),
    ],
)
def test_refuses_other_versions_and_devices(tmp_path, change, match):
    path = aotc.export(mlp_step, *mlp_args(), path=tmp_path / "art")
    _edit_manifest(path, **change)
    with pytest.raises(ArtifactError, match=match):
        aotc.load(path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_refuses_cuda_artifact_without_cuda(tmp_path):
    path = aotc.export(mlp_step, *mlp_args(), path=tmp_path / "art")
    _edit_manifest(path, device="cuda")
    with pytest.raises(ArtifactError, match="exported for cuda.*no CUDA device"):
        aotc.load(path)


def test_refuses_tampered_file(tmp_path):
    path = aotc.export(mlp_step, *mlp_args(), path=tmp_path / "art")
    program = os.path.join(path, "program.json")
    with open(program) as f:
        text = f.read()
    with open(program, "w") as f:
        f.write(text.replace("aten::tanh.default", "aten::sigmoid.default"))
    with pytest.raises(ArtifactError, match="checksum mismatch for program.json"):
        aotc.load(path)


# --------------------------------------------------------------------------- without the compiler

_LOADER = textwrap.dedent(
    """
    import sys

    class Refuse:
        BLOCKED = ("aotc.passes", "aotc.pipeline", "aotc.tracer", "aotc.api", "aotc.exporting",
                   "aotc.metadata", "aotc.persist", "networkx")

        def find_spec(self, name, path=None, target=None):
            if any(name == b or name.startswith(b + ".") for b in self.BLOCKED):
                raise ImportError(f"blocked in this test: {name}")
            return None

    import torch
    import aotc  # (in a checkout, this puts a finder for aotc.passes first: Refuse goes before it)

    sys.meta_path.insert(0, Refuse())

    def mlp_step(x, w1, b, w2):
        h = torch.tanh(x @ w1 + b)
        return (h @ w2).softmax(-1), h.sum()

    def make_seq():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.ReLU())

    for arg in sys.argv[1:]:
        kind, path = arg.split(":", 1)
        if kind == "mod":  # a module artifact bound to a fresh module; eager on a twin
            bound, eager = make_seq(), make_seq()
            loaded = aotc.load(path, module=bound)
            x = torch.randn(6, 3)
            got, want = loaded(x), eager(x)
            got.pow(2).sum().backward()
            want.pow(2).sum().backward()
            torch.testing.assert_close(got, want)
            for (n, a), (_, b) in zip(bound.named_parameters(), eager.named_parameters()):
                torch.testing.assert_close(a.grad, b.grad, msg=n)
            for (n, a), (_, b) in zip(bound.named_buffers(), eager.named_buffers()):
                torch.testing.assert_close(a, b, msg=n)  # running stats updated in place
            print("ok", path, type(got.grad_fn).__name__)
            continue
        loaded = aotc.load(path)
        torch.manual_seed(3)
        x = torch.randn(4, 3)
        ws = [torch.randn(3, 5), torch.randn(5), torch.randn(5, 2)]
        got_w = [w.clone().requires_grad_() for w in ws]
        want_w = [w.clone().requires_grad_() for w in ws]
        got = loaded(x, *got_w)
        want = mlp_step(x, *want_w)
        (got[0].sum() * 3 + got[1]).backward()
        (want[0].sum() * 3 + want[1]).backward()
        for g, w in zip([*got, *(t.grad for t in got_w)], [*want, *(t.grad for t in want_w)]):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        print("ok", path, type(got[0].grad_fn).__name__)
    compiler = [m for m in sys.modules
                if m.startswith(("aotc.passes", "aotc.pipeline", "aotc.tracer", "aotc.api"))]
    assert not compiler, compiler
    """
)


def test_load_runs_without_the_compiler(tmp_path):
    seq = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.ReLU())
    paths = [
        "fn:" + aotc.export(mlp_step, *mlp_args(), path=tmp_path / "aten"),
        "mod:" + aotc.export(seq, torch.randn(6, 3), path=tmp_path / "seq"),
    ]
    if importlib.util.find_spec("triton") is not None:
        tri = aotc.export(mlp_step, *mlp_args(), path=tmp_path / "tri", backend="triton")
        paths.append("fn:" + tri)
    script = tmp_path / "loader.py"
    script.write_text(_LOADER)
    env = dict(os.environ, PYTHONPATH=ROOT)
    result = subprocess.run(
        [sys.executable, str(script), *map(str, paths)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("ok ") == len(paths), result.stdout
    assert "AotcFunction" in result.stdout


@needs_interpreter
def test_dynamic_triton_is_refused_with_a_reason(tmp_path):
    def f(x):
        return (x * 2).sin().sum(0)

    with pytest.raises(ArtifactError, match="dynamic=True and backend='triton'.*backend='aten'"):
        aotc.export(f, torch.randn(6, 4), path=tmp_path / "a", dynamic=True, backend="triton")
