"""Calls after a Dynamo guard hit: the default capture mode's per-call path without
`torch.compile`'s wrapper.

Stage: `hit_caller(fn, backend, isolate_id) -> HitCaller | None` once per DynamoFunction
(`module_hit_caller` per DynamoModule); `.call(args, kwargs)` per call, returning `MISS` whenever
the normal path must run.
Requires: `fn` is the plain Python function Dynamo compiles (through `backend`, in the optimize
context whose recompile bucket is `isolate_id`).
Ensures: a call returns what Dynamo's own per-call path would: the transformed code of the first
cache entry (of this backend and bucket) whose guards pass on the call's frame locals, run with
the function's globals and closure; anything this module does not handle exactly is a `MISS`.

Note [Calls after a Dynamo guard hit]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
`torch.compile`'s wrapper (`compile_wrapper` in torch/_dynamo/eval_frame.py) costs ~20 us of
Python on every call before the frame is even entered: it checks for fx/jit tracing and export,
enters the context's hooks, sets the eval-frame callback, the guard-skip stance, the recompile
bucket and a dispatch-key guard, and undoes all of it afterwards. Then the C frame evaluator
looks the frame up, runs each cache entry's guard manager on the frame's locals, and runs the
first passing entry's transformed code. For a tiny training call that wrapper was most of the
default mode's overhead over eager (2.1x against the strict mode's 1.5x).
Once a frame is compiled, what decides the result is the cache entries, each a guard manager and
a transformed code object. This module does that part itself: it builds the frame locals the
evaluator would (the arguments by name, the closure's cells by name), checks the entries in the
evaluator's order (most recent first) with their own guard managers, and calls the passing
entry's code as a function over the original's globals and closure. It returns `MISS`, leaving
the call to the normal path (which compiles, recompiles, records guard failures and applies the
recompile limit), when:
- the call does not bind like the frame would without defaults: fewer positional arguments
  than parameters (defaults), more without `*args`, a keyword argument without `**kwargs` or one
  naming a parameter; keyword-only and positional-only parameters are never handled here;
- a module call whose `Module.__call__` would do more than call `forward` (see ModuleHitCaller);
- Dynamo is tracing (an outer torch.compile inlines the normal path) or a stance other than
  "default" is set (`torch.compiler.set_stance("force_eager")` must run eagerly);
- no entry of this backend and recompile bucket passes its guards;
- the passing entry's code could run a Python frame Dynamo would compile: only codes whose
  globals are Dynamo's own (`__compiled_fn_*` graphs, `__import_*` modules) run here; a graph
  break's `__resume_at_*` function or a call to a user function goes through the normal path, so
  those frames are compiled as before.
The entries a call passed are remembered (Note [Entries a hit remembers]); the others are read
from the code object when no remembered one passes. Dynamo's guard managers include its
global-state guards (grad mode, autocast, default dtype, torch function modes, ...), so a hit
here is a hit there. Without the eval-frame callback set, the graph's own call is unchanged: the
backend's `run` closure never enters a Python frame Dynamo would compile. What is lost is only
cosmetic: the profiler's "Torch-Compiled Region" range around the call. A torch without these
internals (`CacheEntry.backend`, `guard_manager`) gets no hit caller; everything runs the normal
path. tests/e2e/test_capture_dynamo.py (`test_guard_hit_*`) checks both branches against eager.

Note [Entries a hit remembers]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Reading the entry list (`_debug_get_cache_entry_list`) and each entry's backend, recompile
bucket, guard manager and code through pybind cost ~11K instructions per call, more than the rest
of this path together, and are the same on every call of a compiled training step. So a
HitCaller keeps, for up to `_RECENT` entries that passed, the entry's guard manager (a Python
object), its root's bound `check` and the functions made from its code, and checks those first,
most recently passed first; the entry list is read only when none passes. What makes this exact:
- An entry Dynamo no longer runs is never run here. Dynamo drops an entry in two ways: it
  invalidates it (an object a guard compares by id has died, so a new object could take that id)
  or frees it (`torch._dynamo.reset()`, `reset_code`, a cache eviction). Both set the guard
  manager's `cache_entry` attribute to None (CacheEntry::invalidate and ~CacheEntry in
  torch/csrc/dynamo/cache_entry.cpp), and a remembered entry is used only while it is not None;
  one that is None is forgotten. An entry whose manager had no `cache_entry` when it passed is
  not remembered.
- A recompilation adds an entry only after every entry failed on some call, and entries that
  still pass stay valid for the calls they pass (that is what a guard states). Where two entries
  pass, Dynamo runs the one it moved to the front last and this path the one it remembered last;
  both compile the same frame for those inputs.
- The stance, the compiling flag and the eval-frame callback are read on every call, as before.
test_guard_hit_forgets_entries_dynamo_invalidated and test_guard_hit_remembers_several_entries
(tests/e2e/test_capture_dynamo.py) check both.

Note [The first remembered entry]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A training step calls one entry over and over, so the entry most recently passed is the one to
try first, and for a code without closure cells, `*args` or `**kwargs` that try is generated
once per HitCaller as one function (`call`): the argument count, the stance and compiling flag,
the entry's `cache_entry`, its guard check on the frame locals built as one dict display with
the names inlined, and the call of its code. Anything else (keywords, another count, no entry
remembered, an invalidated entry, a failed check) goes to the general path (`_call`), which
starts again from the top; after a failed check it is handed that entry and skips it (the same
call's locals fail the same guards), so an entry is checked at most once per call and the
result is the general path's. The remembered list is changed in place, never replaced, because
the generated function holds it. This takes ~1 us of Python off each call of a tiny step.
"""

from __future__ import annotations

import dis
import inspect
import types
from collections.abc import Callable
from typing import Any

import torch

MISS: Any = object()  # "run the normal path"

_DYNAMO_GLOBALS = ("__compiled_fn", "__import_")


def _entries_reader() -> Callable[[types.CodeType], list[Any]] | None:
    try:
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:  # another torch: no hit caller
        return None
    return _debug_get_cache_entry_list


def _eval_frame_callback() -> Callable[[], object]:
    from torch._C._dynamo.eval_frame import get_eval_frame_callback

    return get_eval_frame_callback


def _stance() -> Any:
    return getattr(torch._dynamo.eval_frame, "_stance", None)


_RECENT = 4  # entries a HitCaller remembers
_Functions = tuple[types.FunctionType, types.FunctionType]  # a code unwrapped, as it is


class _Hit:
    """A cache entry a call passed: its guard manager (whose `cache_entry` Dynamo clears when the
    entry is invalidated or freed), the bound guard check and the code as functions."""

    __slots__ = ("manager", "check", "plain", "wrapped")

    def __init__(
        self,
        manager: Any,
        check: Callable[[dict[str, Any]], bool],
        plain: types.FunctionType,
        wrapped: types.FunctionType,
    ) -> None:
        self.manager, self.check, self.plain, self.wrapped = manager, check, plain, wrapped


def _locals_builder(
    names: tuple[str, ...], star: str | None, starstar: str | None
) -> Callable[[tuple[Any, ...], dict[str, Any]], dict[str, Any]]:
    """`(args, kwargs) -> the frame's locals by name` as one dict display (`dict(zip(...))` costs
    ~3.5K instructions per call, the display ~0.3K). The names are the code's own identifiers."""
    items = [f"{name!r}: a[{i}]" for i, name in enumerate(names)]
    if star is not None:
        items.append(f"{star!r}: a[{len(names)}:]")
    if starstar is not None:
        items.append(f"{starstar!r}: dict(k)")
    source = "lambda a, k: {" + ", ".join(items) + "}"
    return eval(source, {"__builtins__": {}, "dict": dict})  # noqa: S307


class HitCaller:
    """Runs a call of `fn` through the passing cache entry's transformed code, or says MISS."""

    __slots__ = (
        "_code",
        "_names",
        "_star",
        "_starstar",
        "_cells",
        "_globals",
        "_closure",
        "_backend",
        "_bucket",
        "_read",
        "_frames",
        "_compiling",
        "_runnable",
        "_callback",
        "_profiler",
        "_recent",
        "_locals",
        "call",
    )

    def __init__(
        self,
        fn: types.FunctionType,
        backend: object,
        bucket: int | None,
        read: Callable[[types.CodeType], list[Any]],
    ) -> None:
        code = fn.__code__
        self._code = code
        n = code.co_argcount
        self._names = code.co_varnames[:n]
        # the names of *args and **kwargs in the frame's locals, where the code has them
        rest = iter(code.co_varnames[n:])
        self._star = next(rest) if code.co_flags & inspect.CO_VARARGS else None
        self._starstar = next(rest) if code.co_flags & inspect.CO_VARKEYWORDS else None
        cells = fn.__closure__ or ()
        self._cells = tuple(zip(code.co_freevars, cells, strict=True))
        self._globals = fn.__globals__
        self._closure = fn.__closure__
        self._backend = backend
        self._bucket = bucket
        self._read = read
        self._frames = torch._dynamo.eval_frame  # its `_stance` is replaced by set_stance
        # `torch.compiler.is_compiling()` is this flag (Dynamo holds it True while it compiles,
        # export while it traces) behind two Python frames; read here directly.
        self._compiling = torch.compiler
        self._callback = _eval_frame_callback()
        self._profiler = torch.autograd.profiler  # its `_is_profiler_enabled` flag changes
        # id of a transformed code -> (the code, its functions or None where it must not run here)
        self._runnable: dict[int, tuple[types.CodeType, _Functions | None]] = {}
        self._recent: list[_Hit] = []  # Note [Entries a hit remembers]; changed in place
        self._locals = _locals_builder(self._names, self._star, self._starstar)
        self.call = self._first_hit() or self._call  # Note [The first remembered entry]

    def _first_hit(self) -> Callable[[tuple[Any, ...], dict[str, Any]], Any] | None:
        """Note [The first remembered entry]: `call` for a code without closure cells, `*args`
        or `**kwargs`, as one generated function; None for other codes."""
        if self._cells or self._star is not None or self._starstar is not None:
            return None
        n = len(self._names)
        frame_locals = ", ".join(f"{name!r}: args[{i}]" for i, name in enumerate(self._names))
        source = (
            "def call(args, kwargs):\n"
            f"    if kwargs or len(args) != {n} or not recent:\n"
            "        return general(args, kwargs)\n"
            "    hit = recent[0]\n"
            "    if (\n"
            "        frames._stance.stance != 'default'\n"
            "        or compiling._is_compiling_flag\n"
            "        or hit.manager.cache_entry is None\n"
            "    ):\n"
            "        return general(args, kwargs)\n"
            f"    if not hit.check({{{frame_locals}}}):\n"
            "        return general(args, kwargs, hit)\n"
            "    if callback() is None and not profiler._is_profiler_enabled:\n"
            "        return hit.plain(*args)\n"
            "    return hit.wrapped(*args)\n"
        )
        namespace: dict[str, Any] = {
            "__builtins__": {"len": len},
            "recent": self._recent,
            "general": self._call,
            "frames": self._frames,
            "compiling": self._compiling,
            "callback": self._callback,
            "profiler": self._profiler,
        }
        exec(compile(source, f"<aotc guard hit {self._code.co_name}>", "exec"), namespace)  # noqa: S102
        return namespace["call"]

    def _call(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], failed: _Hit | None = None
    ) -> Any:
        """The general path; `failed`: a remembered entry whose guards this call already failed
        (Note [The first remembered entry])."""
        names = self._names
        n = len(names)
        if len(args) != n and (self._star is None or len(args) < n):
            return MISS
        if kwargs and (self._starstar is None or not kwargs.keys().isdisjoint(names)):
            return MISS  # a keyword binding a parameter: the normal path binds it
        if self._frames._stance.stance != "default" or self._compiling._is_compiling_flag:
            return MISS
        frame_locals = self._locals(args, kwargs)
        for name, cell in self._cells:
            try:
                frame_locals[name] = cell.cell_contents
            except ValueError:  # an empty cell: not in the frame's locals either
                pass
        # Note [Entries a hit remembers]
        recent = self._recent
        for hit in recent:
            if hit.manager.cache_entry is None:  # invalidated or freed: forget it, start again
                recent[:] = [h for h in recent if h.manager.cache_entry is not None]
                return self._call(args, kwargs, failed)
            if hit is not failed and hit.check(frame_locals):
                # Note [Dynamo's disable wrappers]
                fn = (
                    hit.plain
                    if self._callback() is None and not self._profiler._is_profiler_enabled
                    else hit.wrapped
                )
                return fn(*args, **kwargs) if kwargs else fn(*args)
        for entry in self._read(self._code):
            if getattr(entry, "backend", None) != self._backend or (
                self._bucket is not None
                and getattr(entry, "isolate_recompiles_id", None) != self._bucket
            ):
                continue
            manager = entry.guard_manager
            if any(h.manager is manager for h in recent):
                continue  # checked above
            check = getattr(manager, "root", manager).check
            if check(frame_locals):
                code = entry.code
                # keyed by identity: hashing a code object hashes its bytecode (~10 us)
                known = self._runnable.get(id(code))
                if known is None or known[0] is not code:
                    known = self._runnable[id(code)] = (code, self._function(code))
                fns = known[1]
                if fns is None:
                    return MISS
                if getattr(manager, "cache_entry", None) is not None:
                    recent[:] = [_Hit(manager, check, *fns), *recent[: _RECENT - 1]]
                # Note [Dynamo's disable wrappers]
                fn = (
                    fns[0]
                    if self._callback() is None and not self._profiler._is_profiler_enabled
                    else fns[1]
                )
                return fn(*args, **kwargs) if kwargs else fn(*args)
        return MISS

    def _function(self, code: types.CodeType) -> _Functions | None:
        """`code` as functions over the original's closure, if it reads no global but Dynamo's
        own (see the Note); None otherwise. The first reads Dynamo's globals unwrapped, the
        second as they are (Note [Dynamo's disable wrappers])."""
        if code.co_freevars != self._code.co_freevars:
            return None
        names = set()
        # per global, the attributes read from it, or None where it is used otherwise
        attrs: dict[str, set[str] | None] = {}
        instructions = list(dis.get_instructions(code))
        for i, ins in enumerate(instructions):
            if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME", "IMPORT_NAME", "STORE_GLOBAL"):
                if not str(ins.argval).startswith(_DYNAMO_GLOBALS) or ins.opname != "LOAD_GLOBAL":
                    return None
                name = str(ins.argval)
                names.add(name)
                after = instructions[i + 1] if i + 1 < len(instructions) else None
                read = attrs.setdefault(name, set())
                if after is not None and after.opname in ("LOAD_ATTR", "LOAD_METHOD"):
                    if read is not None:
                        read.add(str(after.argval))
                else:
                    attrs[name] = None
        plain: dict[str, Any] = {"__builtins__": self._globals.get("__builtins__")}
        for name in names:
            if name not in self._globals:
                return None
            value = self._globals[name]
            if name.startswith("__compiled_fn"):
                plain[name] = _undisabled(value)
            else:
                read = attrs.get(name)
                plain[name] = (
                    (read is not None and _module_namespace(value, read))
                    or _UndisabledModule(value)
                    if isinstance(value, types.ModuleType)
                    else value
                )
        return (
            types.FunctionType(code, plain, code.co_name, None, self._closure),
            types.FunctionType(code, self._globals, code.co_name, None, self._closure),
        )


# Note [Dynamo's disable wrappers]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The transformed code calls the graph through `torch._dynamo.disable(...)` and two profiler
# helpers (`record_pregraph_bytecode_enter/exit`) through `torch._disable_dynamo`: ~3 us each per
# call on CPU. Each wrapper sets the eval-frame callback to None around its function and restores
# it after, so that frames the function runs are not compiled by the callback of the region
# around it. When no callback is set (a call from plain Python, the case of every call that
# reaches this path outside a torch.compile region) the wrapper changes nothing, so the hit path
# runs a second copy of the transformed code whose globals are those functions unwrapped (read
# from the wrapper's own `_torchdynamo_orig_callable` / `__wrapped__`; a value that is not such a
# wrapper is used as is). With a callback set, the code runs over the original globals.
#
# The two profiler helpers do nothing but open and close a "Pregraph bytecode" profiler range
# (with the profiler off: a `nullcontext` entered and exited, five Python frames per call). In
# the unwrapped copy they are C builtins that return at once (`_PROFILER_ONLY`): the enter's
# result is only ever handed to the exit, whose result is dropped. That copy runs only while the
# profiler is off; with it on, the call takes the original globals, so a profile shows the range
# as Dynamo's own path does.


# the code of `torch._disable_dynamo`'s wrapper (functools.wraps gives it its function's names)
_DISABLE_DYNAMO_CODE = getattr(torch._disable_dynamo(lambda: None), "__code__", None)


def _undisabled(value: Any) -> Any:
    if getattr(value, "_torchdynamo_disable", False) and getattr(
        value, "_torchdynamo_disable_recursive", True
    ):
        return getattr(value, "_torchdynamo_orig_callable", value)
    return value


def _profiler_only() -> dict[object, Any]:
    """Dynamo's profiler-range helpers -> C builtins doing nothing with the same call shape (see
    Note [Dynamo's disable wrappers]): enter() -> None, exit(cm) -> ignored."""
    utils = getattr(torch._dynamo, "utils", None)
    found: dict[object, Any] = {}
    for name, stand_in in (
        ("record_pregraph_bytecode_enter", type(None)),
        ("record_pregraph_bytecode_exit", id),
    ):
        helper = getattr(utils, name, None)
        if helper is not None:
            found[helper] = stand_in
    return found


# keyed by the (disable-wrapped) helper objects themselves: only these exact functions are replaced
_PROFILER_ONLY = _profiler_only()


def _unwrapped_attribute(module: types.ModuleType, name: str) -> Any:
    """`module.name` with `torch._disable_dynamo`'s wrapper taken off, or the no-op standing in
    for a profiler-range helper (Note [Dynamo's disable wrappers])."""
    value = getattr(module, name)
    try:
        stand_in = _PROFILER_ONLY.get(value)
    except TypeError:  # an unhashable attribute
        stand_in = None
    if stand_in is not None:
        return stand_in
    inner = getattr(value, "__wrapped__", None)
    if inner is not None and getattr(value, "__code__", None) is _DISABLE_DYNAMO_CODE:
        return inner
    return value


def _module_namespace(module: types.ModuleType, names: set[str]) -> Any:
    """The attributes `names` of `module`, unwrapped, as a plain namespace (a read of one is an
    instance-dict lookup; `_UndisabledModule`'s `__getattr__` hook makes every read of its class
    go through a Python-level slot, ~0.5K instructions each); None if one is missing."""
    try:
        return types.SimpleNamespace(**{n: _unwrapped_attribute(module, n) for n in names})
    except AttributeError:
        return None


class _UndisabledModule:
    """A module's attributes, unwrapped as `_unwrapped_attribute` does, read once each: for a
    transformed code that uses the module other than by reading named attributes of it."""

    def __init__(self, module: types.ModuleType) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        value = _unwrapped_attribute(self._module, name)
        setattr(self, name, value)
        return value


def hit_caller(fn: Any, backend: object, bucket: int | None) -> HitCaller | None:
    """A HitCaller for `fn`, or None where this torch or this callable is not handled (see
    Note [Calls after a Dynamo guard hit])."""
    read = _entries_reader()
    stance = _stance()
    if read is None or stance is None or not hasattr(stance, "stance"):
        return None
    if not isinstance(getattr(torch.compiler, "_is_compiling_flag", None), bool):
        return None
    if not isinstance(fn, types.FunctionType):
        return None
    code = fn.__code__
    if code.co_kwonlyargcount or code.co_posonlyargcount:
        return None
    return HitCaller(fn, backend, None if bucket is None or bucket < 0 else bucket, read)


def _wrap_inline_code() -> types.CodeType | None:
    try:
        from torch._dynamo.external_utils import wrap_inline
    except ImportError:
        return None
    return getattr(wrap_inline(lambda: None), "__code__", None)


_WRAP_INLINE_CODE = _wrap_inline_code()
_module = torch.nn.modules.module


class ModuleHitCaller:
    """The guard-hit path of a module compiled by Dynamo (Note [Calls after a Dynamo guard hit]).
    Dynamo compiles one of two frames: for torch.nn's own modules, a `wrap_inline` function that
    calls the module (its hooks are in the compiled code); for other modules, the module's
    `forward`, entered from `Module.__call__` with the eval-frame callback set, so hooks run
    outside the compiled frame. The second is handled only while the module has no hooks (local
    or global), no `compile()`d call and no instance-level `forward`: then `Module.__call__` is
    exactly `forward(*args, **kwargs)`."""

    __slots__ = ("_hit", "_module", "_forward")

    def __init__(self, hit: HitCaller, module: torch.nn.Module | None, forward: object) -> None:
        self._hit, self._module, self._forward = hit, module, forward

    def call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        m = self._module
        if m is None:
            return self._hit.call(args, kwargs)
        if (
            m._backward_hooks
            or m._backward_pre_hooks
            or m._forward_hooks
            or m._forward_pre_hooks
            or _module._global_backward_pre_hooks
            or _module._global_backward_hooks
            or _module._global_forward_hooks
            or _module._global_forward_pre_hooks
            or m._compiled_call_impl is not None
            or type(m).forward is not self._forward
            or "forward" in m.__dict__
            or torch._C._get_tracing_state()
        ):
            return MISS
        return self._hit.call((m, *args), kwargs)


def module_hit_caller(
    module: torch.nn.Module, compiled_forward: object, backend: object, bucket: int | None
) -> ModuleHitCaller | None:
    """The guard-hit path of `module`, whose Dynamo-compiled call is `compiled_forward` (an
    OptimizedModule's `forward`), or None where it is not handled."""
    orig = getattr(compiled_forward, "_torchdynamo_orig_callable", None)
    if isinstance(orig, types.FunctionType) and orig.__code__ is _WRAP_INLINE_CODE:
        hit = hit_caller(orig, backend, bucket)
        return None if hit is None else ModuleHitCaller(hit, None, None)
    if (
        isinstance(orig, types.MethodType)
        and orig.__self__ is module
        and orig.__func__ is torch.nn.Module._wrapped_call_impl
    ):
        forward = type(module).forward
        hit = hit_caller(forward, backend, bucket)
        return None if hit is None else ModuleHitCaller(hit, module, forward)
    return None
