"""Custom operators that write their inputs, in aotc's functional traces.

Stage: `note_writing_op(op)`, called by the plain metadata run (`EagerChecks` in
aotc/functional.py) for each operator with a mutable schema the program calls, before the
functional runs (the metadata pass's second run and the joint trace).
Requires: those runs use C++ functionalization with the Python dispatcher on (`functionalization()`).
Ensures: a call of a custom operator whose schema declares that it writes tensor arguments
(`torch.library.custom_op(..., mutates_args=...)`) is traced as torch's functional
`auto_functionalized` operator, whose outputs become the written arguments' new values.

Note [Custom operators that write their inputs]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
C++ functionalization refuses operators outside ATen whose schema has alias annotations ("Found
a custom (non-ATen) operator whose output has alias annotations"), so a program calling
`add_into(x, out)` declared with `mutates_args=("out",)` (an in-place kernel, a cache update)
could not be compiled. torch's `auto_functionalized` operator is that call's functional form: it
clones the written arguments, runs the operator on the clones and returns its outputs followed
by the clones. So at the Functionalize dispatch key such an operator gets a Python kernel that
unwraps the functional tensors, calls `auto_functionalized` below functionalization (make_fx
records that call), and makes each written argument's wrapper hold the matching clone. The
written inputs then show up as data mutations like any other (the epilogue copies their new
values back), and intermediates written this way just switch to the new value.

The kernel is registered the first time the plain metadata run (which every compilation runs
before its functional runs) sees the operator: it goes into the operator's Python kernel table
(`py_impl`), which only the Python dispatcher reads, and stays there (it functionalizes the same
way wherever C++ functionalization runs with the Python dispatcher on). Operators with a C++
Functionalize kernel of their own, built-in (ATen) operators and schemas torch's
`can_auto_functionalize` rejects are left alone. Autograd runs above the Functionalize key, so a
custom operator's registered backward is traced as before. The compiled graph runs
`auto_functionalized` eagerly (its dense kernel: clone, then the operator); like every graph that
calls an operator outside aten and prims, it is not stored in the disk cache (the allowlist of
runtime/fxcodec.py). tests/e2e/test_custom_ops.py.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch._C import DispatchKey

_BUILT_IN = frozenset(("aten", "prim", "prims", "higher_order"))
_LOCK = threading.Lock()
_REGISTERED: set[torch._ops.OpOverload] = set()


def _auto_functionalize() -> tuple[Any, Callable[[torch._ops.OpOverload], bool]]:
    from torch._higher_order_ops.auto_functionalize import (
        auto_functionalized,
        can_auto_functionalize,
    )

    return auto_functionalized, can_auto_functionalize


def _written_args(op: torch._ops.OpOverload) -> list[str]:
    return [
        a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write
    ]


def _functional_kernel(op: torch._ops.OpOverload) -> Callable[..., Any]:
    """The Functionalize kernel of `op`: see Note [Custom operators that write their inputs]."""
    written = _written_args(op)
    schema_args = op._schema.arguments
    num_returns = len(op._schema.returns)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        from torch._subclasses.functional_tensor import CppFunctionalizeAPI

        auto_functionalized, _ = _auto_functionalize()
        api = CppFunctionalizeAPI()
        named: dict[str, Any] = {}
        for k, arg in enumerate(schema_args):  # every argument by name, as the operator takes
            if arg.name in kwargs:
                named[arg.name] = kwargs[arg.name]
            elif k < len(args):
                named[arg.name] = args[k]
            else:
                named[arg.name] = arg.default_value
        plain: dict[str, Any] = api.unwrap_tensors(named)  # type: ignore[arg-type,assignment]
        with api.redispatch_to_next():
            outs = auto_functionalized(op, **plain)
        results, new_values = outs[: len(outs) - len(written)], outs[len(outs) - len(written) :]
        for name, value in zip(written, new_values):
            if value is None:  # an optional argument passed as None
                continue
            old = named[name]
            pairs = zip(old, value) if isinstance(value, (list, tuple)) else [(old, value)]
            for wrapper, new in pairs:
                api.replace(wrapper, new)
                api.commit_update(wrapper)
                api.sync(wrapper)
        if num_returns == 0:
            return None
        result = results[0] if num_returns == 1 else tuple(results)
        return api.wrap_tensors(result)

    return kernel


def _register(op: torch._ops.OpOverload) -> None:
    with _LOCK:
        if op in _REGISTERED:
            return
        _REGISTERED.add(op)
        _, can = _auto_functionalize()
        if DispatchKey.Functionalize in op.py_kernels or not can(op):
            return
        op.py_impl(DispatchKey.Functionalize)(_functional_kernel(op))


def note_writing_op(op: torch._ops.OpOverload) -> None:
    """`op`, whose schema is mutable, ran in the plain metadata run: give it its Functionalize
    kernel before the functional runs if it is a custom operator (cheap after the first call)."""
    if op not in _REGISTERED and op.namespace not in _BUILT_IN:
        _register(op)


__all__ = ["note_writing_op"]
