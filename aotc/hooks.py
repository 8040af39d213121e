"""Module hooks of the module a CompiledModule wraps: run eagerly around the compiled forward.

Stage: `call_with_hooks(module, compiled, args, kwargs)` per call of a CompiledModule whose
module has hooks (`has_hooks(module)`), instead of the compiled call alone.
Requires: `compiled(*args, **kwargs)` computes `module.forward(*args, **kwargs)` and resolves the
module's forward with `forward_override` (so the runner installed here is not seen as one).
Ensures: the module's forward pre-hooks, forward hooks, full backward (pre-)hooks, old-style
backward hooks and the global module hooks run exactly as `nn.Module.__call__` runs them, with the
compiled forward in place of `forward`: the call goes through `nn.Module._call_impl` itself, with
an instance `forward` that runs the compiled function for the length of the call.

Hooks on submodules are inside the traced program and are refused there (see Note [Strict
capture guards] in aotc/strict.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn.modules import module as nn_module

from aotc.usercode import MISSING


def has_own_hooks(module: torch.nn.Module) -> bool:
    """Hooks registered on `module` itself (not the global module hooks)."""
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
    )


def has_hooks(module: torch.nn.Module) -> bool:
    return has_own_hooks(module) or bool(
        nn_module._global_forward_hooks
        or nn_module._global_forward_pre_hooks
        or nn_module._global_backward_hooks
        or nn_module._global_backward_pre_hooks
    )


class _Runner:
    """The instance `forward` during a hooked call: runs the compiled function."""

    __slots__ = ("compiled", "previous")

    def __init__(self, compiled: Callable[..., Any], previous: object) -> None:
        self.compiled, self.previous = compiled, previous

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.compiled(*args, **kwargs)


def forward_override(module: torch.nn.Module) -> object:
    """The module's instance-level `forward` (`module.forward = fn`), or MISSING; a runner
    installed by `call_with_hooks` stands for what it replaced."""
    value = object.__getattribute__(module, "__dict__").get("forward", MISSING)
    while isinstance(value, _Runner):
        value = value.previous
    return value


def call_with_hooks(
    module: torch.nn.Module, compiled: Callable[..., Any], args: tuple[Any, ...], kwargs: Any
) -> Any:
    attrs = object.__getattribute__(module, "__dict__")
    previous = attrs.get("forward", MISSING)
    attrs["forward"] = _Runner(compiled, previous)
    try:
        return module._call_impl(*args, **kwargs)
    finally:
        if previous is MISSING:
            attrs.pop("forward", None)
        else:
            attrs["forward"] = previous
