"""Compiling inside the user's `torch.autograd.graph.disable_saved_tensors_hooks(message)`.

Not a stage: `with compiling_in_region(): ...` around one compile, and `seen_by_program(program)`
for the program it runs (aotc/pipeline.py `compile_signature`).
Requires: nothing; without a disabled region around the compile both do nothing.
Ensures: inside the region, aotc's own saved-tensor hooks are pushed and fire, the user's program
sees the region as eager does, and on exit the region is disabled again with its message (Note
[Compiling where saved-tensor hooks are disabled]).

Note [Compiling where saved-tensor hooks are disabled]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A compile pushes saved-tensor hooks of its own: identity hooks that hide its fake tensors from the
user's hooks and keep autograd's version check off saved fakes (Note [No hooks pushed for
torch.func] in aotc/pipeline.py), the metadata pass's record of saved values (Note [Inputs changed
after the call] in runtime/autograd.py), the trace's aliasing hooks. Inside
`disable_saved_tensors_hooks(message)` torch refuses every push with RuntimeError(message), and
hooks pushed before do not fire either, so a first call there raised the user's message (strict
mode, torch.compile) or ran eagerly (the default mode). An entry compiled outside the region ran
fine inside it.

So while a compile runs in such a region, hooks are enabled and aotc's fire as anywhere else, and
the program is shown the region: while it runs (`seen_by_program`), the functions of
`torch._C._autograd` that `saved_tensors_hooks`, `save_on_cpu`, checkpointing,
`disable_saved_tensors_hooks` and torch.func call answer from the region's state, kept per
thread: a push raises RuntimeError(message) as eager's does, `_saved_tensors_hooks_is_enabled`
and `_saved_tensors_hooks_get_disabled_error_message` report the region, and a nested
`disable_saved_tensors_hooks` sets and restores the message the program sees (and refuses, as
eager's, while hooks the program pushed itself are on the stack). torch.func's disable calls
torch's, which refuses aotc's hooks as outside a region (the compile then runs again without
hooks, Note [No hooks pushed for torch.func]).
aotc's own code, including a compile nested inside the program (a compiled function it calls),
sees torch's state: each compile marks the frames it runs as aotc's. On exit the region is
disabled again with its message, as the compiled calls leave it.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

import torch

from aotc.functional import FlatProgram, refused_by_functorch
from aotc.sharedpatch import SharedPatch

_C = torch._C._autograd
_REAL = {
    name: getattr(_C, name)
    for name in (
        "_push_saved_tensors_default_hooks",
        "_pop_saved_tensors_default_hooks",
        "_saved_tensors_hooks_is_enabled",
        "_saved_tensors_hooks_get_disabled_error_message",
        "_saved_tensors_hooks_disable",
        "_saved_tensors_hooks_enable",
        "_top_saved_tensors_default_hooks",
    )
}


class _Region(threading.local):
    def __init__(self) -> None:
        # True: the user's program runs (answer from `message`); False: aotc's own code.
        self.frames: list[bool] = []
        self.message: str | None = None  # the region's message, as the program sees it
        self.pushed = 0  # hooks the program pushed (enabled again) and has not popped


_REGION = _Region()


def _in_program() -> bool:
    return bool(_REGION.frames) and _REGION.frames[-1]


def _push(pack: Any, unpack: Any) -> None:
    if _in_program():
        if _REGION.message is not None:
            raise RuntimeError(_REGION.message)
        _REGION.pushed += 1
    _REAL["_push_saved_tensors_default_hooks"](pack, unpack)


def _pop() -> Any:
    if _in_program() and _REGION.pushed:
        _REGION.pushed -= 1
    return _REAL["_pop_saved_tensors_default_hooks"]()


def _is_enabled() -> bool:
    if _in_program():
        return _REGION.message is None
    return bool(_REAL["_saved_tensors_hooks_is_enabled"]())


def _disabled_message() -> str | None:
    if _in_program():
        return _REGION.message
    return _REAL["_saved_tensors_hooks_get_disabled_error_message"]()


def _disable(message: str, fail_if_non_empty: bool = True) -> None:
    if not _in_program():
        _REAL["_saved_tensors_hooks_disable"](message, fail_if_non_empty)
    elif fail_if_non_empty and _REGION.pushed:
        raise RuntimeError(message)  # eager's: the program's own hooks are pushed
    elif fail_if_non_empty and refused_by_functorch(RuntimeError(message)):
        # torch.func refuses aotc's hooks as outside a region (Note [No hooks pushed for
        # torch.func]); with none pushed, torch's disable succeeds and holds for both.
        _REAL["_saved_tensors_hooks_disable"](message, True)
    else:
        _REGION.message = message


def _enable() -> None:
    if _in_program():
        _REGION.message = None
    else:
        _REAL["_saved_tensors_hooks_enable"]()


_PATCH = SharedPatch(
    _C,
    {
        "_push_saved_tensors_default_hooks": _push,
        "_pop_saved_tensors_default_hooks": _pop,
        "_saved_tensors_hooks_is_enabled": _is_enabled,
        "_saved_tensors_hooks_get_disabled_error_message": _disabled_message,
        "_saved_tensors_hooks_disable": _disable,
        "_saved_tensors_hooks_enable": _enable,
    },
)


@contextlib.contextmanager
def compiling_in_region() -> Iterator[None]:
    """Around one compile: see Note [Compiling where saved-tensor hooks are disabled]."""
    frames = _REGION.frames
    if frames:  # a compile inside another one's region: its own code sees torch's state
        frames.append(False)
        try:
            yield
        finally:
            frames.pop()
        return
    message = _REAL["_saved_tensors_hooks_get_disabled_error_message"]()
    if message is None:
        yield
        return
    _REGION.message, _REGION.pushed = message, 0
    _REAL["_saved_tensors_hooks_enable"]()
    frames.append(False)
    try:
        with _PATCH.held():
            yield
    finally:
        frames.pop()
        _REGION.message = None
        _REAL["_saved_tensors_hooks_disable"](message, False)


def seen_by_program(program: FlatProgram) -> FlatProgram:
    """`program`, shown the region while it runs (inside `compiling_in_region`; else itself)."""
    if not _REGION.frames:
        return program

    @functools.wraps(program)
    def run(leaves: list[object]) -> tuple[list[object], object]:
        _REGION.frames.append(True)
        try:
            return program(leaves)
        finally:
            _REGION.frames.pop()

    return run
