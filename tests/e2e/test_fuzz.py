"""Fuzz: random small programs of pointwise, reduction, view and in-place ops, aotc against
eager. Each program either gives eager's results (outputs, gradients, mutated inputs, aliasing)
or raises an exception of the type eager raises. Profiles: `ci` (derandomized, small; default
suite) and `nightly` (the `slow` test)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aotc
from tests.conftest import assert_matches_eager

settings.register_profile(
    "ci",
    max_examples=30,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "nightly",
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

UNARY = {
    "sin": torch.sin,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "relu": torch.relu,
    "neg": torch.neg,
    "abs": torch.abs,
    "mul3": lambda t: t * 3.0,
    "add1": lambda t: t + 1.0,
}
BINARY = {"add": torch.add, "mul": torch.mul, "sub": torch.sub, "maximum": torch.maximum}
REDUCE = {
    "sum0": lambda t: t.sum(0),
    "sum_last_keep": lambda t: t.sum(-1, keepdim=True),
    "mean0": lambda t: t.mean(0),
    "amax_last": lambda t: t.amax(-1),
    "sum_all": torch.sum,
}
VIEW = {
    "t": lambda t: t.t(),
    "unsqueeze": lambda t: t.unsqueeze(0),
    "flatten": lambda t: t.reshape(-1),
    "slice": lambda t: t[1:],
    "stride2": lambda t: t[..., ::2],
    "select": lambda t: t[0],
    "view24": lambda t: t.view(2, -1),
    "expand": lambda t: t.unsqueeze(0).expand(2, *t.shape),
}
INPLACE = {
    "add_": lambda t, o: t.add_(o),
    "mul_": lambda t, o: t.mul_(2.0),
    "relu_": lambda t, o: t.relu_(),
    "copy_": lambda t, o: t.copy_(o),
    "clamp_": lambda t, o: t.clamp_(min=-0.5),
}
KINDS = {"unary": UNARY, "binary": BINARY, "reduce": REDUCE, "view": VIEW, "inplace": INPLACE}


@dataclasses.dataclass(frozen=True)
class Step:
    kind: str
    op: str
    a: int  # operand indices into the pool (taken modulo its size)
    b: int


steps_strategy = st.lists(
    st.builds(
        Step,
        kind=st.sampled_from(sorted(KINDS)),
        op=st.integers(0, 7),
        a=st.integers(0, 20),
        b=st.integers(0, 20),
    ),
    min_size=1,
    max_size=6,
)


def build(steps: list[Step], num_outputs: int):
    def program(x: torch.Tensor, y: torch.Tensor):
        pool = [x, y]
        for s in steps:
            table = KINDS[s.kind]
            op = table[sorted(table)[s.op % len(table)]]
            a, b = pool[s.a % len(pool)], pool[s.b % len(pool)]
            if s.kind == "binary" or s.kind == "inplace":
                pool.append(op(a, b))
            else:
                pool.append(op(a))
        return tuple(pool[-num_outputs:])

    return program


def make_args():
    return torch.randn(4, 6, requires_grad=True) * 1, torch.randn(4, 6)


def run_side(fn, backward: bool) -> None:
    torch.manual_seed(0)
    outs = fn(*make_args())
    if backward:
        diff = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
        if diff:
            torch.autograd.backward(diff, [torch.ones_like(o) for o in diff])


def check_program(steps: list[Step], num_outputs: int) -> None:
    program = build(steps, num_outputs)
    for backward in (False, True):
        try:
            run_side(program, backward)
        except Exception as e:  # noqa: BLE001 eager rejects it: aotc must raise the same error
            with pytest.raises(Exception) as info:
                run_side(aotc.compile(program), backward)
            got = info.value
            # Same type, or an aotc error that carries eager's reason (fake tensors' Python
            # decompositions sometimes raise RuntimeError where eager's kernel raises IndexError).
            reason = str(e).strip().splitlines()[0].rstrip(".")
            assert isinstance(got, type(e)) or (
                isinstance(got, aotc.AotcError) and reason in str(got)
            ), f"eager raised {type(e).__name__}: {e}\naotc raised {type(got).__name__}: {got}"
            return
    assert_matches_eager(program, make_args, runs=1)


@settings(settings.get_profile("ci"))
@given(steps=steps_strategy, num_outputs=st.integers(1, 2))
def test_random_programs_match_eager(steps, num_outputs):
    check_program(steps, num_outputs)


@pytest.mark.slow
@settings(settings.get_profile("nightly"))
@given(steps=steps_strategy, num_outputs=st.integers(1, 3))
def test_random_programs_match_eager_nightly(steps, num_outputs):
    check_program(steps, num_outputs)
