"""Shared test helpers: differential comparison against eager PyTorch.

`assert_matches_eager(fn, make_args)` builds two identical, independent argument sets from one
seed, runs `fn` eagerly on one and through aotc on the other (several times, so the cached entry is
exercised too), backpropagates the same random cotangent through both, and compares outputs,
gradients, the inputs after the call (mutations), aliasing between outputs and inputs, requires_grad
flags, leafness and grad_fn presence, shapes, strides and the inputs' version counters.
"""

from __future__ import annotations

import atexit
import copy
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# No TRITON_INTERPRET here: aotc runs CPU kernels in Triton's interpreter whatever the
# environment or import order (see Note [Interpreter-safe Triton] in passes/codegen.py).

# The suite never writes to the user's real cache: one fresh cache directory per session (also
# inherited by the subprocesses tests start). Tests that need their own directory pass cache_dir.
_SESSION_CACHE = tempfile.mkdtemp(prefix="aotc-test-cache-")
os.environ["AOTC_CACHE_DIR"] = _SESSION_CACHE
atexit.register(shutil.rmtree, _SESSION_CACHE, True)
# Nor to the user's config: the cache secret (Note [Trusted entries] in runtime/cache.py) is one
# of the session's own, shared with the subprocesses tests start.
_SESSION_CONFIG = tempfile.mkdtemp(prefix="aotc-test-config-")
os.environ["XDG_CONFIG_HOME"] = _SESSION_CONFIG
atexit.register(shutil.rmtree, _SESSION_CONFIG, True)

import aotc


class Double(torch.autograd.Function):
    """A custom autograd.Function: its backward is Python the key text cannot see."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g * 2


def _tensor_leaves(tree: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _roots(args: Any) -> list[torch.Tensor]:
    """Leaf tensors requiring grad that the arguments hang off (the args or their bases)."""
    out: list[torch.Tensor] = []
    for t in _tensor_leaves(args):
        for cand in (t, t._base):
            if cand is not None and cand.is_leaf and cand.requires_grad:
                if not any(cand is o for o in out):
                    out.append(cand)
    return out


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr() if t.layout is torch.strided else 0


def _alias_signature(outs: list[object], args: list[torch.Tensor]) -> list[tuple]:
    sig = []
    arg_storage = [_storage_ptr(a) for a in args]
    out_storage: list[int] = []
    for j, o in enumerate(outs):
        if not isinstance(o, torch.Tensor):
            sig.append(("const", o))
            continue
        ptr = _storage_ptr(o)
        is_input = next((i for i, a in enumerate(args) if o is a), None)
        shares_input = next((i for i, p in enumerate(arg_storage) if p == ptr and ptr != 0), None)
        is_output = next((k for k in range(j) if outs[k] is o), None)
        shares_output = next(
            (k for k, p in enumerate(out_storage) if p == ptr and ptr != 0 and outs[k] is not o),
            None,
        )
        base_is_input = next((i for i, a in enumerate(args) if o._base is a), None)
        sig.append((is_input, shares_input, is_output, shares_output, o._is_view(), base_is_input))
        out_storage.append(ptr)
    return sig


def _assert_tensor_equal(
    got: torch.Tensor, want: torch.Tensor, what: str, rtol: float, atol: float
) -> None:
    assert got.shape == want.shape, f"{what}: shape {got.shape} != eager {want.shape}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != eager {want.dtype}"
    assert got.requires_grad == want.requires_grad, (
        f"{what}: requires_grad {got.requires_grad} != eager {want.requires_grad}"
    )
    if got.layout is torch.strided and got.numel() > 1:
        # strides of size-1 dims are meaningless (both layouts are the same memory)
        g_strides = [st for st, n in zip(got.stride(), got.shape) if n > 1]
        w_strides = [st for st, n in zip(want.stride(), want.shape) if n > 1]
        assert g_strides == w_strides, f"{what}: stride {got.stride()} != eager {want.stride()}"
    torch.testing.assert_close(
        got.detach(),
        want.detach(),
        rtol=rtol,
        atol=atol,
        equal_nan=True,
        msg=lambda m: f"{what}: {m}",
    )


def run_and_capture(
    fn: Callable[..., Any], args: Sequence[Any], kwargs: dict, cotangent_seed: int, backward: bool
) -> dict[str, Any]:
    arg_tensors = _tensor_leaves((args, kwargs))
    roots = _roots((args, kwargs))
    for t in arg_tensors:
        if t.requires_grad and not t.is_leaf:
            t.retain_grad()
    grad_fns = [t.grad_fn for t in arg_tensors]
    versions = [t._version for t in arg_tensors]
    out = fn(*args, **kwargs)
    # retain_grad() on a non-leaf input that the call mutates is a known divergence (see README,
    # "Known differences"): compare retained grads only for inputs the call did not mutate.
    unmutated = [t.grad_fn is g for t, g in zip(arg_tensors, grad_fns)]
    flat_out = pytree.tree_leaves(out)
    result: dict[str, Any] = {
        "out": flat_out,
        "out_spec": pytree.tree_structure(out),
        "alias": _alias_signature(flat_out, arg_tensors),
        "args_after": [t.detach().clone() for t in arg_tensors],
        "args_meta": [
            (
                t.shape,
                t.stride() if t.layout is torch.strided else None,
                t.requires_grad,
                t.grad_fn is None,
                t._version - v,
            )
            for t, v in zip(arg_tensors, versions)
        ],
        "out_flags": [
            (o.is_leaf, o.grad_fn is not None) if isinstance(o, torch.Tensor) else None
            for o in flat_out
        ],
    }
    diff = [o for o in flat_out if isinstance(o, torch.Tensor) and o.requires_grad]
    if backward and diff:
        gen = torch.Generator().manual_seed(cotangent_seed)
        cts = [
            torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device, o.dtype)
            for o in diff
        ]
        torch.autograd.backward(diff, cts)
    result["grads"] = [r.grad for r in roots]
    result["arg_grads"] = [
        t.grad if t.requires_grad and not t.is_leaf and same else None
        for t, same in zip(arg_tensors, unmutated)
    ]
    return result


def assert_matches_eager(
    fn: Callable[..., Any],
    make_args: Callable[[], Any],
    *,
    runs: int = 2,
    backward: bool = True,
    rtol: float = 1.3e-6,
    atol: float = 1e-5,
    compiled: Callable[..., Any] | None = None,
    grad_tol: tuple[float, float] = (1e-5, 1e-5),
    **options: Any,
) -> Callable[..., Any]:
    """Compare `fn` under eager and under aotc (gradients to `grad_tol`: rtol, atol). `make_args()` returns `args` or `(args, kwargs)`
    when it returns a dict as the last element; it is called under the same seed for both sides."""
    compiled = compiled or aotc.compile(fn, check_invariants=True, **options)
    for run in range(runs):
        sides = []
        for side_fn in (fn, compiled):
            torch.manual_seed(1000 + run)
            made = make_args()
            if isinstance(made, tuple) and made and isinstance(made[-1], dict):
                args, kwargs = made[:-1], made[-1]
            else:
                args, kwargs = (made if isinstance(made, tuple) else (made,)), {}
            torch.manual_seed(7 + run)
            sides.append(run_and_capture(side_fn, args, kwargs, 99 + run, backward))
        want, got = sides
        assert got["out_spec"] == want["out_spec"], (
            f"output structure {got['out_spec']} != {want['out_spec']}"
        )
        assert len(got["out"]) == len(want["out"])
        for j, (g, w) in enumerate(zip(got["out"], want["out"])):
            if isinstance(w, torch.Tensor):
                assert isinstance(g, torch.Tensor), f"output {j}: {type(g)} is not a tensor"
                _assert_tensor_equal(g, w, f"run {run} output {j}", rtol, atol)
            else:
                assert g == w, f"output {j}: {g!r} != eager {w!r}"
        assert got["out_flags"] == want["out_flags"], (
            f"run {run} outputs' (is_leaf, has grad_fn) differ:\n aotc  {got['out_flags']}\n"
            f" eager {want['out_flags']}"
        )
        assert got["alias"] == want["alias"], (
            f"run {run} aliasing differs:\n aotc  {got['alias']}\n eager {want['alias']}"
        )
        for i, (g, w) in enumerate(zip(got["args_after"], want["args_after"])):
            _assert_tensor_equal(g, w, f"run {run} input {i} after the call", rtol, atol)
        assert got["args_meta"] == want["args_meta"], (
            f"run {run} input metadata after the call differs:\n aotc  {got['args_meta']}\n"
            f" eager {want['args_meta']}"
        )
        for kind in ("grads", "arg_grads"):
            for i, (g, w) in enumerate(zip(got[kind], want[kind])):
                assert (g is None) == (w is None), f"run {run} {kind} {i}: {g} vs eager {w}"
                if w is not None:
                    _assert_tensor_equal(g, w, f"run {run} {kind} {i}", *grad_tol)
    return compiled


def assert_module_matches_eager(
    make_module: Callable[[], torch.nn.Module],
    make_inputs: Callable[[], tuple],
    *,
    steps: int = 3,
    lr: float = 0.1,
    train: bool = True,
    **options: Any,
) -> torch.nn.Module:
    """Train an eager copy and an aotc copy of one module for a few SGD steps and compare
    outputs, every parameter gradient, parameters and buffers after each step."""
    torch.manual_seed(0)
    eager = make_module()
    ref = copy.deepcopy(eager)
    compiled = aotc.compile(ref, check_invariants=True, **options)
    eager.train(train)
    compiled.train(train)
    for step in range(steps):
        torch.manual_seed(100 + step)
        inputs = make_inputs()
        torch.manual_seed(200 + step)
        want = eager(*inputs)
        torch.manual_seed(200 + step)
        got = compiled(*inputs)
        w_leaves, g_leaves = _tensor_leaves(want), _tensor_leaves(got)
        for j, (g, w) in enumerate(zip(g_leaves, w_leaves)):
            _assert_tensor_equal(g, w, f"step {step} output {j}", 1e-5, 1e-5)
        if train:
            sum(o.float().sum() for o in w_leaves if o.requires_grad).backward()
            sum(o.float().sum() for o in g_leaves if o.requires_grad).backward()
        for (name, pw), (_, pg) in zip(eager.named_parameters(), ref.named_parameters()):
            if pw.grad is not None or pg.grad is not None:
                assert pg.grad is not None and pw.grad is not None, f"step {step} grad {name}"
                torch.testing.assert_close(
                    pg.grad,
                    pw.grad,
                    rtol=1e-4,
                    atol=1e-5,
                    msg=lambda m: f"step {step} grad {name}: {m}",
                )
        with torch.no_grad():
            for pw, pg in zip(eager.parameters(), ref.parameters()):
                if pw.grad is not None:
                    pw -= lr * pw.grad
                    pg -= lr * pg.grad
                pw.grad = None
                pg.grad = None
        for (name, bw), (_, bg) in zip(eager.named_buffers(), ref.named_buffers()):
            torch.testing.assert_close(
                bg, bw, rtol=1e-5, atol=1e-5, msg=lambda m: f"step {step} buffer {name}: {m}"
            )
    return compiled


@pytest.fixture(autouse=True)
def _fresh_grad_mode():
    with torch.enable_grad():
        yield


# ---- GPU compile check: every generated kernel compiles for sm_90 and sm_80 ------------------
# (see tests/gpu_compile_check.py; AOTC_GPU_CHECK=0 turns it off)

_GPU_CHECK = pytest.StashKey[Any]()


def _current_test() -> str:
    return os.environ.get("PYTEST_CURRENT_TEST", "outside a test").rsplit(" ", 1)[0]


def pytest_configure(config: pytest.Config) -> None:
    from tests import gpu_compile_check

    if not gpu_compile_check.enabled():
        return
    from aotc.passes.kernelize import KERNEL_LISTENERS

    check = gpu_compile_check.GpuCompileCheck(_current_test)
    KERNEL_LISTENERS.append(check.record)
    config.stash[_GPU_CHECK] = [check, [], ""]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    state = session.config.stash.get(_GPU_CHECK, None)
    if state is None:
        return
    from aotc.passes.kernelize import KERNEL_LISTENERS

    KERNEL_LISTENERS.remove(state[0].record)
    state[1], state[2] = state[0].finish()
    if state[1] and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any) -> None:
    state = terminalreporter.config.stash.get(_GPU_CHECK, None)
    if state is None:
        return
    if state[1]:
        terminalreporter.section("GPU compile check failures", red=True)
        for report in state[1]:
            terminalreporter.write_line(report)
    terminalreporter.write_line(state[2])


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test starts with Dynamo's caches empty, as a new process would: Dynamo keeps state per
    code object (compiled entries, sizes seen for automatic dynamic) that would otherwise carry
    over between tests calling the same function."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.reset()
    yield
