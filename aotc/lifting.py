"""Lifting: tensors a program reads without receiving them become graph inputs.

Stage: `find_free_tensors(fn) -> tuple[Access, ...]` once per compiled function;
`swapped(accesses, values)` around every trace.
Ensures: one `Access` per distinct location a tensor is reached through: a closure cell, a global
name, a module parameter/buffer/tensor attribute, an attribute of a plain object, an element of a
list or a value of a dict held there, a dict *key* that is a tensor (an optimizer's `state` is keyed
by parameters), and the `.grad` of a lifted tensor that requires grad. Each call re-reads every
location, so rebinding (`model.weight = new`, `global w; w = ...`) is seen; the trace swaps fake
tensors into exactly these locations, so nothing real is baked into a graph.

Note [Lifting through objects]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A training-step function typically reads `model` and `opt` from its closure. `opt.step()` reads
each parameter from `opt.param_groups[i]["params"][j]`, its gradient from `p.grad`, and its
state from `opt.state[p]`, a dict keyed by the parameter object. So the walk follows plain
objects' attributes, lists and dicts (to a fixed depth), and for a tensor-keyed dict it lifts the
key as its own location. The same parameter reached as a list element and as a dict key is two
locations of one object: the calling convention folds them into one graph argument (dedupe), so
during the trace both locations hold the same fake tensor and `opt.state[p]` finds its entry.
Values are swapped before keys and restored after them, so value slots address the real keys.

What the graph cannot replay is refused after the trace (`check_unchanged`): rebinding a lifted
location to another tensor, assigning `.grad`, or storing a new tensor into a walked container
(an optimizer's first step creates its state that way: run one eager step first).
"""

from __future__ import annotations

import contextlib
import functools
import operator
import threading
import types
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from aotc.runtime.errors import UnsupportedError

_MAX_DEPTH = 4  # how far the walk follows attributes and elements (an optimizer restarts it)


class Slot:
    """One location holding a tensor: `read()` and `write(value)`; `where()` names the location
    by the identities of what holds it (see `Lifted.fingerprint`)."""

    def read(self) -> object:
        raise NotImplementedError

    def where(self) -> tuple[object, ...]:
        raise NotImplementedError

    def reader(self) -> Callable[[], object]:
        """A callable equivalent to `read` for the per-call reads; subclasses return a C-level
        one (a partial of getitem/getattr) where they can."""
        return self.read

    def peek(self) -> object:
        """What the location holds, as it is (what a trace must put back)."""
        return self.read()

    def write(self, value: object) -> None:
        raise NotImplementedError


def _key_id(key: object) -> object:
    """A dict key or list index as a hashable token that compares by identity for objects
    (tensor keys must not be compared with ==)."""
    return key if type(key) in (str, int) else ("id", id(key))


class ItemSlot(Slot):
    __slots__ = ("container", "key")

    def __init__(self, container: dict[Any, Any] | list[Any], key: Any) -> None:
        self.container, self.key = container, key

    def read(self) -> object:
        return self.container[self.key]

    def where(self) -> tuple[object, ...]:
        return ("item", id(self.container), _key_id(self.key))

    def reader(self) -> Callable[[], object]:
        return functools.partial(operator.getitem, self.container, self.key)

    def write(self, value: object) -> None:
        self.container[self.key] = value


class CellSlot(Slot):
    __slots__ = ("cell",)

    def __init__(self, cell: types.CellType) -> None:
        self.cell = cell

    def read(self) -> object:
        return self.cell.cell_contents

    def where(self) -> tuple[object, ...]:
        return ("cell", id(self.cell))

    def reader(self) -> Callable[[], object]:
        return functools.partial(getattr, self.cell, "cell_contents")

    def write(self, value: object) -> None:
        self.cell.cell_contents = value


class KeySlot(Slot):
    """A tensor used as a dict key. Writing renames the key in place, keeping entry order."""

    __slots__ = ("container", "current")

    def __init__(self, container: dict[Any, Any], key: Any) -> None:
        self.container, self.current = container, key

    def read(self) -> object:
        return self.current

    def where(self) -> tuple[object, ...]:
        return ("key", id(self.container), id(self.current))

    def reader(self) -> Callable[[], object]:
        return functools.partial(getattr, self, "current")

    def write(self, value: object) -> None:
        old, self.current = self.current, value
        items = list(self.container.items())
        self.container.clear()
        self.container.update((value if k is old else k, v) for k, v in items)


class ScalarSlot(Slot):
    """A Python float hyper-parameter read as a 0-dim tensor input: an optimizer group's
    learning rate (see Note [Learning rates are inputs]). `peek` gives the raw value."""

    __slots__ = ("container", "key", "dtype", "device", "_value", "_tensor")

    def __init__(
        self, container: dict[Any, Any], key: str, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.container, self.key, self.dtype, self.device = container, key, dtype, device
        self._value: object = None
        self._tensor: torch.Tensor | None = None

    def read(self) -> object:
        value = self.container[self.key]
        if isinstance(value, torch.Tensor):
            return value  # the fake during a trace, or a tensor learning rate of the user's
        if value is not self._value:
            if not (type(value) is type(self._value) and value == self._value):
                self._tensor = torch.tensor(float(value), dtype=self.dtype, device=self.device)
            self._value = value
        return self._tensor

    def reader(self) -> Callable[[], object]:
        return self.read

    def peek(self) -> object:
        return self.container[self.key]

    def write(self, value: object) -> None:
        self.container[self.key] = value

    def where(self) -> tuple[object, ...]:
        return ("scalar", id(self.container), self.key)


class GradSlot(Slot):
    """`.grad` of whatever tensor the parent slot holds now (a fake one during the trace)."""

    __slots__ = ("parent",)

    def __init__(self, parent: Slot) -> None:
        self.parent = parent

    def where(self) -> tuple[object, ...]:
        return ("grad", self.parent.where())

    def read(self) -> object:
        tensor = self.parent.read()
        if not (isinstance(tensor, FakeTensor) or torch._is_functional_tensor(tensor)):  # type: ignore[arg-type]
            return tensor.grad  # type: ignore[attr-defined]
        # During a trace the tensor is ours (fake, maybe a non-leaf clone of a mutated input):
        # reading its .grad must not warn the user.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return tensor.grad  # type: ignore[attr-defined]

    def write(self, value: object) -> None:
        tensor = self.parent.read()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            tensor.grad = value  # type: ignore[attr-defined]


@dataclass(frozen=True, slots=True)
class Access:
    name: str  # e.g. "closure w", "global opt.state[<tensor>]['exp_avg']", "self.lin.weight"
    slot: Slot
    restore: bool = True  # False for .grad of a swapped tensor: only the fake one is written
    # Further locations holding the same tensor object (tied weights: `head.weight` is
    # `wte.weight`); see Note [One tensor, many locations].
    aliases: tuple[Slot, ...] = ()
    alias_names: tuple[str, ...] = ()  # len == len(aliases)

    def get(self) -> object:
        return self.slot.read()

    def write(self, value: object) -> None:
        self.slot.write(value)
        for alias in self.aliases:
            alias.write(value)


# Note [One tensor, many locations]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Lifting is by identity: a tensor object reached through several locations (a weight tied
# between two modules, `lm_head.weight = wte.weight`; a closure and a global naming one tensor)
# is one Access, so one graph input, and its gradient flows into the one Parameter once, as in
# eager. A trace writes the fake into every location, so whichever name the program reads it by,
# it sees the same fake. A call reads the first location and checks that the others still hold
# that same object (`lifted_reader`); if the user untied them (`head.weight = Parameter(...)`),
# the read raises `StaleLifting` and the compiled function lifts again and recompiles. (A module
# shared by two parents, T5's shared embedding, needs nothing of this: its parameters live in
# one `_parameters` dict whichever parent reaches it.) Dict *keys* stay separate accesses (the
# optimizer's `state[p]`): they must be renamed after the values are swapped (Note [Lifting
# through objects]), and the calling convention folds them into the same graph argument.


class StateCreated(UnsupportedError):
    """The program stored new entries into a dict it reads tensors from: an optimizer creating
    its state on its first step. Strict mode runs that call eagerly, then compiles."""


class StaleLifting(Exception):  # noqa: N818 (a signal, caught by the compiled function)
    """The lifted locations no longer hold what the lifting found (an untied weight, a
    removed state entry): the compiled function must lift again."""


@dataclass(frozen=True, slots=True)
class Lifted:
    """Everything lifted from one function: tensor locations and the dicts walked to reach
    them (checked after each trace for entries the program added)."""

    accesses: tuple[Access, ...]
    containers: tuple[dict[Any, Any], ...]
    optimizers: tuple[
        torch.optim.Optimizer, ...
    ] = ()  # see Note [Optimizers take the capturable path]

    def fingerprint(self) -> tuple[object, ...]:
        """Equal for two liftings exactly when they read the same locations in the same order
        (compared while both are alive, so the identities in it are unambiguous)."""
        return (
            tuple((a.slot.where(), tuple(s.where() for s in a.aliases)) for a in self.accesses),
            tuple(map(id, self.containers)),
        )


@dataclass
class _Walk:
    accesses: list[Access] = field(default_factory=list)
    containers: list[dict[Any, Any]] = field(default_factory=list)
    seen: set[int] = field(default_factory=set)
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    # Lift `.grad` of leaves requiring grad: a fake tensor swapped in has no .grad, so code
    # reading it (`if p.grad is None`) would silently take another branch. Off only for a
    # compiled module's own parameters (its forward does not read them).
    grads: bool = True
    owner: dict[int, int] = field(default_factory=dict)  # id(tensor) -> index into accesses
    aliases: dict[int, list[tuple[str, Slot]]] = field(default_factory=dict)  # same index

    def lifted(self) -> Lifted:
        accesses = [
            replace(
                a,
                aliases=tuple(s for _, s in self.aliases.get(i, ())),
                alias_names=tuple(n for n, _ in self.aliases.get(i, ())),
            )
            if i in self.aliases
            else a
            for i, a in enumerate(self.accesses)
        ]
        return Lifted(tuple(accesses), tuple(self.containers), tuple(self.optimizers))


def module_accesses(module: torch.nn.Module, prefix: str) -> Lifted:
    walk = _Walk(grads=False)
    _visit_module(module, prefix, walk)
    return Lifted(walk.lifted().accesses, ())


def module_training_flags(module: torch.nn.Module) -> Callable[[], tuple[bool, ...]]:
    modules = [m for _, m in module.named_modules()]
    training = operator.attrgetter("training")
    return lambda: tuple(map(training, modules))  # hot path: one C-level loop


def find_free_tensors(
    fn: Callable[..., object], bound: Sequence[tuple[str, object]] = ()
) -> Lifted:
    """`bound`: (name, object) for the module and optimizer arguments bound into the program
    (Note [Modules and optimizers as arguments] in aotc/api.py): walked like closure values."""
    walk = _Walk()
    for name, value in bound:
        _visit(value, f"argument {name}", ItemSlot(dict(bound), name), 0, walk)
    if isinstance(fn, types.MethodType) and isinstance(fn.__self__, torch.nn.Module):
        walk.grads = False
        _visit_module(fn.__self__, "self", walk)
        walk.grads = True
        fn = fn.__func__
    elif isinstance(fn, types.MethodType) and isinstance(fn.__self__, torch.optim.Optimizer):
        holder = {"self": fn.__self__}  # `aotc.compile(opt.step)`: walk the optimizer
        _visit(fn.__self__, "self", ItemSlot(holder, "self"), 0, walk)
        fn = fn.__func__
    code = getattr(fn, "__code__", None)
    if code is None:
        return walk.lifted()
    for name, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or ()):
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        _visit(value, f"closure {name}", CellSlot(cell), 0, walk)
    for attr in ("__defaults__", "__kwdefaults__"):  # `def f(x, w=torch.ones(3), cache={})`
        defaults = getattr(fn, attr, None)
        if defaults:
            _visit(defaults, f"{fn.__qualname__}.{attr}", _AttrSlot(fn, attr), 0, walk)
    globals_ = getattr(fn, "__globals__", {})
    for name in sorted(_global_names(code)):
        if name in globals_:
            _visit(globals_[name], f"global {name}", ItemSlot(globals_, name), 0, walk)
    return walk.lifted()


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _add_tensor(tensor: torch.Tensor, name: str, slot: Slot, walk: _Walk) -> None:
    first = walk.owner.get(id(tensor))
    if first is not None:  # See Note [One tensor, many locations]
        walk.aliases.setdefault(first, []).append((name, slot))
        return
    walk.owner[id(tensor)] = len(walk.accesses)
    walk.accesses.append(Access(name, slot))
    if walk.grads and tensor.requires_grad and tensor.is_leaf:
        walk.accesses.append(Access(f"{name}.grad", GradSlot(slot), restore=False))


def _visit(value: object, name: str, slot: Slot, depth: int, walk: _Walk) -> None:
    if isinstance(value, torch.Tensor):
        _add_tensor(value, name, slot, walk)
        return
    if isinstance(value, types.MethodType) and not isinstance(
        value.__self__, (type, types.ModuleType)
    ):  # `opt.step` held in a closure: walk the object it is bound to
        _visit(value.__self__, f"{name}.__self__", slot, depth, walk)
        return
    if id(value) in walk.seen or depth >= _MAX_DEPTH or not _walkable(value):
        return
    walk.seen.add(id(value))
    if isinstance(value, torch.nn.Module):
        _visit_module(value, name.split(" ", 1)[-1], walk)
    elif isinstance(value, torch.optim.Optimizer):
        walk.optimizers.append(value)
        attrs = vars(value)
        for attr in ("param_groups", "state"):  # wherever the optimizer sits, reach its tensors
            _visit(attrs[attr], f"{name}.{attr}", ItemSlot(attrs, attr), 1, walk)
        _visit_learning_rates(value, name, walk)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _visit(item, f"{name}[{i}]", ItemSlot(value, i), depth + 1, walk)
    elif isinstance(value, dict):
        walk.containers.append(value)
        keys = list(value)
        for key in keys:
            label = "<tensor>" if isinstance(key, torch.Tensor) else repr(key)
            _visit(value[key], f"{name}[{label}]", ItemSlot(value, key), depth + 1, walk)
        for key in keys:  # after the values: see Note [Lifting through objects]
            if isinstance(key, torch.Tensor):
                walk.accesses.append(Access(f"{name} key", KeySlot(value, key)))
    elif isinstance(value, tuple):
        for i, item in enumerate(value):
            _visit(item, f"{name}[{i}]", _TupleItemSlot(slot, i), depth + 1, walk)
    elif hasattr(value, "__dict__"):
        attrs = vars(value)
        walk.containers.append(attrs)
        for attr in list(attrs):
            _visit(attrs[attr], f"{name}.{attr}", ItemSlot(attrs, attr), depth + 1, walk)


# Note [Learning rates are inputs]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# An LR scheduler writes a new float into `param_groups[i]["lr"]` every step. Guarded as a Python
# value (Note [Strict capture guards] in aotc/strict.py), that would recompile every step. For the
# optimizers whose update math takes a tensor learning rate while tracing (with capturable=True,
# see Note [Optimizers take the capturable path]; listed in TENSOR_LR_OPTIMIZERS, each checked
# against eager in tests/e2e/test_strict.py), a float `lr` is lifted instead: a ScalarSlot reads
# it every call as a 0-dim tensor (of the optimizer's step dtype, on its parameters' device; a
# new tensor only when the value changes), and the trace swaps a fake 0-dim tensor into the group,
# so the graph takes the rate as an input and one entry serves every rate. Results equal eager's
# to float rounding. Other optimizers' rates, and every other hyper-parameter (betas, momentum,
# weight_decay, eps, flags), stay guarded: a change recompiles, with the reason logged.
TENSOR_LR_OPTIMIZERS: frozenset[type] = frozenset(
    {
        torch.optim.Adam,
        torch.optim.AdamW,
        torch.optim.Adamax,
        torch.optim.NAdam,
        torch.optim.RAdam,
        torch.optim.ASGD,
    }
)
# These take a tensor rate on their foreach path only (the single-tensor path calls `.item()`).
TENSOR_LR_FOREACH_OPTIMIZERS: frozenset[type] = frozenset(
    {torch.optim.SGD, torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adadelta}
)


def _visit_learning_rates(opt: torch.optim.Optimizer, name: str, walk: _Walk) -> None:
    kind = type(opt)
    if kind not in TENSOR_LR_OPTIMIZERS and kind not in TENSOR_LR_FOREACH_OPTIMIZERS:
        return
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    for i, group in enumerate(opt.param_groups):
        lr = group.get("lr")
        params = group.get("params") or []
        if type(lr) not in (float, int) or not params:
            continue
        if group.get("differentiable") or group.get("fused"):
            continue
        if kind in TENSOR_LR_FOREACH_OPTIMIZERS and not _takes_foreach(group, params):
            continue
        device = params[0].device
        slot = ScalarSlot(group, "lr", dtype, device)
        walk.accesses.append(Access(f"{name}.param_groups[{i}]['lr']", slot))


def _takes_foreach(group: dict[Any, Any], params: list[torch.Tensor]) -> bool:
    """Whether the optimizer's step will take its foreach path for this group (as torch.optim
    decides it when `foreach` is None)."""
    foreach = group.get("foreach")
    if foreach is not None:
        return bool(foreach)
    from torch.optim import optimizer as optim_module

    decide = getattr(optim_module, "_default_to_fused_or_foreach", None)
    if decide is None:
        return False
    try:
        return bool(decide(params, False, use_fused=False)[1])
    except Exception:
        return False


def _walkable(value: object) -> bool:
    """Plain data and user objects; not code, classes, Python modules or torch internals."""
    if isinstance(
        value,
        (
            types.FunctionType,
            types.BuiltinFunctionType,
            types.MethodType,
            types.ModuleType,
            type,
            str,
            bytes,
            int,
            float,
            bool,
            type(None),
        ),
    ):
        return False
    module = type(value).__module__ or ""
    if isinstance(value, (torch.nn.Module, torch.optim.Optimizer, list, dict, tuple)):
        return True
    return not module.startswith(("torch", "builtins", "typing", "enum", "logging", "threading"))


class _AttrSlot(Slot):
    """An attribute of an object that is not a tracked container: a function's `__defaults__`
    (a tensor default argument, or a dict default used as a cache)."""

    __slots__ = ("obj", "attr")

    def __init__(self, obj: object, attr: str) -> None:
        self.obj, self.attr = obj, attr

    def where(self) -> tuple[object, ...]:
        return ("attr", id(self.obj), self.attr)

    def read(self) -> object:
        return getattr(self.obj, self.attr)

    def write(self, value: object) -> None:
        setattr(self.obj, self.attr, value)


class _TupleItemSlot(Slot):
    """An element of a tuple held in `parent`: writing rebuilds the tuple."""

    __slots__ = ("parent", "index", "original")

    def __init__(self, parent: Slot, index: int) -> None:
        self.parent, self.index = parent, index
        self.original = parent.peek()  # the tuple as the walk found it

    def where(self) -> tuple[object, ...]:
        return ("tuple", self.parent.where(), self.index)

    def read(self) -> object:
        return self.parent.read()[self.index]  # type: ignore[index]

    def write(self, value: object) -> None:
        items = list(self.parent.read())  # type: ignore[call-overload]
        items[self.index] = value
        original = self.original
        if (
            isinstance(original, tuple)
            and len(original) == len(items)
            and all(map(operator.is_, items, original))
        ):
            # putting back what the trace swapped out: the tuple itself, so that guards on
            # its identity (a global, a function's defaults) still hold
            self.parent.write(original)
        else:
            self.parent.write(tuple(items))


def _visit_module(module: torch.nn.Module, prefix: str, walk: _Walk) -> None:
    for mod_name, mod in module.named_modules(remove_duplicate=True):
        where = f"{prefix}.{mod_name}" if mod_name else prefix
        walk.seen.add(id(mod))
        for store in (mod._parameters, mod._buffers):
            for name in list(store):
                if store[name] is not None:
                    _add_tensor(store[name], f"{where}.{name}", ItemSlot(store, name), walk)
        for name, value in list(vars(mod).items()):
            if isinstance(value, torch.Tensor) and not name.startswith("__"):
                _add_tensor(value, f"{where}.{name}", ItemSlot(vars(mod), name), walk)


# Note [Lifted reads and swaps across threads]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A trace swaps fake tensors into the lifted locations (module attributes, closures). Another
# thread calling a compiled function at that moment would read those fakes as its inputs, so
# swaps and the per-call reads of lifted values hold one process-wide reentrant lock. (Code that
# reads the module's attributes eagerly, not through aotc, while it compiles can still see fakes:
# compile first, or keep eager use of the same module out of concurrent threads.)
LIFT_LOCK = threading.RLock()


def read_lifted(accesses: Sequence[Access]) -> list[object]:
    """The current values of the lifted locations."""
    with LIFT_LOCK:
        return [a.get() for a in accesses]


def lifted_reader(accesses: Sequence[Access]) -> Callable[[], list[object]]:
    """`read_lifted(accesses)` as one closure for the hot path: each slot's read is bound once
    (Slot.reader), so a call runs no Python frame per lifted tensor. Raises `StaleLifting` when
    a tied location no longer holds its tensor (Note [One tensor, many locations])."""
    readers = tuple(a.slot.reader() for a in accesses)
    tied = tuple((i, s.reader()) for i, a in enumerate(accesses) for s in a.aliases)
    if not tied:

        def read() -> list[object]:
            with LIFT_LOCK:
                return [r() for r in readers]

        return read

    def read_tied() -> list[object]:
        with LIFT_LOCK:
            values = [r() for r in readers]
            for i, r in tied:
                if r() is not values[i]:
                    raise StaleLifting(accesses[i].name)
            return values

    return read_tied


@contextlib.contextmanager
def swapped(lifted: Lifted, values: Sequence[object]) -> Iterator[None]:
    """Put `values` into the lifted locations for the duration of a trace; afterwards check
    the program changed none of them in a way the graph cannot replay, and restore them."""
    with LIFT_LOCK:
        yield from _swapped(lifted, values)


def _swapped(lifted: Lifted, values: Sequence[object]) -> Iterator[None]:
    accesses = lifted.accesses
    old = [a.slot.peek() for a in accesses]
    written = 0
    snapshot: list[tuple[dict[Any, Any], set[int]]] = []
    try:
        for a, v in zip(accesses, values, strict=True):
            a.write(v)
            written += 1
        snapshot = _container_snapshot(lifted)
        with _capturable(lifted.optimizers):
            yield
        _check_unchanged(accesses, values, snapshot)
    finally:
        for container, keys in snapshot:
            for key in [k for k in container if id(k) not in keys]:
                del container[key]
        for a, v in reversed(list(zip(accesses[:written], old[:written]))):
            if a.restore:
                a.write(v)


def _container_snapshot(lifted: Lifted) -> list[tuple[dict[Any, Any], set[int]]]:
    """Key identities of every walked dict, taken after the swap (keys may be fakes then)."""
    seen: dict[int, tuple[dict[Any, Any], set[int]]] = {}
    candidates: list[object] = list(lifted.containers)
    candidates += [
        getattr(s, "container", None) for a in lifted.accesses for s in (a.slot, *a.aliases)
    ]
    for container in candidates:
        if isinstance(container, dict) and id(container) not in seen:
            seen[id(container)] = (container, {id(k) for k in container})
    return list(seen.values())


def _check_unchanged(
    accesses: Sequence[Access],
    values: Sequence[object],
    containers: list[tuple[dict[Any, Any], set[int]]],
) -> None:
    for a, v in zip(accesses, values):
        for name, slot in ((a.name, a.slot), *zip(a.alias_names, a.aliases)):
            if slot.read() is v:
                continue
            what = "assigns .grad" if isinstance(slot, GradSlot) else "rebinds"
            raise UnsupportedError(
                f"the compiled function {what} {name} (to a different tensor); aotc replays "
                "in-place updates of lifted tensors but not assignments. Update it in place "
                "(`t.copy_(new)`), or do the assignment outside the compiled function"
                + (
                    " (`opt.zero_grad()` and `loss.backward()` assign .grad: call them outside, "
                    "compile the forward and the optimizer step, or use the default capture "
                    "mode, which compiles a whole training step)."
                    if isinstance(slot, GradSlot)
                    else "."
                )
            )
    for container, keys in containers:
        new = [k for k in container if id(k) not in keys]
        if new:
            raise StateCreated(
                f"the compiled function stores {len(new)} new entries into a dict it reads "
                "tensors from (e.g. an optimizer creating its state on its first step); a graph "
                "cannot replay creating state. Run that first call eagerly, then compile."
            )


# Note [Optimizers take the capturable path]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Adam/AdamW (and others with a `capturable` flag) read their step count with `.item()` unless
# `capturable=True`, and a value read from a tensor cannot be traced. While aotc traces (with
# `torch.compiler.is_compiling()` True, see aotc/functional.py::compiling), every optimizer reached
# through lifting runs with `capturable=True`: the step count stays a tensor and the update is the
# same math in tensor ops (what torch.compile does for CUDA optimizers). The flag is restored right
# after the trace, so eager steps of the same optimizer are unchanged. Results equal eager's to
# float rounding (the capturable formula orders the bias corrections differently).


@contextlib.contextmanager
def _capturable(optimizers: Sequence[torch.optim.Optimizer]) -> Iterator[None]:
    changed = [
        group
        for opt in optimizers
        for group in opt.param_groups
        if group.get("capturable") is False
    ]
    for group in changed:
        group["capturable"] = True
    try:
        yield
    finally:
        for group in changed:
            group["capturable"] = False
