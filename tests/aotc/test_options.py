"""Options as typed keyword arguments: enums or their strings, typos refused at once."""

from __future__ import annotations

import inspect

import pytest
import torch

import aotc
from aotc.options import Backend, Capture, CompileOptions, Partitioner


def _f(x, w):
    return (x @ w).tanh().sum()


def test_signature_lists_every_option():
    params = inspect.signature(aotc.compile).parameters
    for name in [f for f in CompileOptions.__dataclass_fields__ if f != "triton_interpret"]:
        assert name in params, name
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, name
    assert params["backend"].annotation == "Backend | str | None"
    assert params["partitioner"].default is Partitioner.MIN_CUT
    assert params["capture"].default is Capture.DYNAMO


@pytest.mark.parametrize(
    "kind, field",
    [(Backend, "backend"), (Partitioner, "partitioner"), (Capture, "capture")],
)
def test_enum_and_string_are_the_same_option(kind, field):
    for member in kind:
        by_enum = CompileOptions.from_env(**{field: member})
        by_string = CompileOptions.from_env(**{field: member.value})
        by_upper = CompileOptions.from_env(**{field: member.value.upper()})
        assert getattr(by_enum, field) is member
        assert getattr(by_string, field) is member
        assert getattr(by_upper, field) is member
        assert by_enum == by_string
        assert member == member.value and str(member) == member.value


def test_direct_construction_normalises_and_checks():
    opts = CompileOptions(backend="triton", partitioner="simple", capture="trace")
    assert (opts.backend, opts.partitioner, opts.capture) == (
        Backend.TRITON,
        Partitioner.SIMPLE,
        Capture.TRACE,
    )
    with pytest.raises(ValueError, match=r"capture='trac'.*'dynamo', 'trace'.*'trace'\?"):
        CompileOptions(capture="trac")


@pytest.mark.parametrize(
    "option, value, choices, near",
    [
        ("backend", "trition", "'auto', 'aten', 'triton'", "triton"),
        ("partitioner", "mincut", "'min_cut', 'simple'", "min_cut"),
        ("capture", "dynamic", "'dynamo', 'trace'", "dynamo"),
    ],
)
def test_typo_in_a_value_fails_before_any_call(option, value, choices, near):
    with pytest.raises(ValueError) as info:
        aotc.compile(_f, **{option: value})  # refused at compile(), not at the first call
    message = str(info.value)
    assert f"aotc.compile({option}={value!r})" in message
    assert choices in message
    assert f"did you mean {near!r}" in message


def test_wrong_type_for_an_enum_option():
    with pytest.raises(ValueError, match=r"backend=3\): expected one of"):
        aotc.compile(_f, backend=3)


def test_typo_in_an_option_name_suggests_the_name():
    with pytest.raises(
        TypeError, match=r"unknown option\(s\) \['partioner'\].*did you mean partitioner"
    ):
        aotc.compile(_f, partioner="simple")
    with pytest.raises(TypeError, match="unknown option"):
        aotc.compile(partioner="simple")  # the decorator form checks too


def test_typo_in_aotc_backend_environment(monkeypatch):
    monkeypatch.setenv("AOTC_BACKEND", "atne")
    with pytest.raises(ValueError, match=r"AOTC_BACKEND='atne'.*did you mean 'aten'"):
        aotc.compile(_f)


def test_enum_and_string_options_compile_the_same(tmp_path):
    x, w = torch.randn(4, 3), torch.randn(3, 2)
    results = []
    for backend, partitioner in [
        (Backend.ATEN, Partitioner.SIMPLE),
        ("aten", "simple"),
    ]:
        wi = w.clone().requires_grad_()
        compiled = aotc.compile(
            _f, capture="trace", backend=backend, partitioner=partitioner, cache=False
        )
        loss = compiled(x, wi)
        loss.backward()
        [record] = aotc.inspect(compiled)
        assert record.partition is not None and record.partition.plan == "simple"
        results.append((loss.detach(), wi.grad))
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)
    expected = w.clone().requires_grad_()
    _f(x, expected).backward()
    torch.testing.assert_close(results[0][1], expected.grad)


def test_torch_compile_options_take_strings_and_enums():
    x, w = torch.randn(4, 3), torch.randn(3, 2, requires_grad=True)
    for options in ({"backend": "aten"}, {"backend": Backend.ATEN, "partitioner": "simple"}):
        torch._dynamo.reset()
        out = torch.compile(_f, backend="aotc", options=options)(x, w)
        torch.testing.assert_close(out, _f(x, w))
    torch._dynamo.reset()
    with pytest.raises(Exception, match="partitioner='simpel'"):
        torch.compile(_f, backend="aotc", options={"partitioner": "simpel"})(x, w)
    torch._dynamo.reset()


def test_decorator_form_keeps_its_options():
    @aotc.compile(capture="trace", backend="aten")
    def g(x):
        return x.cos() * 3

    x = torch.randn(5)
    torch.testing.assert_close(g(x), x.cos() * 3)
    assert isinstance(g, aotc.CompiledFunction)
