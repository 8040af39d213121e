"""Dataclass instances as containers of a call's arguments and outputs.

Stage: `flatten_tree(value) -> (leaves, spec)` wherever aotc flattens a call's arguments or a
program's outputs (aotc/api.py).
Requires: nothing; classes are registered with torch's pytree the first time an instance is met.
Ensures: `tree_unflatten(leaves, spec)` rebuilds each dataclass instance with exactly the
attributes the flattened one had (Note [Dataclasses as pytree nodes]).

Note [Dataclasses as pytree nodes]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Training code passes batches as dataclasses (`Batch(x=..., y=...)`) and returns them. Left a
pytree leaf, such an argument cannot be keyed (eq=True makes it unhashable) or is keyed by its
own `__eq__`/`__hash__` with tensors inside; so its class becomes a pytree node the first time an
instance is met. torch's `register_dataclass` is not used: it flattens the `init=True` fields
only and rebuilds through the constructor, so a field declared `init=False` and set later comes
back as its default, an attribute `__post_init__` derives is derived again (a field it rescales
is rescaled twice), and an attribute set outside the fields is lost: a different value, silently.
Here an instance flattens to the values of its instance `__dict__` (or, for `slots=True`, its
fields), the names being the node's context, and is rebuilt without running any of its code:
`object.__new__` and `object.__setattr__` of each name, as `copy.copy` would. The names are part
of the spec, so an instance with another set of attributes is another signature. The
registration is process-wide (torch's pytree has one registry); a class someone registered
already is flattened their way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch.utils._pytree as pytree
from torch import Tensor

_REGISTERED: set[type] = set()


def _names(obj: Any) -> tuple[str, ...]:
    attrs = getattr(obj, "__dict__", None)
    if attrs is not None:
        return tuple(attrs)
    return tuple(f.name for f in dataclasses.fields(obj))


def _flatten(obj: Any) -> tuple[list[Any], tuple[str, ...]]:
    names = _names(obj)
    return [getattr(obj, n) for n in names], names


def _flatten_with_keys(obj: Any) -> tuple[list[tuple[Any, Any]], tuple[str, ...]]:
    names = _names(obj)
    return [(pytree.GetAttrKey(n), getattr(obj, n)) for n in names], names


def _unflatten(cls: type) -> Any:
    def rebuild(values: Iterable[Any], names: tuple[str, ...]) -> Any:
        obj: Any = object.__new__(cls)
        for name, value in zip(names, values, strict=True):
            object.__setattr__(obj, name, value)
        return obj

    return rebuild


def _is_instance(value: object) -> bool:
    return (
        type(value) is not Tensor
        and dataclasses.is_dataclass(value)
        and not isinstance(value, type)
    )


def _register(cls: type) -> None:
    if cls in _REGISTERED or cls in pytree.SUPPORTED_NODES:
        return
    pytree.register_pytree_node(
        cls, _flatten, _unflatten(cls), flatten_with_keys_fn=_flatten_with_keys
    )
    _REGISTERED.add(cls)


def flatten_tree(value: Any) -> tuple[list[Any], pytree.TreeSpec]:
    """`pytree.tree_flatten(value)`, with dataclass instances (at any depth) as nodes."""
    leaves, spec = pytree.tree_flatten(value)
    while True:
        # a registered class is never a leaf: any dataclass leaf is one met for the first time
        fresh = {type(x) for x in leaves if _is_instance(x)}
        if not fresh:
            return leaves, spec
        for cls in fresh:
            _register(cls)
        leaves, spec = pytree.tree_flatten(value)
