"""Public API: `aotc.compile` (decorator or wrapper, functions and nn.Modules) and `aotc.inspect`.

A compiled function flattens its arguments, appends the tensors it lifted (closures, globals,
module parameters and buffers), and hands the leaves to a `Dispatcher`, which finds or compiles the
entry for their signature. See aotc/pipeline.py for what a compilation does.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect as pyinspect
import logging
import threading
import time
import types
from collections.abc import Callable
from typing import Any, overload

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode

from aotc.lifting import (
    Lifted,
    find_free_tensors,
    lifted_reader,
    module_accesses,
    module_training_flags,
    swapped,
)
from aotc.options import Capture, CompileOptions, configure_logging
from aotc.pipeline import CompiledRecord, compile_signature
from aotc.runtime.convention import alias_groups
from aotc.runtime.errors import UnsupportedError
from aotc.runtime.symbolic import SymbolicDispatcher
from aotc.runtime.wrappers import CompiledEntry, Dispatcher
from aotc.symbolic import check_static_geometry, guard_expression, symbolic_leaves, symbolic_mode

Tensor = torch.Tensor
_PLAIN_TENSOR = frozenset((Tensor,))
progress = logging.getLogger("aotc.progress")
configure_logging()  # AOTC_LOG, once the compiler is first used

# Called with (compiled function, record, recompile reason or None) after every compilation.
COMPILE_LISTENERS: list[Callable[[CompiledFunction, CompiledRecord, str | None], None]] = []


class CompiledFunction:
    """A function compiled by aotc. Call it like the original."""

    def __init__(
        self,
        fn: Callable[..., Any],
        options: CompileOptions,
        lifted: Lifted,
        name: str,
        extra_key: Callable[[], object] | None = None,
        source: str | None = None,
    ) -> None:
        self._fn = fn
        self._source = source or _source_of(fn)
        self._options = options
        self._lifted = lifted
        self._accesses = lifted.accesses
        self._read_lifted = lifted_reader(lifted.accesses) if lifted.accesses else None
        self._lifted_names = [a.name for a in lifted.accesses]
        self._extra_key = extra_key
        self._name = name
        self._dispatch: Dispatcher | SymbolicDispatcher
        if options.dynamic:
            self._dispatch = SymbolicDispatcher(
                self._compile_symbolic, name, options.max_signatures
            )
        else:
            self._dispatch = Dispatcher(
                self._compile, name, options.recompile_warn_limit, options.max_signatures
            )
        functools.update_wrapper(self, fn, updated=())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not kwargs and {*map(type, args)} <= _PLAIN_TENSOR:  # every arg a plain Tensor
            leaves: list[object] = list(args)
            spec: object = len(args)
        else:
            leaves, spec = pytree.tree_flatten((args, kwargs))
        if self._read_lifted is not None:
            leaves.extend(self._read_lifted())  # Note [Lifted reads and swaps across threads]
        extra = (spec, self._extra_key()) if self._extra_key is not None else spec
        return self._dispatch(leaves, extra)

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
        return [e.record for e in self._dispatch.entries]  # type: ignore[misc]

    @property
    def recompile_reasons(self) -> list[str]:
        return list(self._dispatch.recompile_reasons)

    def _compile_symbolic(
        self, leaves: list[object], key: tuple[object, ...]
    ) -> tuple[CompiledEntry, str | None]:
        """dynamic=True: trace once with symbolic sizes for the user's tensor arguments (see
        Note [Symbolic compilations] in aotc/symbolic.py)."""
        mode = symbolic_mode()
        num_user = len(leaves) - len(self._accesses)
        fakes = symbolic_leaves(mode, leaves, [i < num_user for i in range(len(leaves))])
        entry = self._compile(leaves, key, fakes, mode)
        check_static_geometry(entry.plan.epilogue, self._name)
        _refuse_mutated_aliases(entry, leaves, self._name)
        return entry, guard_expression(mode, fakes)

    def _compile(
        self,
        leaves: list[object],
        key: tuple[object, ...],
        fakes: list[object] | None = None,
        fake_mode: FakeTensorMode | None = None,
    ) -> CompiledEntry:
        spec = key[0][0] if self._extra_key is not None else key[0]
        num_lifted = len(self._accesses)
        num_user = len(leaves) - num_lifted
        if isinstance(spec, int):
            in_spec = pytree.tree_flatten((tuple(leaves[:num_user]), {}))[1]
        else:
            in_spec = spec
        names = _leaf_names(self._fn, in_spec, num_user) + self._lifted_names
        fn, lifted = self._fn, self._lifted

        _mark_user_code(fn)

        def program(user_leaves: list[object]) -> tuple[list[object], object]:
            args, kwargs = pytree.tree_unflatten(user_leaves[:num_user], in_spec)
            with swapped(lifted, user_leaves[num_user:]):
                out = fn(*args, **kwargs)
            return _flatten_output(out)

        n = len(self._dispatch.entries) + 1
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
        progress.info(
            "aotc: compiled %s (signature %d) in %.2f s", self._name, n, time.perf_counter() - start
        )
        reason = self._dispatch.recompile_reasons[-1] if n > 1 else None
        for listener in COMPILE_LISTENERS:
            listener(self, entry.record, reason)  # type: ignore[arg-type]
        return entry


_BOUND_LOCK = threading.Lock()
_BOUND_ATTR = "_aotc_compiled_methods"


class _BoundMethods(dict):  # type: ignore[type-arg]
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
    inputs = entry.record.meta.inputs  # type: ignore[union-attr]
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
    target = getattr(fn, "__func__", fn)
    if register is not None and hasattr(target, "__code__"):
        register(target)


def _flatten_output(out: object) -> tuple[list[object], pytree.TreeSpec]:
    leaves, spec = pytree.tree_flatten(out)
    fresh = {type(x) for x in leaves if dataclasses.is_dataclass(x) and not isinstance(x, type)}
    if fresh:
        for cls in fresh:
            pytree.register_dataclass(cls)
        leaves, spec = pytree.tree_flatten(out)
    return leaves, spec


def _leaf_names(fn: Callable[..., Any], in_spec: pytree.TreeSpec, num: int) -> list[str]:
    """Readable names of user leaves: parameter names with pytree paths."""
    try:
        params = list(pyinspect.signature(fn).parameters)
    except (TypeError, ValueError):
        params = []
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


class CompiledModule(torch.nn.Module):
    """An nn.Module whose forward runs through aotc. Shares the original's live parameters and
    buffers: state_dict, parameters(), train()/eval() and attribute access go to the original."""

    def __init__(self, module: torch.nn.Module, options: CompileOptions) -> None:
        super().__init__()
        self._orig_mod = module
        forward = type(module).forward

        def call_forward(*args: Any, **kwargs: Any) -> Any:
            return forward(module, *args, **kwargs)

        call_forward.__signature__ = _drop_self(forward)  # type: ignore[attr-defined]
        name = type(module).__name__
        self._compiled = CompiledFunction(
            call_forward,
            options,
            module_accesses(module, "self"),
            name,
            extra_key=module_training_flags(module),
            source=_source_of(forward),
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._compiled(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["_orig_mod"], name)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self._orig_mod.state_dict(*args, **kwargs)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self._orig_mod.load_state_dict(*args, **kwargs)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:
        return self._orig_mod.named_parameters(*args, **kwargs)

    def named_buffers(self, *args: Any, **kwargs: Any) -> Any:
        return self._orig_mod.named_buffers(*args, **kwargs)

    @property
    def records(self) -> list[CompiledRecord]:
        return self._compiled.records


def _drop_self(fn: Callable[..., Any]) -> pyinspect.Signature | None:
    try:
        sig = pyinspect.signature(fn)
    except (TypeError, ValueError):
        return None
    return sig.replace(parameters=list(sig.parameters.values())[1:])


@overload
def compile(fn: torch.nn.Module, **options: Any) -> CompiledModule: ...
@overload
def compile(fn: Callable[..., Any], **options: Any) -> CompiledFunction: ...
@overload
def compile(
    fn: None = None, **options: Any
) -> Callable[[Callable[..., Any]], CompiledFunction]: ...


def compile(fn: Any = None, **options: Any) -> Any:
    """Compile a function or nn.Module ahead of time into forward and backward graphs.

    Usable as `aotc.compile(f)`, `@aotc.compile` or `@aotc.compile(check_invariants=True)`.
    Options are the fields of `aotc.options.CompileOptions` (`dump=` is short for `dump_dir=`).
    """
    if "dump" in options:
        options["dump_dir"] = options.pop("dump")
    opts = CompileOptions.from_env(**options)
    if fn is None:
        return lambda f: compile(f, **options)
    from aotc.capture import DynamoFunction, DynamoModule, capture

    if isinstance(fn, (CompiledFunction, CompiledModule, DynamoFunction, DynamoModule)):
        return fn
    if not isinstance(fn, torch.nn.Module) and not callable(fn):
        raise TypeError(f"aotc.compile() expects a function or nn.Module, got {type(fn).__name__}")
    if opts.capture is Capture.DYNAMO:
        return capture(fn, opts, _qualname(fn))
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
    captured (each recompilation and each piece between graph breaks)."""
    from aotc.capture import DynamoFunction, DynamoModule

    if isinstance(compiled, (CompiledFunction, CompiledModule, DynamoFunction, DynamoModule)):
        return compiled.records
    raise TypeError(
        f"aotc.inspect() expects what aotc.compile() returned, got {type(compiled).__name__}"
    )
