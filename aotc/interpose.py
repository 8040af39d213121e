"""Interposing on a traced program's Python: recording class methods and library-call stubs.

Stage: `patch_class(cls)` / `unpatch_class(cls)` (refcounted) install recording
`__getattribute__`, `__getattr__`, `__setattr__` and `__delattr__` on a class for the length of a
run; `recording_module_class(cls)` is a Python module class that records the same way;
`install_stubs()` / `remove_stubs()` replace `print`, `Tensor.register_hook` and friends, and
Python's and NumPy's random draws, for the length of a run, and give tensors a `__setattr__`
and `detach_`/`requires_grad_`/`backward` that refuse what a graph cannot replay on inputs (Note
[Tensor state a graph does not carry]); `watch_generators()` / `unwatch_generators()` refuse
reading or setting a torch.Generator's state, and creating one, from the program (Note
[Generator state in strict mode]). `ACTIVE` lists the recorders of the
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


# Note [Tensor state a graph does not carry]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Some things a program does to a tensor are not operators, so no trace sees them, and a compiled
# call would not do them: on an input, the trace does them to a stand-in (a fake tensor) and the
# caller's tensor keeps its old state. While a strict run is in progress, user code doing them is
# refused, naming the input (or output) and the line:
# - `x.detach_()` on an input that requires grad (eager leaves the caller's `x` detached);
# - `x.requires_grad_(False)` / `x.requires_grad = False` on an input that requires grad (eager
#   turns the caller's flag off; turning it on is replayed, Note [Inference traces keep
#   requires_grad] in aotc/tracer.py);
# - a Python attribute set on a tensor (`x.seen = True`, `y.tag = "..."`) that is an input, or
#   an output of the call (Recorder.call checks the outputs): a compiled call returns new tensors
#   without it and never sets it on the input. On other intermediates it is harmless (eager drops
#   them with the tensor too) and allowed;
# - `.backward()` / `torch.autograd.backward` whose backward reaches the program's inputs: eager
#   accumulates into their `.grad` (or goes on into the caller's graph), which the trace cannot
#   (their gradients are what the compiled backward computes; the trace reports "Cannot backprop
#   through mirrored meta"). A backward that stays inside the program runs as before;
# - `torch.autograd.grad`/`.backward()` without `retain_graph` free the graph behind what they
#   differentiate; each call is noted (`Recorder.freeing_calls`), and Recorder.call refuses a
#   program that returns an output whose backward needs a value that call freed (eager raises
#   "Trying to backward through the graph a second time" when the caller backpropagates it;
#   strict mode differentiates every output that requires grad when it compiles).
# Library code doing the same (torch's own `Parameter`, a checkpoint's inner backward) is let
# through: its tensors are its own business (Note [Strict capture guards] in aotc/strict.py).


def _input_of(rec: Recorder, t: object) -> str | None:
    found = rec.inputs.get(id(t))
    return None if found is None else found[0]


def _refuse_on_input(rec: Recorder, what: str, name: str, where: str, hint: str) -> None:
    """`what`: the program's action, completed by "input <name>" (e.g. "calls detach_() on")."""
    raise UnsupportedError(
        f"{rec.name}: the program {what} input {name!r} at {where}. That is not an operator aotc "
        "traces: the trace does it to a stand-in for the input, so a compiled call would leave "
        f"your tensor as it was. {hint}"
    )


_OUT_OF_PLACE_HINT = (
    "Use the out-of-place form inside the compiled function (`x = x.detach()`), do it outside "
    "the compiled function, or use the default capture mode."
)


def _on_detach_(rec: Recorder, orig: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    where = _caller_line(2)
    self = args[0] if args else None
    name = _input_of(rec, self) if where else None
    if name is not None and isinstance(self, Tensor) and self.requires_grad:
        _refuse_on_input(rec, "calls detach_() (in place) on", name, where, _OUT_OF_PLACE_HINT)
    return orig(*args, **kwargs)


def _refuse_requires_grad_off(rec: Recorder, t: object, value: object, where: str) -> None:
    name = _input_of(rec, t) if where else None
    if name is not None and isinstance(t, Tensor) and t.requires_grad and not value:
        _refuse_on_input(
            rec,
            "turns requires_grad off (requires_grad_(False), or .requires_grad = False) on",
            name,
            where,
            "Pass `x.detach()` to the compiled function, turn the flag off before the call, or "
            "use the default capture mode.",
        )


def _on_requires_grad_(rec: Recorder, orig: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    value = args[1] if len(args) > 1 else kwargs.get("requires_grad", True)
    _refuse_requires_grad_off(rec, args[0] if args else None, value, _caller_line(2))
    return orig(*args, **kwargs)


def _is_data_descriptor(cls: type, name: str) -> bool:
    for klass in cls.__mro__:
        found = vars(klass).get(name, MISSING)
        if found is not MISSING:
            return hasattr(type(found), "__set__")
    return False


_OBJECT_SETATTR = object.__setattr__


def _tensor_setattr(self: Tensor, name: str, value: object) -> None:
    """`Tensor.__setattr__` during a run: torch's own code sets attributes on the trace's
    tensors thousands of times per trace, so the common case (library code) is one frame and a
    cached file lookup."""
    rec = ACTIVE[-1] if ACTIVE else None
    if rec is not None and name[:2] != "__":
        code = sys._getframe(1).f_code
        if is_user_file(code.co_filename) and threading.get_ident() == rec.thread:
            _check_tensor_setattr(rec, self, name, value, user_line(2))
    _OBJECT_SETATTR(self, name, value)


def _check_tensor_setattr(
    rec: Recorder, self: Tensor, name: str, value: object, where: str
) -> None:
    if name == "requires_grad":
        _refuse_requires_grad_off(rec, self, value, where)
    elif not _is_data_descriptor(type(self), name):  # a Python attribute (`grad`, `data`: above)
        input_name = _input_of(rec, self)
        if input_name is not None:
            _refuse_on_input(
                rec,
                f"sets Python attribute {name!r} on",
                input_name,
                where,
                "Set it outside the compiled function (before or after the call), or use the "
                "default capture mode.",
            )
        rec.tensor_attributes[id(self)] = (self, name, where)


_FREES_GRAPH_ARGS = {"grad": 3, "backward": 2}  # position of retain_graph (create_graph next)


def _retains_graph(orig: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    pos = _FREES_GRAPH_ARGS.get(getattr(orig, "__name__", ""), 2)
    retain = kwargs.get("retain_graph", args[pos] if len(args) > pos else None)
    create = kwargs.get("create_graph", args[pos + 1] if len(args) > pos + 1 else False)
    return bool(create) if retain is None else bool(retain)


def _on_autograd(rec: Recorder, orig: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    where = _caller_line(2)
    nested = torch._C._current_graph_task_id() != -1  # called inside a backward
    if not where or nested:
        return orig(*args, **kwargs)
    name = getattr(orig, "__name__", "?")
    what = _AUTOGRAD_CALLS.get(getattr(orig, "__qualname__", name), f"{name}()")
    if not _retains_graph(orig, args, kwargs):
        rec.freeing_calls.append((what, where))
    try:
        return orig(*args, **kwargs)
    except RuntimeError as e:
        if "mirrored meta" not in str(e):
            raise
        raise UnsupportedError(
            f"{rec.name}: {what} at {where} backpropagates into the compiled function's inputs: "
            "eager would accumulate gradients into the .grad of the tensors it comes from (or go "
            "on into the caller's autograd graph), which strict mode (capture='trace') cannot "
            "trace, since the gradients of the inputs are what the compiled backward computes. "
            "Return the loss and call .backward() after the call, take the gradients inside "
            "with torch.autograd.grad(loss, inputs) and return them, or use the default "
            "capture mode."
        ) from e


_AUTOGRAD_CALLS = {
    "Tensor.backward": "Tensor.backward()",
    "backward": "torch.autograd.backward()",
    "grad": "torch.autograd.grad()",
}


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
        # See Note [Tensor state a graph does not carry]
        (Tensor, "detach_", _on_detach_),
        (Tensor, "requires_grad_", _on_requires_grad_),
        (Tensor, "backward", _on_autograd),
        (torch.autograd, "backward", _on_autograd),
        (torch.autograd, "grad", _on_autograd),
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
        (Tensor, "__setattr__", _tensor_setattr),  # Note [Tensor state a graph does not carry]
    ]


# Note [Generator state in strict mode]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A random op given a generator (`torch.rand(2, generator=g)`) is traced with the generator
# itself as a constant (Note [Generators in a trace] in aotc/fxgenerators.py): compiled calls draw
# from it as eager does. What the program does to the generator's *state* is no op, so it would
# happen only while tracing: `g.manual_seed(3)` (eager reseeds on every call), `s = g.get_state()`
# ... `g.set_state(s)` (eager draws the same numbers twice), `g.initial_seed()` (a value frozen in
# the graph); and a generator the program creates (`torch.Generator().manual_seed(5)`) would be
# the one created while tracing, drawn from by every compiled call, where eager makes a fresh one
# per call. `torch.manual_seed()` and friends are refused by their stubs above; these are refused
# the same way, by name and line. torch.Generator is a C type whose methods cannot be replaced,
# so a run whose user code names one of these methods (or `Generator`: CodeFacts.uses, checked
# before each run and for each function walked during it) watches C calls with a profile
# function for its length (`sys.setprofile`, this thread only: ~35% more trace time, so only
# then), and stands a class for `torch.Generator` whose instance checks are the real class's and
# whose construction from user code refuses. A run under another profiler (cProfile) cannot
# watch calls: the recorder then falls back on comparing each generator's state after the run
# (aotc/recording.py), which misses a state set back to what it was.
GENERATOR_NAMES = frozenset(
    {"Generator", "manual_seed", "seed", "initial_seed", "get_state", "set_state",
     "graphsafe_get_state", "graphsafe_set_state", "clone_state", "get_offset", "set_offset"}
)  # fmt: skip
REAL_GENERATOR = torch._C.Generator
_GENERATOR_HINT = (
    "Create and seed the generator outside the compiled function and pass it in as an argument "
    "(random ops inside draw from it on every call, as in eager), or use the default capture mode."
)


def _generator_calls(frame: Any, event: str, arg: Any) -> None:
    """The profile function of a run that watches generators (Note [Generator state in strict
    mode])."""
    if event != "c_call" or not isinstance(getattr(arg, "__self__", None), REAL_GENERATOR):
        return
    name = getattr(arg, "__name__", "")
    rec = ACTIVE[-1] if ACTIVE else None
    if name not in GENERATOR_NAMES or rec is None or threading.get_ident() != rec.thread:
        return
    code = frame.f_code
    if not is_user_file(code.co_filename):
        return
    where = format_line(code.co_filename, frame.f_lineno)
    raise UnsupportedError(
        f"{rec.name}: torch.Generator.{name}() at {where} reads or sets a generator's state. "
        "That is not an operator aotc traces: it would run once, while aotc traces the program, "
        "and compiled calls would draw from the generator as they find it. " + _GENERATOR_HINT
    )


class _GeneratorClass(type):
    """The metaclass of the stand-in for torch.Generator: instance and subclass checks are the
    real class's; constructing one from user code refuses."""

    def __instancecheck__(cls, obj: object) -> bool:
        return isinstance(obj, REAL_GENERATOR)

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, REAL_GENERATOR)

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        rec = ACTIVE[-1] if ACTIVE else None
        where = _caller_line(1)
        if where and rec is not None and threading.get_ident() == rec.thread:
            raise UnsupportedError(
                f"{rec.name}: the program creates a torch.Generator at {where}. A graph would "
                "keep the one generator made while aotc traces, and every compiled call would "
                "go on drawing from it, where eager makes a fresh one on each call. "
                + _GENERATOR_HINT
            )
        return REAL_GENERATOR(*args, **kwargs)


class _Generator(metaclass=_GeneratorClass):
    """torch.Generator while a run watches generators (see Note [Generator state in strict
    mode])."""


_WATCHING: list[object] = []  # the profile functions replaced (one per watching run)


def watch_generators() -> bool:
    """Start watching (Note [Generator state in strict mode]); False if this thread has another
    profile function (its calls cannot be watched then). Undo with `unwatch_generators`."""
    if sys.getprofile() not in (None, _generator_calls):
        return False
    with _PATCH_LOCK:
        if not _WATCHING:
            setattr(torch, "Generator", _Generator)  # noqa: B010 (a stand-in, for the run)
        _WATCHING.append(sys.getprofile())
    sys.setprofile(_generator_calls)
    return True


def unwatch_generators() -> None:
    with _PATCH_LOCK:
        previous = _WATCHING.pop()
        if not _WATCHING:
            setattr(torch, "Generator", REAL_GENERATOR)  # noqa: B010
    sys.setprofile(previous)  # type: ignore[arg-type]


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
