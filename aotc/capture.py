"""The default capture mode of `aotc.compile`: Dynamo captures the program, aotc compiles its graphs.

Stage: `capture(fn_or_module, options) -> DynamoFunction | DynamoModule`.
Requires: `options.capture is Capture.DYNAMO`.
Ensures: calls run through Dynamo (`torch._dynamo.optimize`, what `torch.compile` wraps) with a
backend of this object's own: every FX graph Dynamo captures (one per graph break, per
recompilation, per DDP bucket) is compiled by `aotc.backend.compile_graph` with these options, and
its record lands in this object's `records` (`aotc.inspect`). Everything Python-level is Dynamo's:
guards on Python values (module attributes, `dropout.p`, globals, optimizer hyper-parameters,
submodule identity), module hooks, Python side effects replayed after each call, graph breaks
around what it cannot trace, DDP's bucketed graphs, lazily created optimizer state.

Note [Dynamo capture]
~~~~~~~~~~~~~~~~~~~~~
Why Dynamo and not aotc's tracer by default: the tracer runs the program once on fake tensors and
keeps only the ATen ops, so anything the program *reads* from Python (a float attribute, a hook
dict, an optimizer's `lr`) is baked into the graph with no way to notice a change, and anything it
*does* in Python (append to a list, create optimizer state) happens once. Dynamo symbolically
executes the bytecode instead: each Python value it reads becomes a guard (a change recompiles),
each side effect is replayed after the graph runs, and what it cannot model splits the program
into graphs with eager Python in between. aotc keeps what it is good at: the functional joint
graph, the min-cut partition, the runtime wrappers and the kernels, applied to each Dynamo graph.

How options map (see docs/guide.md, "Capture modes"):
- `dynamic`: None (the default) is Dynamo's automatic dynamic: a graph is first compiled with
  static sizes, and a size that changes between calls recompiles it once with that dimension
  symbolic. False specializes every size (one graph per shape, as `aotc.compile` did before);
  True makes every dimension symbolic from the first call.
- `max_signatures`: Dynamo's recompile limit for this object's frames (counted for this object
  alone, `isolate_recompiles`). Past it Dynamo runs the frame eagerly (with its warning), as
  torch.compile does: correct, only not compiled. `recompile_warn_limit`: aotc warns once when a
  frame has been recompiled that many times, naming the last guard that failed.
- `recompile_reasons`: the guards that failed, as Dynamo words them, in order.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import inspect
import logging
import sys
import threading
import time
import types
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch

from aotc.dynamohit import MISS, hit_caller, module_hit_caller
from aotc.functional import FUNCTORCH_HOOKS_HINT, TRACING, refused_by_functorch
from aotc.hooks import has_own_hooks
from aotc.options import Capture, CompileOptions
from aotc.pipeline import CompiledRecord
from aotc.runtime.errors import AotcError, UnsupportedError
from aotc.wrapped_module import OriginalState

log = logging.getLogger("aotc.recompiles")
_OPTIMIZE_TAKES_LIMITS = (
    "isolate_recompiles" in inspect.signature(torch._dynamo.eval_frame._optimize).parameters
)
progress = logging.getLogger("aotc.progress")


class _Capture:
    """What one `aotc.compile` object shares with its Dynamo backend: options, name, the graphs
    compiled so far, the guard failures Dynamo reported."""

    def __init__(self, options: CompileOptions, name: str, owner: Any) -> None:
        self.options = dataclasses.replace(options, capture=Capture.DYNAMO)
        self.name = name
        self.graphs: list[Any] = []  # each has `.records` (a compiled graph or a lazy fallback)
        self.recompile_reasons: list[str] = []
        self._pending: list[str] = []
        self._owner = weakref.ref(owner)
        self._lock = threading.Lock()
        self._warned = False
        self._first_lock = threading.RLock()
        self.warm: frozenset[bool] = frozenset()  # grad modes a call has completed in
        # See Note [Global module hooks under Dynamo]
        self.hook_states: set[tuple[tuple[int, ...], ...] | None] = set()
        self.hooked = False  # some compile saw global hooks
        self.warned_hooks = False

    def backend(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        """Dynamo's backend protocol (see aotc/backend.py)."""
        from aotc.backend import compile_graph

        sound_guards_for_this_compile()
        _run_unconvertible_frames_eagerly()
        state = _global_hook_state()  # Note [Global module hooks under Dynamo]
        self.hook_states.add(state)
        self.hooked = self.hooked or state is not None
        with self._lock:
            reason = "; ".join(self._pending) if self._pending else None
            self._pending.clear()
        if reason is not None:
            self.recompile_reasons.append(reason)
            log.info("recompiling %s: %s", self.name, reason)
        n = len(self.graphs) + 1
        progress.info("aotc: compiling %s (graph %d) ...", self.name, n)
        start = time.perf_counter()
        run = compile_graph(
            gm, example_inputs, self.options, self.name, self._owner(), reason, self.graphs.append
        )
        progress.info(
            "aotc: compiled %s (graph %d) in %.2f s", self.name, n, time.perf_counter() - start
        )
        return run

    def guard_failed(self, failure: Any) -> None:
        """Dynamo's `guard_fail_fn`: called for each cached graph whose guard failed before a
        recompilation. Must not raise (Dynamo calls it while evaluating guards)."""
        # Dynamo appends the user's stack to each reason: keep the guard itself.
        reason = str(getattr(failure, "reason", failure)).split("\nUser stack trace")[0].strip()
        if "BACKEND_MATCH" in reason:
            # Another aotc.compile object of the same code ran into this one's cached graph
            # (Dynamo calls the guard_fail_fn the graph was compiled with): not a recompile here.
            return
        with self._lock:
            self._pending.append(reason)
        count = len(self.recompile_reasons) + 1
        if count >= self.options.recompile_warn_limit and not self._warned:
            self._warned = True
            warnings.warn(
                f"aotc: {self.name} recompiled {count} times; the last guard that failed: "
                f"{reason}. Frequent recompiles cost compile time (`recompile_reasons` lists "
                "every guard that failed; a Python flag or string that changes every call is a "
                "constant of each graph: pass it as a tensor).",
                stacklevel=2,
            )

    @property
    def records(self) -> list[CompiledRecord]:
        return [r for g in self.graphs for r in g.records]

    def first_call(self, call: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """The first call in each grad mode, one thread at a time (see Note [First calls from
        many threads]); later calls skip this (one frozenset lookup)."""
        install_callbacks()
        grad = torch.is_grad_enabled()
        with self._first_lock:
            out = call(*args, **kwargs)
            self.warm = self.warm | {grad}
            return out

    def optimize(self) -> Any:
        """The Dynamo context that compiles through this capture's backend."""
        dynamic = self.options.dynamic
        extra: dict[str, Any] = {}
        if _OPTIMIZE_TAKES_LIMITS:  # torch >= 2.13; before, Dynamo's global recompile limit
            extra = {"recompile_limit": self.options.max_signatures, "isolate_recompiles": True}
        return torch._dynamo.optimize(
            self.backend,
            dynamic=None if dynamic is None else bool(dynamic),
            guard_fail_fn=self.guard_failed,
            **extra,
        )


# Note [First calls from many threads]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Dynamo compiles one frame at a time, but threads that entered the frame while another compiled
# it compile it again afterwards (each adding a cache entry). The first call of an aotc.compile
# object in each grad mode therefore runs one thread at a time, so the others find the entry it
# made; once a call in that grad mode has returned, calls run concurrently.


# Note [Sound guards]
# ~~~~~~~~~~~~~~~~~~~
# Two of Dynamo's defaults trade soundness for guard speed: it does not guard on modules' hook
# dicts (a hook added after the first compile is never run: a stale graph), nor on parameters
# passed as two arguments aliasing each other. The default capture mode must not give a stale
# result, so for the compilations it owns those guards are on. A compile-start callback turns
# them on when one of this module's call frames is on the stack (a frame Dynamo compiles inside
# a call of an aotc.compile object, graph or not), the backend does too (it runs in the middle of
# each compilation, before Dynamo builds the guards), and the compile-end callback puts the
# user's settings back. Dynamo compiles one frame at a time under its compile lock, so other
# torch.compile users see their own settings. (Flipping the settings around every call instead
# would cost ~10 us a call.)
_SOUND = {"skip_nnmodule_hook_guards": False, "skip_no_tensor_aliasing_guards_on_parameters": False}
_saved_config: dict[str, object] | None = None
# ids of the call paths of this module's objects (filled below): compared by identity, since
# hashing a code object hashes its constants, and Dynamo's generated codes may hold a dict there
_CALL_CODES: set[int] = set()


def sound_guards_for_this_compile() -> None:
    """See Note [Sound guards]. Called inside a Dynamo compilation."""
    global _saved_config
    install_callbacks()
    if _saved_config is None:
        config = torch._dynamo.config
        _saved_config = {k: getattr(config, k) for k in _SOUND}
        for k, v in _SOUND.items():
            setattr(config, k, v)


def install_callbacks() -> None:
    """Register the compile-start/end callbacks (again after `torch._dynamo.reset()`, which
    clears Dynamo's callbacks): called on every first call and every compile."""
    handler = torch._dynamo.callback.callback_handler
    if _on_compile_start not in handler.start_callbacks:
        handler.register_start_callback(_on_compile_start)
    if _restore_config not in handler.end_callbacks:
        handler.register_end_callback(_restore_config)


def _on_compile_start(_args: object = None) -> None:
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        if id(frame.f_code) in _CALL_CODES:
            sound_guards_for_this_compile()
            _run_unconvertible_frames_eagerly()
            _keep_unmaterialized_functions_eager()
            _read_the_exporting_flag()
            return
        frame = frame.f_back


# Note [Frames Dynamo cannot convert]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Dynamo itself fails on some frames eager runs: its fake-tensor copy of an input can fail an
# internal assertion (a view whose base had its metadata changed in place by an earlier frame,
# `b.t_()` on one of two views of a buffer), and an aotc backend failure surfaces as
# BackendCompilerFailed. torch.compile raises those; `aotc.compile` must behave as eager, so for
# frames converted inside a call of one of its objects, Dynamo's `suppress_errors` is on: the
# frame that failed to convert runs eagerly, before any of it ran (the conversion precedes the
# frame's execution), with Dynamo's warning naming the frame and the error. The setting is a
# ContextVar override set by the compile-start callback (only this thread, only while such a call
# is on the stack) and reset when that call returns (one list check per call); setting the
# global config around every call would cost ~10 us a call. A torch whose config entries hold no
# ContextVar (2.11) gets the global setting instead, on while any thread holds the suppression
# and restored when the last releases it (other threads' compiles in that window suppress too).
_SUPPRESS_ERRORS: Any = None
_GLOBAL_SETTING = object()  # _SUPPRESS_ERRORS when this torch's config has no ContextVar override
_global_saved: list[Any] = []  # the config value before the first thread's global override
_suppress_state = threading.local()
_suppressing = [0]  # threads holding an override: calls check this before looking further
_suppress_lock = threading.Lock()


def _run_unconvertible_frames_eagerly() -> None:
    """See Note [Frames Dynamo cannot convert]. Called inside a Dynamo compilation."""
    global _SUPPRESS_ERRORS
    if _SUPPRESS_ERRORS is None:
        entries = getattr(torch._dynamo.config, "_config", None)
        entry = entries.get("suppress_errors") if isinstance(entries, dict) else None
        override = getattr(entry, "user_override", None)
        _SUPPRESS_ERRORS = (
            override if isinstance(override, contextvars.ContextVar) else _GLOBAL_SETTING
        )
    if getattr(_suppress_state, "token", None) is not None:
        return
    with _suppress_lock:
        if _SUPPRESS_ERRORS is _GLOBAL_SETTING:
            if _suppressing[0] == 0:
                _global_saved[:] = [torch._dynamo.config.suppress_errors]
                torch._dynamo.config.suppress_errors = True
            _suppress_state.token = _GLOBAL_SETTING
        else:
            _suppress_state.token = _SUPPRESS_ERRORS.set(True)
        _suppressing[0] += 1


def _release_suppression() -> None:
    """Undo `_run_unconvertible_frames_eagerly` for this thread, once its call returns."""
    token = getattr(_suppress_state, "token", None)
    if token is None:
        return
    _suppress_state.token = None
    with _suppress_lock:
        _suppressing[0] -= 1
        if token is _GLOBAL_SETTING:
            if _suppressing[0] == 0 and _global_saved:
                torch._dynamo.config.suppress_errors = _global_saved.pop()
            return
    try:
        _SUPPRESS_ERRORS.reset(token)
    except ValueError:  # set in another context (should not happen): clear the override
        _SUPPRESS_ERRORS.set(torch.utils._config_module._UNSET_SENTINEL)


# Note [Functions that leave gradients unmaterialized]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# An autograd.Function whose forward calls `ctx.set_materialize_grads(False)` gets None, not
# zeros, for the gradient of an output the loss does not use, and may return None for an input
# (`y.grad` stays None in eager). Dynamo traces the call as a store to the ctx it does not act on:
# its graph materializes zeros, and `y.grad` becomes a zero tensor (`torch.compile(backend=
# "eager")` does the same). For the frames converted inside a call of an aotc.compile object, the
# compile-start callback swaps `FunctionCtx.set_materialize_grads` for a wrapper that calls the
# original through `torch._dynamo.disable` when the value is False, so Dynamo cannot trace that
# call: the Function's apply becomes a graph break and runs eagerly, with eager's None. The compile-end callback puts the original back. The wrapper
# does the same as the original when called outside Dynamo (another thread running eager code
# meanwhile sees no change). Strict mode traces the Function with eager's autograd and needs
# nothing. Not covered: a forward assigning `ctx.materialize_grads = False` directly.
_FunctionCtx = torch.autograd.function.FunctionCtx
_MATERIALIZE: Any = _FunctionCtx.__dict__.get("set_materialize_grads")
_materialize_swapped = [False]


def _keep_unmaterialized_functions_eager() -> None:
    """See Note [Functions that leave gradients unmaterialized]. Called at a compile's start."""
    if _MATERIALIZE is None or _materialize_swapped[0]:
        return
    _FunctionCtx.set_materialize_grads = _set_materialize_grads  # type: ignore[method-assign]
    _materialize_swapped[0] = True


def _set_materialize_grads(self: Any, value: bool) -> None:
    # Dynamo inlines this and reads `value` as a constant: only False breaks the graph
    if value:
        _MATERIALIZE(self, value)
    else:
        _untraceable_materialize(self, value)


_untraceable_materialize = torch._dynamo.disable(_MATERIALIZE)


# Note [torch.compiler.is_exporting() under Dynamo]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch 2.11's Dynamo folds `torch.compiler.is_exporting()` to the constant True in every frame
# it traces, torch.export or not (its table of tracing-state functions; torch 2.13 reads the real
# flag, `torch.compiler._is_exporting_flag`). A program that branches on it took the export branch
# under the default capture mode, where eager takes the other: Hugging Face's masks never skip the
# causal mask then (SDPA got an explicit mask instead of `is_causal=True`), and a Llama, Mixtral
# or T5 training step under CPU bf16 autocast came out with gradients a rounding away from
# eager's (`torch.compile(backend="eager")` does the same). For the frames converted inside a call
# of an aotc.compile object, the compile-start callback puts the real flag into that table (False
# outside torch.export, which sets the flag), and the compile-end callback puts True back.
# Dynamo compiles one frame at a time under its compile lock, so no other compilation reads the
# table meanwhile. On a torch that reads the flag itself the table entry is not consulted.
_exporting_saved: list[object] = []  # the table's entry while aotc's compile replaced it


def _tracing_state_table() -> dict[Any, Any] | None:
    """Dynamo's table of the values it folds tracing-state functions to (None if none)."""
    from torch._dynamo.variables import torch as torch_variables

    table = getattr(torch_variables, "tracing_state_functions", lambda: None)()
    return table if isinstance(table, dict) else None


def _read_the_exporting_flag() -> None:
    """See Note [torch.compiler.is_exporting() under Dynamo]. Called at a compile's start."""
    table = _tracing_state_table()
    is_exporting = torch.compiler.is_exporting
    if table is None or is_exporting not in table or _exporting_saved:
        return
    _exporting_saved.append(table[is_exporting])
    table[is_exporting] = torch.compiler._is_exporting_flag


def _restore_config(_args: object = None) -> None:
    global _saved_config
    if _materialize_swapped[0]:  # Note [Functions that leave gradients unmaterialized]
        _FunctionCtx.set_materialize_grads = _MATERIALIZE  # type: ignore[method-assign]
        _materialize_swapped[0] = False
    table = _tracing_state_table() if _exporting_saved else None
    if table is not None:  # Note [torch.compiler.is_exporting() under Dynamo]
        table[torch.compiler.is_exporting] = _exporting_saved.pop()
    if _saved_config is not None:
        for k, v in _saved_config.items():
            setattr(torch._dynamo.config, k, v)
        _saved_config = None


_transforms_active = torch._C._are_functorch_transforms_active

# Note [Global module hooks under Dynamo]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# `nn.modules.module.register_module_forward_hook` (and the pre/backward variants) add hooks that
# eager runs for every module call. Dynamo traces the ones registered when it compiles into the
# graph, but installs no guard on the global hook dicts: a hook added or removed later is
# silently skipped or still run by the cached graph. So every compile records the global hooks
# it saw (`_Capture.hook_states`: the hook ids of each dict), and a call goes through the
# compiled graphs only while the global hooks are those every compile saw; otherwise it runs the
# program eagerly, as eager would with those hooks, and says so once. The check is four dict
# truth tests while no global hook is registered or was at a compile. A DynamoModule is itself
# an nn.Module, so `nn.Module.__call__` would run the global hooks once more for the wrapper:
# its `__call__` skips them there (the original module's call inside runs them, as in eager).
_module_globals = torch.nn.modules.module
_GLOBAL_HOOKS = tuple(
    getattr(_module_globals, name)
    for name in (
        "_global_forward_pre_hooks",
        "_global_forward_hooks",
        "_global_backward_pre_hooks",
        "_global_backward_hooks",
    )
    if isinstance(getattr(_module_globals, name, None), dict)
)


def _global_hook_state() -> tuple[tuple[int, ...], ...] | None:
    """The ids of the registered global module hooks, or None when there are none."""
    if not any(_GLOBAL_HOOKS):
        return None
    return tuple(tuple(d) for d in _GLOBAL_HOOKS)


def _hooks_moved(capture: _Capture, stacklevel: int = 3) -> bool:
    """See Note [Global module hooks under Dynamo]: True if this call must run eagerly. Callers
    ask only when `capture.hooked` or a global hook is registered."""
    now = _global_hook_state()
    if not capture.hook_states:
        if not capture.graphs:
            return False  # nothing compiled yet: the compile records these hooks
        capture.hook_states = {None}  # compiled before any global hook existed
    if capture.hook_states == {now}:
        return False
    if not capture.warned_hooks:
        capture.warned_hooks = True
        warnings.warn(
            f"aotc: {capture.name}: the global module hooks changed since it was compiled "
            "(nn.modules.module.register_module_forward_hook and friends); Dynamo's graphs do "
            "not guard them, so this call and later ones run eagerly, as eager would with these "
            "hooks. Register global hooks before the first call to keep compiled calls.",
            stacklevel=stacklevel,
        )
    return True


def _has_own_hooks(module: torch.nn.Module) -> bool:
    return has_own_hooks(module) or getattr(module, "_compiled_call_impl", None) is not None


def _functorch_refusal(e: RuntimeError, name: str) -> None:
    """A torch.func transform in the program refused the user's saved-tensor hooks (as in
    eager). Dynamo's trace of it stops after its graph disabled the hooks, leaving them disabled
    for the process: enable them again (they were enabled, or the user could not have pushed
    any), and say what happened. Off the per-call path: only on an exception."""
    if not refused_by_functorch(e) or isinstance(e, AotcError):
        return
    torch._C._autograd._saved_tensors_hooks_enable()
    raise UnsupportedError(f"{name}: {str(e).splitlines()[0]} {FUNCTORCH_HOOKS_HINT}") from e


class DynamoFunction:
    """A function compiled by aotc through Dynamo (the default capture mode). Call it like the
    original; `aotc.inspect` lists every graph compiled for it."""

    def __deepcopy__(self, memo: dict[int, Any]) -> DynamoFunction:
        return self  # like the function it wraps (copy.deepcopy of a dict holding it)

    def __init__(self, fn: Callable[..., Any], options: CompileOptions, name: str) -> None:
        self._fn = fn
        self._name = name
        self._options = options
        self._capture = _Capture(options, name, self)
        context = self._capture.optimize()
        self._call = context(fn)
        # See Note [Calls after a Dynamo guard hit]
        self._hit = hit_caller(
            fn, self._capture.backend, getattr(context, "_isolate_recompiles_id", None)
        )
        functools.update_wrapper(self, fn, updated=())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Note [Compiled functions under torch.func] in aotc/api.py; Note [Compiled functions
        # called while aotc traces] in aotc/functional.py
        if _transforms_active() or (TRACING.anywhere and TRACING.active):
            return self._fn(*args, **kwargs)
        capture = self._capture
        if (capture.hooked or any(_GLOBAL_HOOKS)) and _hooks_moved(capture):
            return self._fn(*args, **kwargs)  # Note [Global module hooks under Dynamo]
        try:
            if torch.is_grad_enabled() in capture.warm:
                if self._hit is not None:
                    result = self._hit.call(args, kwargs)
                    if result is not MISS:
                        return result
                return self._call(*args, **kwargs)
            return capture.first_call(self._call, args, kwargs)
        except RuntimeError as e:
            _functorch_refusal(e, self._name)
            raise
        finally:
            if _suppressing[0]:  # See Note [Frames Dynamo cannot convert]
                _release_suppression()

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        """`@aotc.compile` on a method (also `nn.Module.forward`): see aotc.api.bind_method."""
        from aotc.api import bind_method

        return bind_method(
            self, obj, lambda bound: DynamoFunction(bound, self._options, self._name)
        )

    @property
    def records(self) -> list[CompiledRecord]:
        return self._capture.records

    @property
    def recompile_reasons(self) -> list[str]:
        return list(self._capture.recompile_reasons)

    def __repr__(self) -> str:
        return f"<aotc.DynamoFunction {self._name}>"


class DynamoModule(OriginalState):
    """An nn.Module whose calls run through Dynamo and aotc (the default capture mode). Shares the
    original's live parameters and buffers: state_dict, parameters(), train()/eval(), attribute
    reads and writes go to the original. Its forward hooks, pre-hooks and full backward hooks run
    as in eager (the original's `__call__` is what Dynamo compiles)."""

    _own_attributes = frozenset(
        {"_orig_mod", "_capture", "_optimized", "_hit", "_name", "_options", "training"}
    )

    def __init__(self, module: torch.nn.Module, options: CompileOptions) -> None:
        super().__init__()
        self._orig_mod = module
        name = type(module).__name__
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_options", options)
        object.__setattr__(self, "_capture", _Capture(options, name, self))
        # Dynamo's own module wrapper decides how the call is entered (hooks run in the
        # original's `__call__`; built-in modules get a frame Dynamo can capture). Only its
        # `forward` is used: the wrapper is not registered, so it adds no parameters.
        context = self._capture.optimize()
        object.__setattr__(self, "_optimized", context(module))
        # See Note [Calls after a Dynamo guard hit]
        object.__setattr__(
            self,
            "_hit",
            module_hit_caller(
                module,
                self._optimized.forward,
                self._capture.backend,
                getattr(context, "_isolate_recompiles_id", None),
            ),
        )
        self.training = module.training

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # See Note [Global module hooks under Dynamo]: the wrapper runs no global hooks itself
        # (without hooks of its own, `nn.Module.__call__` would only call `forward`).
        if not _has_own_hooks(self):
            return self.forward(*args, **kwargs)
        return super().__call__(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # Note [Compiled functions under torch.func] in aotc/api.py; Note [Compiled functions
        # called while aotc traces] in aotc/functional.py
        if _transforms_active() or (TRACING.anywhere and TRACING.active):
            return self._orig_mod(*args, **kwargs)
        capture = self._capture
        if (capture.hooked or any(_GLOBAL_HOOKS)) and _hooks_moved(capture, 4):
            return self._orig_mod(*args, **kwargs)  # Note [Global module hooks under Dynamo]
        try:
            if torch.is_grad_enabled() in capture.warm:
                if self._hit is not None:
                    result = self._hit.call(args, kwargs)
                    if result is not MISS:
                        return result
                return self._optimized.forward(*args, **kwargs)
            return capture.first_call(self._optimized.forward, args, kwargs)
        except RuntimeError as e:
            _functorch_refusal(e, self._name)
            raise
        finally:
            if _suppressing[0]:  # See Note [Frames Dynamo cannot convert]
                _release_suppression()

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["_orig_mod"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        # The wrapper's own state (and nn.Module's, set by its methods) stays here; the rest
        # (a swapped submodule, a changed hyper-parameter) goes to the original, where the
        # compiled program reads it.
        if (
            name in DynamoModule._own_attributes
            or name in self.__dict__
            or "_orig_mod" not in self.__dict__.get("_modules", {})
        ):
            super().__setattr__(name, value)
        else:
            setattr(self._orig_mod, name, value)

    def __delattr__(self, name: str) -> None:
        if name in DynamoModule._own_attributes:
            super().__delattr__(name)
        else:
            delattr(self._orig_mod, name)

    @property
    def records(self) -> list[CompiledRecord]:
        return self._capture.records

    @property
    def recompile_reasons(self) -> list[str]:
        return list(self._capture.recompile_reasons)


_CALL_CODES.update(
    id(code)
    for code in (
        DynamoFunction.__call__.__code__,
        DynamoModule.forward.__code__,
        _Capture.first_call.__code__,
    )
)


def capture(fn: Any, options: CompileOptions, name: str) -> DynamoFunction | DynamoModule:
    install_callbacks()
    if isinstance(fn, torch.nn.Module):
        return DynamoModule(fn, options)
    return DynamoFunction(fn, options, name)
