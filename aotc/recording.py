"""Recording what a traced program reads from Python state, and undoing what it writes.

Stage: `Recorder(name)`, given its roots before the first trace (`track_function(fn)`,
`track(value, label)`); `with recorder.run(lifting_containers): recorder.call(fn, args, kwargs)`
around every run of the program during one compilation. Afterwards `reads` (attribute loads),
`slot_reads` (the globals and closure cells the program's code can load) and `side_effects` hold
what aotc/strict.py turns into the entry's guards and warnings; a run that made a change the
graph cannot replay raises `SideEffectsRefused` when it ends.
Requires: one compilation at a time per recorder, on the thread that created it.
Ensures: every attribute load the program makes on a tracked object, during a run, is in
`reads` with the user's line; every object such a load returns is tracked before the program
sees it; Python state the program changed (attributes, globals, cells, containers, and what
aotc/statewatch.py compares: torch's global state, standard-library objects' state, containers
passed as arguments) is restored when the run ends where it can be, and each change is described
in `side_effects`. See Note [Strict capture guards] in aotc/strict.py for what is tracked and
why that is complete.

How loads are seen: for the duration of a run, the class of every tracked object gets recording
`__getattribute__`/`__getattr__`/`__setattr__`/`__delattr__` methods that call the original and
tell the recorder (set on the class, not by changing the object's class: `type(obj)` stays what
the program expects and no `__init_subclass__` runs); a tracked Python module gets a recording
module class. The patches are removed when the run ends.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import operator
import sys
import threading
import traceback
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from aotc import statewatch
from aotc.dataclasstree import flatten_tree
from aotc.interpose import (
    ACTIVE,
    GENERATOR_NAMES,
    can_patch,
    install_stubs,
    patch_class,
    recording_module_class,
    remove_stubs,
    unpatch_class,
    unwatch_generators,
    watch_generators,
)
from aotc.lifting import StateCreated
from aotc.runtime.errors import UnsupportedError
from aotc.runtime.stateguard import same_constant
from aotc.usercode import (
    MISSING,
    code_facts,
    format_line,
    is_constant,
    is_user_class,
    is_user_file,
    user_line,
)

Tensor = torch.Tensor


_MAX_DEPTH = 8  # how far the walk follows attributes, elements, globals and closures
_HOOK_DICTS = frozenset(
    {"_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"}
)
# Forward (pre-)hooks of submodules run inside the trace like `forward` itself (Note [Strict
# capture guards], hooks, in aotc/strict.py); backward hooks are refused.
TRACED_HOOK_DICTS = frozenset({"_forward_hooks", "_forward_pre_hooks"})
_OPTIMIZER_HOOK_DICTS = frozenset({"_optimizer_step_pre_hooks", "_optimizer_step_post_hooks"})
# nn.Module bookkeeping the walk does not follow (parameters, buffers and submodules are reached
# through named_modules and the lifting; hook dicts are checked when read).
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))
_MUTABLE_CONTAINERS = (list, dict, set, collections.deque)
# Methods of user classes the walk skips: construction, pickling and printing.
_NOT_CALLED_IN_A_TRACE = frozenset(
    {
        "__init__", "__new__", "__init_subclass__", "__del__", "__repr__", "__str__",
        "__reduce__", "__reduce_ex__", "__getstate__", "__setstate__", "__copy__",
        "__deepcopy__", "__class_getitem__",
    }
)  # fmt: skip

# ---------------------------------------------------------------- records


@dataclass(slots=True)
class AttrRead:
    """`obj.name` as the program first read it (value may be MISSING: it was absent)."""

    obj: object
    name: str
    value: object
    label: str  # e.g. "self.h.0.attn.dropout.p"
    where: str  # the user's line


@dataclass(slots=True)
class SlotRead:
    """A global name, closure cell, default-argument tuple or class attribute the program's
    code can load (found statically), or the `__dict__` of an object whose loads cannot be
    recorded."""

    reader: Callable[[], object]
    value: object
    label: str  # e.g. "global SCALE (train.py)", "closure opt"
    where: str
    write: Callable[[object], None] | None  # restores a value (None: never written)


# ---------------------------------------------------------------- the recorder

# Note [State created on the first call]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Programs initialize state lazily on their first call: an optimizer creates its moment buffers
# (new entries in `opt.state`, found by the lifting), a model sets `config.problem_type` or a
# cached tensor attribute that was absent or None. A graph cannot replay creating state, and
# undoing it after the trace would leave the program looking uninitialized forever. So a run that
# adds dict entries the lifting reads tensors from, adds keys to any other dict it reaches while
# leaving the entries it had as they were (a cache filled on first use, `register_buffer` in
# `forward`), or sets an attribute of a tracked object that was absent or None, raises
# `StateCreated`: the compiled function runs that call eagerly (the state is created for real),
# and compiles on the next call, which then reads the state (lifted if it holds tensors, guarded
# if not). A lazy module's uninitialized parameter among the call's tensors is the same case
# (aotc/api.py, `_uninitialized`). A program that creates state again right after such an
# eager call is refused (aotc/api.py). Changing an attribute that existed is a side effect
# instead: undone, and the compilation refused (Note [Python side effects in strict mode]
# in aotc/strict.py).


class SideEffectsRefused(UnsupportedError):
    """The program changed Python state that outlives the call (Note [Python side effects in
    strict mode] in aotc/strict.py): raised at the end of the run that made the changes."""


class Recorder:
    """What one compilation's runs of the program read and wrote; see the module docstring."""

    def __init__(self, name: str, exempt_hooks: object = None) -> None:
        self.name = name
        self.thread = threading.get_ident()
        self.exempt_hooks = exempt_hooks  # a module whose own hooks run eagerly (CompiledModule)
        self.tracked: dict[int, object] = {}  # id -> object whose attribute loads are recorded
        self.labels: dict[int, str] = {}
        self.reads: dict[tuple[int, str], AttrRead] = {}
        self.slot_reads: dict[tuple[object, ...], SlotRead] = {}
        # key -> (message, where, refuse): see Note [Python side effects in strict mode]
        self.side_effects: dict[str, tuple[str, str, bool]] = {}
        self.module_calls = False  # a module's __call__ ran (its hook dicts were read)
        self.optimizer_steps = False
        self._seen: dict[int, object] = {}  # walked values (kept alive)
        self._containers: dict[int, tuple[object, str]] = {}
        self._pymodules: dict[int, types.ModuleType] = {}
        self._codes: list[tuple[types.CodeType, str]] = []  # walked user code, for line lookups
        self._classes: set[type] = set()
        self._busy = False
        self._running = False
        # per run
        self._patched: list[type] = []
        self._swapped_modules: list[tuple[types.ModuleType, type[types.ModuleType]]] = []
        self._written: set[tuple[int, str]] = set()
        # (object, name, old value, user line, written by library code)
        self._writes: list[tuple[object, str, object, str, bool]] = []
        self._snapshots: dict[int, tuple[object, list[Any], str]] = {}
        self._slot_snapshots: dict[tuple[object, ...], object] = {}
        self._lifting: frozenset[int] = frozenset()
        # id -> (name, is an argument) of the run's input tensors: Note [.grad and .data of
        # inputs in strict mode] in aotc/interpose.py
        self.inputs: dict[int, tuple[str, bool]] = {}
        # per run, see Note [Tensor state a graph does not carry] in aotc/interpose.py:
        # id -> (tensor, attribute, user line) of Python attributes set on non-input tensors
        self.tensor_attributes: dict[int, tuple[Tensor, str, str]] = {}
        self.freeing_calls: list[tuple[str, str]] = []  # (call, user line) without retain_graph
        # See Note [State strict mode compares around a run] in aotc/statewatch.py
        self._hidden: dict[int, tuple[object, str]] = {}  # id -> (library object, label)
        self._hidden_before: dict[int, statewatch.HiddenState] = {}  # per run
        self._torch_state: list[object] = []  # per run: statewatch.read_torch_state()
        self._watching = False  # per run: Note [Generator state in strict mode]
        # id -> (tensor, label) of the tensors the walk met (named when an op refuses one)
        self._tensor_labels: dict[int, tuple[Tensor, str]] = {}
        self.arguments_seen: dict[str, object] = {}  # "argument <name>" -> a non-tensor leaf

    # ------------------------------------------------------------ the walk

    def track(self, value: object, label: str, depth: int = 0) -> None:
        """Make `value`, and what it reaches, recorded (see Note [Strict capture guards])."""
        if isinstance(value, Tensor):
            self._tensor_labels.setdefault(id(value), (value, label))
            return
        if depth > _MAX_DEPTH or value is MISSING:
            return
        if depth == 0 and label.startswith("argument "):
            self.arguments_seen.setdefault(label, value)
        if is_constant(value) or id(value) in self._seen:
            return
        self._seen[id(value)] = value
        if isinstance(value, torch.nn.Module):
            refuse_distributed(value, label, self.name)
            for path, module in value.named_modules(remove_duplicate=True):
                where = f"{label}.{path}" if path else label
                if path and id(module) in self._seen:
                    continue
                self._seen[id(module)] = module
                self._track_object(module, where)
                self._walk_attrs(module, where, depth)
        elif isinstance(value, types.FunctionType):
            self._walk_function(value, label, depth)
        elif isinstance(value, types.MethodType):
            self.track(value.__self__, label.rsplit(".", 1)[0] if "." in label else label, depth)
            self.track(value.__func__, label, depth)
        elif isinstance(value, functools.partial):
            self.track(value.func, f"{label}.func", depth + 1)
            self.track(value.args, f"{label}.args", depth + 1)
            self.track(value.keywords, f"{label}.keywords", depth + 1)
        elif isinstance(value, type):
            self._walk_class(value)
        elif isinstance(value, types.ModuleType):
            if getattr(value, "__file__", None) and is_user_file(value.__file__):  # type: ignore[arg-type]
                self._pymodules[id(value)] = value
                self._track_object(value, label, patch=False)
                if self._running:
                    self._swap_module(value)
        elif isinstance(value, (*_MUTABLE_CONTAINERS, tuple, frozenset)):
            if isinstance(value, _MUTABLE_CONTAINERS):
                self._containers[id(value)] = (value, label)
                if self._running:
                    self._snapshot(value, label)
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                text = "<tensor>" if isinstance(key, Tensor) else repr(key)
                self.track(item, f"{label}[{text}]", depth + 1)
                if isinstance(value, dict) and not is_constant(key):
                    self.track(key, f"{label} key", depth + 1)
        elif _is_trackable(value):
            self._track_object(value, label)
            self._walk_attrs(value, label, depth)
        elif statewatch.has_hidden_state(value):
            self._hidden[id(value)] = (value, label)
            if self._running:
                self._read_hidden(value)

    def track_function(self, fn: object, label: str) -> None:
        if isinstance(fn, types.MethodType):
            self.track(fn.__self__, label)
            fn = fn.__func__
        self.track(fn, label)

    def _track_object(self, obj: object, label: str, patch: bool = True) -> None:
        if patch and not can_patch(type(obj)):
            # Loads cannot be recorded (a C type such as types.SimpleNamespace): guard every
            # attribute instead, through the instance dict.
            attrs = object.__getattribute__(obj, "__dict__")
            self._slot(
                ("dict", id(obj)), functools.partial(object.__getattribute__, obj, "__dict__"),
                attrs, f"{label}.__dict__", "", None,
            )  # fmt: skip
            self.track(attrs, f"{label}.__dict__", 1)
            return
        self.tracked[id(obj)] = obj
        self.labels.setdefault(id(obj), label)
        if isinstance(obj, torch.optim.Optimizer):
            self.optimizer_steps = True
        cls = type(obj)
        if is_user_class(cls):
            self._walk_class(cls)
        if patch and self._running and cls not in self._patched and patch_class(cls):
            self._patched.append(cls)

    def _walk_attrs(self, obj: object, label: str, depth: int) -> None:
        try:
            attrs = object.__getattribute__(obj, "__dict__")
        except AttributeError:
            return
        module = isinstance(obj, torch.nn.Module)
        for name, value in list(attrs.items()):
            if module and name in _MODULE_INTERNALS:
                continue
            self.track(value, f"{label}.{name}", depth + 1)

    def _walk_function(self, fn: types.FunctionType, label: str, depth: int) -> None:
        code = fn.__code__
        if not is_user_file(code.co_filename):
            # A library decorator's wrapper (`contextlib.contextmanager`, `torch.no_grad()`,
            # anything made with functools.wraps) runs the user function it names
            inner = fn.__dict__.get("__wrapped__")
            if inner is not None and inner is not fn:
                self.track(inner, label, depth + 1)
            return
        self._codes.append((code, label))
        facts = code_facts(code)
        if self._running and not self._watching and not GENERATOR_NAMES.isdisjoint(facts.uses):
            self._watching = watch_generators()  # Note [Generator state in strict mode]
        globals_ = fn.__globals__
        module = globals_.get("__name__", "?")
        for name, line in facts.load_globals.items():
            key: tuple[object, ...] = ("global", id(globals_), name)
            if key in self.slot_reads:
                continue
            value = globals_.get(name, MISSING)
            self._slot(
                key,
                functools.partial(dict.get, globals_, name, MISSING),
                value,
                f"global {name} ({module})",
                format_line(code.co_filename, line),
                functools.partial(_set_item, globals_, name),
            )
            self.track(value, f"global {name}", depth + 1)
        for var, cell in zip(code.co_freevars, fn.__closure__ or ()):
            key = ("cell", id(cell))
            try:
                value = cell.cell_contents
            except ValueError:
                continue  # not bound yet
            if key not in self.slot_reads:
                self._slot(
                    key,
                    functools.partial(getattr, cell, "cell_contents"),
                    value,
                    f"closure {var} (of {fn.__qualname__})",
                    format_line(code.co_filename, code.co_firstlineno),
                    functools.partial(setattr, cell, "cell_contents"),
                )
                self.track(value, f"closure {var}", depth + 1)
        for attr in ("__defaults__", "__kwdefaults__"):
            value = getattr(fn, attr)
            if value and ("defaults", id(fn), attr) not in self.slot_reads:
                self._slot(
                    ("defaults", id(fn), attr),
                    functools.partial(getattr, fn, attr),
                    value,
                    f"default arguments of {fn.__qualname__}",
                    format_line(code.co_filename, code.co_firstlineno),
                    functools.partial(setattr, fn, attr),
                )
                self.track(value, f"{fn.__qualname__}.{attr}", depth + 1)

    def _walk_class(self, cls: type) -> None:
        for klass in cls.__mro__:
            if klass in self._classes or not is_user_class(klass):
                continue
            self._classes.add(klass)
            for name, value in list(vars(klass).items()):
                if name in _NOT_CALLED_IN_A_TRACE:
                    continue
                if isinstance(value, (staticmethod, classmethod)):
                    value = value.__func__
                if isinstance(value, property):
                    for part in (value.fget, value.fset, value.fdel):
                        if isinstance(part, types.FunctionType):
                            self._walk_function(part, f"{klass.__qualname__}.{name}", 1)
                elif isinstance(value, types.FunctionType):
                    self._walk_function(value, f"{klass.__qualname__}.{name}", 1)
                elif not name.startswith("__") and not hasattr(value, "__get__"):
                    key = ("class", id(klass), name)  # class-level data: `Cls.X`, `type(self).X`
                    self._slot(
                        key,
                        functools.partial(getattr, klass, name, MISSING),
                        value,
                        f"{klass.__qualname__}.{name}",
                        "",
                        functools.partial(setattr, klass, name),
                    )
                    self.track(value, f"{klass.__qualname__}.{name}", 1)

    def _slot(
        self,
        key: tuple[object, ...],
        reader: Callable[[], object],
        value: object,
        label: str,
        where: str,
        write: Callable[[object], None] | None,
    ) -> None:
        self.slot_reads[key] = SlotRead(reader, value, label, where, write)
        if self._running and write is not None:
            self._slot_snapshots.setdefault(key, value)

    # ------------------------------------------------------------ runs

    @contextlib.contextmanager
    def run(self, lifting_containers: frozenset[int] = frozenset()) -> Iterator[None]:
        """One run of the program: record loads, and restore Python state afterwards."""
        self._lifting = lifting_containers
        self._running = True
        self._written = set()
        self._writes = []
        self._snapshots = {}
        self._slot_snapshots = {k: s.reader() for k, s in self.slot_reads.items() if s.write}
        for container, label in list(self._containers.values()):
            self._snapshot(container, label)
        # See Note [State strict mode compares around a run] in aotc/statewatch.py
        self._torch_state = statewatch.read_torch_state()
        self._hidden_before = {}
        for value, _ in list(self._hidden.values()):
            self._read_hidden(value)
        self.tensor_attributes = {}
        self.freeing_calls = []
        install_stubs()
        for obj in list(self.tracked.values()):
            cls = type(obj)
            if isinstance(obj, types.ModuleType):
                self._swap_module(obj)
            elif cls not in self._patched and patch_class(cls):
                self._patched.append(cls)
        names = (code_facts(code).uses for code, _ in self._codes)
        self._watching = any(not GENERATOR_NAMES.isdisjoint(n) for n in names) and (
            watch_generators()  # Note [Generator state in strict mode] in aotc/interpose.py
        )
        ACTIVE.append(self)
        created: list[str] = []
        try:
            yield
        except (RuntimeError, AssertionError) as e:  # fake tensors raise AssertionError
            unliftable = statewatch.unliftable_tensor(e, self._tensor_labels)
            if unliftable is None:
                raise
            raise UnsupportedError(self._unliftable_message(unliftable, e)) from e
        finally:
            ACTIVE.remove(self)
            if self._watching:
                unwatch_generators()
                self._watching = False
            self._running = False
            for cls in reversed(self._patched):
                unpatch_class(cls)
            self._patched = []
            for module, cls in reversed(self._swapped_modules):
                module.__class__ = cls
            self._swapped_modules = []
            remove_stubs()
            created = self._undo()
        if created:  # See Note [State created on the first call] (only when the run succeeded)
            raise StateCreated(
                f"the compiled function creates state: it sets {', '.join(created[:3])}, "
                "which it did not hold before (lazy initialization); a graph cannot replay "
                "creating state. Run that first call eagerly, then compile."
            )
        refused = self.refusal()
        if refused is not None:  # at once: the later runs would only make the changes again
            raise refused

    def call(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """`fn(*args, **kwargs)` inside `run()`, checking what the call did to its arguments
        and returned (Note [State strict mode compares around a run] in aotc/statewatch.py, Note
        [Tensor state a graph does not carry] in aotc/interpose.py)."""
        containers = statewatch.snapshot_arguments(fn, args, kwargs)
        out = fn(*args, **kwargs)
        for snap in statewatch.changed_arguments(containers):
            where = self._use_line(snap.label)
            self.side_effect(
                f"argument {snap.label}",
                f"the program modifies {snap.label} (a {type(snap.container).__name__})"
                + (f" at {where}" if where else "")
                + ": the compiled function passes the graph the tensors of its arguments and "
                "hands the program its own copy of their containers, so your "
                f"{type(snap.container).__name__} would not change.",
                where,
            )
        leaves, _ = flatten_tree(out)
        for k, leaf in enumerate(leaves):
            found = self.tensor_attributes.get(id(leaf))
            if found is not None and found[0] is leaf:
                self.side_effect(
                    f"output attribute {k}",
                    f"the program sets Python attribute {found[1]!r} on a tensor it returns "
                    f"(output {k}) at {found[2]}: compiled calls return new tensors without it.",
                    found[2],
                )
        freed = statewatch.freed_outputs(leaves) if self.freeing_calls else []
        if freed:
            what, where = self.freeing_calls[0]
            raise UnsupportedError(
                f"{self.name}: {what} at {where} frees the autograd graph of what it "
                "differentiates (retain_graph is not set), and the program returns "
                f"output {freed[0]} (in the flattened outputs), whose backward needs values of "
                "that graph: eager raises 'Trying to backward through the graph a second time' "
                "when the caller backpropagates it. Strict mode (capture='trace') differentiates "
                "every output that requires grad when it compiles, so it cannot compile this. "
                "Return that output .detach()ed, pass retain_graph=True, or use the default "
                "capture mode."
            )
        return out

    def refusal(self) -> SideEffectsRefused | None:
        """The error refusing the compilation for the side effects recorded so far (see Note
        [Python side effects in strict mode] in aotc/strict.py), or None."""
        refused = [message for message, _, refuse in self.side_effects.values() if refuse]
        if not refused:
            return None
        listed = "\n".join(f"  - {m}" for m in refused)
        return SideEffectsRefused(
            f"{self.name}: the program changes Python state that outlives the call:\n{listed}\n"
            "Strict mode (capture='trace') runs the Python code only while it traces; compiled "
            "calls replay the graph and would never make these changes, so the state (and "
            "anything the program later computes from it) would differ from eager. Move them "
            "outside the compiled function (return the value and update the state there), or "
            "use the default capture mode, which runs Python side effects on every call."
        )

    def _read_hidden(self, value: object) -> None:
        if id(value) not in self._hidden_before:
            state = statewatch.read_hidden_state(value, check_stable=True)
            if state is not None:
                self._hidden_before[id(value)] = state

    def _unliftable_message(self, label: str, error: BaseException) -> str:
        frames = traceback.extract_tb(error.__traceback__)
        lines = [format_line(f.filename, f.lineno) for f in frames if is_user_file(f.filename)]
        where = lines[-1] if lines else "an unknown line"
        roots = [
            r for r in self.arguments_seen if label == r or label.startswith((f"{r}.", f"{r}["))
        ]
        root = max(roots, key=len) if roots else label.split(".")[0].split("[")[0]
        holder = self.arguments_seen.get(root)
        kind = f"a {type(holder).__name__}" if holder is not None else "an object"
        if (
            holder is not None
            and hasattr(type(holder), "__torch_function__")
            and not isinstance(holder, Tensor)
        ):
            kind += ", whose class defines __torch_function__"
        if not label.startswith("argument "):
            return (
                f"{self.name}: the program reads tensor {label} at {where}, which aotc could not "
                "lift as a graph input. Pass it as an argument, or use the default capture mode."
            )
        return (
            f"{self.name}: the program reads tensor {label} at {where}, held by {root} "
            f"({kind}). Strict mode (capture='trace') makes graph inputs of tensor arguments, of "
            "tensors in lists, tuples, dicts and dataclasses passed as arguments, and of the "
            "tensors of modules and optimizers (passed, or reached through closures and "
            "globals); not of tensors held by other objects passed as arguments. Pass the "
            "tensor itself as an argument (or inside a dataclass, a dict or a tuple), or use "
            "the default capture mode."
        )

    def _swap_module(self, module: types.ModuleType) -> None:
        cls = type(module)
        if getattr(cls, "__aotc_original__", None) is not None:
            return
        module.__class__ = recording_module_class(cls)
        self._swapped_modules.append((module, cls))

    def on_read(self, obj: object, name: str, value: object) -> None:
        if (
            name[:2] == "__"
            or self._busy
            or id(obj) not in self.tracked
            or threading.get_ident() != self.thread
        ):
            return
        key = (id(obj), name)
        if key in self.reads or key in self._written:
            return
        self._busy = True
        try:
            label = f"{self.labels.get(id(obj), type(obj).__name__)}.{name}"
            if name in _HOOK_DICTS and isinstance(obj, torch.nn.Module):
                self.module_calls = True
                self._refuse_hooks(obj, name, value, label)
            elif name in _OPTIMIZER_HOOK_DICTS and isinstance(obj, torch.optim.Optimizer):
                self._refuse_optimizer_hooks(obj, value, label)
            self.reads[key] = AttrRead(obj, name, value, label, user_line(3))
            if not isinstance(value, Tensor):
                self.track(value, label, 0)
        finally:
            self._busy = False

    def on_write(self, obj: object, name: str) -> None:
        if self._busy or id(obj) not in self.tracked or threading.get_ident() != self.thread:
            return
        key = (id(obj), name)
        if key in self._written:
            return
        self._busy = True
        try:
            old = _current(obj, name)
            self._written.add(key)
            library = not is_user_file(sys._getframe(2).f_code.co_filename)
            self._writes.append((obj, name, old, user_line(3), library))
        finally:
            self._busy = False

    def side_effect(self, key: str, message: str, where: str, refuse: bool = True) -> None:
        """Note one thing the program did that compiled calls will not do (`where`: the user's
        line as `user_line` formats it, or ""); `refuse`: it changes state or a value later calls
        read, so the compilation is refused (Note [Python side effects in strict mode] in
        aotc/strict.py), else it is only reported."""
        self.side_effects.setdefault(key, (message, where, refuse))

    # ------------------------------------------------------------ hooks

    def _refuse_hooks(self, module: object, name: str, hooks: object, label: str) -> None:
        from torch.nn.modules import module as nn_module

        if module is not self.exempt_hooks and hooks and name not in TRACED_HOOK_DICTS:
            hook = next(iter(hooks.values()))  # type: ignore[attr-defined]
            kind = name.strip("_").replace("hooks", "hook").replace("_", " ")
            raise UnsupportedError(
                f"{self.name}: module {label.rsplit('.', 1)[0]} ({type(module).__name__}) has a "
                f"{kind} ({_describe(hook)}), reached at {user_line(4) or 'an unknown line'}. "
                "Strict mode (capture='trace') runs the program only while tracing it, so a "
                "backward hook inside it would see fake tensors once and never the compiled "
                "calls' gradients (forward hooks are traced like the forward). Register the "
                "hook on the module you pass to aotc.compile (its own hooks run eagerly around "
                "each compiled call), remove it, or use the default capture mode."
            )
        for glob in (
            "_global_forward_hooks",
            "_global_forward_pre_hooks",
            "_global_backward_hooks",
            "_global_backward_pre_hooks",
        ):
            table = getattr(nn_module, glob, None)
            if table and glob[7:] in TRACED_HOOK_DICTS:  # traced, and guarded (aotc/strict.py)
                self.track(table, f"torch.nn.modules.module.{glob}")
            elif table:
                raise UnsupportedError(
                    f"{self.name}: a global module hook is registered "
                    f"(torch.nn.modules.module.register_module_{glob[8:-1]}: "
                    f"{_describe(next(iter(table.values())))}); a backward hook would run for "
                    "every module call inside the program, only while aotc traces it, on fake "
                    "tensors (global forward hooks are traced like the forward). Remove it "
                    "while using strict mode (capture='trace'), or use the default capture mode."
                )

    def _refuse_optimizer_hooks(self, opt: object, hooks: object, label: str) -> None:
        from torch.optim import optimizer as optim_module

        tables: list[Any] = [  # dicts of hooks, or None
            hooks,
            getattr(optim_module, "_global_optimizer_pre_hooks", None),
            getattr(optim_module, "_global_optimizer_post_hooks", None),
        ]
        for table in tables:
            if table:
                raise UnsupportedError(
                    f"{self.name}: optimizer {label.rsplit('.', 1)[0]} has a step hook "
                    f"({_describe(next(iter(table.values())))}); strict mode would run it only "
                    "while tracing. Remove it, call it outside the compiled function, or use "
                    "the default capture mode."
                )

    # ------------------------------------------------------------ undoing side effects

    def _snapshot(self, container: object, label: str) -> None:
        if id(container) in self._snapshots:
            return
        if isinstance(container, dict):
            copy: list[Any] = list(container.items())
        else:
            copy = list(container)  # type: ignore[call-overload]
        self._snapshots[id(container)] = (container, copy, label)

    def _undo(self) -> list[str]:
        """Restore what the run changed; report each change as a side effect, except attributes
        the run created (absent or None before): those are returned."""
        created = []
        for obj, name, old, where, library in reversed(self._writes):
            now = _current(obj, name)
            if isinstance(old, Tensor):
                continue  # a lifted location: the lifting checks and restores it
            if now is old:
                continue
            if old is MISSING:
                with contextlib.suppress(AttributeError):
                    delattr(obj, name)
            else:
                setattr(obj, name, old)
            if not (now is MISSING or old is MISSING) and same_constant(now, old):
                continue
            label = f"{self.labels.get(id(obj), type(obj).__name__)}.{name}"
            if (old is MISSING or old is None) and now is not MISSING:
                created.append(f"{label} (at {where})" if where else label)
                continue
            self.side_effect(
                f"assign {label}",
                f"the program assigns {label} at {where or 'an unknown line'}"
                + (" (in library code it calls)." if library else "."),
                where,
                # Library code's own attributes are library state, taken as constant (Note
                # [Strict capture guards]): reported only. `nn.LSTM` refreshes its weight cache
                # when the trace swaps fake parameters in; eager calls would not.
                refuse=not library,
            )
        for container, copy, label in self._snapshots.values():
            added = _added_keys(container, copy)
            changed = self._restore_container(container, copy)
            if changed and added and id(container) not in self._lifting:
                # only new keys (a cache filled on first use, a buffer registered lazily):
                # state created, as for an attribute that was absent
                created.append(f"{label}[{added[0]!r}]")
                continue
            if changed:
                where = self._mutation_line(label)
                self.side_effect(
                    f"mutate {label}",
                    f"the program modifies {type(container).__name__} {label}"
                    + (f" at {where}" if where else "")
                    + ".",
                    where,
                )
        for key, old in self._slot_snapshots.items():
            slot = self.slot_reads[key]
            try:
                now = slot.reader()
            except Exception:
                now = MISSING
            if now is old:
                continue
            self._restore_slot(key, old)
            where = self._store_line(key, slot.label)
            self.side_effect(
                f"store {slot.label}",
                f"the program assigns {slot.label}" + (f" at {where}" if where else "") + ".",
                where,
            )
        self._undo_hidden_state()
        return created

    def _undo_hidden_state(self) -> None:
        """See Note [State strict mode compares around a run] in aotc/statewatch.py."""
        for state, old, now in statewatch.changed_torch_state(self._torch_state):
            where = self._use_line(*state.setters)
            self.side_effect(
                f"torch state {state.label}",
                f"the program leaves {state.label} changed ({old!r} -> {now!r}; "
                + (f"set at {where}" if where else "set somewhere in the program")
                + "): eager keeps the change after the call, compiled calls would not make it.",
                where,
            )
        for key, before in self._hidden_before.items():
            value, label = self._hidden[key]
            now = statewatch.read_hidden_state(value)
            if now is None or now.frozen == before.frozen:
                continue
            restored = statewatch.restore_hidden_state(value, before)
            where = self._use_line(label)
            self.side_effect(
                f"hidden state {label}",
                f"the program changes the state of {label} (a {type(value).__name__})"
                + (f", used at {where}" if where else "")
                + (" (put back)" if restored else " (it stays changed: it cannot be put back)")
                + ": compiled calls would not change it.",
                where,
            )

    def _restore_container(self, container: Any, copy: list[Any]) -> bool:
        """Put back what the run changed in one container; True if it changed anything."""
        if isinstance(container, dict):
            now = list(container.items())
            if len(now) == len(copy) and all(
                a[0] is b[0] and a[1] is b[1] for a, b in zip(now, copy)
            ):
                return False
            if id(container) in self._lifting:
                # A dict the lifting reads tensors from: new entries are the lifting's to refuse
                # (an optimizer creating its state) and tensors its to check; put back the
                # other entries that were there.
                changed = False
                for k, v in copy:
                    if not isinstance(v, Tensor) and container.get(k, MISSING) is not v:
                        container[k] = v
                        changed = True
                return changed
            container.clear()
            container.update(copy)
            return True
        now_items = list(container)
        if len(now_items) == len(copy) and all(map(operator.is_, now_items, copy)):
            return False
        if isinstance(container, list):
            container[:] = copy
        else:
            container.clear()
            (container.extend if hasattr(container, "extend") else container.update)(copy)
        return True

    def _restore_slot(self, key: tuple[object, ...], old: object) -> None:
        write = self.slot_reads[key].write
        assert write is not None
        if old is MISSING and key[0] == "global":
            self.slot_reads[key].reader.args[0].pop(key[2], None)  # type: ignore[attr-defined]
        else:
            write(old)

    def _mutation_line(self, label: str) -> str:
        leaf = label.rsplit(".", 1)[-1].split(" ")[-1].split("[")[0]
        for code, _ in self._codes:
            line = code_facts(code).mutations.get(leaf)
            if line is not None:
                return format_line(code.co_filename, line)
        return ""

    def _use_line(self, *names: str) -> str:
        """The first line of the walked user code that mutates or loads one of `names` (a
        label's last name: "argument xs" -> xs, "global counter" -> counter), or ""."""
        leaves = [n.rsplit(".", 1)[-1].split(" ")[-1].split("[")[0] for n in names]
        for field in ("mutations", "uses"):
            for code, _ in self._codes:
                table = getattr(code_facts(code), field)
                for leaf in leaves:
                    if leaf in table:
                        return format_line(code.co_filename, table[leaf])
        return ""

    def _store_line(self, key: tuple[object, ...], label: str) -> str:
        name = str(key[2]) if key[0] == "global" else label.split(" ")[1]
        for code, _ in self._codes:
            facts = code_facts(code)
            line = (facts.store_globals if key[0] == "global" else facts.store_derefs).get(name)
            if line is not None:
                return format_line(code.co_filename, line)
        return ""


def _current(obj: object, name: str) -> object:
    """What `obj.name` holds on the instance itself (MISSING when it would come from the
    class, or nowhere), so that restoring it recreates exactly that."""
    try:
        attrs = object.__getattribute__(obj, "__dict__")
    except AttributeError:
        attrs = {}
    if name in attrs:
        return attrs[name]
    if isinstance(obj, torch.nn.Module):
        for store in (obj._parameters, obj._buffers, obj._modules):
            if name in store:
                return store[name]
    static = inspect.getattr_static(type(obj), name, MISSING)
    if static is not MISSING and hasattr(type(static), "__set__"):  # a property, a slot
        try:
            return getattr(obj, name)
        except AttributeError:
            return MISSING
    return MISSING


def _added_keys(container: object, copy: list[Any]) -> list[object]:
    """The keys a run added to a dict while leaving every entry it had as it was, or []."""
    if not isinstance(container, dict) or len(container) <= len(copy):
        return []
    if any(container.get(k, MISSING) is not v for k, v in copy):
        return []
    old = {id(k) for k, _ in copy}
    return [k for k in container if id(k) not in old]


def _set_item(container: dict[Any, Any], key: object, value: object) -> None:
    container[key] = value


def _is_trackable(value: object) -> bool:
    """Objects whose attributes the program may read and the user may change: instances of
    user and third-party classes, modules, optimizers. Not torch's other objects, the standard
    library's, or code."""
    if isinstance(value, (torch.nn.Module, torch.optim.Optimizer)):
        return True
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, types.MethodType)):
        return False
    cls = type(value)
    if not can_patch(cls) and not hasattr(value, "__dict__"):
        return False
    top = (cls.__module__ or "").split(".")[0]
    if top == "__main__":
        return True
    return top != "torch" and top not in sys.stdlib_module_names


def _describe(hook: object) -> str:
    code = getattr(getattr(hook, "__func__", hook), "__code__", None)
    name = getattr(hook, "__qualname__", None) or type(hook).__name__
    if code is not None:
        return f"{name} at {code.co_filename}:{code.co_firstlineno}"
    return name


def refuse_distributed(module: torch.nn.Module, label: str, name: str) -> None:
    what = None
    if isinstance(module, torch.nn.parallel.DistributedDataParallel):
        what = "DistributedDataParallel"
    else:
        fsdp = getattr(getattr(torch.distributed, "fsdp", None), "FSDPModule", None)
        if fsdp is not None and isinstance(module, fsdp):
            what = "an FSDP2 (fully_shard) module"
    if what is not None:
        raise UnsupportedError(
            f"{name}: {label} is {what}. Its gradient communication runs in autograd hooks and "
            "module hooks around the forward, which strict mode (capture='trace') would run "
            "only while tracing. Use the default capture mode (aotc.compile(ddp_model)), or "
            "wrap the compiled module instead: DDP(aotc.compile(model, capture='trace'))."
        )
