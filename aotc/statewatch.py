"""State a traced program can change without an attribute store: what strict mode compares
around each run of the program.

Stage: helpers of aotc/recording.py's `Recorder`, per run: `read_torch_state()` before and
`changed_torch_state(before)` after (restoring what changed); `read_hidden_state(obj)` of each
library object the walk reached, before and after (`restore_hidden_state` puts back what it
can); `snapshot_arguments(fn, args, kwargs)` before and `changed_arguments(snapshots)` after;
`freed_outputs(outs)` and `unliftable_tensor(error, labels)` on the run's result or error.
Requires: called on the thread that runs the program, outside any fake or functional mode's
effect on what they read (they read real library state; `read_hidden_state` disables the
dispatch modes itself).
Ensures: each reports, by name, a change the graph cannot replay; the Recorder turns it into a
refused side effect (Note [Python side effects in strict mode] in aotc/strict.py).

Note [State strict mode compares around a run]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The recorder sees the program's attribute loads and stores on tracked objects, and snapshots the
containers it reaches (aotc/recording.py). Three kinds of state change escape that, and a
compiled call, which runs no Python, would not make them again:
- torch's global state: grad mode, the default dtype and device, deterministic algorithms,
  anomaly detection, autocast, thread count, matmul precision, cuDNN/TF32 flags. A program that
  sets one and leaves it set (`torch.set_grad_enabled(False)`, `torch.no_grad().__enter__()`,
  `torch.set_default_dtype(torch.float64)`) leaves it set after each eager call. Each is read
  before the run and after it; a change is put back (later runs of the compilation, and the
  caller, see the state they had) and refused, naming the state and the line that names its
  setter. A change undone before the run ends (`with torch.no_grad():`) is traced as before.
- the hidden state of library objects the program reaches (arguments, globals, closures,
  attributes, container elements) whose attribute loads cannot be recorded: iterators
  (`next(it)`), `random.Random` instances, `queue.Queue`, `itertools.count`, generators,
  `argparse.Namespace`, torch.Generator. Their state is read through pickling's protocol
  (`__reduce_ex__`: an iterator's position, a Random's state, an object's `__dict__`), copied
  down to constants and identities (`_frozen`), or for a Python generator its frame's position;
  a change is refused, and put back where the object can take its state back (`__setstate__`
  with a constant state: list and tuple iterators, Random; torch.Generator's `set_state`).
  Objects without a readable state (locks, C objects that do not pickle) are taken as unchanged
  (documented in docs/guide.md).
- containers passed as arguments: the compiled function flattens its arguments to their tensors
  and rebuilds lists, dicts and dataclass instances for each run (aotc/api.py), so the program
  changes copies; `xs.append(...)`, `d["n"] += 1`, `xs[0] = t`, `batch.step = 3` would change
  the caller's objects in eager and nothing here. Each rebuilt container is snapshotted before
  the run and compared after it.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import types
import warnings
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, cast

import torch

from aotc.interpose import REAL_GENERATOR
from aotc.usercode import MISSING, is_constant

Tensor = torch.Tensor

_MAX_ELEMENTS = 4096  # elements of one container copied into a state; beyond: identity
_MAX_DEPTH = 4  # containers nested in a state


# ---------------------------------------------------------------- torch's global state


@dataclass(frozen=True, slots=True)
class TorchState:
    """One piece of torch's global state: how to read it, set it back, and the names of the
    calls that set it (to find the user's line)."""

    label: str
    read: Callable[[], object]
    write: Callable[[Any], object]
    setters: tuple[str, ...]


def _default_device() -> object:
    """The device `torch.set_default_device` set (None: never set, or set to None)."""
    context = getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", None)
    return None if context is None else context.device


def _cudnn() -> tuple[bool, ...]:
    b = torch.backends.cudnn
    return (b.enabled, b.benchmark, b.deterministic, b.allow_tf32)


def _set_cudnn(v: tuple[bool, ...]) -> None:
    b = torch.backends.cudnn
    b.enabled, b.benchmark, b.deterministic, b.allow_tf32 = v


def _cuda_matmul() -> tuple[bool, ...]:
    m = torch.backends.cuda.matmul
    return (m.allow_tf32, m.allow_fp16_reduced_precision_reduction)


def _set_cuda_matmul(v: tuple[bool, ...]) -> None:
    m = torch.backends.cuda.matmul
    m.allow_tf32, m.allow_fp16_reduced_precision_reduction = v


def _autocast() -> tuple[object, ...]:
    return tuple(
        (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")
    )


def _set_autocast(v: tuple[tuple[bool, torch.dtype], ...]) -> None:
    for d, (enabled, dtype) in zip(("cpu", "cuda"), v):
        torch.set_autocast_enabled(d, enabled)
        torch.set_autocast_dtype(d, dtype)


TORCH_STATE: tuple[TorchState, ...] = (
    TorchState(
        "grad mode (torch.is_grad_enabled())",
        torch.is_grad_enabled,
        torch._C._set_grad_enabled,
        ("set_grad_enabled", "no_grad", "enable_grad"),
    ),
    TorchState(
        "the default dtype (torch.get_default_dtype())",
        torch.get_default_dtype,
        torch.set_default_dtype,
        ("set_default_dtype", "set_default_tensor_type"),
    ),
    TorchState(
        "the default device (torch.set_default_device)",
        _default_device,
        torch.set_default_device,
        ("set_default_device",),
    ),
    TorchState(
        "deterministic algorithms (torch.are_deterministic_algorithms_enabled())",
        lambda: (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ),
        lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1]),
        ("use_deterministic_algorithms",),
    ),
    TorchState(
        "anomaly detection (torch.is_anomaly_enabled())",
        lambda: (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
        lambda v: torch.set_anomaly_enabled(*v),
        ("set_detect_anomaly", "detect_anomaly", "set_anomaly_enabled"),
    ),
    TorchState(
        "autocast (torch.is_autocast_enabled())",
        _autocast,
        _set_autocast,
        ("autocast", "set_autocast_enabled", "set_autocast_dtype"),
    ),
    TorchState(
        "the number of threads (torch.get_num_threads())",
        torch.get_num_threads,
        torch.set_num_threads,
        ("set_num_threads",),
    ),
    TorchState(
        "float32 matmul precision (torch.get_float32_matmul_precision())",
        torch.get_float32_matmul_precision,
        torch.set_float32_matmul_precision,
        ("set_float32_matmul_precision",),
    ),
    TorchState("torch.backends.cudnn flags", _cudnn, _set_cudnn, ("cudnn",)),
    TorchState(
        "torch.backends.cuda.matmul flags", _cuda_matmul, _set_cuda_matmul, ("matmul", "cuda")
    ),
    TorchState(
        "torch.is_warn_always_enabled()",
        torch.is_warn_always_enabled,
        torch.set_warn_always,
        ("set_warn_always",),
    ),
)


def read_torch_state() -> list[object]:
    """See Note [State strict mode compares around a run]; len == len(TORCH_STATE)."""
    return [s.read() for s in TORCH_STATE]


def changed_torch_state(before: list[object]) -> list[tuple[TorchState, object, object]]:
    """(state, before, after) of each piece the run left changed; each is put back."""
    changed = []
    for state, old in zip(TORCH_STATE, before, strict=True):
        now = state.read()
        if now is old or now == old:
            continue
        state.write(old)
        changed.append((state, old, now))
    return changed


# ---------------------------------------------------------------- hidden state of library objects

_CONTAINERS = (list, tuple, dict, set, frozenset, deque)
_CODE = (
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    types.BuiltinMethodType,
    types.WrapperDescriptorType,
    types.MethodDescriptorType,
    types.MethodWrapperType,
    types.ModuleType,
    type,
    property,
    staticmethod,
    classmethod,
)


def has_hidden_state(value: object) -> bool:
    """An object of the standard library (or a torch.Generator), neither code nor a constant,
    whose state the recorder cannot see change: see the Note. Objects of other libraries are
    library state, taken as constant (their pure-Python objects are tracked like the user's)."""
    if isinstance(value, (*_CODE, *_CONTAINERS, Tensor)) or is_constant(value):
        return False  # containers: their contents are snapshotted and guarded on their own
    if isinstance(value, REAL_GENERATOR):
        return True
    top = (type(value).__module__ or "").split(".")[0]
    names = sys.stdlib_module_names
    return top == "builtins" or top in names or top.lstrip("_") in names


@dataclass(frozen=True, slots=True)
class HiddenState:
    """What `read_hidden_state` read: `frozen` to compare, `restore` to put back (MISSING when
    the object cannot take its state back)."""

    frozen: object
    restore: object


def read_hidden_state(value: object, check_stable: bool = False) -> HiddenState | None:
    """The object's state (see the Note), or None when it cannot be read. `check_stable`: also
    None when two reads in a row differ (a state that holds a fresh object each time)."""
    state = _read_hidden_state(value)
    if check_stable and state is not None:
        again = _read_hidden_state(value)
        if again is None or again.frozen != state.frozen:
            return None
    return state


def _reduced(value: object) -> object:
    """`value.__reduce_ex__(4)`, or None when it does not pickle."""
    try:
        if type(value).__module__ == "itertools":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # its pickling is deprecated (Python 3.12)
                return value.__reduce_ex__(4)
        return value.__reduce_ex__(4)
    except Exception:  # noqa: BLE001 not picklable (a lock, a C object): not readable
        return None


def _read_hidden_state(value: object) -> HiddenState | None:
    if isinstance(value, REAL_GENERATOR):
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes(), torch._C.DisableTorchFunction():  # a real state tensor
            state = value.get_state()
            return HiddenState((value.initial_seed(), tuple(state.tolist())), state)
    if isinstance(value, types.GeneratorType):
        frame = value.gi_frame
        return HiddenState(None if frame is None else frame.f_lasti, MISSING)
    reduced = _reduced(value)
    if reduced is None or isinstance(reduced, str):
        return None  # not picklable, or a global name (a singleton): nothing to compare
    state = reduced[2] if isinstance(reduced, tuple) and len(reduced) > 2 else MISSING
    restore: object = MISSING
    if state is not MISSING and is_constant(state) and hasattr(value, "__setstate__"):
        restore = state
    elif isinstance(state, dict) and state is getattr(value, "__dict__", None):
        # a Python object of the standard library (queue.Queue, argparse.Namespace)
        restore = _DictState(cast(dict[str, Any], state))
    return HiddenState(_frozen(reduced, 0), restore)


class _DictState:
    """An object's `__dict__` and the contents of the containers it holds, to put back."""

    __slots__ = ("attrs", "items", "contents")

    def __init__(self, attrs: dict[str, Any]) -> None:
        self.attrs = attrs
        self.items = tuple(attrs.items())
        self.contents = [
            (v, list(v.items()) if isinstance(v, dict) else list(v))
            for v in attrs.values()
            if isinstance(v, (list, dict, deque, set))
        ]

    def put_back(self) -> None:
        self.attrs.clear()
        self.attrs.update(self.items)
        for container, copy in self.contents:
            container.clear()
            (container.update if isinstance(container, (dict, set)) else container.extend)(copy)


def hidden_state_key(value: object) -> object:
    """What a state guard compares for a library object the program read (see
    `guarded_hidden_state`): `read_hidden_state(value).frozen`, None when unreadable."""
    state = read_hidden_state(value)
    return None if state is None else state.frozen


def guarded_hidden_state(value: object) -> bool:
    """Whether a compiled entry guards the state of `value`, a value the program read: objects
    of the standard library (`argparse.Namespace`, `types.SimpleNamespace`), whose attribute
    loads cannot be recorded. Not a torch.Generator: its draws move its state on every call."""
    return not isinstance(value, REAL_GENERATOR) and has_hidden_state(value)


def restore_hidden_state(value: object, saved: HiddenState) -> bool:
    """Put back what `read_hidden_state` read, if the object can take it back."""
    if saved.restore is MISSING:
        return False
    if isinstance(saved.restore, _DictState):
        saved.restore.put_back()
        return True
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch._C.DisableTorchFunction():
        if isinstance(value, REAL_GENERATOR):
            value.set_state(cast(Tensor, saved.restore))
        else:
            value.__setstate__(saved.restore)  # type: ignore[attr-defined]
    return True


class _Same:
    """An object in a frozen state, compared by identity; holding it keeps its id its own (an
    object the reduction made afresh, such as an args tuple, is another object next time)."""

    __slots__ = ("obj",)

    def __init__(self, obj: object) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __repr__(self) -> str:
        return f"<{type(self.obj).__name__} at {id(self.obj):#x}>"


def _frozen(value: object, depth: int) -> object:
    """A copy of `value` down to constants and identities (see the Note). Beyond `_MAX_DEPTH`,
    containers keep their elements as identities (a reduction's args tuple is a fresh one)."""
    if is_constant(value):
        return value
    if isinstance(value, Tensor):
        return _Same(value)
    if isinstance(value, (list, tuple, deque, dict)) and len(value) > _MAX_ELEMENTS:
        return (_Same(value), len(value))
    if isinstance(value, (list, tuple, deque)):
        if depth >= _MAX_DEPTH:
            return (type(value), tuple(v if is_constant(v) else _Same(v) for v in value))
        return (type(value), tuple(_frozen(v, depth + 1) for v in value))
    if isinstance(value, dict):
        if depth >= _MAX_DEPTH:
            pairs = ((k, v if is_constant(v) else _Same(v)) for k, v in value.items())
            return (type(value), tuple(pairs))
        return (
            type(value),
            tuple((_frozen(k, depth + 1), _frozen(v, depth + 1)) for k, v in value.items()),
        )
    if isinstance(value, (set, frozenset)):
        return (type(value), len(value), _Same(value))
    if depth < _MAX_DEPTH and has_hidden_state(value) and not isinstance(value, REAL_GENERATOR):
        reduced = _reduced(value)  # an object in an object's state (`zip`'s iterators)
        if reduced is not None and not isinstance(reduced, str):
            return ("object", _Same(value), _frozen(reduced, depth + 1))
    return _Same(value)


# ---------------------------------------------------------------- containers passed as arguments


@dataclass(frozen=True, slots=True)
class ContainerSnapshot:
    container: object
    label: str  # e.g. "argument xs", "argument batch.items"
    items: tuple[object, ...]  # the elements (dicts: (key, value) pairs, objects: their dict's)


def snapshot_arguments(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[ContainerSnapshot]:
    """The mutable containers in the arguments the program receives (lists, dicts, deques,
    dataclass instances, at any depth through tuples and each other)."""
    names = _positional_names(fn)
    out: list[ContainerSnapshot] = []
    for i, value in enumerate(args):
        _snapshot(value, f"argument {names[i] if i < len(names) else f'args[{i}]'}", 0, out)
    for key, value in kwargs.items():
        _snapshot(value, f"argument {key}", 0, out)
    return out


def changed_arguments(snapshots: list[ContainerSnapshot]) -> list[ContainerSnapshot]:
    return [s for s in snapshots if not _same(_items(s.container), s.items)]


def _positional_names(fn: Callable[..., Any]) -> list[str]:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _items(container: object) -> tuple[object, ...]:
    if isinstance(container, dict):
        return tuple(container.items())
    if isinstance(container, (list, deque)):
        return tuple(container)
    attrs = getattr(container, "__dict__", None)
    if isinstance(attrs, dict):
        return tuple(attrs.items())
    fields = dataclasses.fields(container)  # type: ignore[arg-type]
    return tuple((f.name, getattr(container, f.name, MISSING)) for f in fields)


def _same(now: tuple[object, ...], before: tuple[object, ...]) -> bool:
    if len(now) != len(before):
        return False
    for a, b in zip(now, before):
        if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) == 2:
            if a[0] is not b[0] and a[0] != b[0] or a[1] is not b[1]:
                return False
        elif a is not b:
            return False
    return True


def _snapshot(value: object, label: str, depth: int, out: list[ContainerSnapshot]) -> None:
    if depth > 8 or isinstance(value, Tensor) or is_constant(value):
        return
    children: Iterable[tuple[str, object]]
    if isinstance(value, tuple):
        children = ((f"{label}[{i}]", v) for i, v in enumerate(value))
    elif isinstance(value, (list, deque, dict)) or (
        dataclasses.is_dataclass(value) and not isinstance(value, type)
    ):
        items = _items(value)
        out.append(ContainerSnapshot(value, label, items))
        if isinstance(value, (list, deque)):
            children = ((f"{label}[{i}]", v) for i, v in enumerate(items))
        else:  # (key, value) pairs
            pairs = cast(tuple[tuple[object, object], ...], items)
            text = "[{!r}]" if isinstance(value, dict) else ".{}"
            children = ((label + text.format(k), v) for k, v in pairs)
    else:
        return
    for child_label, child in children:
        _snapshot(child, child_label, depth + 1, out)


# ---------------------------------------------------------------- autograd graphs freed inside


def freed_outputs(outs: list[object]) -> list[int]:
    """Indices of the tensor outputs requiring grad whose backward would unpack a value that an
    autograd.grad/backward call of the program freed (eager: "Trying to backward through the
    graph a second time" when the caller backpropagates them)."""
    found = []
    for k, out in enumerate(outs):
        if isinstance(out, Tensor) and out.requires_grad and _reaches_freed(out.grad_fn):
            found.append(k)
    return found


def _reaches_freed(root: object) -> bool:
    todo, seen = [root], set[int]()
    while todo and len(seen) < 100_000:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        for name in dir(node):
            if name.startswith("_saved_"):
                try:
                    getattr(node, name)
                except RuntimeError as e:
                    if "freed" in str(e) or "second time" in str(e):
                        return True
        todo.extend(n for n, _ in getattr(node, "next_functions", ()))
    return False


# ---------------------------------------------------------------- tensors held by other objects


def unliftable_tensor(error: BaseException, labels: dict[int, tuple[Tensor, str]]) -> str | None:
    """The label of the real tensor a fake-tensor op refused (`error`: "Please convert all
    Tensors to FakeTensors first"), found among the failing frames' locals, if the walk reached
    it (`labels`: id -> (tensor, label))."""
    text = str(error)
    if "FakeTensor" not in text or not ("non-Fake" in text or "convert all Tensors" in text):
        return None
    tb = error.__traceback__
    while tb is not None:
        for value in tb.tb_frame.f_locals.values():
            for item in value if isinstance(value, (list, tuple)) else (value,):
                found = labels.get(id(item)) if isinstance(item, Tensor) else None
                if found is not None and found[0] is item:
                    return found[1]
        tb = tb.tb_next
    return None
