"""Strict capture (`capture="trace"`): the guards on Python state that keep an entry valid.

Stage: `build_state_guard(recorder, lifted, name) -> StateGuard | None`, once per compiled entry,
after the compilation's runs of the program (aotc/recording.py recorded them);
`report_side_effects(recorder)` refuses (or, for `print`, reports) what the program did that
compiled calls will not do (Note [Python side effects in strict mode]).
Requires: `recorder` recorded every run of the program in this compilation, with `lifted`'s
fake tensors swapped in (so tensor reads are lifted inputs, not state).
Ensures: the guard holds on a later call only if every non-tensor value the program read is
still what it read (see the Note); values it cannot guard raise `UnsupportedError` naming them.

Note [Strict capture guards]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Strict mode traces the whole program once per signature and replays the graph afterwards,
never running the Python again. So every Python value the trace read is baked in: a changed
`dropout.p`, a swapped submodule, a new learning rate or a global flag would silently reuse a
stale graph. The graph stays valid exactly while every *non-tensor* value the trace loaded from
state that outlives the call is unchanged (tensors it loads are lifted inputs, re-read each
call: aotc/lifting.py). So we guard each such load, and refuse what we cannot guard.

What the program can load. Its Python code, run on the arguments, loads values from: (a) its
arguments; (b) its locals, which are built from other loads; (c) globals of the code that runs;
(d) closure cells of the functions that run; (e) attributes of objects, (f) elements of
containers, reached by (a)-(f); (g) library state (torch, the standard library, installed
packages): their module globals, and objects they create. Each is covered:
  (a) non-tensor arguments are in the signature key by value (runtime/guards.py);
  (c), (d) for every user function that can run (the compiled function, and every function
      reachable from it through globals, closures, attributes, containers, default arguments,
      and methods of the classes of tracked objects), the globals its bytecode loads
      (LOAD_GLOBAL, found with `dis`, names absent from its globals included: a later global
      would shadow the builtin), its closure cells and default arguments are guarded; a library
      function is not walked, but the user function a library decorator wraps is (its
      `__wrapped__`: `@torch.no_grad()`, `contextlib.contextmanager`, `functools.wraps`);
  (e) every object reached by the walk from the roots (the module tree of a compiled module,
      the compiled function's globals and closure, and through those, attributes, elements,
      functions and classes, as above) is *tracked*: while the program runs, its class carries
      recording `__getattribute__`/`__getattr__` methods, so each attribute load is recorded
      with its value and the user's line; the value itself is tracked before the program sees
      it (a submodule returned by `self.block` is recorded from then on). Loads of tracked
      Python modules (`import config; config.X`) are recorded the same way;
  (f) each container reached by a recorded load, a global or a cell is guarded whole: its
      length or its keys, and each non-tensor element recursively, since element loads
      (`group["lr"]`, `self.sizes[i]`) cannot be recorded;
  (g) library state is taken as constant, except the torch state traces depend on: grad mode
      and autocast (in the signature key) and the default dtype and device (guarded here).
A value loaded this way is guarded by kind: constants (numbers, strings, dtypes, enum members,
tuples of them) by type and value (so 1, 1.0 and True differ); containers by identity plus
contents; everything else (modules, objects, functions, classes) by identity, its own loads
being recorded separately. A load resolved from a class attribute that is code (a method, a
property) is not guarded (code is constant) beyond "the instance does not override it"; the
property's own loads are recorded. Reads of state the program itself wrote earlier in the run
are not guarded (they are the program's own doing), and the write itself is a side effect.

Hooks are loads too: `nn.Module.__call__` loads the hook dicts of each submodule it calls (and
the optimizer's `step` its step-hook dicts). Forward pre-hooks and forward hooks of submodules,
and global ones (`register_module_forward_hook`), run inside the trace as the forward does:
their tensor work is traced, the hook functions are walked like any function the program
reaches (their globals and cells guarded, their side effects refused), and each such dict is
guarded as its (handle, hook) pairs in order, so adding, removing or replacing one recompiles.
Backward hooks and optimizer step hooks present while tracing are refused on that load, before
they run (a backward hook would see fake tensors once, never the compiled calls' gradients);
their empty dicts are guarded like any container, so one added after compiling recompiles,
which then refuses it. The hooks of the module given to
`aotc.compile` itself are not inside the program: CompiledModule runs them eagerly around each
compiled call (aotc/api.py), as `nn.Module.__call__` does.

Side effects. After each run the recorder restores the attributes, globals, cells and container
contents the program changed (so every run of one compilation starts from the same state), and
each change refuses the compilation (Note [Python side effects in strict mode]). Python/NumPy
random draws and tensor hooks registered inside the program raise at once.

State the walk cannot record loads of (a class of the standard library: `argparse.Namespace`,
`types.SimpleNamespace`, an iterator, `random.Random`) is guarded as a whole: an object of that
kind that the program read (a global, a cell, an attribute, a non-tensor argument) gets one item
comparing pickling's view of its state (Note [State strict mode compares around a run] in
aotc/statewatch.py), so `args.scale = 3.0` recompiles.

Note [Python side effects in strict mode]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A compiled call replays the graph and runs none of the program's Python. A change the program
makes to state that outlives the call (an attribute, a global, a closure cell, a list or dict it
does not own, `self.calls += 1`, `log.append(...)`) would therefore happen once, while tracing,
and never again: after the next call the state differs from eager's, and so does every value the
program reads back from it (a counter the output is scaled by stays at its first value, since
the guard sees the undone state unchanged). Warning and going on would return a different answer
silently from the second call on, so strict mode refuses the compilation, naming each change and
its line: the user moves the change out of the compiled function or uses the default capture
mode, where Dynamo replays side effects after each graph. Reading the clock (`time.time()`) is
refused the same way: the value would be frozen into the graph. `print` is an exception: it
changes no state the program or the user's code can read back, so it is skipped and reported
with a `SideEffectWarning` at its line. So are attributes that library code assigns on its own
objects (library state is taken as constant, above): `nn.LSTM` refreshes its flat-weight cache
whenever the trace swaps fake parameters in, which eager calls on the real ones never do. State created on the first call (an attribute that was
absent or None, optimizer state) is not a side effect of this kind: that call runs eagerly and
the next one compiles (Note [State created on the first call] in aotc/recording.py).

Beyond attribute, global and cell stores, the same refusal covers what the recorder compares
around each run (Note [State strict mode compares around a run] in aotc/statewatch.py): changes
to containers passed as arguments (the program gets copies of them), to the state of
standard-library objects (`next(it)`, `r.random()` on a `random.Random`, `q.put(...)`,
`next(counter)` on an `itertools.count`), and torch's global state left changed at the end
(`torch.set_grad_enabled(False)`, `torch.set_default_dtype(...)`,
`torch.use_deterministic_algorithms(True)`, `torch.autograd.set_detect_anomaly(True)`). The
refusal is raised at the end of the first run that made a change (the key trace's included),
after the recorder put back what it can, so a change the recorder cannot undo (an
`itertools.count` advanced) happens once, as in one eager call. Python attributes set on input
or output tensors, `detach_()` and `requires_grad_(False)` on inputs, and a torch.Generator's
state read or set (or a generator created) inside the program are refused at the line that does
it (Notes [Tensor state a graph does not carry] and [Generator state in strict mode] in
aotc/interpose.py).

What is refused, with the value named: NumPy arrays the program reads (in-place changes to
them cannot be seen), containers with more than `MAX_GUARDED_ELEMENTS` non-constant elements or
nested deeper than `MAX_GUARD_DEPTH`, backward module hooks (of submodules or global) and
optimizer step hooks inside the program, DDP and FSDP2 modules inside it, random draws, tensor
hooks and retain_grad() inside it, the changes above, and tensors held by objects passed as
arguments that are neither tensors, containers, modules nor optimizers (a plain object's tensor
attribute, a `__torch_function__` object, `functools.partial(f, t=tensor)`): their tensors are
not graph inputs, and the refusal names the tensor, the argument and the line.

What is assumed, and documented (docs/guide.md): library code and library module state are
constant (a custom attention function registered into a library's registry is library state);
methods of classes are not monkeypatched at the class level while compiled entries live; reads
that bypass attribute lookup (`object.__getattribute__(obj, name)`, `vars(obj)[name]` on a
tracked object, `gc`, files, environment variables) are not seen; an object argument that
compares equal to another (a custom `__eq__`) is taken as interchangeable with it; objects of
other libraries than the standard library and torch.Generator (a tokenizer's Rust object) keep
no state the program changes, and standard-library objects whose state pickling cannot read
(locks, files) none either; under another profiler (`sys.setprofile`, cProfile) a generator
state set back to what it was inside the program is not seen (Note [Generator state in strict
mode] in aotc/interpose.py).

Cost per call: one C-level pass over the item readers comparing identities (see
runtime/stateguard.py). A function that reads no Python state pays for two items (the default
dtype and device).
"""

from __future__ import annotations

import itertools
import operator
import types
import warnings
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any, cast

import torch

from aotc import statewatch
from aotc.lifting import Lifted
from aotc.recording import TRACED_HOOK_DICTS, AttrRead, Recorder
from aotc.runtime.errors import UnsupportedError
from aotc.runtime.stateguard import Compare, GuardItem, StateGuard
from aotc.usercode import MISSING, is_constant

MAX_GUARDED_ELEMENTS = 4096  # non-tensor elements guarded one by one in a container
MAX_GUARD_DEPTH = 8  # containers nested in containers


class SideEffectWarning(UserWarning):
    """The program did something while aotc traced it that compiled calls will not do."""


def build_state_guard(rec: Recorder, lifted: Lifted, name: str) -> StateGuard | None:
    builder = _Builder(rec, _lifted_locations(lifted), name)
    for read in rec.reads.values():
        builder.attr(read)
    for slot in rec.slot_reads.values():
        builder.value(slot.reader, slot.value, slot.label, slot.where, 0)
    for label, value in rec.arguments_seen.items():  # keyed by identity: guard their state too
        builder.hidden_state(value, label, "")
    builder.torch_state()
    if rec.module_calls:
        builder.global_hooks("torch.nn.modules.module", _MODULE_GLOBAL_HOOKS)
    if rec.optimizer_steps:
        builder.global_hooks("torch.optim.optimizer", _OPTIMIZER_GLOBAL_HOOKS)
    return StateGuard(builder.items) if builder.items else None


def report_side_effects(rec: Recorder) -> None:
    """See Note [Python side effects in strict mode]: warn for each `print` the compiled calls
    skip; refuse the compilation for every change of state (and clock read) the program made."""
    for message, where, refuse in rec.side_effects.values():
        if refuse:
            continue
        filename, _, line = where.split(" (", 1)[0].rpartition(":")
        text = (
            f"aotc ({rec.name}): {message} Move it outside the compiled function, or use the "
            "default capture mode (which runs Python side effects on every call)."
        )
        if filename and line.isdigit():
            warnings.warn_explicit(text, SideEffectWarning, filename, int(line))
        else:
            warnings.warn(text, SideEffectWarning, stacklevel=4)
    refused = rec.refusal()
    if refused is not None:
        raise refused


_HOOK_DICTS = frozenset(
    {
        "_forward_hooks",
        "_forward_pre_hooks",
        "_backward_hooks",
        "_backward_pre_hooks",
        "_optimizer_step_pre_hooks",
        "_optimizer_step_post_hooks",
    }
)
_MODULE_GLOBAL_HOOKS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
)
_OPTIMIZER_GLOBAL_HOOKS = ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")


def _lifted_locations(lifted: Lifted) -> frozenset[tuple[int, object]]:
    """(id(container), key) of the dict entries the lifting reads: their values are inputs."""
    out = set()
    for access in lifted.accesses:
        for slot in (access.slot, *access.aliases):
            container = getattr(slot, "container", None)
            if container is not None and hasattr(slot, "key"):
                out.add((id(container), slot.key))
    return frozenset(out)


class _Builder:
    def __init__(self, rec: Recorder, lifted: frozenset[tuple[int, object]], name: str) -> None:
        self.rec = rec
        self.lifted = lifted
        self.name = name
        self.items: list[GuardItem] = []
        self._guarded: set[tuple[int, str]] = set()  # (id(reader target), ...) already covered
        self._contents: set[int] = set()  # containers whose contents are guarded

    def add(self, reader: Callable[[], object], expected: object, compare: Compare, what: str,
            where: str) -> None:  # fmt: skip
        self.items.append(GuardItem(reader, expected, compare, what, where))

    def attr(self, read: AttrRead) -> None:
        obj, name, value = read.obj, read.name, read.value
        if isinstance(value, torch.Tensor):
            return  # a lifted input (its location is re-read every call)
        if (id(obj), name) in self._guarded:
            return
        self._guarded.add((id(obj), name))
        if name in _HOOK_DICTS and isinstance(value, dict):
            # See Note [Strict capture guards], hooks: a hook added, removed or replaced later
            # recompiles.
            if value and name in TRACED_HOOK_DICTS:
                self.add(_HookIds(value), _HookIds(value)(), Compare.EQUAL,
                         f"{read.label} (the same hooks)", read.where)  # fmt: skip
            else:
                self.add(partial(len, value), 0, Compare.VALUE, f"{read.label} (no hooks)",
                         read.where)  # fmt: skip
            return
        readers = _readers(obj, name, value)
        if readers is None:  # from the class: guard only that the instance does not hide it
            attrs = _instance_dict(obj)
            if attrs is not None and value is not MISSING:
                self.add(
                    partial(dict.get, attrs, name, MISSING),
                    MISSING,
                    Compare.IDENTITY,
                    f"{read.label} (not overridden on the instance)",
                    read.where,
                )
            return
        for reader in readers:
            self.value(reader, value, read.label, read.where, 0)

    def value(self, reader: Callable[[], object], value: object, label: str, where: str,
              depth: int) -> None:  # fmt: skip
        if isinstance(value, torch.Tensor):
            return
        if value is MISSING:
            self.add(reader, MISSING, Compare.IDENTITY, f"{label} (absent)", where)
            return
        if is_constant(value):
            self.add(reader, value, Compare.VALUE, label, where)
            return
        if type(value).__module__ == "numpy" and type(value).__name__ == "ndarray":
            raise UnsupportedError(
                f"{self.name}: the program reads {label}, a numpy.ndarray"
                + (f" (at {where})" if where else "")
                + ". Strict mode (capture='trace') cannot see in-place changes to its contents. "
                "Make it a tensor (a registered buffer, or an argument), or use the default "
                "capture mode."
            )
        self.add(reader, value, Compare.IDENTITY, label, where)
        self.hidden_state(value, label, where)
        if isinstance(value, tuple):
            for i, item in enumerate(value):
                if isinstance(item, (list, dict, set, tuple)) and not is_constant(item):
                    self.value(partial(operator.getitem, value, i), item, f"{label}[{i}]", where,
                               depth + 1)  # fmt: skip
        elif isinstance(value, (list, dict, set)) or type(value).__name__ == "deque":
            self.contents(value, label, where, depth)

    def hidden_state(self, value: object, label: str, where: str) -> None:
        """A standard-library object whose attribute loads cannot be recorded (an
        `argparse.Namespace`, a `types.SimpleNamespace`): guard its state as a whole (Note [State
        strict mode compares around a run] in aotc/statewatch.py)."""
        if id(value) in self._contents or not statewatch.guarded_hidden_state(value):
            return
        self._contents.add(id(value))
        read = statewatch.read_hidden_state(value, check_stable=True)
        state = None if read is None else read.frozen
        if state is not None:
            self.add(partial(statewatch.hidden_state_key, value), state, Compare.EQUAL,
                     f"the state of {label}", where)  # fmt: skip

    def contents(self, container: object, label: str, where: str, depth: int) -> None:
        if id(container) in self._contents:
            return
        self._contents.add(id(container))
        if depth >= MAX_GUARD_DEPTH:
            raise UnsupportedError(
                f"{self.name}: the program reads {label}, containers nested more than "
                f"{MAX_GUARD_DEPTH} deep; strict mode guards containers element by element. "
                "Flatten it, or use the default capture mode."
            )
        if isinstance(container, dict):
            entries = [
                (k, v) for k, v in container.items() if (id(container), k) not in self.lifted
            ]
        elif isinstance(container, (set, frozenset)):
            entries = []
        else:
            entries = list(enumerate(cast(Iterable[object], container)))  # a list or tuple
        others = [(k, v) for k, v in entries if not isinstance(v, torch.Tensor)]
        if len(others) > MAX_GUARDED_ELEMENTS or isinstance(container, (set, frozenset)):
            if not all(is_constant(v) for _, v in others) or not all(
                map(is_constant, container if isinstance(container, (set, frozenset)) else ())
            ):
                raise UnsupportedError(
                    f"{self.name}: the program reads {label}, a {type(container).__name__} "
                    f"with {len(others)} elements that are not constants; strict mode guards "
                    f"at most {MAX_GUARDED_ELEMENTS} of them one by one. Make it a tuple, "
                    "store tensors, or use the default capture mode."
                )
            copy = (
                cast(Any, type(container))(container)
                if not isinstance(container, dict)
                else dict(container)
            )
            self.add(itertools.repeat(container).__next__, copy, Compare.EQUAL,
                     f"contents of {label}", where)  # fmt: skip
            return
        if isinstance(container, dict):
            keys = list(container)
            if all(type(k) in (str, int) for k in keys):
                self.add(partial(list, container), keys, Compare.EQUAL, f"keys of {label}", where)
            else:
                self.add(_KeyIds(container), _IdList(keys), Compare.EQUAL, f"keys of {label}",
                         where)  # fmt: skip
            for k, v in others:
                text = "<tensor>" if isinstance(k, torch.Tensor) else repr(k)
                self.value(partial(dict.get, container, k, MISSING), v, f"{label}[{text}]", where,
                           depth + 1)  # fmt: skip
        else:
            self.add(partial(len, container), len(container), Compare.EQUAL,  # type: ignore[arg-type]
                     f"len({label})", where)  # fmt: skip
            for i, v in others:
                self.value(partial(operator.getitem, container, i), v, f"{label}[{i}]", where,
                           depth + 1)  # fmt: skip

    def torch_state(self) -> None:
        self.add(torch.get_default_dtype, torch.get_default_dtype(), Compare.IDENTITY,
                 "torch.get_default_dtype()", "")  # fmt: skip
        self.add(torch._C._get_default_device, torch._C._get_default_device(), Compare.EQUAL,
                 "torch.get_default_device()", "")  # fmt: skip

    def global_hooks(self, module_name: str, names: tuple[str, ...]) -> None:
        import sys

        module = sys.modules[module_name]
        for name in names:
            table = getattr(module, name, None)
            if isinstance(table, dict) and table and name[7:] in TRACED_HOOK_DICTS:
                self.add(_HookIds(table), _HookIds(table)(), Compare.EQUAL,
                         f"{module_name}.{name} (the same hooks)", "")  # fmt: skip
            elif isinstance(table, dict):
                self.add(partial(len, table), 0, Compare.EQUAL, f"{module_name}.{name} (empty)", "")


class _HookIds:
    """Reads a hook dict as its (handle id, hook) pairs, in calling order. The expected pairs
    hold the hooks themselves, so a replaced hook cannot pass as one at a reused address; hooks
    compare by identity (functions) or as bound methods do."""

    __slots__ = ("hooks",)

    def __init__(self, hooks: dict[int, Any]) -> None:
        self.hooks = hooks

    def __call__(self) -> tuple[tuple[int, Any], ...]:
        return tuple(self.hooks.items())


class _KeyIds:
    """Reads the identities of a dict's keys (tensor keys must not be compared with ==)."""

    __slots__ = ("container",)

    def __init__(self, container: dict[Any, Any]) -> None:
        self.container = container

    def __call__(self) -> list[int]:
        return list(map(id, self.container))


class _IdList(list[int]):
    """The expected key identities; holds the keys too, so their ids stay theirs."""

    def __init__(self, keys: list[object]) -> None:
        super().__init__(map(id, keys))
        self.keys = keys


def _instance_dict(obj: object) -> dict[str, Any] | None:
    try:
        return object.__getattribute__(obj, "__dict__")
    except AttributeError:
        return None


def _readers(obj: object, name: str, value: object) -> list[Callable[[], object]] | None:
    """Cheap readers that together see every change of `getattr(obj, name, MISSING)`, or None
    when the name resolves to code on the class (a method, a property: see the Note).

    A plain instance attribute is read from the instance dict (also under a custom
    `__getattribute__`, such as a Hugging Face config's, when that returned the dict's own
    value), a module's parameter, buffer or submodule from its dict, and an absent attribute
    is watched where an assignment would put it. Anything else goes through getattr."""
    import inspect

    cls = type(obj)
    static = inspect.getattr_static(cls, name, MISSING)
    attrs = _instance_dict(obj)
    data_descriptor = static is not MISSING and hasattr(type(static), "__set__")
    module = isinstance(obj, torch.nn.Module)
    if attrs is not None and not data_descriptor and name in attrs and attrs[name] is value:
        return [partial(dict.get, attrs, name, MISSING)]
    if module and static is MISSING:
        for store in (obj._parameters, obj._buffers, obj._modules):  # type: ignore[attr-defined]
            if name in store and store[name] is value:
                return [partial(dict.get, store, name, MISSING)]
    if value is MISSING and attrs is not None and static is MISSING:
        stores = [attrs]
        if module:
            stores += [obj._parameters, obj._buffers, obj._modules]  # type: ignore[attr-defined]
        return [partial(dict.get, store, name, MISSING) for store in stores]
    if static is not MISSING and not isinstance(obj, types.ModuleType):
        if static is value or not _is_slot(static) and hasattr(type(static), "__get__"):
            # Code, a property, or data on the class: the class is constant (user classes'
            # data is guarded through the class itself, see Recorder._walk_class).
            return None
    return [partial(getattr, obj, name, MISSING)]


def _is_slot(descriptor: object) -> bool:
    return type(descriptor).__name__ == "member_descriptor"
