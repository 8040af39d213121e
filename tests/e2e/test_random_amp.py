"""Randomness (dropout masks, seeds, recomputation) and mixed precision (autocast, GradScaler)
through aotc.compile and torch.compile(backend="aotc"), against eager."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F

import aotc
from tests.conftest import assert_matches_eager
from tests.e2e.models import GPT, DropoutMLP, gpt_batch, mlp_batch, train_against_eager


def _dynamo(model):
    torch._dynamo.reset()
    return torch.compile(model, backend="aotc")


# ---------------------------------------------------------------- randomness


def dropout_chain(x, w):
    h = F.dropout((x @ w).sin(), 0.5, True)  # cheap ops around the mask: recompute candidates
    return (h.cos() * torch.rand_like(h)).sum(-1)


def test_dropout_masks_equal_eager_for_the_same_seed():
    assert_matches_eager(
        dropout_chain,
        lambda: (torch.randn(17, 9), torch.randn(9, 13, requires_grad=True)),
        rtol=0,
        atol=0,
    )


def test_random_ops_never_recomputed_even_under_a_tiny_budget():
    compiled = aotc.compile(dropout_chain, memory_budget=0.01, check_invariants=True)
    x, w = torch.randn(17, 9), torch.randn(9, 13, requires_grad=True)
    torch.manual_seed(3)
    (g,) = torch.autograd.grad(compiled(x, w).sum(), w)
    torch.manual_seed(3)
    (want,) = torch.autograd.grad(dropout_chain(x, w).sum(), w)
    torch.testing.assert_close(g, want, rtol=0, atol=0)  # backward used the forward's mask
    rec = compiled.records[0]
    random_ops = {
        n.name
        for n in rec.joint.graph.nodes
        if isinstance(n.target, torch._ops.OpOverload)
        and torch.Tag.nondeterministic_seeded in n.target.tags
    }
    assert random_ops and not random_ops & set(rec.partition.recomputed)
    assert not any(
        isinstance(n.target, torch._ops.OpOverload)
        and torch.Tag.nondeterministic_seeded in n.target.tags
        for n in rec.backward.graph.nodes
    )


@pytest.mark.parametrize("compile_model", [_dynamo, aotc.compile], ids=["dynamo", "aotc"])
def test_fixed_seed_step_reproduces_bit_for_bit(compile_model):
    torch.manual_seed(0)
    model = DropoutMLP()
    start = copy.deepcopy(model.state_dict())
    compiled = compile_model(model)
    (x,) = mlp_batch()
    results = []
    for _ in range(2):
        model.load_state_dict(start)
        torch.manual_seed(123)
        loss = compiled(x)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        model.zero_grad()
    (l0, g0), (l1, g1) = results
    assert torch.equal(l0, l1) and all(torch.equal(a, b) for a, b in zip(g0, g1))


def test_random_distribution_matches_eager():
    def sample(x):
        return torch.rand_like(x), torch.randn_like(x), F.dropout(x, 0.3, True)

    compiled = aotc.compile(sample)
    x = torch.ones(200_000)
    torch.manual_seed(5)
    got = compiled(x)
    torch.manual_seed(5)
    want = sample(x)
    for g, w in zip(got, want):  # on CPU the streams are even identical
        assert torch.equal(g, w)
    assert abs(got[0].mean().item() - 0.5) < 0.01 and abs(got[1].std().item() - 1) < 0.01
    assert abs((got[2] == 0).float().mean().item() - 0.3) < 0.01


def test_gpt_with_dropout_through_torch_compile_matches_eager_masks():
    train_against_eager(
        lambda: GPT(layers=1, dropout=0.2), gpt_batch, _dynamo, steps=2, rtol=1e-5, atol=1e-6
    )


# ---------------------------------------------------------------- mixed precision


def mixed(x, w1, w2):
    h = (x @ w1).relu()
    with torch.autocast("cpu", enabled=False):
        z = h.float() @ w2  # fp32 region inside
    return z.softmax(-1), h


def _mixed_args():
    return (
        torch.randn(8, 16),
        torch.randn(16, 16, requires_grad=True),
        torch.randn(16, 4, requires_grad=True),
    )


@pytest.mark.parametrize("how", ["aotc", "dynamo"])
def test_autocast_around_the_call_gives_eager_dtypes(how):
    torch._dynamo.reset()
    compiled = aotc.compile(mixed) if how == "aotc" else torch.compile(mixed, backend="aotc")
    args = _mixed_args()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = compiled(*args)
        want = mixed(*args)
    assert [g.dtype for g in got] == [w.dtype for w in want] == [torch.float32, torch.bfloat16]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    got_grads = torch.autograd.grad(got[0].sum() + got[1].float().sum(), args[1:])
    want_grads = torch.autograd.grad(want[0].sum() + want[1].float().sum(), args[1:])
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w)
    if how == "aotc":  # without autocast the same function is a new entry with fp32 outputs
        plain = compiled(*args)
        assert [t.dtype for t in plain] == [torch.float32, torch.float32]
        assert len(compiled.records) == 2


def test_autocast_inside_the_function():
    def f(x, w):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = x @ w
        return y.float().sum(), y

    assert_matches_eager(
        f, lambda: (torch.randn(5, 7), torch.randn(7, 3, requires_grad=True)), rtol=0, atol=0
    )


def test_grad_scaler_loop_matches_eager():
    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    twin = copy.deepcopy(eager)
    compiled = aotc.compile(twin)
    runs = []
    for model, call in ((eager, eager), (twin, compiled)):
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        losses = []
        for step in range(3):
            torch.manual_seed(step)
            x = torch.randn(8, 16)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = call(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            losses.append(loss.detach())
        runs.append((losses, [p.detach().clone() for p in model.parameters()], scaler.get_scale()))
    (le, pe, se), (lc, pc, sc) = runs
    torch.testing.assert_close(lc, le)
    torch.testing.assert_close(pc, pe)
    assert se == sc
