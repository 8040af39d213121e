"""`torch.Generator` arguments of ops in aotc's fx traces, on a torch whose fx cannot record them.

`held()` is a context manager: while any thread holds it, fx's make_fx tracer records a
`torch.Generator` an op reads (`torch.rand(3, generator=g)`) as a constant attribute of the traced
module. `compiling()` (aotc/functional.py) holds it around every compilation.

Note [Generators in a trace]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torch 2.13 registers `torch.Generator` as an opaque reference type, and fx's `create_arg` stores
such an object on the traced module (`_opaque_obj0 = self._opaque_obj0`, a `get_attr` node the
op reads): the graph draws from the caller's generator, as eager does, and the signature guard
on the argument (its identity) recompiles for another generator. torch 2.11 has no such
registration: `create_arg` raised "argument of type: <class 'torch._C.Generator'>" and a program
eager runs failed to compile. There, while held, make_fx's tracer stores a generator the same way
(the same attribute name), so the graph is the one 2.13 traces. The replacement serves every
thread: it only turns that error into 2.13's behaviour, which no trace relies on failing.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import PythonKeyTracer

from aotc.sharedpatch import SharedPatch


@functools.cache
def _records_generators() -> bool:
    """Whether this torch's fx records a Generator argument itself (2.13: an opaque reference
    type; 2.11: not)."""
    from torch._library import opaque_object

    check = getattr(opaque_object, "is_opaque_reference_type", None)
    return check is not None and bool(check(torch.Generator))


def _create_arg(self: PythonKeyTracer, a: object) -> Any:
    """`PythonKeyTracer.create_arg` that stores a Generator on the traced module (Note
    [Generators in a trace]); any other value goes to torch's own."""
    if not isinstance(a, torch.Generator):
        return _PATCH.saved["create_arg"](self, a)
    stored: dict[Any, str] = self.tensor_attrs  # keyed by identity, as fx's own constants
    qualname = stored.get(a)
    if not qualname:
        qualname = self.get_fresh_qualname("_opaque_obj")
        stored[a] = qualname
        setattr(self.root, qualname, a)
    node: fx.Node = self.create_node("get_attr", qualname, (), {})
    return node


_PATCH = SharedPatch(PythonKeyTracer, {"create_arg": _create_arg})


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Generators recorded as constants while held (Note [Generators in a trace]); nothing to
    do on a torch that records them itself."""
    with contextlib.nullcontext() if _records_generators() else _PATCH.held():
        yield
