"""Every unsupported situation raises an aotc exception that says where (op, argument or source
line) and what to do. One row per situation; the message is checked, not only the type.

These are strict mode's errors (`capture="trace"`); the default capture mode runs most of these
programs (Dynamo breaks the graph around what it cannot trace): tests/e2e/test_capture_dynamo.py
checks each against eager there."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

import aotc

HERE = os.path.basename(__file__)


@dataclasses.dataclass
class Case:
    fn: object
    make_args: object
    error: type
    where: tuple[str, ...]  # substrings naming the op, argument or source line
    hint: tuple[str, ...]  # substrings of the advice
    backward: bool = False
    options: dict = dataclasses.field(default_factory=dict)


def item_branch(x):
    if x.sum().item() > 0:  # data-dependent control flow
        return x * 2
    return x * 3


def tensor_branch(x):
    if x.sum() > 0:
        return x * 2
    return x


def nonzero_shape(x):
    return torch.nonzero(x)


def leaf_inplace(x):
    x.add_(1)
    return x


def multi_view_inplace(x):
    a, b = (x * 1).split(2)
    a.mul_(2)
    return b


def no_grad_view_mutation(x):
    with torch.no_grad():
        v = x.view(-1)
    v.mul_(2)  # eager: a view created in no_grad mode is modified in-place with grad
    return v


def expanded_inplace(x, y):
    v = y.unsqueeze(0).expand(2, 4, 6)
    v.add_(x)
    return v


class Opaque:
    """A user type aotc does not know how to return from a graph."""


def opaque_output(x):
    return x * 2, Opaque()


def mixed_devices(x, y):
    return x + y


def storage_swap(x):
    x.set_(torch.zeros(2))
    return x


def new_leaf_output(x):
    return torch.nn.Parameter(x.detach())


@torch.library.custom_op("aotc_errors::opaque_op", mutates_args=())
def opaque_op(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


def custom_op_without_fake(x):
    return opaque_op(x) * 2


CASES = {
    "item_control_flow": Case(
        item_branch,
        lambda: (torch.randn(3),),
        aotc.UnsupportedError,
        (HERE, "x.sum().item()"),
        ("outside the compiled function",),
    ),
    "tensor_bool_control_flow": Case(
        tensor_branch,
        lambda: (torch.randn(3),),
        aotc.UnsupportedError,
        (HERE, "if x.sum() > 0"),
        ("torch.where",),
    ),
    "data_dependent_shape": Case(
        nonzero_shape,
        lambda: (torch.randn(3),),
        aotc.UnsupportedError,
        ("nonzero", HERE),
        ("outside the compiled function",),
    ),
    "inplace_on_leaf": Case(
        leaf_inplace,
        lambda: (torch.randn(3, requires_grad=True),),
        aotc.UnsupportedError,
        (HERE, "x.add_(1)", "leaf Variable"),
        ("out-of-place", "clone"),
    ),
    "inplace_on_multi_output_view": Case(
        multi_view_inplace,
        lambda: (torch.randn(4, requires_grad=True),),
        aotc.UnsupportedError,
        (HERE, "a.mul_(2)"),
        ("out-of-place",),
    ),
    "no_grad_view_mutated_with_grad": Case(
        no_grad_view_mutation,
        lambda: (torch.randn(4, requires_grad=True) * 1,),
        aotc.UnsupportedError,
        (HERE, "v.mul_(2)"),
        ("clone",),
    ),
    "inplace_into_expanded_view": Case(
        expanded_inplace,
        lambda: (torch.randn(4, 6), torch.randn(4, 6)),
        aotc.UnsupportedError,
        (HERE, "v.add_(x)", "aten.add_"),
        ("clone",),
    ),
    "unknown_output_type": Case(
        opaque_output,
        lambda: (torch.randn(3),),
        aotc.UnsupportedError,
        ("output 1", "Opaque"),
        ("Return tensors",),
    ),
    "mixed_devices": Case(
        mixed_devices,
        lambda: (torch.randn(3), torch.randn(3, device="meta")),
        aotc.UnsupportedError,
        (HERE, "x + y", "meta"),
        ("one device",),
    ),
    "storage_swap": Case(
        storage_swap,
        lambda: (torch.randn(3),),
        aotc.UnsupportedError,
        ("'x'", "set_"),
        ("outside the compiled function",),
    ),
    "new_leaf_requires_grad_output": Case(
        new_leaf_output,
        lambda: (torch.randn(3),),
        aotc.UnsupportedError,
        ("output 0", "requires_grad=True"),
        ("pass it as an argument",),
    ),
    "custom_op_without_fake_kernel": Case(
        custom_op_without_fake,
        lambda: (torch.randn(3),),
        aotc.UnsupportedError,
        ("opaque_op", HERE),
        ("register_fake", "outside the compiled function"),
    ),
    "unhashable_argument": Case(
        lambda x, s: x * len(s),
        lambda: (torch.randn(3), {1, 2}),
        aotc.UnsupportedError,
        ("argument 1", "set"),
        ("hashable",),
    ),
    "sparse_input": Case(
        lambda x: x * 2,
        lambda: (torch.randn(3, 3).to_sparse(),),
        aotc.UnsupportedError,
        ("argument 0", "sparse"),
        ("to_dense",),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_error_names_where_and_what_to_do(name):
    case = CASES[name]
    compiled = aotc.compile(case.fn, capture="trace", **case.options)
    with pytest.raises(aotc.AotcError) as info:
        compiled(*case.make_args())
        if case.backward:
            x = case.make_args()[0]
            y = compiled(x)
            (g,) = torch.autograd.grad(y, x, create_graph=True)
            g.sum().backward()
    err = info.value
    assert isinstance(err, case.error), type(err)
    text = str(err)
    for part in case.where + case.hint:
        assert part.lower() in text.lower(), f"{name}: {part!r} not in message:\n{text}"
    assert len(text) < 1500, f"{name}: message too long ({len(text)} chars)"


def test_too_many_signatures_is_a_guard_error():
    compiled = aotc.compile(lambda x: x * 2, max_signatures=2, capture="trace")
    compiled(torch.randn(1))
    compiled(torch.randn(2))
    with pytest.raises(aotc.GuardError, match="max_signatures=2") as info:
        compiled(torch.randn(3))
    assert "input 0 shape" in str(info.value)


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_call_inside_torch_func_transform_matches_eager(transform):
    """Strict mode under torch.func runs the Python function (Note [Compiled functions under
    torch.func] in aotc/api.py); tests/e2e/test_func_transforms.py covers every transform."""

    def f(x):
        return (x.sin() * 2).sum()

    compiled = aotc.compile(f, cache=False, capture="trace")
    wrap = torch.func.grad if transform == "grad" else torch.func.vmap
    x = torch.randn(4, 3)
    torch.testing.assert_close(wrap(compiled)(x), wrap(f)(x))
