"""Control-flow operators (`torch.cond`, `while_loop`, `map`, `scan`) called while aotc traces.

`held()` is a context manager: while any thread holds it, a control-flow operator called on the
thread that traces (`TRACING.active`, aotc/functional.py) runs its operator directly instead of
compiling a wrapper of it with Dynamo. `compiling()` holds it around every run of a program.

Note [Control-flow operators in a trace]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Called outside torch.compile, `torch.cond(pred, true_fn, false_fn, operands)` (and `while_loop`,
`map`, `scan`) does not call its operator: it hands a wrapper to `_hop_compile_and_call`, which
compiles the wrapper with Dynamo (fullgraph, an eager backend) and calls that, so that the branch
functions are checked and captured as subgraphs. In the strict capture mode the program runs on
aotc's fake and functional tensors under aotc's modes, where that nested Dynamo compilation fails
("Unsupported method call"). Dynamo is not needed there: the operator itself, called with the
Python branch functions, dispatches through aotc's modes to the fake-tensor and make_fx rules torch
registers for it, which trace each branch into a subgraph of the graph, as Dynamo would have. So
on the tracing thread the patched `_hop_compile_and_call` calls the wrapper directly. The graph
then holds the operator with both branches, as a graph from the default capture mode does:
the predicate is read when the compiled graph runs, never at trace time, so no guard is needed.
torch 2.11 has no `_hop_compile_and_call`: each operator calls `torch.compile(wrapper,
fullgraph=True)` itself, so there `torch.compile` is the patched name (`_compile_directly`).

The patched function replaces a module attribute that every thread shares, through a
`SharedPatch` (aotc/sharedpatch.py); other threads, and calls on this thread outside a trace, get
torch's function.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch._higher_order_ops.utils as hop_utils
import torch.utils._pytree as pytree
from torch._higher_order_ops.cond import CondAutogradOp

from aotc.runtime.errors import AotcError, UnsupportedError
from aotc.sharedpatch import SharedPatch
from aotc.usercode import user_line


def _call_directly(fn: Any, args: Any, kwargs: Any = None) -> Any:
    from aotc.functional import TRACING

    if not TRACING.active:
        return _PATCH.saved["_hop_compile_and_call"](fn, args, kwargs)
    return _run_directly(fn, args, kwargs)


def _compile_directly(model: Any = None, *args: Any, **kwargs: Any) -> Any:
    """`torch.compile` while held, on a torch without `_hop_compile_and_call` (2.11: each
    control-flow operator calls `torch.compile(wrapper, backend=..., fullgraph=True)(*operands)`
    itself; 2.13 through that function): on the tracing thread the operators' wrappers run
    directly, as `_call_directly` runs them (Note [Control-flow operators in a trace])."""
    from aotc.functional import TRACING

    if TRACING.active and getattr(model, "__name__", "") in _OPS and kwargs.get("fullgraph"):
        return lambda *operands, **kw: _run_directly(model, operands, kw)
    return _COMPILE.saved["compile"](model, *args, **kwargs)


def _run_directly(fn: Any, args: Any, kwargs: Any) -> Any:
    name = getattr(fn, "__name__", "")
    op = _OPS.get(name, f"the control-flow operator ({name})")
    try:
        if name == "_cond_op_wrapper" and not kwargs:
            return _cond(fn, *args)
        if name == "run_flattened_map" and not kwargs:
            return _map(fn, *args)
        if name == "_while_loop_op_wrapper":
            _refuse_without_shape_env(op, args)
        return fn(*args, **(kwargs or {}))
    except AotcError:
        raise
    except Exception as e:  # noqa: BLE001 (torch's rules for the operator refused the program)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise UnsupportedError(
            f"{op} at {user_line()}: capture='trace' traces its functions without Dynamo, and "
            f"the trace failed ({type(e).__name__}: {first}). There its functions may read "
            "only the operands passed to it (no parameters or other tensors they close over) "
            "and must not modify or return their inputs. Pass the tensors they read as "
            "operands, or use the default capture mode, which compiles it through Dynamo."
        ) from e


# The functions torch's control-flow operators hand to `_hop_compile_and_call`.
_OPS = {
    "_cond_op_wrapper": "torch.cond",
    "_while_loop_op_wrapper": "torch._higher_order_ops.while_loop",
    "run_flattened_map": "torch._higher_order_ops.map",
    "run_flattened_scan": "torch._higher_order_ops.scan",
    "run_flattened_associative_scan": "torch._higher_order_ops.associative_scan",
}


def _refuse_without_shape_env(op: str, args: Any) -> None:
    """`while_loop`'s fake-tensor rule makes the iteration count a fresh symbol: it needs a
    ShapeEnv, which a static compilation's fake tensors do not have."""
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode(pytree.tree_leaves(args))
    if mode is not None and mode.shape_env is None:
        raise UnsupportedError(
            f"{op} at {user_line()} under capture='trace' with static shapes: its trace needs "
            "symbolic sizes. "
            "Compile with dynamic=True, or use the default capture mode, which compiles it "
            "through Dynamo."
        )


def _flat_outputs(fn: Any, specs: list[pytree.TreeSpec]) -> Any:
    """`fn` returning the flat tuple of its result's leaves; each call's structure goes to
    `specs`."""

    def run(*args: Any) -> tuple[Any, ...]:
        out, spec = pytree.tree_flatten(fn(*args))
        specs.append(spec)
        return tuple(out)

    return run


def _same_structure(op: str, specs: list[pytree.TreeSpec]) -> pytree.TreeSpec:
    other = next((spec for spec in specs if spec != specs[0]), None)
    if other is not None:
        raise UnsupportedError(
            f"{op} at {user_line()}: the functions it calls return different structures ({specs[0]} and "
            f"{other}); they must return the same nesting of tensors."
        )
    return specs[0]


def _map(op: Any, f: Any, flat_xs: Any, flat_args: Any) -> Any:
    specs: list[pytree.TreeSpec] = []
    result = op(_flat_outputs(f, specs), flat_xs, flat_args)
    return pytree.tree_unflatten(
        list(result), _same_structure("torch._higher_order_ops.map", specs)
    )


def _cond(op: Any, pred: Any, true_fn: Any, false_fn: Any, operands: Any) -> Any:
    """`cond` with branches that take and return flat tuples of tensors, as the operator's
    rules expect (Dynamo flattens them the same way); the result in the branches' structure."""
    flat, in_spec = pytree.tree_flatten(operands)
    specs: list[pytree.TreeSpec] = []

    def flattened(branch: Any) -> Any:
        return _flat_outputs(
            lambda *leaves: branch(*pytree.tree_unflatten(list(leaves), in_spec)), specs
        )

    result = op(pred, flattened(true_fn), flattened(false_fn), tuple(flat))
    return pytree.tree_unflatten(list(result), _same_structure("torch.cond", specs))


def _cond_backward(ctx: Any, *grads: Any) -> Any:
    """`cond`'s backward with a distinct tensor for each output's gradient (Note [One gradient
    for two outputs of cond])."""
    from aotc.functional import TRACING

    if TRACING.active:
        seen: set[int] = set()
        distinct = []
        for grad in grads:
            if isinstance(grad, torch.Tensor) and id(grad) in seen:
                grad = grad.clone()
            seen.add(id(grad))
            distinct.append(grad)
        grads = tuple(distinct)
    return _BACKWARD.saved["backward"](ctx, *grads)


# Note [One gradient for two outputs of cond]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# `a, b = torch.cond(...); (a + b).sum().backward()`: add's backward hands the same tensor to
# both outputs, and cond's backward passes it twice to the backward branches. Under aotc's
# functionalization, torch's rule for `cond` then finds two operands of one storage and refuses
# the branches as "might be aliasing the input" (AOTAutograd's functionalization takes another
# path that does not check). While aotc traces, a gradient object that cond's backward already
# got once is cloned: the same values, one more copy in the backward graph, no refusal.

_PATCH = SharedPatch(hop_utils, {"_hop_compile_and_call": _call_directly})
_COMPILE = SharedPatch(torch, {"compile": _compile_directly})
_BACKWARD = SharedPatch(CondAutogradOp, {"backward": staticmethod(_cond_backward)})


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Control-flow operators call their operator directly on the tracing thread while held
    (Note [Control-flow operators in a trace]), and cond's backward gets distinct gradients
    (Note [One gradient for two outputs of cond])."""
    # torch 2.13 compiles every control-flow operator's wrapper through
    # `_hop_compile_and_call`; torch 2.11 has no such function and calls `torch.compile`.
    direct = _PATCH if hasattr(hop_utils, "_hop_compile_and_call") else _COMPILE
    with direct.held(), _BACKWARD.held():
        yield
