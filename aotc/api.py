"""Public API: `aotc.compile` (decorator or wrapper, functions and nn.Modules) and `aotc.inspect`.

A compiled function flattens its arguments, appends the tensors it lifted (closures, globals,
module parameters and buffers), and hands the leaves to a `Dispatcher`, which finds or compiles the
entry for their signature. See aotc/pipeline.py for what a compilation does.
"""

from __future__ import annotations

import functools
import inspect as pyinspect
import logging
import threading
import time
import types
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Never, TypedDict, Unpack, cast, overload

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode

from aotc.dataclasstree import flatten_tree
from aotc.functional import TRACING
from aotc.hooks import call_with_hooks, forward_override, has_hooks
from aotc.lifting import (
    Lifted,
    StateCreated,
    find_free_tensors,
    lifted_reader,
    module_accesses,
    module_training_flags,
    swapped,
)
from aotc.options import Backend, Capture, CompileOptions, Partitioner, configure_logging
from aotc.passes.recompute import RecomputePolicy
from aotc.pipeline import CompiledRecord, compile_signature
from aotc.recording import Recorder, refuse_distributed
from aotc.runtime.convention import alias_groups
from aotc.runtime.errors import UnsupportedError
from aotc.runtime.guards import MISS
from aotc.runtime.stateguard import (
    Compare,
    GuardedDispatcher,
    GuardItem,
    History,
    Retry,
    StateGuard,
)
from aotc.runtime.wrappers import COMPILE_LOCK, CompiledEntry
from aotc.strict import build_state_guard, report_side_effects
from aotc.symbolic import (
    check_static_geometry,
    guard_expression,
    static_guard_expression,
    symbolic_leaves,
    symbolic_mode,
)
from aotc.usercode import MISSING
from aotc.wrapped_module import OriginalState

Tensor = torch.Tensor
_PLAIN_TENSOR = frozenset((Tensor,))
_NO_OBJECTS: Any = object()  # `_objects_bound`: the call has no module or optimizer argument
_transforms_active = torch._C._are_functorch_transforms_active

# Note [Compiled functions under torch.func]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch.func.grad, vjp, jvp, jacrev, jacfwd, hessian and vmap work on tensors wrapped per
# transform level, and differentiate or batch every ATen op the function runs. A compiled entry
# cannot take part: its autograd.Function has no functorch rules (setup_context, jvp, vmap), its
# backward graph is not differentiable, and its Triton kernels cannot be batched. So a strict-mode
# call made while any transform is active runs the user's Python function itself (lifted state
# is read live, as in eager), which gives exactly eager's results, gradients and mutations; the
# first such call is logged (AOTC_LOG=progress). The check is one C call per call (~70 ns). The
# default capture mode (aotc/capture.py) makes the same check: Dynamo would give the same result
# (its guards include the functorch stack, and it runs a frame called inside a transform eagerly)
# but pays a failed guard and a cache lookup per call (~0.3 ms measured, bench/func_transforms.py).
# torch.compile(backend="aotc") gets Dynamo's behaviour. A body that calls torch.func transforms
# itself is traced: see Note [Traces under torch.func] in aotc/functional.py.
progress = logging.getLogger("aotc.progress")
configure_logging()  # AOTC_LOG, once the compiler is first used

# Called with (compiled function, record, recompile reason or None) after every compilation.
COMPILE_LISTENERS: list[Callable[[CompiledFunction, CompiledRecord, str | None], None]] = []


class CompiledFunction:
    """A function compiled by aotc in strict mode (`capture="trace"`). Call it like the
    original. See Note [Strict capture guards] in aotc/strict.py for what a compiled entry is
    specialized on and how a call checks it."""

    def __deepcopy__(self, memo: dict[int, Any]) -> CompiledFunction:
        return self  # like the function it wraps (copy.deepcopy of a dict holding it)

    def __init__(
        self,
        fn: Callable[..., Any],
        options: CompileOptions,
        lifted: Lifted,
        name: str,
        extra_key: Callable[[], object] | None = None,
        source: str | None = None,
        *,
        relift: Callable[[], Lifted] | None = None,
        roots: Callable[[Recorder], None] | None = None,
        module: torch.nn.Module | None = None,
    ) -> None:
        self._fn = fn
        self._source = source or _source_of(fn)
        self._options = options
        self._extra_key = extra_key
        self._name = name
        self._relift = relift or functools.partial(find_free_tensors, fn)
        self._roots = roots or functools.partial(_function_roots, fn)
        self._module = module  # a CompiledModule's module: its own hooks run eagerly
        self._history = History()
        self._gens: list[_Generation] = []
        self._eager_runs = 0
        self._ran_eagerly = False  # the last call that needed a compilation ran eagerly
        self._warned_transform = False  # logged a call under a torch.func transform
        self._gen = self._generation(lifted)
        # See Note [Modules and optimizers as arguments]: (positions, names, ids) -> function
        self._with_objects: dict[tuple[object, ...], CompiledFunction] = {}
        functools.update_wrapper(self, fn, updated=())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # The entry that ran last, when its call was of plain tensors only: its probe checks
        # everything the key would (and that no transform is active), see Note [Fused guard and
        # call] in runtime/guards.py; MISS sends the call down the general path below.
        probe = self._gen.dispatch.plain_probe
        if probe is not None and not kwargs:
            try:
                out = probe(args)
            except (Retry, StateCreated) as e:
                return self._recover(e, args, kwargs, 0)
            if out is not MISS:
                return out
        if _transforms_active():  # See Note [Compiled functions under torch.func]
            return self._under_transform(args, kwargs)
        if (
            TRACING.anywhere and TRACING.active
        ):  # Note [Compiled functions called while aotc traces]
            return self._fn(*args, **kwargs)
        if not kwargs and {*map(type, args)} <= _PLAIN_TENSOR:  # every arg a plain Tensor
            leaves: list[object] = list(args)
            spec: object = len(args)
        else:
            bound = self._objects_bound(args, kwargs)
            if bound is not _NO_OBJECTS:
                return bound
            leaves, spec = flatten_tree((args, kwargs))  # Note [Dataclasses as pytree nodes]
        gen = self._gen
        if gen.read is not None:
            try:
                leaves.extend(gen.read())  # Note [Lifted reads and swaps across threads]
            except Exception as e:  # a lifted location moved (an untied weight, state cleared)
                return self._recover(e, args, kwargs, 0)
        extra = (spec, self._extra_key()) if self._extra_key is not None else spec
        try:
            return gen.dispatch.run(leaves, extra)
        except (Retry, StateCreated) as e:
            return self._recover(e, args, kwargs, 0)
        except RuntimeError:
            lazy = _uninitialized(leaves, gen)
            if lazy is None:
                raise
            return self._recover(lazy, args, kwargs, 0)

    def _objects_bound(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """See Note [Modules and optimizers as arguments]: the call's result through the compiled
        function with this call's module and optimizer arguments bound, or `_NO_OBJECTS` if it
        has none (the result itself may be None: an update function returning nothing)."""
        positions = tuple(i for i, a in enumerate(args) if isinstance(a, _BOUND_TYPES))
        names = tuple(k for k, v in kwargs.items() if isinstance(v, _BOUND_TYPES))
        if not positions and not names:
            return _NO_OBJECTS
        objects = tuple(args[i] for i in positions) + tuple(kwargs[k] for k in names)
        key = (positions, names, tuple(map(id, objects)))
        compiled = self._with_objects.get(key)
        if compiled is None or any(a is not b for a, b in zip(compiled._fn.objects, objects)):  # type: ignore[attr-defined]
            compiled = self._bind_objects(positions, names, objects)
            self._with_objects[key] = compiled
            while len(self._with_objects) > _MAX_BOUND_OBJECTS:
                del self._with_objects[next(iter(self._with_objects))]
        rest = tuple(a for i, a in enumerate(args) if i not in positions)
        others = {k: v for k, v in kwargs.items() if k not in names}
        return compiled(*rest, **others)

    def _bind_objects(
        self, positions: tuple[int, ...], names: tuple[str, ...], objects: tuple[object, ...]
    ) -> CompiledFunction:
        fn = self._fn
        program = _WithObjects(fn, positions, names, objects)
        labels = _argument_labels(fn, positions, names)
        bound = tuple(zip(labels, objects))

        def roots(recorder: Recorder) -> None:
            self._roots(recorder)
            for label, obj in bound:
                recorder.track(obj, f"argument {label}")

        return CompiledFunction(
            program,
            self._options,
            find_free_tensors(fn, bound),
            self._name,
            self._extra_key,
            self._source,
            relift=functools.partial(find_free_tensors, fn, bound),
            roots=roots,
            module=self._module,
        )

    def _under_transform(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call inside torch.func.grad/vmap/jvp/...: run the user's function itself."""
        if not self._warned_transform:
            self._warned_transform = True
            progress.info(
                "aotc: %s is called inside a torch.func transform (%s); it runs the Python "
                "function there, so the transform sees eager's ops",
                self._name,
                torch._C._functorch.peek_interpreter_stack().key().name,
            )
        return self._fn(*args, **kwargs)

    def _recover(self, error: Exception, args: tuple[Any, ...], kwargs: dict[str, Any],
                 attempt: int) -> Any:  # fmt: skip
        """The slow path of a call: the program created state (run it eagerly once), or the
        objects it reads tensors from changed (lift again, see Note [Strict capture guards])."""
        if isinstance(error, StateCreated):
            if self._ran_eagerly or self._eager_runs >= _MAX_EAGER_RUNS:
                raise UnsupportedError(
                    f"{self._name}: {error} It did so again right after an eager call that "
                    "created state; strict mode compiles only programs whose state exists "
                    "before the call. Use the default capture mode."
                ) from error
            self._ran_eagerly = True  # until a compilation succeeds
            self._eager_runs += 1
            progress.info(
                "aotc: %s creates state on this call (%s); running it eagerly, compiling on the "
                "next call",
                self._name,
                str(error).split(";")[0],
            )
            return self._fn(*args, **kwargs)
        if attempt >= _MAX_RELIFTS:
            raise UnsupportedError(
                f"{self._name}: the objects it reads tensors from keep changing between reading "
                f"them and compiling ({error}); strict mode cannot pin them down. Use the "
                "default capture mode."
            ) from error
        if not isinstance(error, Retry):
            with COMPILE_LOCK:
                self._history.pending = (
                    f"the tensors it reads moved ({type(error).__name__}: {error}); lifted again"
                )
                self._switch(self._relift())
        gen = self._gen
        leaves, tree = flatten_tree((args, kwargs))  # Note [Dataclasses as pytree nodes]
        # A flat call of plain tensors is keyed by its arity (no spec to compare).
        spec: pytree.TreeSpec | int = tree
        if not kwargs and {*map(type, args)} <= _PLAIN_TENSOR:
            spec = len(args)
        if gen.read is not None:
            try:
                leaves.extend(gen.read())
            except Exception as e:
                return self._recover(e, args, kwargs, attempt + 1)
        extra = (spec, self._extra_key()) if self._extra_key is not None else spec
        try:
            return gen.dispatch.run(leaves, extra)
        except (Retry, StateCreated) as e:
            return self._recover(e, args, kwargs, attempt + 1)
        except RuntimeError:
            lazy = _uninitialized(leaves, gen)
            if lazy is None:
                raise
            return self._recover(lazy, args, kwargs, attempt + 1)

    def _generation(self, lifted: Lifted) -> _Generation:
        gen = _Generation(lifted)
        options = self._options
        compile_entry = functools.partial(
            self._compile_symbolic if options.dynamic else self._compile_static, gen
        )
        gen.dispatch = GuardedDispatcher(
            compile_entry,
            self._name,
            options.recompile_warn_limit,
            options.max_signatures,
            self._history,
            symbolic=bool(options.dynamic),
        )
        self._gens.append(gen)
        del self._gens[:-_MAX_GENERATIONS]
        return gen

    def _switch(self, lifted: Lifted) -> None:
        """Make `lifted` the current lifting: a generation lifted the same way before, or a new
        one (its entries keyed apart, since its leaves mean other things)."""
        fingerprint = lifted.fingerprint()
        for gen in self._gens:
            if gen.fingerprint == fingerprint:
                self._gen = gen
                return
        self._gen = self._generation(lifted)

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        """`@aotc.compile` on a method: see `bind_method`."""
        return bind_method(
            self,
            obj,
            lambda bound: CompiledFunction(
                bound, self._options, find_free_tensors(bound), self._name, source=self._source
            ),
        )

    @property
    def records(self) -> list[CompiledRecord]:
        own = [e.record for gen in self._gens for e in gen.dispatch.entries]  # type: ignore[attr-defined]
        return own + [r for c in self._with_objects.values() for r in c.records]

    @property
    def _dispatch(self) -> GuardedDispatcher:
        """The dispatcher of the current lifting (diagnostics and tests)."""
        return self._gen.dispatch

    @property
    def recompile_reasons(self) -> list[str]:
        own = list(self._history.reasons)
        return own + [r for c in self._with_objects.values() for r in c.recompile_reasons]

    def _compile_symbolic(
        self, gen: _Generation, leaves: list[object], key: tuple[object, ...]
    ) -> tuple[CompiledEntry, str | None, StateGuard | None]:
        """dynamic=True: trace once with symbolic sizes for the user's tensor arguments (see
        Note [Symbolic compilations] in aotc/symbolic.py)."""
        self._check_lifting(gen)
        mode = symbolic_mode()
        num_user = len(leaves) - len(gen.lifted.accesses)
        fakes = symbolic_leaves(mode, leaves, [i < num_user for i in range(len(leaves))])
        try:
            entry, guard = self._compile(gen, leaves, key, fakes, mode)
            check_static_geometry(entry.plan.epilogue, self._name)
            _refuse_mutated_aliases(entry, leaves, self._name)
        except UnsupportedError as e:
            # See Note [Static entries under dynamic=True] in aotc/symbolic.py
            progress.info("aotc: %s: static entry for these sizes (%s)", self._name, e)
            entry, guard = self._compile(gen, leaves, key)
            return entry, static_guard_expression(leaves), guard
        return entry, guard_expression(mode, fakes), guard

    def _compile_static(
        self, gen: _Generation, leaves: list[object], key: tuple[object, ...]
    ) -> tuple[CompiledEntry, str | None, StateGuard | None]:
        self._check_lifting(gen)
        entry, guard = self._compile(gen, leaves, key)
        return entry, None, guard

    def _check_lifting(self, gen: _Generation) -> None:
        """Before compiling, lift again: if the tensors now sit elsewhere (a swapped submodule,
        optimizer state created since), switch to that lifting and have the call retried."""
        fresh = self._relift()
        if fresh.fingerprint() != gen.fingerprint:
            self._switch(fresh)
            raise Retry

    def _compile(
        self,
        gen: _Generation,
        leaves: list[object],
        key: tuple[object, ...],
        fakes: list[object] | None = None,
        fake_mode: FakeTensorMode | None = None,
    ) -> tuple[CompiledEntry, StateGuard | None]:
        extra = key[0]
        spec = extra[0] if self._extra_key is not None else extra  # type: ignore[index]
        lifted = gen.lifted
        num_lifted = len(lifted.accesses)
        num_user = len(leaves) - num_lifted
        if isinstance(spec, int):
            in_spec = pytree.tree_flatten((tuple(leaves[:num_user]), {}))[1]
        else:
            assert isinstance(spec, pytree.TreeSpec), spec
            in_spec = spec
        names = _leaf_names(self._fn, in_spec, num_user) + gen.names
        fn = self._fn

        _mark_user_code(fn)
        recorder = Recorder(self._name, exempt_hooks=self._module)
        self._roots(recorder)
        for name, leaf in zip(names, leaves[:num_user]):
            if not isinstance(leaf, torch.Tensor):
                recorder.track(leaf, f"argument {name}")
        lifting = _lifting_containers(lifted)

        def program(user_leaves: list[object]) -> tuple[list[object], object]:
            args, kwargs = pytree.tree_unflatten(user_leaves[:num_user], in_spec)
            recorder.inputs = {
                id(t): (name, i < num_user)
                for i, (name, t) in enumerate(zip(names, user_leaves))
                if isinstance(t, torch.Tensor)
            }
            with swapped(lifted, user_leaves[num_user:]), recorder.run(lifting):
                out = recorder.call(fn, args, kwargs)  # checks what it did to args and outputs
            return _flatten_output(out)

        def backward_state(user_leaves: list[object]) -> AbstractContextManager[None]:
            """See Note [State during the traced backward] in aotc/tracer.py."""
            return swapped(lifted, user_leaves[num_user:])

        program.aotc_backward_state = backward_state  # type: ignore[attr-defined]

        n = self._history.count + 1
        progress.info("aotc: compiling %s (signature %d) ...", self._name, n)
        start = time.perf_counter()
        entry = compile_signature(
            program,
            fakes if fakes is not None else leaves,
            names,
            self._options,
            self._name,
            self._source,
            fake_mode,
        )
        self._ran_eagerly = False
        guard = build_state_guard(recorder, lifted, self._name)
        if self._module is not None:
            guard = _with_forward_override(guard, self._module)
        report_side_effects(recorder)
        if guard is not None:
            # The state guard exists only once the compilation's runs are over, after the
            # record was built; set the text in place (replace() would decode a cache hit's
            # deferred graphs).
            record = entry.record
            object.__setattr__(
                record,
                "guards",
                f"{record.guards}\n# Python state the program read (strict mode)\n"  # type: ignore[attr-defined]
                f"{guard.format()}",
            )
        progress.info(
            "aotc: compiled %s (signature %d) in %.2f s", self._name, n, time.perf_counter() - start
        )
        reason = self._history.reasons[-1] if n > 1 and self._history.reasons else None
        for listener in COMPILE_LISTENERS:
            listener(self, entry.record, reason)  # type: ignore[arg-type]
        return entry, guard


class _Generation:
    """One way of lifting the function's tensors, and the entries compiled with it."""

    __slots__ = ("lifted", "fingerprint", "read", "names", "dispatch")

    def __init__(self, lifted: Lifted) -> None:
        self.lifted = lifted
        self.fingerprint = lifted.fingerprint()
        self.read = lifted_reader(lifted.accesses) if lifted.accesses else None
        self.names = [a.name for a in lifted.accesses]
        self.dispatch: GuardedDispatcher


_MAX_EAGER_RUNS = 8  # eager calls of one function that created state (new param groups...)
_MAX_RELIFTS = 4  # liftings one call may go through before giving up
_MAX_GENERATIONS = 16  # liftings whose entries are kept
_MAX_BOUND_OBJECTS = 8  # module/optimizer argument combinations whose compilations are kept
_BOUND_TYPES = (torch.nn.Module, torch.optim.Optimizer)

# Note [Modules and optimizers as arguments]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A training step is often written `step(model, opt, x, y)`: the model and the optimizer come in
# as arguments, not through a closure. Their tensors (parameters, buffers, gradients, optimizer
# state) are read by the program without being arguments themselves, so they must be lifted
# exactly like a closure's (aotc/lifting.py), and the lifting depends on which objects the call
# passes. A call whose top-level arguments include nn.Modules or optimizers therefore goes
# through a compiled function of its own per combination of those objects (by identity, the
# last `_MAX_BOUND_OBJECTS` kept): the program with the objects bound at their positions
# (`_WithObjects`), lifted from them as roots (locations named `argument model.lin.weight`), its
# Python state guarded from them (they are tracked like closure values), and its remaining
# arguments keyed as usual. A module passed inside a container (a list of modules) is not bound:
# its tensors are refused as unliftable, with the message saying so. Passing another model is
# another combination, hence another compilation; the same model with swapped parameters is a
# relift, as for closures. The bound objects are held by the kept compilations, as a closure
# would hold them.


class _WithObjects:
    """The user's function with its module/optimizer arguments bound at their positions."""

    def __init__(
        self,
        fn: Callable[..., Any],
        positions: tuple[int, ...],
        names: tuple[str, ...],
        objects: tuple[object, ...],
    ) -> None:
        self.fn, self.positions, self.names, self.objects = fn, positions, names, objects
        self.__name__ = getattr(fn, "__name__", "fn")
        self.__qualname__ = getattr(fn, "__qualname__", self.__name__)
        self.__module__ = getattr(fn, "__module__", None) or __name__
        self.__signature__ = _without_parameters(fn, positions, names)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        full = list(args)
        k = len(self.positions)
        for i, obj in zip(self.positions, self.objects[:k]):
            full.insert(i, obj)
        kwargs.update(zip(self.names, self.objects[k:]))
        return self.fn(*full, **kwargs)


def _argument_labels(
    fn: Callable[..., Any], positions: tuple[int, ...], names: tuple[str, ...]
) -> list[str]:
    try:
        params = list(pyinspect.signature(fn).parameters)
    except (TypeError, ValueError):
        params = []
    return [params[i] if i < len(params) else f"args[{i}]" for i in positions] + list(names)


def _without_parameters(
    fn: Callable[..., Any], positions: tuple[int, ...], names: tuple[str, ...]
) -> pyinspect.Signature | None:
    try:
        sig = pyinspect.signature(fn)
    except (TypeError, ValueError):
        return None
    params = [
        p
        for i, p in enumerate(sig.parameters.values())
        if i not in positions and p.name not in names
    ]
    try:
        return sig.replace(parameters=params)
    except ValueError:
        return None


def _function_roots(fn: Callable[..., Any], recorder: Recorder) -> None:
    recorder.track_function(fn, getattr(fn, "__qualname__", "fn"))


def _lifting_containers(lifted: Lifted) -> frozenset[int]:
    ids = {id(c) for c in lifted.containers}
    for access in lifted.accesses:
        for slot in (access.slot, *access.aliases):
            container = getattr(slot, "container", None)
            if container is not None:
                ids.add(id(container))
    return frozenset(ids)


_BOUND_LOCK = threading.Lock()
_BOUND_ATTR = "_aotc_compiled_methods"


class _BoundMethods(dict[int, Any]):
    """An instance's compiled methods (`bind_method`), kept in the instance's `__dict__`: they go
    with the instance (a reference cycle the collector frees), and a copy or a pickle of the
    instance starts empty (the copy compiles its own, bound to itself)."""

    def __deepcopy__(self, memo: dict[int, Any]) -> _BoundMethods:
        return _BoundMethods()

    def __copy__(self) -> _BoundMethods:
        return _BoundMethods()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_BoundMethods, ())


def bind_method(compiled: Any, obj: Any, make: Callable[[Any], Any]) -> Any:
    """The descriptor protocol for a compiled function stored on a class (`@aotc.compile` on a
    method, `nn.Module.forward` included): `obj.method` is a compiled function of the bound
    method, made once per instance by `make(bound_method)` and kept in the instance, so each
    instance has its own compiled entries and `self` is bound as in Python. On the class
    (`obj is None`) the compiled function itself is returned. Shared by both capture modes: the
    strict tracer lifts the instance's parameters and buffers through the bound method
    (aotc/lifting.py), Dynamo guards on the instance. An instance without a `__dict__` gets the
    compiled function with itself as the first argument."""
    if obj is None:
        return compiled
    attrs = getattr(obj, "__dict__", None)
    if not isinstance(attrs, dict):
        return functools.partial(compiled, obj)
    cache = attrs.get(_BOUND_ATTR)
    bound = cache.get(id(compiled)) if cache is not None else None
    if bound is not None:
        return bound
    with _BOUND_LOCK:
        cache = attrs.setdefault(_BOUND_ATTR, _BoundMethods())
        if id(compiled) not in cache:
            cache[id(compiled)] = make(types.MethodType(compiled.__wrapped__, obj))
        return cache[id(compiled)]


def _refuse_mutated_aliases(entry: CompiledEntry, leaves: list[object], name: str) -> None:
    """Symbolic entries have no synthetic bases (see Note [Symbolic compilations])."""
    graph_of = dict(entry.plan.convention.leaf_to_graph)
    inputs = cast(CompiledRecord, entry.record).meta.inputs
    for group in alias_groups(leaves):
        if any(inputs[graph_of[m]].mutation.value != "none" for m in group):
            raise UnsupportedError(
                f"{name}: with dynamic=True, inputs {list(group)} share storage and one of them is "
                "mutated; aotc replays such mutations only with static shapes. Pass separate "
                "tensors (a .clone()), or compile without dynamic=True."
            )


def _source_of(fn: Callable[..., Any]) -> str:
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    return f"{code.co_filename}:{code.co_firstlineno}" if code is not None else "<unknown>"


def _mark_user_code(fn: Callable[..., Any]) -> None:
    """Let make_fx record the user's source line on each node (it keeps frames of functions
    named `forward` and of registered anchors). The hook is private to torch.fx and may be
    absent in other torch versions; then only `forward` methods get source lines."""
    register = getattr(torch.fx.proxy, "_register_stack_trace_anchor", None)
    if isinstance(fn, _WithObjects):
        fn = fn.fn
    target = getattr(fn, "__func__", fn)
    if register is not None and hasattr(target, "__code__"):
        register(target)


def _uninitialized(leaves: list[object], gen: _Generation) -> StateCreated | None:
    """A lazy module's parameter not yet initialized (`nn.LazyLinear` before its first
    forward) among the call's tensors: state the call creates, so it runs eagerly (Note [State
    created on the first call] in aotc/recording.py). Off the hot path: after a failed call."""
    first_lifted = len(leaves) - len(gen.names)
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, Tensor) and torch.nn.parameter.is_lazy(leaf):
            name = gen.names[i - first_lifted] if i >= first_lifted else f"argument {i}"
            return StateCreated(
                f"{name} is an uninitialized parameter of a lazy module; its first forward "
                "initializes it"
            )
    return None


def _flatten_output(out: object) -> tuple[list[object], pytree.TreeSpec]:
    leaves, spec = flatten_tree(out)  # Note [Dataclasses as pytree nodes]
    caches = {type(x) for x in leaves if _is_hf_cache(x)}
    if caches:
        for cls in caches:  # a Hugging Face KV cache (use_cache=True): its tensors are outputs
            from transformers.exporters.exporter_dynamo import register_pytree_node

            register_pytree_node(cls)
        leaves, spec = pytree.tree_flatten(out)
    return leaves, spec


def _is_hf_cache(value: object) -> bool:
    """A Hugging Face Cache object, which transformers can register as a pytree node."""
    cls = type(value)
    if not (cls.__module__ or "").startswith("transformers.") or not cls.__name__.endswith("Cache"):
        return False
    try:
        import transformers.exporters.exporter_dynamo  # noqa: F401
    except ImportError:
        return False
    return True


def _positional_names(fn: Callable[..., Any]) -> list[str]:
    """Names of the positional parameters; a Dynamo graph's forward (`*args`) is named by its
    placeholders (`L_x_` is the user's `x`)."""
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, torch.fx.GraphModule):
        return [
            str(n.target).removeprefix("L_").removesuffix("_") or str(n.target)
            for n in owner.graph.nodes
            if n.op == "placeholder"
        ]
    try:
        params = list(pyinspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return []
    names = []
    for p in params:
        if p.kind is p.VAR_POSITIONAL:
            break
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
    return names


def _leaf_names(fn: Callable[..., Any], in_spec: pytree.TreeSpec, num: int) -> list[str]:
    """Readable names of user leaves: parameter names with pytree paths."""
    params = _positional_names(fn)
    placeholder = pytree.tree_unflatten(list(range(num)), in_spec)
    paths = pytree.tree_flatten_with_path(placeholder)[0]
    names = []
    for path, _ in paths:
        keys = [getattr(k, "idx", getattr(k, "key", k)) for k in path]
        if keys and keys[0] == 0 and len(keys) > 1:
            pos = keys[1]
            base = params[pos] if isinstance(pos, int) and pos < len(params) else f"args[{pos}]"
            rest = keys[2:]
        elif keys and keys[0] == 1 and len(keys) > 1:
            base, rest = str(keys[1]), keys[2:]
        else:
            base, rest = "arg", keys
        names.append(base + "".join(f"[{k!r}]" for k in rest))
    return names


class CompiledModule(OriginalState):
    """An nn.Module whose forward runs through aotc. Shares the original's live parameters and
    buffers: state_dict, parameters(), train()/eval() and attribute access go to the original.
    Hooks registered on the original module run eagerly around each compiled call, as
    `nn.Module.__call__` runs them; hooks on its submodules are refused (see Note [Strict capture
    guards] in aotc/strict.py)."""

    def __init__(self, module: torch.nn.Module, options: CompileOptions) -> None:
        super().__init__()
        refuse_distributed(module, "the module", "aotc.compile")
        self._orig_mod = module
        self._options = options
        forward = type(module).forward

        def call_forward(*args: Any, **kwargs: Any) -> Any:
            override = forward_override(module)  # `module.forward = ...` (monkeypatching)
            if override is MISSING:
                return type(module).forward(module, *args, **kwargs)
            return cast(Callable[..., Any], override)(*args, **kwargs)

        call_forward.__signature__ = _drop_self(forward)  # type: ignore[attr-defined]
        name = type(module).__name__
        self._compiled = CompiledFunction(
            call_forward,
            options,
            module_accesses(module, "self"),
            name,
            extra_key=module_training_flags(module),
            source=_source_of(forward),
            relift=functools.partial(module_accesses, module, "self"),
            roots=functools.partial(_module_roots, module),
            module=module,
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._forward_hooks or self._forward_pre_hooks or self._backward_hooks:
            return super().__call__(*args, **kwargs)  # hooks on this wrapper itself
        if self._backward_pre_hooks:
            return super().__call__(*args, **kwargs)
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        module = self._modules["_orig_mod"]
        assert module is not None
        if has_hooks(module):
            return call_with_hooks(module, self._compiled, args, kwargs)
        return self._compiled(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["_orig_mod"], name)

    @property
    def records(self) -> list[CompiledRecord]:
        return self._compiled.records

    @property
    def recompile_reasons(self) -> list[str]:
        return self._compiled.recompile_reasons


def _module_roots(module: torch.nn.Module, recorder: Recorder) -> None:
    recorder.track(module, "self")


def _with_forward_override(guard: StateGuard | None, module: torch.nn.Module) -> StateGuard:
    """CompiledModule's forward reads the module's instance `forward` (a monkeypatch, or none)
    outside the recorder: guard it explicitly."""
    item = GuardItem(
        functools.partial(forward_override, module),
        forward_override(module),
        Compare.IDENTITY,
        "self.forward (an instance override of the class's forward)",
    )
    return StateGuard([*(guard.items if guard is not None else ()), item])


def _drop_self(fn: Callable[..., Any]) -> pyinspect.Signature | None:
    try:
        sig = pyinspect.signature(fn)
    except (TypeError, ValueError):
        return None
    return sig.replace(parameters=list(sig.parameters.values())[1:])


class CompileKwargs(TypedDict, total=False):
    """The keyword arguments of `aotc.compile` (for its overloads; see `compile`)."""

    capture: Capture | str
    backend: Backend | str | None
    partitioner: Partitioner | str
    dynamic: bool | None
    memory_budget: float | int | None
    recompute: RecomputePolicy | None
    check_invariants: bool | None
    dump_dir: str | None
    dump: str | None
    cache: bool | None
    cache_dir: str | None
    cache_max_bytes: int | None
    recompile_warn_limit: int | None
    max_signatures: int | None


# A module is callable too: the first overload wins for it (mypy flags the overlap).
@overload
def compile(  # type: ignore[overload-overlap]
    fn: torch.nn.Module, **options: Unpack[CompileKwargs]
) -> CompiledModule: ...
@overload
def compile(fn: Callable[..., Any], **options: Unpack[CompileKwargs]) -> CompiledFunction: ...
@overload
def compile(
    fn: None = None, **options: Unpack[CompileKwargs]
) -> Callable[[Callable[..., Any]], CompiledFunction]: ...


def compile(
    fn: Any = None,
    *,
    capture: Capture | str = Capture.DYNAMO,
    backend: Backend | str | None = None,
    partitioner: Partitioner | str = Partitioner.MIN_CUT,
    dynamic: bool | None = None,
    memory_budget: float | int | None = None,
    recompute: RecomputePolicy | None = None,
    check_invariants: bool | None = None,
    dump_dir: str | None = None,
    dump: str | None = None,
    cache: bool | None = None,
    cache_dir: str | None = None,
    cache_max_bytes: int | None = None,
    recompile_warn_limit: int | None = None,
    max_signatures: int | None = None,
    **unknown: Never,
) -> Any:
    """Compile a function or nn.Module ahead of time into forward and backward graphs.

    Usable as `aotc.compile(f)`, `@aotc.compile` or `@aotc.compile(check_invariants=True)`.
    The options are the fields of `aotc.options.CompileOptions` (see docs/guide.md, "Options"):

    - `capture`: `Capture.DYNAMO` (default; through Dynamo, with graph breaks) or
      `Capture.TRACE` (aotc's strict whole-program tracer).
    - `backend`: `Backend.AUTO` (Triton kernels for CUDA graphs, ATen calls elsewhere),
      `Backend.ATEN` or `Backend.TRITON`; None reads AOTC_BACKEND, else "auto".
    - `partitioner`: `Partitioner.MIN_CUT` (fewest saved bytes) or `Partitioner.SIMPLE`.
    - `dynamic`: None (Dynamo's automatic dynamic; static in strict mode), True (symbolic sizes
      from the first call) or False (one compilation per shape).
    - `memory_budget`: cap on saved activations, a fraction in (0, 1] or a byte count.
    - `recompute`: a `RecomputePolicy`; `check_invariants`: lint graphs between stages
      (None: AOTC_CHECK_INVARIANTS); `dump_dir` (or `dump`): write every stage's record there.
    - `cache`, `cache_dir`, `cache_max_bytes`: the persistent compile cache (None: the AOTC_CACHE*
      environment variables); `recompile_warn_limit`, `max_signatures`: recompilation limits.

    Each enum option also takes its string (`backend="aten"` is `backend=Backend.ATEN`); a
    misspelt value or option name raises at once, listing the choices.

    >>> import torch, aotc
    >>> def f(x, w):
    ...     return (x @ w).relu().sum()
    >>> cf = aotc.compile(f, capture="trace", backend=aotc.Backend.ATEN)
    >>> x, w = torch.randn(4, 3), torch.randn(3, 2, requires_grad=True)
    >>> loss = cf(x, w)
    >>> loss.backward()
    >>> torch.allclose(loss, f(x, w)), w.grad.shape
    (True, torch.Size([3, 2]))
    >>> aotc.compile(f, backend="trion")
    Traceback (most recent call last):
        ...
    ValueError: aotc.compile(backend='trion'): expected one of 'auto', 'aten', 'triton' (or aotc.Backend.<NAME>); did you mean 'triton'?
    """
    options: dict[str, Any] = {
        "capture": capture,
        "backend": backend,
        "partitioner": partitioner,
        "dynamic": dynamic,
        "memory_budget": memory_budget,
        "recompute": recompute,
        "check_invariants": check_invariants,
        "dump_dir": dump_dir if dump is None else dump,
        "cache": cache,
        "cache_dir": cache_dir,
        "cache_max_bytes": cache_max_bytes,
        "recompile_warn_limit": recompile_warn_limit,
        "max_signatures": max_signatures,
        **unknown,  # refused by from_env, naming them (type checkers refuse them already)
    }
    opts = CompileOptions.from_env(**options)
    if fn is None:
        return lambda f: compile(f, **options)
    from aotc.capture import DynamoFunction, DynamoModule
    from aotc.capture import capture as dynamo_capture

    if isinstance(fn, (CompiledFunction, CompiledModule, DynamoFunction, DynamoModule)):
        return fn
    if not isinstance(fn, torch.nn.Module) and not callable(fn):
        raise TypeError(f"aotc.compile() expects a function or nn.Module, got {type(fn).__name__}")
    if opts.capture is Capture.DYNAMO:
        return dynamo_capture(fn, opts, _qualname(fn))
    if isinstance(fn, torch.nn.Module):
        return CompiledModule(fn, opts)
    return CompiledFunction(fn, opts, find_free_tensors(fn), _qualname(fn))


def _qualname(fn: Any) -> str:
    if isinstance(fn, torch.nn.Module):
        return type(fn).__name__
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def inspect(compiled: Any) -> list[CompiledRecord]:
    """One record per compiled graph: joint, forward and backward graphs, metadata, partition
    report, and compile time by stage. In the default capture mode, one per graph Dynamo
    captured (each recompilation and each piece between graph breaks).

    >>> import torch, aotc
    >>> cf = aotc.compile(lambda x: (x.sin() * 2).sum(), capture="trace")
    >>> cf(torch.randn(5, requires_grad=True)).backward()
    >>> [record] = aotc.inspect(cf)
    >>> print(record.signature)
    x: float32[5] stride=(1,) cpu requires_grad
    grad_enabled=True
    >>> [(s.name, s.nbytes) for s in record.partition.saved]  # the backward needs only x
    [('arg0_1', 20)]
    >>> print(record.forward.code.strip())
    def forward(self, arg0_1):
        sin = torch.ops.aten.sin.default(arg0_1)
        mul = torch.ops.aten.mul.Tensor(sin, 2);  sin = None
        sum_1 = torch.ops.aten.sum.default(mul);  mul = None
        return (sum_1, arg0_1)
    """
    from aotc.capture import DynamoFunction, DynamoModule

    if isinstance(compiled, (CompiledFunction, CompiledModule, DynamoFunction, DynamoModule)):
        return compiled.records
    raise TypeError(
        f"aotc.inspect() expects what aotc.compile() returned, got {type(compiled).__name__}"
    )


def cache_flush() -> None:
    """Wait until every cache entry this process has compiled is written to the cache
    directory. Entries are encoded and written on a background thread after the compile returns
    (see Note [Deferred cache stores] in aotc/persist.py); the interpreter also waits for them at
    exit, and a second compile of the same program waits for its own entry. Call this before
    copying or inspecting the cache directory from the same process."""
    from aotc import persist

    persist.flush()
