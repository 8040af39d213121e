"""Interposing on a traced program's Python: recording class methods and library-call stubs.

Stage: `patch_class(cls)` / `unpatch_class(cls)` (refcounted) install recording
`__getattribute__`, `__getattr__`, `__setattr__` and `__delattr__` on a class for the length of a
run; `recording_module_class(cls)` is a Python module class that records the same way;
`install_stubs()` / `remove_stubs()` replace `print`, `Tensor.register_hook` and friends, and
Python's and NumPy's random draws, for the length of a run. `ACTIVE` lists the recorders of the
runs in progress (aotc/recording.py): every recorded load and store is reported to each of them.
Requires: called under the compile lock; a patched class is unpatched as often as patched.
Ensures: each patch calls the original method (resolved along the MRO, skipping patches), so the
program behaves as without them; only loads and stores on the recorders' tracked objects, on
their own thread, are recorded (the recorder filters).
"""

from __future__ import annotations

import builtins
import functools
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from aotc.runtime.errors import UnsupportedError
from aotc.usercode import MISSING, format_line, is_user_file, user_line

if TYPE_CHECKING:
    from aotc.recording import Recorder

Tensor = torch.Tensor

# ---------------------------------------------------------------- class patches

ACTIVE: list[Recorder] = []  # the recorders of the runs in progress, innermost last
_PATCH_LOCK = threading.RLock()
_PATCH_COUNT: dict[type, int] = {}
_PATCH_SAVED: dict[type, list[tuple[str, object]]] = {}  # the class's own entries before
_RECORDING_MODULE_CLASSES: dict[type, type] = {}


def _recording_lookup(orig: Callable[[object, str], object], report_missing: bool) -> Any:
    """`orig` (a class's `__getattribute__` or `__getattr__`) reporting each read to the active
    recorders: the value, or MISSING when the lookup fails and `report_missing` (a
    `__getattribute__` whose class has a `__getattr__` leaves the miss to that one)."""

    def lookup(self: object, name: str) -> object:
        try:
            value = orig(self, name)
        except AttributeError:
            if ACTIVE and report_missing:
                for rec in ACTIVE:
                    rec.on_read(self, name, MISSING)
            raise
        if ACTIVE:
            for rec in ACTIVE:
                rec.on_read(self, name, value)
        return value

    lookup.__aotc_recording__ = True  # type: ignore[attr-defined]
    return lookup


def _wrap_getattribute(orig: Callable[[object, str], object], has_getattr: bool) -> Any:
    return _recording_lookup(orig, report_missing=not has_getattr)


def _wrap_getattr(orig: Callable[[object, str], object]) -> Any:
    return _recording_lookup(orig, report_missing=True)


def _wrap_setattr(orig: Callable[..., None], deleting: bool) -> Any:
    if deleting:

        def __delattr__(self: object, name: str) -> None:  # noqa: N807
            for rec in ACTIVE:
                rec.on_write(self, name)
            orig(self, name)

        __delattr__.__aotc_recording__ = True  # type: ignore[attr-defined]
        return __delattr__

    def __setattr__(self: object, name: str, value: object) -> None:  # noqa: N807
        for rec in ACTIVE:
            rec.on_write(self, name)
        orig(self, name, value)

    __setattr__.__aotc_recording__ = True  # type: ignore[attr-defined]
    return __setattr__


def _unwrapped(cls: type, name: str) -> Any:
    """`cls.<name>` resolved along the MRO, skipping recording wrappers."""
    for klass in cls.__mro__:
        value = vars(klass).get(name)
        if value is not None and not getattr(value, "__aotc_recording__", False):
            return value
    return None


def can_patch(cls: type) -> bool:
    flags = cls.__flags__
    return bool(flags & (1 << 9)) and not flags & (1 << 8)  # heap type, not immutable


def patch_class(cls: type) -> bool:
    """Install recording methods on `cls` (refcounted); False if the class cannot take them."""
    with _PATCH_LOCK:
        if cls in _PATCH_COUNT:
            _PATCH_COUNT[cls] += 1
            return True
        if not can_patch(cls):
            return False
        own = vars(cls)
        getattr_ = _unwrapped(cls, "__getattr__")
        wrappers = {
            "__getattribute__": _wrap_getattribute(
                _unwrapped(cls, "__getattribute__"), getattr_ is not None
            ),
            "__setattr__": _wrap_setattr(_unwrapped(cls, "__setattr__"), deleting=False),
            "__delattr__": _wrap_setattr(_unwrapped(cls, "__delattr__"), deleting=True),
        }
        if getattr_ is not None:
            wrappers["__getattr__"] = _wrap_getattr(getattr_)
        saved = [(name, own.get(name, MISSING)) for name in wrappers]
        try:
            for name, wrapper in wrappers.items():
                setattr(cls, name, wrapper)
        except (TypeError, AttributeError):
            _restore_class(cls, saved)
            return False
        _PATCH_SAVED[cls] = saved
        _PATCH_COUNT[cls] = 1
        return True


def unpatch_class(cls: type) -> None:
    with _PATCH_LOCK:
        _PATCH_COUNT[cls] -= 1
        if _PATCH_COUNT[cls]:
            return
        del _PATCH_COUNT[cls]
        _restore_class(cls, _PATCH_SAVED.pop(cls))


def _restore_class(cls: type, saved: list[tuple[str, object]]) -> None:
    for name, value in saved:
        if value is MISSING:
            if name in vars(cls):
                delattr(cls, name)
        else:
            setattr(cls, name, value)


def recording_module_class(cls: type) -> type:
    """A subclass of a Python module's class whose attribute loads and stores are recorded."""
    rec = _RECORDING_MODULE_CLASSES.get(cls)
    if rec is None:
        getattribute = _wrap_getattribute(cls.__getattribute__, False)  # type: ignore[arg-type]
        rec = type(
            cls.__name__,
            (cls,),
            {
                "__getattribute__": getattribute,
                "__setattr__": _wrap_setattr(cls.__setattr__, deleting=False),
                "__delattr__": _wrap_setattr(cls.__delattr__, deleting=True),
                "__aotc_original__": cls,
            },
        )
        _RECORDING_MODULE_CLASSES[cls] = rec
    return rec


# ---------------------------------------------------------------- library calls made in a run


def _stub(orig: Callable[..., Any], on_call: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def stub(*args: Any, **kwargs: Any) -> Any:
        rec = ACTIVE[-1] if ACTIVE else None
        if rec is not None and threading.get_ident() == rec.thread:
            return on_call(rec, orig, *args, **kwargs)
        return orig(*args, **kwargs)

    return stub


def _caller_line(skip: int) -> str:
    """`file:line (source)` of the frame `skip` levels up if it is user code, else ""."""
    frame = sys._getframe(skip + 1)
    code = frame.f_code
    return format_line(code.co_filename, frame.f_lineno) if is_user_file(code.co_filename) else ""


def _on_print(rec: Recorder, orig: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    where = _caller_line(2)
    if not where:
        return orig(*args, **kwargs)
    rec.side_effect(
        f"print at {where}",
        f"print() at {where} runs only while aotc traces the program (on fake tensors), "
        "never in compiled calls; it was skipped.",
        where,
        refuse=False,
    )
    return None


def _on_hook(rec: Recorder, orig: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    what = getattr(orig, "__name__", "register_hook")
    if what == "retain_grad" and args and isinstance(args[0], Tensor) and args[0].is_leaf:
        return orig(*args, **kwargs)  # a no-op on leaves, as in eager
    where = user_line(3) or "an unknown line"
    raise UnsupportedError(
        f"{rec.name}: Tensor.{what}() at {where} is called inside the compiled function. In "
        "strict mode (capture='trace') the program runs only while aotc traces it, so a hook "
        "registered there would see fake tensors once and never the compiled calls' gradients "
        "(and retain_grad() would never fill .grad). Register hooks on inputs or parameters "
        "outside the compiled function, or use the default capture mode."
    )


def _on_random(rec: Recorder, orig: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    where = _caller_line(2)
    if not where:
        return orig(*args, **kwargs)
    module = getattr(orig, "__module__", None) or "random"
    raise UnsupportedError(
        f"{rec.name}: {module}.{getattr(orig, '__name__', '?')}() at {where} draws from "
        "Python/NumPy random state; aotc would freeze this one draw into the graph and every "
        "compiled call would reuse it. Use torch.rand/torch.randint/torch.randn (traced: fresh "
        "each call), draw outside and pass the value in, or use the default capture mode."
    )


def _on_seed(rec: Recorder, orig: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    where = _caller_line(2)
    if not where:  # library code (torch.utils.checkpoint restores the state it stashed)
        return orig(*args, **kwargs)
    raise UnsupportedError(
        f"{rec.name}: torch.{getattr(orig, '__name__', '?')}() at {where} sets the global random "
        "state: it would run once, while aotc traces, and compiled calls would draw from the "
        "state as they find it. Seed outside the compiled function, pass a torch.Generator as an "
        "argument, or use the default capture mode."
    )


def _on_clock(rec: Recorder, orig: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    where = _caller_line(2)
    if where:
        rec.side_effect(
            f"clock at {where}",
            f"the program reads the clock (time.{getattr(orig, '__name__', '?')}()) at "
            f"{where}: a value read once while aotc traces, which compiled calls would reuse.",
            where,
        )
    return orig(*args, **kwargs)


_RANDOM_NAMES = (
    "random", "uniform", "randint", "randrange", "choice", "choices", "shuffle", "sample",
    "gauss", "normalvariate", "lognormvariate", "expovariate", "betavariate", "gammavariate",
    "triangular", "vonmisesvariate", "paretovariate", "weibullvariate", "getrandbits",
    "randbytes", "binomialvariate",
)  # fmt: skip
_NUMPY_RANDOM_NAMES = (
    "rand", "randn", "random", "random_sample", "randint", "normal", "uniform", "choice",
    "shuffle", "permutation", "standard_normal", "binomial", "poisson", "beta", "integers",
)  # fmt: skip


def _stub_targets() -> list[tuple[object, str, Callable[..., Any]]]:
    import random
    import time

    targets: list[tuple[object, str, Callable[..., Any]]] = [
        (builtins, "print", _on_print),
        (Tensor, "register_hook", _on_hook),
        (Tensor, "register_post_accumulate_grad_hook", _on_hook),
        (Tensor, "retain_grad", _on_hook),
    ]
    targets += [(random, n, _on_random) for n in _RANDOM_NAMES if hasattr(random, n)]
    targets += [(time, n, _on_clock) for n in ("time", "time_ns", "perf_counter", "monotonic")]
    seeds = ("manual_seed", "seed", "set_rng_state")
    targets += [(owner, n, _on_seed) for owner in (torch, torch.random) for n in seeds]
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        targets += [(numpy.random, n, _on_random) for n in _NUMPY_RANDOM_NAMES]
    return [(o, n, h) for o, n, h in targets if hasattr(o, n)]


# Note [.grad and .data of inputs in strict mode]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Two tensor attributes bypass the dispatcher, so no trace sees them: `.grad` (a field of the
# autograd meta) and the `.data` setter (`x.data = t` swaps x's storage and sizes in place). On a
# program's inputs (its tensor arguments and lifted tensors) both would be silently wrong in a
# graph: a fake argument's `.grad` is None whatever the real one holds, so `x.grad` would be baked
# as None and `x.grad = t` dropped; `x.data = t` would change only the fake swapped in for the
# trace, so the call would leave the real tensor as it was. While a strict run is in progress,
# `Tensor.grad` and `Tensor.data` are properties that refuse, naming the input and the user's
# line: reading or writing `.grad` of an argument (a lifted tensor's `.grad` is lifted itself,
# see aotc/lifting.py), and assigning `.data` of any input. Intermediates are left alone: eager
# and the trace agree on them. Both properties call TensorBase's own descriptors otherwise.
_GRAD: Any = vars(torch._C.TensorBase)["grad"]  # the C descriptors
_DATA: Any = vars(torch._C.TensorBase)["data"]


def _input_name(self: Tensor, arguments_only: bool) -> str | None:
    rec = ACTIVE[-1] if ACTIVE else None
    if rec is None or threading.get_ident() != rec.thread:
        return None
    found = rec.inputs.get(id(self))
    if found is None or (arguments_only and not found[1]):
        return None
    return found[0]


def _refuse_attribute(self: Tensor, what: str, name: str, hint: str) -> None:
    rec = ACTIVE[-1]
    where = user_line(3) or "an unknown line"
    raise UnsupportedError(
        f"{rec.name}: the program {what} of input {name!r} at {where}. That bypasses the "
        f"operators aotc traces, so a compiled call would not do it. {hint}"
    )


_GRAD_HINT = (
    "Pass the gradient as an argument of its own (`f(x, x.grad)`), do this outside the compiled "
    "function, or use the default capture mode."
)


def _get_grad(self: Tensor) -> Any:
    name = _input_name(self, arguments_only=True)
    if name is not None:
        _refuse_attribute(self, "reads .grad", name, _GRAD_HINT)
    return _GRAD.__get__(self, type(self))


def _set_grad(self: Tensor, value: Any) -> None:
    name = _input_name(self, arguments_only=True)
    if name is not None:
        _refuse_attribute(self, "assigns .grad", name, _GRAD_HINT)
    _GRAD.__set__(self, value)


def _del_grad(self: Tensor) -> None:
    name = _input_name(self, arguments_only=True)
    if name is not None:
        _refuse_attribute(self, "deletes .grad", name, _GRAD_HINT)
    _GRAD.__delete__(self)


def _get_data(self: Tensor) -> Any:
    return _DATA.__get__(self, type(self))


def _set_data(self: Tensor, value: Any) -> None:
    name = _input_name(self, arguments_only=False)
    if name is not None:
        _refuse_attribute(
            self,
            "assigns .data",
            name,
            "Write the values in place instead (`with torch.no_grad(): x.copy_(t)`), or do this "
            "outside the compiled function.",
        )
    _DATA.__set__(self, value)


def _property_targets() -> list[tuple[object, str, object]]:
    return [
        (Tensor, "grad", property(_get_grad, _set_grad, _del_grad, doc=_GRAD.__doc__)),
        (Tensor, "data", property(_get_data, _set_data, doc=_DATA.__doc__)),
    ]


_STUB_COUNT = 0
_STUB_SAVED: list[tuple[object, str, object, bool]] = []


def install_stubs() -> None:
    global _STUB_COUNT
    with _PATCH_LOCK:
        _STUB_COUNT += 1
        if _STUB_COUNT > 1:
            return
        for owner, name, handler in _stub_targets():
            orig = getattr(owner, name)
            own = name in vars(owner)
            _STUB_SAVED.append((owner, name, vars(owner).get(name), own))
            setattr(owner, name, _stub(orig, handler))
        for owner, name, replacement in _property_targets():
            own = name in vars(owner)
            _STUB_SAVED.append((owner, name, vars(owner).get(name), own))
            setattr(owner, name, replacement)


def remove_stubs() -> None:
    global _STUB_COUNT
    with _PATCH_LOCK:
        _STUB_COUNT -= 1
        if _STUB_COUNT:
            return
        for owner, name, value, own in reversed(_STUB_SAVED):
            if own:
                setattr(owner, name, value)
            else:
                delattr(owner, name)
        _STUB_SAVED.clear()
