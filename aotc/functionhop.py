"""Saved values of the autograd.Functions Dynamo captured, checked as eager checks them.

Stage: `checked_function_saves()` around the plain metadata run (aotc/metadata.py).
Requires: the run executes a Dynamo graph whose Functions are `autograd_function_apply` calls.
Ensures: inside it, a value the Function's forward gave to `ctx.save_for_backward` is saved
through autograd's saved-variable machinery, so its version check and the run's saved-tensor
hooks see it (Note [Saved values of Functions Dynamo captured]).

Note [Saved values of Functions Dynamo captured]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Dynamo captures a custom autograd.Function as its `autograd_function_apply` operator (a forward
graph and a backward graph). Run eagerly, the operator keeps what the forward saved in a Python
closure instead of `ctx.save_for_backward`, so autograd never checks those values' versions: a
Function that saves its input `y`, followed by `y.add_(1)`, backpropagates through the changed
value where eager raises "one of the variables needed for gradient computation has been
modified by an inplace operation" (`torch.compile(backend="eager")` returns a wrong gradient
there). The operator's `saved_for_backward_idx` names the saved values that came from
`save_for_backward`. While the plain metadata run executes a Dynamo graph, the operator runs as a
Function that saves exactly those with `save_for_backward` (values the program stashed on ctx
directly, `ctx.y = y`, stay unchecked, as in eager): the run's saved-value hooks note them, and
an output whose backward unpacks one that changed since is refused with eager's error (Note
[Backward eager would refuse] in runtime/autograd.py). A torch whose operator lacks
`saved_for_backward_idx` is left as it is.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from aotc.sharedpatch import SharedPatch


def _apply(op: Any, fwd: Any, bwd: Any, *fwd_args: Any, **fwd_kwargs: Any) -> Any:
    if "saved_for_backward_idx" not in fwd_kwargs:
        return _original(op, fwd, bwd, *fwd_args, **fwd_kwargs)
    checked = sorted(set(fwd_kwargs["saved_for_backward_idx"]))
    dirty = list(fwd_kwargs.get("dirty_idx", ()))
    non_differentiable = list(fwd_kwargs.get("non_differentiable_idx", ()))

    def selected(output: Any, idx: list[int]) -> list[Any]:
        if isinstance(output, (tuple, list)):
            return [output[i] for i in idx]
        return [output] if 0 in idx else []

    class CheckedApply(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):  # type: ignore[no-untyped-def]
            output, saved = fwd(*args)
            saved = list(saved)
            ctx.aotc_unchecked = [None if i in checked else v for i, v in enumerate(saved)]
            ctx.save_for_backward(*(saved[i] for i in checked))
            if dirty:
                ctx.mark_dirty(*selected(output, dirty))
            if non_differentiable:
                ctx.mark_non_differentiable(*selected(output, non_differentiable))
            return output

        @staticmethod
        def backward(ctx, *grads):  # type: ignore[no-untyped-def]
            values = list(ctx.aotc_unchecked)
            for i, t in zip(checked, ctx.saved_tensors, strict=True):
                values[i] = t
            return bwd(*grads, *values)

    return CheckedApply.apply(*fwd_args)


def _operator_class() -> type | None:
    try:
        from torch._functorch.autograd_function import AutogradFunctionApply
    except ImportError:
        return None
    return AutogradFunctionApply


_CLASS = _operator_class()
_original: Any = _CLASS.__call__ if _CLASS is not None else None


@functools.cache
def _patch() -> SharedPatch | None:
    return None if _CLASS is None else SharedPatch(_CLASS, {"__call__": _apply})


def checked_function_saves() -> contextlib.AbstractContextManager[object]:
    """See Note [Saved values of Functions Dynamo captured]."""
    patch = _patch()
    return contextlib.nullcontext() if patch is None else patch.held()
