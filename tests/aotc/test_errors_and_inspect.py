"""Errors are clear and typed; inspection records hold every stage; structural guarantees."""

from __future__ import annotations

import ast
import os
import pathlib

import pytest
import torch

import aotc
from aotc.passes.descriptors import SavedOutput

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_double_backward_matches_eager_or_raises_clear_error():
    compiled = aotc.compile(lambda x: (x**3).sum())
    x = torch.randn(4, requires_grad=True)
    (g,) = torch.autograd.grad(compiled(x), x, create_graph=True)
    torch.testing.assert_close(g, 3 * x.detach() ** 2)
    (gg,) = torch.autograd.grad(g.sum(), x)
    torch.testing.assert_close(gg, 6 * x.detach())

    # An input the program itself overwrote has lost the value the recomputation needs: a
    # short, clear refusal naming it.
    def scale(h):
        h.mul_(2)
        return h.sin().sum()

    h = x * 1
    with pytest.raises(aotc.UnsupportedError, match="double backward") as info:
        torch.autograd.grad(aotc.compile(scale, capture="trace")(h), x, create_graph=True)
    assert "create_graph" in str(info.value) and "'h'" in str(info.value)
    assert len(str(info.value)) < 700


def test_data_dependent_control_flow_raises_naming_the_line():
    def f(x):
        if x.sum() > 0:
            return x * 2
        return x

    with pytest.raises(aotc.UnsupportedError, match="depends on tensor values") as info:
        aotc.compile(f, capture="trace")(torch.randn(3))
    assert "test_errors_and_inspect.py" in str(info.value)
    assert "torch.where" in str(info.value)


def test_item_raises():
    with pytest.raises(aotc.UnsupportedError, match=r"\.item\(\)"):
        aotc.compile(lambda x: x * x.max().item(), capture="trace")(torch.randn(3))


def test_data_dependent_output_shape_raises():
    with pytest.raises(aotc.UnsupportedError):
        aotc.compile(lambda x: x.nonzero(), capture="trace")(torch.randn(5))


def test_unknown_output_type_raises():
    class Opaque:
        """An object aotc has no way to return from a graph."""

    with pytest.raises(aotc.UnsupportedError, match="output 1 has type Opaque"):
        aotc.compile(lambda x: (x * 2, Opaque()), capture="trace")(torch.randn(3))


def test_new_parameter_output_raises():
    with pytest.raises(aotc.UnsupportedError, match="nn.Parameter created inside"):
        aotc.compile(lambda x: (x + 1, torch.nn.Parameter(x * 2)), capture="trace")(torch.randn(3))


def test_bad_options_name_the_option():
    with pytest.raises(TypeError, match="unknown option"):
        aotc.compile(lambda x: x, no_such_option=1)
    with pytest.raises(ValueError, match="backend='bogus'"):
        aotc.compile(lambda x: x, backend="bogus")
    with pytest.raises(TypeError, match="expects a function or nn.Module"):
        aotc.compile(3)


def test_dynamic_mutation_through_aliased_inputs_gets_a_static_entry():
    """Not guessed with symbolic sizes: compiled for the call's exact sizes, as eager runs it
    (Note [Static entries under dynamic=True])."""

    def f(a, b):
        a.mul_(2)
        return a + b

    compiled = aotc.compile(f, dynamic=True, capture="trace")
    base, ref = torch.randn(8), None
    ref = base.clone()
    out = compiled(base[:4], base[4:])
    want = f(ref[:4], ref[4:])
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(base, ref)
    # a static entry: another size compiles again, the first size reuses its entry
    base2, ref2 = torch.randn(12), None
    ref2 = base2.clone()
    torch.testing.assert_close(compiled(base2[:6], base2[6:]), f(ref2[:6], ref2[6:]))
    torch.testing.assert_close(base2, ref2)
    assert len(aotc.inspect(compiled)) == 2
    compiled(base[:4], base[4:])
    assert len(aotc.inspect(compiled)) == 2
    # the same sizes and strides with the views elsewhere in their base, or in a larger base:
    # the static entry's synthetic base does not fit, so each compiles its own
    for make in (lambda: torch.randn(8), lambda: torch.randn(10)):
        base3 = make()
        ref3 = base3.clone()
        torch.testing.assert_close(compiled(base3[4:8], base3[:4]), f(ref3[4:8], ref3[:4]))
        torch.testing.assert_close(base3, ref3)
    assert len(aotc.inspect(compiled)) == 4


def test_dynamic_entry_serves_every_size_of_a_tensor_passed_twice():
    def f(a, b, c):
        return (a * b).sum(0) + c

    compiled = aotc.compile(f, dynamic=True, capture="trace")
    for n in (4, 5, 7, 9):
        x, c = torch.randn(3, n, requires_grad=True), torch.randn(n)
        ref = x.detach().clone().requires_grad_()
        got, want = compiled(x, x, c), f(ref, ref, c)
        got.sum().backward()
        want.sum().backward()
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(x.grad, ref.grad)
    assert len(aotc.inspect(compiled)) == 1, compiled.recompile_reasons


def test_storage_swap_of_input_raises():
    def f(x, y):
        x.set_(y)
        return x * 2

    with pytest.raises(aotc.UnsupportedError, match="set_ / resize_") as info:
        aotc.compile(f, capture="trace")(torch.randn(3), torch.randn(3))
    assert "'x'" in str(info.value)


def test_inspect_record_has_every_stage():
    def f(x, w):
        return (x @ w).relu().sum()

    compiled = aotc.compile(f, cache=False)  # a cold compile: every stage ran
    compiled(torch.randn(3, 4), torch.randn(4, 2, requires_grad=True)).backward()
    (record,) = aotc.inspect(compiled)
    assert isinstance(record.joint, torch.fx.GraphModule)
    assert isinstance(record.forward, torch.fx.GraphModule)
    assert isinstance(record.backward, torch.fx.GraphModule)
    assert record.meta.inputs[1].requires_grad
    assert set(record.stage_seconds) >= {"metadata", "trace", "partition"}
    assert record.partition is not None and record.partition.saved_bytes > 0
    text = record.format()
    for stage in ("signature", "metadata", "joint", "partition", "forward", "backward", "epilogue"):
        assert f"# stage: {stage}" in text
    with pytest.raises(TypeError):
        aotc.inspect(f)


def test_dump_dir_writes_every_stage(tmp_path):
    compiled = aotc.compile(lambda x: x.sin().sum(), dump=str(tmp_path))
    compiled(torch.randn(3, requires_grad=True)).backward()
    (folder,) = list(tmp_path.iterdir())
    names = sorted(p.name for p in folder.iterdir())
    assert names[:3] == ["00_signature.txt", "01_metadata.txt", "02_joint.py"]
    assert "04_forward.py" in names and "05_backward.py" in names


def test_saved_tensor_hooks_see_exactly_the_saved_values():
    def f(x, w):
        return (x @ w).tanh().sum()

    compiled = aotc.compile(f)
    x, w = torch.randn(5, 4), torch.randn(4, 3, requires_grad=True)
    packed = []

    def pack(t):
        packed.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = compiled(x, w)
    out.backward()
    record = compiled.records[0]
    assert record.partition is not None
    assert len(packed) == len(record.partition.saved)
    assert sum(isinstance(d, SavedOutput) for d in record.partition.forward.outputs) == len(packed)
    want = w.grad.clone()
    w.grad = None
    f(x, w).backward()
    torch.testing.assert_close(want, w.grad)


def test_inputs_with_statically_no_gradient_are_detached():
    def f(x, unused):
        return x * 2, unused.shape[0]

    compiled = aotc.compile(f, capture="trace")  # aotc's graph takes `unused` as an input
    x, unused = torch.randn(3, requires_grad=True), torch.randn(2, requires_grad=True)
    out, n = compiled(x, unused)
    assert n == 2
    out.sum().backward()
    assert unused.grad is None and x.grad is not None
    assert compiled.records[0].training
    node = out.grad_fn
    assert len(node.next_functions) == 2  # x, and a None edge for the detached input
    assert node.next_functions[0][0] is not None and node.next_functions[1][0] is None


def test_imports_go_downward_only():
    """aotc -> passes -> runtime; runtime imports neither, passes never imports aotc, and no
    package imports AOTAutograd or Inductor internals."""
    forbidden_everywhere = (
        "torch._functorch.aot_autograd",
        "torch._functorch.partitioners",
        "torch._inductor",
    )
    # folder -> the aotc subpackages its modules may import (see Note [One import name])
    allowed = {
        "runtime": ("aotc.runtime",),
        "passes": ("aotc.passes", "aotc.runtime"),
        "aotc": ("aotc",),
    }
    for folder, ok in allowed.items():
        for path in (ROOT / folder).rglob("*.py"):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                names: list[str] = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                for name in names:
                    top = name.split(".")[0]
                    assert top not in ("runtime", "passes"), f"{path} imports {name} (not aotc.*)"
                    if top == "aotc":
                        assert any(name == o or name.startswith(o + ".") for o in ok), (
                            f"{path} imports {name}"
                        )
                    assert not name.startswith(forbidden_everywhere), f"{path} imports {name}"


def test_cli_version_and_help(capsys):
    from aotc import cli

    assert cli.main(["--version"]) == 0
    assert aotc.__version__ in capsys.readouterr().out
    assert cli.main([]) == 0
    assert "usage" in capsys.readouterr().out.lower()
    assert cli.main(["no-such-command"]) == 2


@pytest.mark.skipif(os.name != "posix", reason="console script check")
def test_console_script_installed():
    import shutil
    import subprocess
    import sys

    exe = shutil.which("aotc", path=os.path.dirname(sys.executable))
    if exe is None:
        pytest.skip("aotc console script not installed in this environment")
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, check=True)
    assert aotc.__version__ in out.stdout


@pytest.mark.parametrize("capture", ["dynamo", "trace"])
def test_shape_errors_are_not_preceded_by_fake_tensor_tracebacks(capture, caplog):
    def f(x, w):
        return (x @ w).relu().sum()

    torch._dynamo.reset()
    compiled = aotc.compile(f, capture=capture)
    with caplog.at_level("ERROR"), pytest.raises(RuntimeError, match=r"3x4|\[3, 4\]"):
        compiled(torch.randn(3, 4), torch.randn(5, 2))
    assert not [r for r in caplog.records if "attempting to run meta" in r.getMessage()]
    # fake tensors used outside aotc keep their log
    from torch._subclasses.fake_tensor import FakeTensorMode

    with caplog.at_level("ERROR"), FakeTensorMode(), pytest.raises(RuntimeError):
        torch.randn(3, 4) @ torch.randn(5, 2)
    assert [r for r in caplog.records if "attempting to run meta" in r.getMessage()]
