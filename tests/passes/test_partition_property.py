"""Property test: on random programs of pointwise, matmul, reduction and view ops, the min-cut
partition is sound (gradients equal eager's; the backward reads only saved values and tangents)
and never saves more than the simple plan."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aotc
from aotc.passes.descriptors import SavedInput, TangentInput
from tests.conftest import assert_matches_eager

OPS = ["sin", "exp_neg", "mul_prev", "add_prev", "matmul_w", "sum_keep", "t_t", "relu", "softmax"]


def build(program: list[str]):
    def f(x, w):
        values = [x]
        for op in program:
            a = values[-1]
            b = values[len(values) // 2]
            if op == "sin":
                values.append(a.sin())
            elif op == "exp_neg":
                values.append((-a.abs()).exp())
            elif op == "mul_prev":
                values.append(a * b)
            elif op == "add_prev":
                values.append(a + b)
            elif op == "matmul_w":
                values.append(a @ w)
            elif op == "sum_keep":
                values.append(a.sum(-1, keepdim=True) * a)
            elif op == "t_t":
                values.append(a.t().contiguous().t())
            elif op == "relu":
                values.append(a.relu())
            elif op == "softmax":
                values.append(a.softmax(-1))
        return values[-1].sum()

    return f


@settings(
    max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(program=st.lists(st.sampled_from(OPS), min_size=1, max_size=8))
def test_random_programs_partition_soundly(program):
    torch._dynamo.reset()  # every `f` shares one code object: torch 2.11 counts its recompiles
    f = build(program)

    def make():
        return torch.randn(6, 6, requires_grad=True), torch.randn(6, 6, requires_grad=True)

    compiled = assert_matches_eager(f, make, runs=1)
    (record,) = compiled.records
    part = record.partition
    assert all(isinstance(d, SavedInput | TangentInput) for d in part.backward.inputs)
    assert part.saved_bytes <= part.simple_bytes
    simple = aotc.compile(f, partitioner="simple")
    x, w = make()
    simple(x, w).backward()
    assert part.saved_bytes <= simple.records[0].partition.saved_bytes
