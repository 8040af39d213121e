"""Aliased outputs rebuilt with eager's own view ops.

Stage: `replay(base, ops) -> Tensor`, per aliased output per call, from the `ViewOp`s the
metadata pass recorded (`view_chain` in aotc/aliasing.py).
Requires: `ops` is the chain of view ops eager's run applied to `base` to make the output, every
argument plain data (no tensors, no symbolic sizes).
Ensures: the same view of `base` eager made, made the way eager made it.

Note [Replayed views]
~~~~~~~~~~~~~~~~~~~~~
An output that aliases an input or an intermediate is returned as a view made outside the
compiled node, so autograd and in-place ops see the view eager returned. Built with one
`as_strided` of the base, it has the right elements but not eager's autograd node: eager's
`x.view(-1)` has a `ViewBackward0`, `x[0]` a `SelectBackward0`, and the as_strided view an
`AsStridedBackward0`, whose backward is a general (slower) scatter into zeros of the base.
The plain metadata run sees every view op eager runs (aotc/functional.py `EagerChecks`), so the
chain from the base to the output is recorded as data: each op's name, its non-tensor arguments
and, for unbind/split, which element. Each call applies the chain to the real base, in the grad
mode eager made the views in, which gives eager's nodes, creation metadata (a view from
`unbind` may not be written in place) and conjugate/negative bits. The chain is used only if
the base and the output still have the geometry they had when the view was made (an in-place
`transpose_` of either in between breaks it): compared when sizes are concrete, and for symbolic
sizes (not compared: that would add shape guards) taken from whether an in-place op reshaped
either (`EagerChecks.reshaped`). Replay is also what makes views of inputs work with symbolic
sizes at all: the ops' arguments are plain numbers (`view(-1)`, `select(0, 0)`) while the
geometry is symbolic, which `as_strided` cannot take; such views without a chain (a symbolic size
argument) are refused at compile time. Where no chain exists otherwise (a step that is no view
op, views whose gradient eager stops early: the `via_geometry`/`narrowed_by`/stale cases of
runtime/epilogue.py) the as_strided view from the recorded geometry is kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class ViewOp:
    op: str  # "aten.view.default"
    args: tuple[Any, ...]  # after the tensor argument; plain data
    kwargs: tuple[tuple[str, Any], ...] = ()
    index: int | None = None  # the element of a multi-output view (unbind, split)


_OPS: dict[str, Any] = {}


def _resolve(name: str) -> Any:
    namespace, *op, overload = name.split(".")
    fn = getattr(getattr(getattr(torch.ops, namespace), ".".join(op)), overload)
    _OPS[name] = fn
    return fn


def replay(base: torch.Tensor, ops: tuple[ViewOp, ...]) -> torch.Tensor:
    t = base
    for v in ops:
        fn = _OPS.get(v.op) or _resolve(v.op)
        t = fn(t, *v.args, **dict(v.kwargs)) if v.kwargs else fn(t, *v.args)
        if v.index is not None:
            t = t[v.index]
    return t


_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.memory_format, torch.layout)


def plain_args(value: object) -> object:
    """`value` as plain data (lists as tuples), or raise TypeError."""
    if isinstance(value, (list, tuple)):
        return tuple(plain_args(v) for v in value)
    if isinstance(value, _PLAIN) and not isinstance(value, (torch.SymInt, torch.SymFloat)):
        return value
    raise TypeError(type(value).__name__)
