"""Functionalization helpers shared by the metadata pass and the joint trace.

Both run the user program on functional tensor wrappers (the C++ functionalization layer behind
`torch.func.functionalize`) over fake tensors, so no real compute happens at compile time and
every in-place op becomes a functional op plus a record of the mutation.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence

import torch
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedOperatorException,
)

from runtime.errors import AotcError, UnsupportedError

# A user program after flattening: takes the user leaves, returns (output leaves, output spec).
FlatProgram = Callable[[list[object]], tuple[list[object], object]]


def to_functional(t: torch.Tensor) -> torch.Tensor:
    wrapped = torch._to_functional_tensor(t)
    torch._mirror_autograd_meta_to(t, wrapped)  # keeps requires_grad and non-leafness
    return wrapped


def from_functional(t: object) -> object:
    if isinstance(t, torch.Tensor) and torch._is_functional_tensor(t):
        torch._sync(t)
        return torch._from_functional_tensor(t)
    return t


@contextlib.contextmanager
def functionalization() -> Iterator[None]:
    """C++ functionalization with the Python dispatcher on. The Python dispatcher routes ops
    whose schema hides a mutation (`native_batch_norm` updates running stats without declaring
    it) to correctly-schema'd variants, so functionalization sees every input mutation."""
    with enable_python_dispatcher():
        torch._enable_functionalization(reapply_views=True)
        try:
            yield
        finally:
            torch._disable_functionalization()


_OWN_DIRS = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep  # type: ignore[arg-type]
    for m in (torch, sys.modules[__name__.split(".")[0]])
) + tuple(
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), p) + os.sep
    for p in ("passes", "runtime")
)


def _user_frame(tb: traceback.StackSummary) -> str:
    """The innermost frame outside torch and aotc's packages: the user's line."""
    for frame in reversed(tb):
        path = os.path.abspath(frame.filename)
        if not path.startswith(_OWN_DIRS) and not path.endswith("contextlib.py"):
            return f"{frame.filename}:{frame.lineno} ({frame.line})"
    return "<unknown>"


@contextlib.contextmanager
def user_errors(what: str) -> Iterator[None]:
    """Turn tracing failures that mean 'unsupported program' into UnsupportedError."""
    try:
        yield
    except AotcError:
        raise
    except (DataDependentOutputException, DynamicOutputShapeException) as e:
        where = _user_frame(traceback.extract_tb(sys.exc_info()[2]))
        op = getattr(e, "func", "?")
        raise UnsupportedError(
            f"{what}: the program's control flow or output shape depends on tensor values "
            f"(op {op}, at {where}): e.g. `if x.sum() > 0`, `.item()`, `.tolist()`, "
            "`torch.nonzero`. aotc compiles one graph per input signature and cannot see values. "
            "Move the data-dependent part outside the compiled function, or use torch.where."
        ) from e
    except UnsupportedOperatorException as e:
        where = _user_frame(traceback.extract_tb(sys.exc_info()[2]))
        raise UnsupportedError(
            f"{what}: op {e.func} has no fake-tensor implementation (at {where}); aotc cannot "
            "trace it. Call it outside the compiled function."
        ) from e
    except (RuntimeError, AssertionError) as e:
        text = str(e)
        if "FakeTensor" in text and ("non-Fake" in text or "convert all Tensors" in text):
            found = text.split("Found in", 1)[-1].strip()[:200]
            where = _user_frame(traceback.extract_tb(sys.exc_info()[2]))
            raise UnsupportedError(
                f"{what}: the program reads a tensor that is neither an argument nor reachable "
                f"from a closure, global or module attribute aotc can lift (in {found}, at "
                f"{where}). Pass it as an argument (or register it as a module buffer)."
            ) from e
        raise


def fakeify(
    mode: FakeTensorMode, tensors: Sequence[torch.Tensor], *, as_leaves: bool
) -> list[torch.Tensor]:
    """Fake copies. `as_leaves=False` keeps non-leafness and aliasing (metadata pass);
    `as_leaves=True` gives leaves with the same requires_grad (joint trace primals).

    Tensors that are fake already (symbolic compilations, see Note [Symbolic compilations])
    get fresh fakes of the same (symbolic) geometry, so runs never share tensors or symbols
    differ between runs."""
    if tensors and all(isinstance(t, FakeTensor) for t in tensors):
        return [fresh_fake(t, as_leaves=as_leaves) for t in tensors]
    if not as_leaves:
        return [mode.from_tensor(t) for t in tensors]
    fakes = []
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        detached = [t.detach() for t in tensors]
    for t, d in zip(tensors, detached):
        fake = mode.from_tensor(d)
        if t.requires_grad:
            fake.requires_grad_(True)
        fakes.append(fake)
    return fakes


def fresh_fake(t: torch.Tensor, *, as_leaves: bool) -> torch.Tensor:
    """A new fake tensor (in the ambient fake mode) with `t`'s sizes, strides, dtype, device and
    requires_grad; also its non-leafness unless `as_leaves`. Sizes may be SymInts: the copy
    shares their symbols. Storage offsets and aliasing between inputs are not kept (symbolic
    compilations have no synthetic bases; see Note [Symbolic compilations])."""
    fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    if t.requires_grad:
        fake.requires_grad_(True)
        if not as_leaves and not t.is_leaf:
            with torch.enable_grad():
                fake = fake.clone()
    return fake


@contextlib.contextmanager
def compiling() -> Iterator[None]:
    """`torch.compiler.is_compiling()` is True while aotc traces, as under torch.compile.

    Library code checks the flag to take its traceable path: torch.optim's Adam/AdamW keep the
    step count a tensor instead of calling `.item()` on it, and group tensors lazily. The flag is
    torch.compiler's own (set by Dynamo for the duration of its compilations)."""
    session = getattr(torch.compiler, "_compile_session_context", None)
    if session is not None:
        with session():
            yield
        return
    old = torch.compiler._is_compiling_flag  # type: ignore[attr-defined]
    torch.compiler._is_compiling_flag = True  # type: ignore[attr-defined]
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = old  # type: ignore[attr-defined]
