"""Compiled optimizer steps (AdamW: many in-place input mutations under no_grad) and saved-tensor
hooks around compiled calls, against eager."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo

import aotc


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))


def _train_with_adamw(compile_step, steps=4, **opt_kwargs):
    # A model whose every parameter gets a real gradient: for a parameter with a ~0 gradient
    # (a key bias in attention) Adam's m/sqrt(v) amplifies float rounding arbitrarily.
    torch.manual_seed(0)
    eager = _mlp()
    twin = copy.deepcopy(eager)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=0.01, weight_decay=0.1, **opt_kwargs)
    opt_c = torch.optim.AdamW(twin.parameters(), lr=0.01, weight_decay=0.1, **opt_kwargs)
    step_c = None
    for step in range(steps):
        torch.manual_seed(step)
        x, y = torch.randn(8, 16), torch.randn(8, 4)
        torch.nn.functional.mse_loss(eager(x), y).backward()
        torch.nn.functional.mse_loss(twin(x), y).backward()
        opt_e.step()
        if step_c is None:  # the first step creates the optimizer state: run it eagerly
            opt_c.step()
            step_c = compile_step(opt_c.step)
        else:
            step_c()
        opt_e.zero_grad()
        opt_c.zero_grad()
        for (name, pe), (_, pc) in zip(eager.named_parameters(), twin.named_parameters()):
            torch.testing.assert_close(
                pc,
                pe,
                rtol=1e-5,
                atol=1e-6,
                msg=lambda m, step=step, name=name: f"step {step} {name}: {m}",
            )
        for pe, pc in zip(eager.parameters(), twin.parameters()):
            for key in ("exp_avg", "exp_avg_sq", "step"):
                torch.testing.assert_close(
                    opt_c.state[pc][key], opt_e.state[pe][key], rtol=1e-5, atol=1e-7
                )
    return step_c


def test_adamw_step_aotc_compile_matches_eager():
    step = _train_with_adamw(lambda fn: aotc.compile(lambda: fn()))
    rec = step.records[0]
    assert not rec.training  # an optimizer step is no_grad: an inference entry
    mutated = [i for i in rec.meta.inputs if i.mutation.has_data]
    assert len(mutated) == 4 * len(list(_mlp().parameters()))  # params, 2 moments, steps


def test_adamw_foreach_aotc_compile_matches_eager():
    _train_with_adamw(lambda fn: aotc.compile(lambda: fn()), steps=3, foreach=True)


def test_adamw_step_torch_compile_matches_eager():
    torch._dynamo.reset()
    _train_with_adamw(lambda fn: torch.compile(lambda: fn(), backend="aotc"), steps=3)


def test_eager_steps_of_a_compiled_optimizer_keep_their_flags():
    p = torch.nn.Parameter(torch.randn(3))
    opt = torch.optim.AdamW([p])
    p.grad = torch.randn(3)
    opt.step()
    aotc.compile(lambda: opt.step())()
    assert opt.param_groups[0]["capturable"] is False


# ---------------------------------------------------------------- saved-tensor hooks


def block(x, w1, w2):
    return ((x @ w1).tanh() @ w2).sin().sum()


def _block_args():
    torch.manual_seed(0)
    return (
        torch.randn(6, 8),
        torch.randn(8, 8, requires_grad=True),
        torch.randn(8, 3, requires_grad=True),
    )


@pytest.mark.parametrize("runtime", ["pair", "eager_autograd"])
def test_saved_tensor_hooks_see_what_the_compiled_forward_saves(runtime, monkeypatch):
    """The compiled pair saves the partition's values through the hooks; an entry whose backward
    eager's autograd records (Note [Eager autograd on the ATen path]) saves eager's own."""
    from aotc import pipeline

    if runtime == "pair":
        monkeypatch.setattr(pipeline, "_eager_autograd", lambda plan, *args: plan)
    compiled = aotc.compile(block, cache=False)  # the two runtimes' entries share a cache key
    args = _block_args()
    compiled(*args)  # compile outside the hooks
    packed, unpacked = [], []

    def pack(t):
        packed.append(t)
        return ("packed", t.clone())

    def unpack(box):
        unpacked.append(box)
        return box[1]

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = compiled(*args)
    assert compiled.records[0].program.plan.eager_autograd == (runtime == "eager_autograd")
    if runtime == "pair":
        saved = compiled.records[0].partition.saved
        shapes = [tuple(s.shape) for s in saved if not s.is_symint]
    else:
        eager_packed = []
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t: eager_packed.append(t) or t, lambda t: t
        ):
            block(*args)
        shapes = [tuple(t.shape) for t in eager_packed]
    assert len(packed) == len(shapes) > 0
    assert [tuple(t.shape) for t in packed] == shapes
    grads = torch.autograd.grad(out, args[1:])
    assert len(unpacked) == len(packed)
    want = torch.autograd.grad(block(*args), args[1:])
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("how", ["aotc", "dynamo"])
def test_save_on_cpu_around_compiled_call(how):
    torch._dynamo.reset()
    compiled = aotc.compile(block) if how == "aotc" else torch.compile(block, backend="aotc")
    args = _block_args()
    with torch.autograd.graph.save_on_cpu(pin_memory=False):
        out = compiled(*args)
    grads = torch.autograd.grad(out, args[1:])
    want = torch.autograd.grad(block(*args), args[1:])
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w)


def test_hooks_that_change_values_change_the_gradient_as_in_eager():
    """A pack hook that scales what is saved must act on the compiled backward's inputs."""

    def f(x, w):
        return (x * w).sum()  # the backward of w reads the saved x

    compiled = aotc.compile(f)
    x, w = torch.randn(5), torch.randn(5, requires_grad=True)
    compiled(x, w)
    results = []
    for fn in (f, compiled):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t * 2, lambda t: t):
            out = fn(x, w)
        results.append(torch.autograd.grad(out, w)[0])
    torch.testing.assert_close(results[1], results[0])
    torch.testing.assert_close(results[0], 2 * x)


_DISABLED = "saved tensor hooks are disabled here"


def _compiled(how, fn):
    torch._dynamo.reset()
    if how == "torch_compile":
        return torch.compile(fn, backend="aotc")
    return aotc.compile(fn, capture=how)


def _sigmoid_of_mm(x, w):
    return (x @ w).sigmoid()


@pytest.mark.parametrize("how", ["trace", "dynamo", "torch_compile"])
def test_compiling_inside_disable_saved_tensors_hooks(how):
    """The first call (the compile) inside `disable_saved_tensors_hooks(msg)`: aotc's own hooks
    were refused with the user's message (Note [Compiling where saved-tensor hooks are
    disabled]). It matches eager, and the region is still disabled after the call."""
    compiled = _compiled(how, _sigmoid_of_mm)
    for _ in range(2):
        results = []
        for fn in (_sigmoid_of_mm, compiled):
            torch.manual_seed(0)
            x, w = torch.randn(3, 4), torch.randn(4, 5, requires_grad=True)
            with torch.autograd.graph.disable_saved_tensors_hooks(_DISABLED):
                out = fn(x, w)
                assert torch._C._autograd._saved_tensors_hooks_get_disabled_error_message() == (
                    _DISABLED
                )
            out.sum().backward()
            results.append((out, w.grad))
        torch.testing.assert_close(results[1], results[0], rtol=0, atol=0)
    assert torch._C._autograd._saved_tensors_hooks_is_enabled()


def _saves_on_cpu(x, w):
    with torch.autograd.graph.save_on_cpu(pin_memory=False):
        return (x @ w).sigmoid()


def _reads_the_region(x, w):
    enabled = torch._C._autograd._saved_tensors_hooks_is_enabled()
    with torch.autograd.graph.disable_saved_tensors_hooks("inner"):
        inner = torch._C._autograd._saved_tensors_hooks_get_disabled_error_message()
    after = torch._C._autograd._saved_tensors_hooks_get_disabled_error_message()
    return (x @ w).tanh(), enabled, inner, after


@pytest.mark.parametrize("how", ["trace", "torch_compile"])
def test_the_program_sees_the_disabled_region_as_in_eager(how):
    """Inside the region the program's own saved-tensor hooks are refused with the user's
    message, as in eager, and (strict mode) what it reads of the hook state is eager's."""
    with torch.autograd.graph.disable_saved_tensors_hooks(_DISABLED):
        for fn in (_saves_on_cpu, _compiled(how, _saves_on_cpu)):
            with pytest.raises(RuntimeError, match=_DISABLED):
                fn(torch.randn(3, 4), torch.randn(4, 5, requires_grad=True))
        if how != "trace":
            # A Dynamo graph calls torch's disable itself (a node), which refuses aotc's hooks
            # in or out of a region: not covered here.
            return
        x, w = torch.randn(3, 4), torch.randn(4, 5, requires_grad=True)
        want, got = _reads_the_region(x, w), _compiled(how, _reads_the_region)(x, w)
    assert got[1:] == want[1:] == (False, "inner", _DISABLED)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    assert torch._C._autograd._saved_tensors_hooks_is_enabled()
