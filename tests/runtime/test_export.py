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
    # The partition saves what eager's autograd does: the artifact's calls let eager's autograd
    # record the backward (Note [Eager autograd on the ATen path] in aotc/eagerautograd.py).
    assert loaded.artifact.program.plan.eager_autograd
    assert type(out.grad_fn).__name__ == type(mlp_step(*mlp_args())[0].grad_fn).__name__


@pytest.mark.parametrize("capture", ["dynamo", "trace"])
def test_exporting_a_compiled_function_exports_what_it_was_made_from(tmp_path, capture):
    compiled = aotc.compile(mlp_step, capture=capture)
    compiled(*mlp_args())
    loaded = _export_load(compiled, mlp_args(), tmp_path)
    assert_matches_eager(mlp_step, mlp_args, compiled=loaded, runs=2)
    net = aotc.compile(Net(), capture=capture)
    path = aotc.export(net, torch.randn(5, 3), path=tmp_path / "net")
    assert "self.norm.running_mean" in aotc.load(path, module=Net()).artifact.state_names


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


def _train_and_compare(eager, bound, loaded, steps=3, train=True, batches=()):
    for step in range(len(batches) or steps):
        x = torch.randn(batches[step] if batches else 5, 3)
        want, got = eager(x), loaded(x)
        _assert_tensor_equal(got, want, f"step {step} output", 1e-5, 1e-5)
        if train:
            want.sum().backward()
            got.sum().backward()
        # A gradient BatchNorm makes zero in exact arithmetic (the bias before it) is float32
        # cancellation noise of the step's other gradient terms: at a batch of 2 it is ~2e-4
        # in eager itself, so the absolute tolerance scales with the step's largest gradient.
        scale = max((p.grad.abs().max().item() for p in eager.parameters() if train), default=1)
        for (name, pw), (_, pg) in zip(eager.named_parameters(), bound.named_parameters()):
            if train:
                atol = max(1e-5, 1e-4 * scale)
                torch.testing.assert_close(pg.grad, pw.grad, rtol=1e-4, atol=atol, msg=name)
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
        # a dynamic artifact runs at other sizes too (batch, hidden and output sizes)
        sizes = [(4, 3, 5, 2), (9, 3, 7, 4), (2, 3, 3, 6)] if kind == "dyn" else [(4, 3, 5, 2)]
        for n, d, h, o in sizes:
            x = torch.randn(n, d)
            ws = [torch.randn(d, h), torch.randn(h), torch.randn(h, o)]
            got_w = [w.clone().requires_grad_() for w in ws]
            want_w = [w.clone().requires_grad_() for w in ws]
            got = loaded(x, *got_w)
            want = mlp_step(x, *want_w)
            (got[0].sum() * 3 + got[1]).backward()
            (want[0].sum() * 3 + want[1]).backward()
            for g, w in zip([*got, *(t.grad for t in got_w)], [*want, *(t.grad for t in want_w)]):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        if kind == "dyn":
            from aotc.runtime import kernels
            from aotc.runtime.errors import GuardError

            assert not kernels._FAILED, kernels._FAILED
            launched = {(x, r) for _, _, x, r in kernels._BEST}
            assert len(launched) >= 3, launched  # kernels ran at each size, none fell back
            try:
                loaded(torch.randn(1, 3), *got_w)  # outside the guard (sizes >= 2)
            except GuardError as e:
                assert "outside its guard" in str(e), e
            else:
                raise AssertionError("a call outside the guard ran")
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
        dyn = aotc.export(
            mlp_step, *mlp_args(), path=tmp_path / "dyn", backend="triton", dynamic=True
        )
        paths.append("dyn:" + dyn)
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


# --------------------------------------------------------------------------- dynamic Triton


def swish_head(x, w):
    y = x * torch.sigmoid(x) + 1.0
    return (y @ w).softmax(-1), y.sum(0)


def swish_args(n, m, k, grad=True):
    return lambda: (torch.randn(n, m, requires_grad=grad), torch.randn(m, k, requires_grad=grad))


def _launch_sizes(loaded):
    """(kernel key, xnumel, rnumel) of every launch of the loaded artifact's kernels so far;
    asserts its lowerings are symbolic (sizes stored as expressions) and no kernel fell back."""
    from aotc.runtime import kernels

    programs = [loaded.artifact.program.forward_kernels, loaded.artifact.program.backward_kernels]
    assert programs[0] is not None and programs[0].symbols
    mine = {
        sp.kernel_file.removesuffix(".py").rsplit("_", 1)[-1]  # files are named by source key
        for gp in programs
        if gp is not None
        for sp in gp.steps
        if sp.kernel_file is not None
    }
    assert mine and not mine & {key for key, _ in kernels._FAILED}
    return {(key, x, r) for key, _, x, r in kernels._BEST if key in mine}


@needs_interpreter
def test_dynamic_triton_function_training(tmp_path):
    path = aotc.export(
        swish_head, *swish_args(8, 16, 4)(), path=tmp_path / "a", dynamic=True, backend="triton"
    )
    assert os.listdir(os.path.join(path, "kernels"))
    with open(os.path.join(path, "program.json")) as f:
        assert '"aotc.runtime.symexpr.SizeExpr"' in f.read()  # sizes stored as expressions
    loaded = aotc.load(path)
    assert loaded.artifact.program.backward_kernels is not None
    before = _launch_sizes(loaded)
    for n, m, k in ((8, 16, 4), (5, 7, 3), (19, 33, 6)):  # every dim is symbolic
        assert_matches_eager(
            swish_head, swish_args(n, m, k), compiled=loaded, runs=1, rtol=1e-5, atol=1e-5
        )
    new = _launch_sizes(loaded) - before
    assert len({(x, r) for _, x, r in new}) >= 3  # the same kernels ran at the new sizes
    with pytest.raises(GuardError, match=r"sizes \[\(1, 16\), \(16, 4\)\] fall outside its guard"):
        loaded(*swish_args(1, 16, 4)())  # the trace assumed sizes >= 2 (0/1 specialize)
    with pytest.raises(GuardError, match="outside its guard"):
        loaded(torch.randn(4, 6, requires_grad=True), torch.randn(5, 3, requires_grad=True))


@needs_interpreter
def test_dynamic_triton_function_inference(tmp_path):
    with torch.no_grad():
        path = aotc.export(
            swish_head, *swish_args(6, 8, 3, False)(), path=tmp_path / "a", dynamic=True,
            backend="triton",
        )  # fmt: skip
        loaded = aotc.load(path)
        assert loaded.artifact.backward is None and loaded.artifact.forward_kernels is not None
        for n, m, k in ((6, 8, 3), (3, 21, 2), (12, 5, 7)):
            assert_matches_eager(
                swish_head, swish_args(n, m, k, False), compiled=loaded, backward=False,
                rtol=1e-5, atol=1e-5,
            )  # fmt: skip


class NormNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.head(torch.nn.functional.gelu(self.norm(self.lin(x))))


@needs_interpreter
@pytest.mark.parametrize("net", [NormNet, Net])
def test_dynamic_triton_module_training(tmp_path, net):
    torch.manual_seed(0)
    eager = net()
    path = aotc.export(
        net(), torch.randn(5, 3), path=tmp_path / "net", dynamic=True, backend="triton"
    )
    bound = copy.deepcopy(eager)
    loaded = aotc.load(path, module=bound)
    assert loaded.artifact.program.backward_kernels is not None
    _train_and_compare(eager, bound, loaded, batches=(5, 9, 2, 16))
    with pytest.raises(GuardError, match="outside its guard"):
        loaded(torch.randn(5, 4))  # the parameters fix the feature size


@needs_interpreter
def test_dynamic_triton_module_inference(tmp_path):
    torch.manual_seed(0)
    eager = NormNet().eval()
    bound = copy.deepcopy(eager)
    with torch.no_grad():
        path = aotc.export(
            NormNet().eval(), torch.randn(5, 3), path=tmp_path / "net", dynamic=True,
            backend="triton",
        )  # fmt: skip
        loaded = aotc.load(path, module=bound)
        assert loaded.artifact.backward is None
        _train_and_compare(eager, bound, loaded, train=False, batches=(5, 3, 12))


@needs_interpreter
def test_dynamic_triton_size_text_is_checked_on_load(tmp_path):
    import hashlib

    path = aotc.export(
        swish_head, *swish_args(8, 16, 4)(), path=tmp_path / "a", dynamic=True, backend="triton"
    )
    program = os.path.join(path, "program.json")
    with open(program) as f:
        body = json.load(f)
    text = json.dumps(body)
    # a size expression replaced by other Python: refused by the size grammar, never run
    bad = text.replace('"text": "s14"', '"text": "__import__(\'os\').getpid()"', 1)
    if bad == text:  # the symbol has another name in this torch: edit the first expression
        import re

        bad = re.sub(r'"text": "[^"]*"', '"text": "print(1)"', text, count=1)
    assert bad != text
    with open(program, "w") as f:
        f.write(bad)
    with open(os.path.join(path, "manifest.json")) as f:
        files = json.load(f)["files"]
    _edit_manifest(path, files={**files, "program.json": hashlib.sha256(bad.encode()).hexdigest()})
    with pytest.raises(ArtifactError, match="program.json cannot be decoded.*size expression"):
        aotc.load(path)


@needs_interpreter
def test_dynamic_triton_gpt_block_sequence_lengths(tmp_path):
    """A transformer block (attention without SDPA, LayerNorm, MLP): reductions, matmuls as ATen
    calls between kernels, symbolic strides of ATen results; exported once, run at other
    batch sizes and sequence lengths, gradients of the bound module's parameters compared."""
    from examples.gpt_block import Block

    torch.manual_seed(0)
    block = Block(16, 2, use_sdpa=False)
    path = aotc.export(
        block, torch.randn(2, 5, 16), path=tmp_path / "gpt", dynamic=True, backend="triton"
    )
    bound, eager = copy.deepcopy(block), copy.deepcopy(block)
    loaded = aotc.load(path, module=bound)
    before = _launch_sizes(loaded)
    for b, n in ((3, 7), (2, 11)):
        x = torch.randn(b, n, 16)
        got, want = loaded(x), eager(x)
        got.pow(2).sum().backward()
        want.pow(2).sum().backward()
        _assert_tensor_equal(got, want, f"output at {(b, n)}", 1e-4, 1e-5)
        for (name, pg), (_, pw) in zip(bound.named_parameters(), eager.named_parameters()):
            torch.testing.assert_close(pg.grad, pw.grad, rtol=1e-4, atol=1e-5, msg=name)
        bound.zero_grad()
        eager.zero_grad()
    assert len(_launch_sizes(loaded) - before) > 2
    with pytest.raises(GuardError, match="outside its guard"):
        loaded(torch.randn(1, 4, 16))  # a batch of 1 was specialized away by the trace


def strided_slice(x):
    return x[1:, ::2].sigmoid().cumsum(0)


@needs_interpreter
def test_dynamic_triton_strided_slice(tmp_path):
    """Sizes with max/min (`x[:, ::2]` has stride max(1, (s + 1) // 2)): the compiled function
    (which raised before max/min had a size-code form) and the loaded artifact both run."""

    def args(n):
        return lambda: (torch.randn(n, 2 * n - 1, requires_grad=True),)

    compiled = aotc.compile(strided_slice, dynamic=True, backend="triton", capture="trace")
    path = aotc.export(
        strided_slice, *args(4)(), path=tmp_path / "s", dynamic=True, backend="triton"
    )
    loaded = aotc.load(path)
    for n in (4, 7, 3):
        assert_matches_eager(strided_slice, args(n), compiled=compiled, runs=1)
        assert_matches_eager(strided_slice, args(n), compiled=loaded, runs=1)
