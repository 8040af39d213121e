"""The output structure a compiled call rebuilds its result with: `torch.Size` stays a Size.

Stage: `keep_sizes(spec) -> TreeSpec`, on the user program's output spec when the runtime plan is
made (aotc/pipeline.py); the runtime unflattens with the result (runtime/wrappers.py,
runtime/fastpath.py).
Requires: `spec` is `pytree.tree_flatten`'s spec of the program's return value.
Ensures: every `torch.Size` node becomes a `SizeOutput` node, which flattens and serializes as
the Size node did and unflattens to a `torch.Size` (Note [Size outputs]); nothing else changes.

Note [Size outputs]
~~~~~~~~~~~~~~~~~~~
`return y, x.shape` returns a torch.Size in eager (`s.numel()` works). Importing torch's
proxy_tensor registers torch.Size with pytree so that it unflattens to a plain tuple (its
constructor refuses the SymInt proxies fx's tracer holds), and every compiled call rebuilt its
result with that spec: strict mode returned `(3, 4)`, whose `.numel()` raises. The plan's spec
names `SizeOutput` instead, a node type no value has, whose unflatten builds the `torch.Size`
(a tuple where the sizes are not ints: a call made while an outer tracer runs, as torch's rule).
It is registered on import, with a serialization name, so cached and exported artifacts load it
in a process that never imports the compiler.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.utils._pytree as pytree


class SizeOutput:
    """The pytree node type of a `torch.Size` output in a compiled call's spec (never a value)."""


def _flatten(value: Any) -> tuple[list[Any], None]:
    return list(value), None


def _unflatten(values: Iterable[Any], context: None) -> tuple[Any, ...]:
    items = tuple(values)
    try:
        return torch.Size(items)
    except TypeError:  # not ints (an outer tracer's proxies): what torch's rule returns
        return items


def _flatten_with_keys(value: Any) -> tuple[list[tuple[Any, Any]], None]:
    return [(pytree.SequenceKey(i), x) for i, x in enumerate(value)], None


pytree.register_pytree_node(
    SizeOutput,
    _flatten,
    _unflatten,
    serialized_type_name="aotc.runtime.outspec.SizeOutput",
    flatten_with_keys_fn=_flatten_with_keys,
)


def keep_sizes(spec: pytree.TreeSpec) -> pytree.TreeSpec:
    """See Note [Size outputs]."""
    if spec.is_leaf():
        return spec
    children = [keep_sizes(c) for c in spec.children()]
    kind = SizeOutput if spec.type is torch.Size else spec.type
    if kind is spec.type and all(a is b for a, b in zip(children, spec.children())):
        return spec
    return pytree.TreeSpec(kind, spec.context, children)


__all__ = ["SizeOutput", "keep_sizes"]
