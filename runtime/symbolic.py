"""Dispatch for dynamic-shape entries: one compiled entry serves every size its guards admit.

Stage: `SymbolicDispatcher` (the `Dispatcher` of `aotc.compile(dynamic=True)`).
Requires: the compile callback returns an entry and the ShapeEnv's guard expression over
`L['t<k>']`, the k-th tensor leaf (see aotc/symbolic.py).
Ensures: a call runs the first entry whose coarse key matches (per tensor: dtype, device, number
of dims, requires_grad, leafness; constants by value; grad mode; autocast; aliasing) and whose
symbolic guard holds for the call's sizes and strides; otherwise compiles a new entry. Sizes are
not part of the coarse key: that is what makes one entry serve all batch sizes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

from aotc.runtime.errors import GuardError
from aotc.runtime.guards import _alias_pattern, _autocast_state

Tensor = torch.Tensor
GuardFn = Callable[[list[Tensor]], bool]


def coarse_key(leaves: Sequence[object]) -> tuple[object, ...]:
    parts: list[object] = []
    ptrs: list[int] = []
    for t in leaves:
        if isinstance(t, Tensor):
            parts.append((t.dtype, t.device, t.dim(), t.requires_grad, t.is_leaf))
            ptrs.append(t.untyped_storage().data_ptr())
        elif isinstance(t, slice):
            parts.append((slice, t.start, t.stop, t.step))
        else:
            parts.append((type(t), t))
    pattern = _alias_classes(leaves, ptrs) if len(set(ptrs)) != len(ptrs) else None
    autocast = _autocast_state() if torch._C._is_any_autocast_enabled() else None
    return (tuple(parts), pattern, torch.is_grad_enabled(), autocast)


def _alias_classes(leaves: Sequence[object], ptrs: list[int]) -> tuple[object, ...]:
    """Which tensor leaves are one object, share a storage or have one base: `_alias_pattern`
    without the geometry (offsets, the bases' sizes and strides). A symbolic entry's fakes share
    no storage (only one object passed twice is one fake), so no geometry of the aliasing is
    assumed by it; a static entry's guard checks that geometry itself
    (`static_guard_expression` in aotc/symbolic.py). With the geometry in the key, every new
    size of a call passing one tensor twice compiled again."""
    return tuple(entry[:3] for entry in _alias_pattern(leaves, ptrs))  # type: ignore[index]


def make_guard(code: str | None) -> GuardFn:
    """Compile a guard expression once; calling it evaluates it on the tensor leaves."""
    if code is None:
        return lambda tensors: True
    compiled = compile(code, "<aotc shape guard>", "eval")

    def guard(tensors: list[Tensor]) -> bool:
        scope = {"L": {f"t{k}": t for k, t in enumerate(tensors)}}
        return bool(eval(compiled, SYMPY_INTERP, scope))

    return guard


class SymbolicDispatcher:
    """Entries grouped by coarse key, each with its symbolic guard; compiles on a miss."""

    def __init__(
        self,
        compile_entry: Callable[[list[object], tuple[object, ...]], tuple[Any, str | None]],
        name: str,
        max_signatures: int,
    ) -> None:
        self._compile = compile_entry
        self._groups: dict[tuple[object, ...], list[tuple[GuardFn, Any]]] = {}
        self._all: list[Any] = []
        self._lock = threading.Lock()
        self._name = name
        self._max = max_signatures
        self.recompile_reasons: list[str] = []
        self.guards: list[str | None] = []  # readable, one per entry

    @property
    def entries(self) -> list[Any]:
        return list(self._all)

    def __call__(self, leaves: list[object], extra: object) -> object:
        key = (extra, coarse_key(leaves))
        tensors = [t for t in leaves if isinstance(t, Tensor)]
        for guard, entry in self._groups.get(key, ()):
            if guard(tensors):
                return entry.run(leaves)
        return self._miss(key, leaves, tensors).run(leaves)

    def _miss(self, key: tuple[object, ...], leaves: list[object], tensors: list[Tensor]) -> Any:
        with self._lock:
            for guard, entry in self._groups.get(key, ()):
                if guard(tensors):
                    return entry
            if self._all:
                shapes = [tuple(t.shape) for t in tensors]
                reason = (
                    f"no entry admits input sizes {shapes}: dtype/device/rank/grad mode changed, "
                    f"or a symbolic guard failed ({self.guards[-1]})"
                    if key in self._groups
                    else "dtype, device, rank, requires_grad, grad mode, "
                    "autocast, constants or aliasing changed"
                )
                self.recompile_reasons.append(reason)
                if len(self._all) >= self._max:
                    raise GuardError(
                        f"{self._name} has been compiled {len(self._all)} times "
                        f"(max_signatures={self._max}); the last miss: {reason}."
                    )
            entry, code = self._compile(leaves, key)
            self._groups.setdefault(key, []).append((make_guard(code), entry))
            self._all.append(entry)
            self.guards.append(code)
            return entry
