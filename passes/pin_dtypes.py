"""Pin the dtype of every node whose result dtype would come from the ambient default dtype.

Stage: `pin_default_dtypes(module, default_dtype) -> None`, on a graph its caller just traced
(the tracer's own module, or decompose's), before any other stage sees it.
Requires: an ATen fx graph with `meta["val"]` on its nodes; `default_dtype` is the default dtype
the compiled graph runs under (the call's: the compiled entry guards on it), or None to only pin.
Ensures: every factory node (see Note [Factory ops follow the default dtype]) names its result's
dtype (`meta["val"].dtype`) explicitly; a node without a dtype argument whose dtype the ambient
default set to something other than `default_dtype` raises `UnsupportedError` naming the op and
the user's line.

Worked example (`torch.set_default_dtype(torch.float64); y = torch.ones(2) + x`, x float64):

    before: ones = aten.ones.default([2], device=cpu, pin_memory=False)       # val: float64[2]
    after:  ones = aten.ones.default([2], dtype=torch.float64, device=cpu, pin_memory=False)

Note [Factory ops follow the default dtype]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A factory call without a dtype (`torch.ones(2)`, `zeros`, `empty`, `full(.., 1.5)`, `rand`,
`randn`, `arange(0., 1.)`, `linspace`, `scalar_tensor`, `normal(0., 1., size)`, windows, ...)
traces as an ATen node without one, and such a node takes the default dtype that is ambient when
the graph *runs*. The trace saw the default the program had at that point, which the program may
have changed (`torch.set_default_dtype(torch.float64)` inside it: Dynamo's graphs call it too),
while the compiled graph runs under the call's default, so eager's float64 `ones` came out
float32. Every such node now carries the dtype the trace saw (its `meta["val"]`), which also keeps
common-subexpression elimination from merging a float32 `ones` with a float64 one. Factory ops
are recognised by their schema: an optional `dtype` defaulting to None next to `layout`, `device`
and `pin_memory` (the TensorOptions), and no `self` (`*_like`, `new_*`, `_to_copy` take the dtype
of `self`, not the default).

Ops without a dtype argument can also read the default: type promotion of an integer or bool
tensor with a Python float (`torch.arange(3) / 2`, `i * 0.5`, `i.sqrt()`) gives the default
dtype. Their dtype cannot be pinned, and casting the result would round differently from eager
(which computes in the wider type), so a node whose result dtype is not what it would be under
the call's default is refused, with the op and line. Checking only needs a fake re-run of nodes
whose dtype comes from none of their tensor inputs and is neither the call's default nor its
complex counterpart, which no program that leaves the default alone has.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._guards import detect_fake_mode

from aotc.passes.provenance import source_of
from aotc.runtime.errors import UnsupportedError

_OPTIONS = ("dtype", "layout", "device", "pin_memory")
_COMPLEX_OF = {
    torch.float16: torch.complex32,
    torch.float32: torch.complex64,
    torch.float64: torch.complex128,
}


def pin_default_dtypes(module: fx.GraphModule, default_dtype: torch.dtype | None) -> None:
    """See Note [Factory ops follow the default dtype]. Changes `module` in place."""
    changed = False
    for node in module.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        slot = _unset_dtype_slot(node.target._schema, node)
        if slot is not None:
            if isinstance(slot, int):
                args = list(node.args)
                args[slot] = val.dtype
                node.args = tuple(args)
            else:
                node.kwargs = {**node.kwargs, "dtype": val.dtype}
            changed = True
        elif default_dtype is not None and _reads_default(node, val, default_dtype):
            _check_under(node, val, default_dtype)
    if changed:
        module.recompile()


def is_factory(schema: torch.FunctionSchema) -> bool:
    """A schema whose dtype, when None, is the default dtype (Note [Factory ops follow the
    default dtype])."""
    names = {a.name: a for a in schema.arguments}
    dtype = names.get("dtype")
    return (
        dtype is not None
        and all(name in names for name in _OPTIONS)
        and "self" not in names
        and dtype.has_default_value()
        and dtype.default_value is None
    )


def _unset_dtype_slot(schema: torch.FunctionSchema, node: fx.Node) -> int | str | None:
    """Where a factory node's dtype goes when it has none: its position in `args`, "kwargs",
    or None when the node is no factory or names its dtype."""
    if not is_factory(schema):
        return None
    index = next(i for i, a in enumerate(schema.arguments) if a.name == "dtype")
    if not schema.arguments[index].kwarg_only and index < len(node.args):
        return index if node.args[index] is None else None
    return "kwargs" if node.kwargs.get("dtype") is None else None


def _reads_default(node: fx.Node, val: torch.Tensor, default_dtype: torch.dtype) -> bool:
    """Whether the node's dtype may have come from another default than the call's: a floating
    or complex result that is neither the call's default (or its complex type) nor the dtype of
    a tensor input, from an op that names no dtype."""
    if not (val.dtype.is_floating_point or val.dtype.is_complex):
        return False
    if val.dtype in (default_dtype, _COMPLEX_OF.get(default_dtype)):
        return False
    if node.kwargs.get("dtype") is not None or any(
        isinstance(a, torch.dtype) for a in pytree.tree_leaves(node.args)
    ):
        return False
    inputs = [n.meta.get("val") for n in node.all_input_nodes]
    return not any(isinstance(t, torch.Tensor) and t.dtype == val.dtype for t in inputs)


def _check_under(node: fx.Node, val: torch.Tensor, default_dtype: torch.dtype) -> None:
    """Run the node again on its inputs' fake values under the call's default dtype; refuse it
    when its dtype changes."""
    args, kwargs = pytree.tree_map_only(
        fx.Node, lambda n: n.meta.get("val"), (node.args, node.kwargs)
    )
    mode = detect_fake_mode(pytree.tree_leaves((args, kwargs)))
    if mode is None:
        return  # no fake inputs to run on (a graph read back from a cache was checked before)
    ambient = torch.get_default_dtype()
    try:
        torch.set_default_dtype(default_dtype)
        with mode:
            got = node.target(*args, **kwargs)  # type: ignore[operator]
    except Exception:
        return  # not re-runnable out of its trace (random ops, ...): as traced
    finally:
        torch.set_default_dtype(ambient)
    if isinstance(got, torch.Tensor) and got.dtype != val.dtype:
        line = source_of(node).line or "an unknown line"
        raise UnsupportedError(
            f"{node.target} (at {line}) computes in the default dtype, which the program "
            f"changed to {val.dtype} before it (torch.set_default_dtype); the compiled graph "
            f"runs under the call's default, {default_dtype}, and would compute it in "
            f"{got.dtype}. Cast its tensor inputs to {val.dtype} explicitly (`.to({val.dtype})`), "
            "or set the default dtype outside the compiled function."
        )
