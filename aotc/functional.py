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
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from aotc.runtime.errors import AotcError, UnsupportedError

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
    for m in (torch, sys.modules["aotc"], sys.modules["aotc.passes"], sys.modules["aotc.runtime"])
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
        where = _user_frame(traceback.extract_tb(sys.exc_info()[2]))
        if "FakeTensor" in text and ("non-Fake" in text or "convert all Tensors" in text):
            found = text.split("Found in", 1)[-1].strip()[:200]
            raise UnsupportedError(
                f"{what}: the program reads a tensor that is neither an argument nor reachable "
                f"from a closure, global or module attribute aotc can lift (in {found}, at "
                f"{where}). Pass it as an argument (or register it as a module buffer)."
            ) from e
        if isinstance(e, RuntimeError) and where != "<unknown>":
            raise UnsupportedError(_program_error(what, e, where)) from e
        raise


def _program_error(what: str, e: RuntimeError, where: str) -> str:
    """The user program raised while being traced: eager raises the same for these inputs (a
    device mismatch, an in-place op autograd forbids), so say where and keep torch's reason."""
    reason = (
        str(e).strip().splitlines()[0][:300].rstrip(".") if str(e).strip() else type(e).__name__
    )
    if "device" in reason and ("same device" in reason or "expected device" in reason):
        hint = (
            "Move every tensor the op reads to one device before the call (or with .to() "
            "inside the function)."
        )
    elif "fake impl" in reason or "fake kernel" in reason or "Meta" in reason:
        hint = (
            "aotc traces with fake tensors: give the op a fake kernel "
            "(torch.library.register_fake / `<op>.register_fake`), or call it outside the "
            "compiled function."
        )
    else:
        hint = (
            "Eager PyTorch rejects such programs too (e.g. an in-place op autograd forbids): "
            "use the out-of-place op or .clone() the tensor before modifying it. If eager "
            "runs this line, call it outside the compiled function and report it."
        )
    return f"{what}: the program failed at {where}: {type(e).__name__}: {reason}. {hint}"


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
    compilations have no synthetic bases; see Note [Symbolic compilations]). A 0-d tensor that
    stands for a dynamic Python float keeps its symbol (Note [Dynamic Python floats] in
    aotc/backend.py)."""
    fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    memo = getattr(t, "item_memo", None)
    if memo is not None:
        fake.item_memo = memo
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


class OverlapCheck(TorchDispatchMode):
    """Eager refuses in-place writes into a tensor whose elements share memory (an `expand`ed
    view); fake tensors do not check. This mode notes the first such write during the plain
    metadata run (raising inside a dispatch can abort from C++ callers) and `check()` raises it
    afterwards with the user's line."""

    def __init__(self) -> None:
        super().__init__()
        self.problem: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if self.problem is None and func._schema.is_mutable:
            try:
                self._check(func, args)
            except Exception:  # noqa: BLE001 best effort: a failing check must not fail a compile
                self.problem = None
        return func(*args, **kwargs)

    def _check(self, func: torch._ops.OpOverload, args: tuple[object, ...]) -> None:
        written = [
            value
            for arg, value in zip(func._schema.arguments, args)
            if arg.alias_info is not None
            and arg.alias_info.is_write
            and isinstance(value, torch.Tensor)
        ]
        read = [a for a in args if isinstance(a, torch.Tensor) and all(a is not w for w in written)]
        for w in written:
            if torch._debug_has_internal_overlap(w) == 1:
                self.problem = self._message(
                    func,
                    "writes into a tensor in which several elements share memory (e.g. "
                    "an expand()ed view)",
                    "more than one element of the written-to tensor "
                    "refers to a single memory location",
                )
            elif func._schema.name.endswith("_") and any(_partial_overlap(w, r) for r in read):
                self.problem = self._message(
                    func,
                    "writes into a tensor that partially overlaps one of its inputs",
                    "some elements of the input tensor and the written-to tensor refer to a "
                    "single memory location",
                )

    @staticmethod
    def _message(func: object, what: str, eager: str) -> str:
        where = _user_frame(traceback.extract_stack())
        return (
            f"metadata pass: the program failed at {where}: {func} {what}; eager PyTorch raises "
            f"'unsupported operation: {eager}' here too. .clone() the tensor before modifying it."
        )

    def check(self) -> None:
        if self.problem is not None:
            raise UnsupportedError(self.problem)


def _partial_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """eager's partial-overlap check (TensorIterator's assert_no_partial_overlap): two dense
    tensors on one storage whose byte ranges intersect, other than the same range and strides."""
    from torch._prims_common import is_non_overlapping_and_dense_or_false as dense

    if a.device != b.device or not (dense(a) and dense(b)):
        return False
    if StorageWeakRef(a.untyped_storage()) != StorageWeakRef(b.untyped_storage()):
        return False
    a0, b0 = a.storage_offset() * a.element_size(), b.storage_offset() * b.element_size()
    a1, b1 = a0 + a.numel() * a.element_size(), b0 + b.numel() * b.element_size()
    if (a0, a1) == (b0, b1):
        return a.stride() != b.stride()
    return a0 < b1 and b0 < a1
