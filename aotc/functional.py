"""Functionalization helpers shared by the metadata pass and the joint trace.

Both run the user program on functional tensor wrappers (the C++ functionalization layer behind
`torch.func.functionalize`) over fake tensors, so no real compute happens at compile time and
every in-place op becomes a functional op plus a record of the mutation.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
import torch.utils._pytree as pytree
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from aotc import eagercomposites, eagerlayouts, fxgenerators, hopcalls
from aotc.customops import note_writing_op
from aotc.lifting import StateCreated
from aotc.runtime.errors import AotcError, UnsupportedError
from aotc.runtime.viewreplay import ViewOp, plain_args
from aotc.sharedpatch import SharedPatch

# A user program after flattening: takes the user leaves, returns (output leaves, output spec).
FlatProgram = Callable[[list[object]], tuple[list[object], object]]


def to_functional(t: torch.Tensor) -> torch.Tensor:
    wrapped = torch._to_functional_tensor(t)
    # keeps requires_grad and non-leafness (in torch._C, not declared in torch's stubs)
    torch._mirror_autograd_meta_to(t, wrapped)  # type: ignore[attr-defined]
    return wrapped


# What the joint trace raises when a leaf's .grad changes while it traces the backward.
NESTED_BACKWARD = "autograd accumulated into a leaf's .grad while tracing the backward"


def to_functional_leaf(t: torch.Tensor) -> torch.Tensor:
    """A functional wrapper of `t` that is a leaf requiring grad, as the user's parameter is (Note
    [Autocast casts of parameters] in aotc/tracer.py)."""
    wrapped = torch._to_functional_tensor(t)
    return wrapped.requires_grad_(True) if not wrapped.requires_grad else wrapped


def from_functional(t: object) -> object:
    if isinstance(t, torch.Tensor) and torch._is_functional_tensor(t):
        torch._sync(t)
        return torch._from_functional_tensor(t)
    return t


@contextlib.contextmanager
def functionalization() -> Iterator[None]:
    """C++ functionalization with the Python dispatcher on. The Python dispatcher routes ops
    whose schema hides a mutation (`native_batch_norm` updates running stats without declaring
    it) to correctly-schema'd variants, so functionalization sees every input mutation."""
    # See Note [Eager's own dropout in the trace] in aotc/eagercomposites.py
    with enable_python_dispatcher(), eagercomposites.held(), _lenient_checkpoint_caches():
        torch._enable_functionalization(reapply_views=True)
        try:
            yield
        finally:
            torch._disable_functionalization()


# Note [Checkpoint caches under functionalization]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Dynamo captures `torch.utils.checkpoint` as the `tag_activation_checkpoint` operator, which
# runs the region under selective checkpointing: while a proxy mode traces, every op's output is
# cached in the forward (below functionalization, so the plain fake tensor) and handed back when
# the backward recomputes the region, after checking that the cached tensor's version did not
# change since. A functional tensor shares its version counter with the plain tensor it wrapped
# first, so `scores = q @ k; scores += bias` (T5's attention) bumps the cached matmul output's
# version although the plain tensor itself never changes: under functionalization the in-place
# add is an out-of-place add the wrapper switches to. The check then refused the trace ("Tensor
# cached during selective activation checkpoint has been mutated") and the graph ran as Dynamo's
# graph module, whose checkpoint recomputes dropout with new numbers (the operator turns
# `preserve_rng_state` off, leaving RNG to the compiler): wrong gradients. While aotc's
# functionalization is on, the cache hands back its value without that check; nothing below
# functionalization mutates a cached tensor.
@functools.cache
def _checkpoint_cache_patch() -> SharedPatch | None:
    from torch.utils import checkpoint

    wrapper = getattr(checkpoint, "_VersionWrapper", None)
    if wrapper is None or not hasattr(wrapper, "get_val"):
        return None  # another torch: nothing to relax
    return SharedPatch(wrapper, {"get_val": _cached_value})


def _lenient_checkpoint_caches() -> contextlib.AbstractContextManager[object]:
    patch = _checkpoint_cache_patch()
    return contextlib.nullcontext() if patch is None else patch.held()


def _cached_value(self: Any, allow_cache_entry_mutation: bool) -> Any:
    return self.val


def symbolic_dispatch(symbolic: bool) -> contextlib.AbstractContextManager[object]:
    """The Python dispatcher for a run on fake tensors with symbolic sizes, else nothing.

    Note [Symbolic sizes need the Python dispatcher]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    Some C++ kernels that fake tensors reach take concrete sizes only: `baddbmm`'s meta expands
    its `self` through `expand`'s CompositeExplicitAutograd kernel, which raises "SymIntArrayRef
    expected to contain only concrete integers" for symbolic sizes (BLOOM's ALiBi attention on a
    dynamic recompile). The Python dispatcher routes such ops to their SymInt-aware Python
    kernels; make_fx turns it on for symbolic tracing and `functionalization()` always does, so
    every run on symbolic fakes does. A run on static shapes stays as eager dispatches."""
    return _python_dispatcher() if symbolic else contextlib.nullcontext()


@contextlib.contextmanager
def _python_dispatcher() -> Iterator[None]:
    with enable_python_dispatcher(), eagercomposites.held():
        yield


_OWN_DIRS = tuple(
    os.path.dirname(os.path.abspath(str(m.__file__))) + os.sep
    for m in (
        torch,
        sys.modules["aotc"],
        importlib.import_module("aotc.passes"),
        sys.modules["aotc.runtime"],
    )
)


def _user_frame(tb: traceback.StackSummary) -> str:
    """The innermost frame outside torch and aotc's packages: the user's line. Frames of the
    standard library and of generated code are passed over while a file of the program's own is
    further out; make_fx's wrapper always is."""
    own = [f for f in tb if not os.path.abspath(f.filename).startswith(_OWN_DIRS)]
    own = [f for f in own if not f.filename.endswith("contextlib.py")]
    own = [f for f in own if (f.filename, f.name) != ("<string>", "<lambda>")]  # make_fx's wrapper
    frames = [f for f in own if _raised_by_program(f.filename)] or own
    if not frames:
        return "<unknown>"
    return f"{frames[-1].filename}:{frames[-1].lineno} ({frames[-1].line})"


def _noted_user_line(e: BaseException) -> str | None:
    """The user's line of the Dynamo graph node that raised `e`: from the node's stack trace when
    the graph's own code ran it (aotc's strict fallback calls the GraphModule), else from the
    "Original traceback" fx's Interpreter adds to the message."""
    found = None
    for frame, lineno in traceback.walk_tb(e.__traceback__):
        if frame.f_code.co_filename.startswith("<eval_with_key>"):
            found = frame, lineno
    if found is not None:
        frame, lineno = found
        gm = frame.f_locals.get("self")
        graph = getattr(gm, "graph", None)
        lines = getattr(gm, "_lineno_map", None)  # GraphModule: line of its code -> node index
        if lines is None and isinstance(graph, torch.fx.Graph):  # a copy keeps no map: rebuild
            try:
                lines = graph.python_code(root_module="self")._lineno_map
            except Exception:  # noqa: BLE001 only the error's location is at stake
                lines = None
        index = lines.get(lineno - frame.f_code.co_firstlineno) if lines else None
        if index is not None and graph is not None and index < len(graph.nodes):
            where = _last_file_line(list(graph.nodes)[index].meta.get("stack_trace") or "")
            if where is not None:
                return where
    for note in (*getattr(e, "__notes__", ()), str(e)):
        _, found_trace, trace = note.partition("Original traceback:")
        if found_trace and (where := _last_file_line(trace)) is not None:
            return where
    return None


def _last_file_line(trace: str) -> str | None:
    """`path:line (code)` of the innermost frame of a formatted Python stack."""
    lines = trace.splitlines()
    for k in range(len(lines) - 1, -1, -1):
        head = lines[k].strip()
        if head.startswith('File "') and ", line " in head:
            path, _, rest = head[len('File "') :].partition('", line ')
            code = lines[k + 1].strip() if k + 1 < len(lines) else ""
            return f"{path}:{rest.split(',')[0]} ({code})"
    return None


def _raised_by_program(filename: str) -> bool:
    """Whether the innermost frame of an error is the program's own code (not torch's, aotc's
    or the standard library's)."""
    path = os.path.abspath(filename)
    return not path.startswith(_OWN_DIRS) and not path.startswith(_STDLIB) and "<" not in filename


_STDLIB = os.path.dirname(os.path.abspath(contextlib.__file__))


@contextlib.contextmanager
def user_errors(what: str, eager_ran: bool = False) -> Iterator[None]:
    """Turn tracing failures that mean 'unsupported program' into UnsupportedError.
    `eager_ran`: the plain (eager-like) run of the program already succeeded, so a failure here
    is aotc's own limitation, never eager's refusal."""
    try:
        yield
    except AotcError:
        raise
    except (DataDependentOutputException, DynamicOutputShapeException) as e:
        where = _user_frame(traceback.extract_tb(sys.exc_info()[2]))
        op = getattr(e, "func", "?")
        raise UnsupportedError(
            f"{what}: the program's control flow or output shape depends on tensor values "
            f"(op {op}, at {where}): e.g. `if x.sum() > 0`, `.item()`, `.tolist()`, "
            "`torch.nonzero`. aotc compiles one graph per input signature and cannot see values. "
            "Move the data-dependent part outside the compiled function, or use torch.where."
        ) from e
    except UnsupportedOperatorException as e:
        where = _user_frame(traceback.extract_tb(sys.exc_info()[2]))
        raise UnsupportedError(
            f"{what}: op {e.func} has no fake-tensor implementation (at {where}); aotc cannot "
            "trace it. Call it outside the compiled function."
        ) from e
    except (RuntimeError, AssertionError, ValueError, IndexError) as e:
        # ValueError, AssertionError: fake tensors' Python implementations (`view`, `t_`) raise
        # them where eager's kernels raise RuntimeError. IndexError: a dim out of range, which
        # fake tensors also raise replaying a view from a base whose rank an in-place op changed
        # (`v = a.t(); a.squeeze_(0); v.unsqueeze_(0)`: eager runs it; fuzz seed 8119).
        text = str(e)
        frames = traceback.extract_tb(sys.exc_info()[2])
        where = _user_frame(frames)
        if not eager_ran and frames and _raised_by_program(frames[-1].filename):
            raise  # the program's own `raise` (or a builtin it called): eager raises it too
        if "FakeTensor" in text and ("non-Fake" in text or "convert all Tensors" in text):
            found = text.split("Found in", 1)[-1].strip()[:200]
            raise UnsupportedError(
                f"{what}: the program reads a tensor that is neither an argument nor reachable "
                f"from a closure, global or module attribute aotc can lift (in {found}, at "
                f"{where}). Pass it as an argument (or register it as a module buffer)."
            ) from e
        if "data is not allocated yet" in text:
            # a kernel reading an index tensor's values (`tensor_split(x, idx_tensor)` on CPU)
            raise UnsupportedError(
                f"{what}: the program's output shape depends on tensor values (a kernel reads "
                f"the values of a tensor argument, at {where}). aotc compiles one graph per "
                "input signature and cannot see values. Pass those values as Python ints, or "
                "move that call outside the compiled function."
            ) from e
        if where == "<unknown>" or where.startswith("<eval_with_key>"):  # a Dynamo graph's node
            where = _noted_user_line(e) or where
        if where == "<unknown>" and what == "joint trace":
            # raised in the backward, which autograd's engine runs with no line of the program
            # on the stack (a custom Function's backward, torch.utils.checkpoint)
            where = "its backward"
        elif where == "<unknown>" and eager_ran:  # aotc's limitation: never a raw error
            where = "a line aotc cannot name (code without a source file)"
        if where != "<unknown>":  # raised for a line of the user's program
            raise UnsupportedError(_program_error(what, e, where, eager_ran)) from e
        raise


NO_HOOKS = contextlib.nullcontext()

# Note [Traces under torch.func]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch.func.grad, vjp, jacrev and hessian refuse to start while any saved-tensor hooks are
# active ("don't yet support saved tensor hooks"). aotc runs the program under hooks of its own:
# the plain metadata run notes autograd's saved values (`SavedValues`, Note [Backward eager would
# refuse] in runtime/autograd.py), and the joint trace saves values under identity hooks so that
# autograd's version check does not refuse a functional graph (the refusal is the metadata
# pass's business). A program that calls those transforms fails under them where eager runs it,
# so each of the two runs is repeated without its hooks when that is why it failed:
# - the plain run repeats on fresh fakes with nothing noting saved values; `_backward_refusals`
#   then probes every differentiable output with a fake backward, and autograd's own version
#   check decides which eager would refuse;
# - the joint trace repeats without identity hooks; it then fails where a transform's result
#   feeds a backward through a value modified in place afterwards (eager refuses that backward).
# Both run inside a compile that itself runs again without its own identity hooks (Note [No hooks
# pushed for torch.func] in aotc/pipeline.py); with user hooks active the repeated runs fail too,
# as eager does. The plain run's retry also marks the entry (`refuses_saved_hooks`): calls made
# under saved-tensor hooks raise eager's error, since the compiled graphs no longer run the
# transform that would.
_FUNCTORCH_HOOKS = "don't yet support saved tensor hooks"
FUNCTORCH_HOOKS_HINT = (
    "torch.func.grad, vjp, jacrev and hessian refuse to run while saved-tensor hooks "
    "(torch.autograd.graph.saved_tensors_hooks, save_on_cpu, activation checkpointing) are "
    "active around the call; eager raises the same error here. Call the compiled function "
    "outside those hooks, or use torch.autograd.grad inside it instead of the transform."
)


def refused_by_functorch(e: BaseException) -> bool:
    """`e` (raw, or from `user_errors`) says a torch.func transform refused our saved-tensor
    hooks."""
    cause = e.__cause__ if isinstance(e, AotcError) else e
    return isinstance(cause, RuntimeError) and _FUNCTORCH_HOOKS in str(cause)


def _undo_layers_to(depth: int) -> None:
    """Pop the functorch layers above `depth`, each with its transform's own exit (what
    `pop_dynamic_layer_stack_and_undo_to_depth` does on torch 2.13; torch 2.11's pops every layer
    twice, the second time through the exit, and fails an internal assert: a jvp layer's "stack
    is empty", or the next layer "is not a Jvp layer", which hid the run's own error)."""
    functorch = torch._C._functorch
    exits = {
        functorch.TransformType.Vmap: functorch._vmap_decrement_nesting,
        functorch.TransformType.Grad: functorch._grad_decrement_nesting,
        functorch.TransformType.Jvp: functorch._jvp_decrement_nesting,
        functorch.TransformType.Functionalize: functorch._func_decrement_nesting,
    }
    while functorch.get_dynamic_layer_stack_depth() > depth:
        top = functorch.peek_interpreter_stack()
        exit_layer = exits.get(top.key()) if top is not None else None
        if exit_layer is None:  # a layer of another kind: torch's own undo
            functorch.pop_dynamic_layer_stack_and_undo_to_depth(depth)
            return
        exit_layer()


@contextlib.contextmanager
def transform_state() -> Iterator[None]:
    """Undo, on exit, what a run that stopped half-way through a torch.func transform left set.
    A Dynamo graph of a transform calls `_saved_tensors_hooks_disable`/`_enable` and
    `_grad_increment_nesting`/`_decrement_nesting` (and vmap's, jvp's, forward AD's levels) as
    graph nodes, without try/finally: a failed run between them would leave saved-tensor hooks
    disabled, a functorch layer pushed or a dual level entered for the whole process (Dynamo's
    own frames undo the layers on error)."""
    message = torch._C._autograd._saved_tensors_hooks_get_disabled_error_message()
    depth = torch._C._functorch.get_dynamic_layer_stack_depth()
    include = torch._C._dispatch_tls_local_include_set()
    exclude = torch._C._dispatch_tls_local_exclude_set()
    fwd_grad = torch._C._is_fwd_grad_enabled()
    try:
        with torch._C._ForceDispatchKeyGuard(include, exclude):
            yield
    except BaseException:
        # A forward-AD level the run entered (jvp, jacfwd, hessian) and did not exit. Levels
        # do not nest, so it is the one right above the level the Python API knows of.
        try:
            torch._C._exit_dual_level(level=torch.autograd.forward_ad._current_level + 1)
        except RuntimeError:
            pass  # none was left entered
        raise
    finally:
        _undo_layers_to(depth)
        torch._C._set_fwd_grad_enabled(fwd_grad)
        if message is None:
            torch._C._autograd._saved_tensors_hooks_enable()
        else:
            torch._C._autograd._saved_tensors_hooks_disable(message, False)


# Errors the plain metadata run raises exactly where eager would: autograd's in-place and view
# checks and eager's memory-overlap checks run unchanged on fake tensors.
_EAGER_CHECKS = (
    "a leaf Variable that requires grad",
    "a view of a leaf Variable that requires grad",
    "is a view and is being modified inplace",
    "A view was created in no_grad mode",
    "unsupported operation:",
    "modified by an inplace operation",
    "does not require grad and does not have a grad_fn",
)
# Errors that say an op read tensors on two devices (eager's and fake tensors' wordings).
_MIXED_DEVICES = ("same device", "expected device", "two different devices")
# Errors that only fake tensors raise: the program reads tensor data into Python.
_NEEDS_DATA = (
    "unallocated storage",
    "Cannot access data pointer",
    "Cannot access storage",
    "numpy() is not supported",
    "Cannot copy out of meta tensor",
)


def _program_error(what: str, e: Exception, where: str, eager_ran: bool = False) -> str:
    """The user program raised while being traced: say where, keep torch's reason, and say what
    it means for this kind of failure (each hint true for the failures it is given for)."""
    text = str(e).strip()
    reason = text.splitlines()[0][:300].rstrip(".") if text else type(e).__name__
    # Fake tensors' wording: torch 2.13 "Expected all tensors to be on the same device, ...",
    # torch 2.11 "Unhandled FakeTensor Device Propagation ..., found two different devices".
    if "device" in reason and any(p in reason for p in _MIXED_DEVICES):
        hint = (
            "Eager raises this too. Move every tensor the op reads to one device before the "
            "call (or with .to() inside the function)."
        )
    elif any(p in text for p in _NEEDS_DATA):
        kind = "`.numpy()`" if "numpy" in text else "`.tolist()`, `.numpy()` or a data pointer"
        hint = (
            f"The line reads tensor values into Python ({kind}); aotc traces with fake tensors, "
            "which hold no values, and compiles one graph per input signature. Keep such reads "
            "outside the compiled function (on its inputs or results), or use tensor ops."
        )
    elif _FUNCTORCH_HOOKS in text:
        hint = FUNCTORCH_HOOKS_HINT
    elif "torch.func" in text or "functorch" in text:
        hint = (
            "A torch.func transform in the function failed while aotc traced it on fake "
            "tensors. If eager raises this too for these inputs, fix that line; if eager runs "
            "it, call the transform outside the compiled function (or compile with "
            'capture="dynamo") and report it as an aotc bug.'
        )
    elif "custom (non-ATen) operator" in text or "alias annotations" in text:
        op = reason.split("annotations: ", 1)[-1].split(". ", 1)[0] if ": " in reason else "?"
        hint = (
            f"A custom operator mutates or aliases its inputs ({op}); aotc functionalizes the "
            "program and cannot trace such operators. Register a functional variant that returns "
            "new tensors (and write them back outside), or call the operator outside the "
            "compiled function."
        )
    elif (
        "mirrored meta" in text
        or NESTED_BACKWARD in text
        or ("use_reentrant=True" in text and "checkpoint" in text)
    ):
        hint = (
            "The program runs autograd inside a backward: a custom autograd.Function whose "
            "backward calls .backward() or torch.autograd.grad (reversible layers do), or "
            "reentrant checkpointing (use_reentrant=True). Strict mode traces the backward into "
            "the graph and cannot trace such a nested backward into the tensors it lifted. Use "
            "the default capture mode (aotc.compile without capture='trace'), or "
            "use_reentrant=False."
        )
    elif eager_ran:
        hint = (
            "The program runs in eager (aotc ran it on fake tensors first), but aotc's "
            "functional trace of it fails: an aotc limitation. Call that part outside the "
            "compiled function, and report it as an aotc bug."
        )
    elif "fake impl" in reason or "fake kernel" in reason or "Meta" in reason:
        hint = (
            "aotc traces with fake tensors: give the op a fake kernel "
            "(torch.library.register_fake / `<op>.register_fake`), or call it outside the "
            "compiled function."
        )
    elif any(p in text for p in _EAGER_CHECKS):
        hint = (
            "Eager PyTorch raises the same error here (an in-place op autograd forbids): use the "
            "out-of-place op, or .clone() the tensor before modifying it."
        )
    else:
        hint = (
            "PyTorch raised this while aotc traced the function on fake tensors (no data). If "
            "eager raises it too for these inputs, fix that line; if eager runs it, call that "
            "part outside the compiled function and report it as an aotc bug."
        )
    return f"{what}: the program failed at {where}: {type(e).__name__}: {reason}. {hint}"


def fakeify(
    mode: FakeTensorMode, tensors: Sequence[torch.Tensor], *, as_leaves: bool
) -> list[torch.Tensor]:
    """Fake copies. `as_leaves=False` keeps non-leafness and aliasing (metadata pass);
    `as_leaves=True` gives leaves with the same requires_grad (joint trace primals).

    Tensors that are fake already (symbolic compilations, see Note [Symbolic compilations])
    get fresh fakes of the same (symbolic) geometry, so runs never share tensors or symbols
    differ between runs."""
    if tensors and all(isinstance(t, FakeTensor) for t in tensors):
        return [fresh_fake(t, as_leaves=as_leaves) for t in tensors]
    if not as_leaves:
        return [mode.from_tensor(t) for t in tensors]
    fakes: list[torch.Tensor] = []
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        detached = [t.detach() for t in tensors]
    for t, d in zip(tensors, detached):
        fake = mode.from_tensor(d)
        if t.requires_grad:
            fake.requires_grad_(True)
        fakes.append(fake)
    return fakes


def fresh_fake(t: torch.Tensor, *, as_leaves: bool) -> torch.Tensor:
    """A new fake tensor (in the ambient fake mode) with `t`'s sizes, strides, dtype, device and
    requires_grad; also its non-leafness unless `as_leaves`. Sizes may be SymInts: the copy
    shares their symbols. The storage offset is kept; aliasing between inputs is not (symbolic
    compilations have no synthetic bases; see Note [Symbolic compilations]). A 0-d tensor that
    stands for a dynamic Python float keeps its symbol (Note [Dynamic Python floats] in
    aotc/backend.py)."""
    fake = _empty_with_geometry(t)
    _copy_lazy_bits(t, fake)
    memo = getattr(t, "item_memo", None)
    if memo is not None:
        fake.item_memo = memo  # type: ignore[attr-defined]  # FakeTensor's, set on an empty
    if t.requires_grad:
        fake.requires_grad_(True)
        if not as_leaves and not t.is_leaf:
            # A non-leaf with exactly these strides (a clone would make them contiguous).
            out = _empty_with_geometry(t)
            _copy_lazy_bits(t, out)
            with torch.enable_grad():
                fake = out.copy_(fake)
    return fake


def _copy_lazy_bits(t: torch.Tensor, fake: torch.Tensor) -> None:
    """`t`'s conjugate and negative bits on `fake`: a complex input Dynamo hands over as
    `b.conj()` is a conjugate view, and `x.resolve_conj()` must trace as a copy, not as a no-op
    (which returned the input itself, bit set)."""
    if t.is_conj():
        torch._C._set_conj(fake, True)
    if t.is_neg():
        torch._C._set_neg(fake, True)


def _extent(sizes: Sequence[Any], strides: Sequence[Any]) -> Any:
    """Elements from a strided view's first to one past its last (0 when it has none)."""
    if any(n == 0 for n in sizes):
        return 0
    return 1 + sum((n - 1) * st for n, st in zip(sizes, strides))


def _empty_with_geometry(t: torch.Tensor) -> torch.Tensor:
    """An empty tensor with `t`'s sizes, strides and storage offset. The offset matters to ops
    that take an absolute one (`x.as_strided(size, stride, 0)` of an input that is a view at
    offset 5 reads from the start of its storage, as in eager)."""
    offset = t.storage_offset()
    if isinstance(offset, int) and offset == 0:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    extent = _extent(t.shape, t.stride())
    storage = torch.empty(offset + extent, dtype=t.dtype, device=t.device).untyped_storage()
    empty = torch.empty(0, dtype=t.dtype, device=t.device)
    return empty.set_(storage, offset, t.shape, t.stride())


class _Tracing:
    """Which threads are inside an aotc trace. `active`: this thread's flag; `anywhere`: how many
    traces run in the process. Every compiled call asks; a `threading.local` read costs ~2K
    instructions, so the calls read `anywhere` first (a plain attribute, 0 unless some thread
    traces) and the thread's flag only then."""

    __slots__ = ("anywhere", "_local", "_lock")

    def __init__(self) -> None:
        self.anywhere = 0
        self._local = threading.local()
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        return self.anywhere > 0 and getattr(self._local, "active", False)

    def enter(self) -> bool:
        """Mark this thread as tracing; returns its flag before, for `leave`."""
        with self._lock:
            self.anywhere += 1
        was = getattr(self._local, "active", False)
        self._local.active = True
        return was

    def leave(self, was: bool) -> None:
        self._local.active = was
        with self._lock:
            self.anywhere -= 1


# Note [Compiled functions called while aotc traces]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A program may call another `aotc.compile` object (a helper compiled on its own, a submodule
# compiled before the whole model). While aotc traces the outer program, that call gets fake or
# functional tensors: its compiled entries cannot run on them (their guards read storage
# pointers), and Dynamo would compile its frame on them. So, on the thread that traces, such a
# call runs the inner object's Python function itself, which the outer trace then captures like
# the rest of the program. `TRACING.active` is that thread's flag, set by `compiling()`.
TRACING = _Tracing()


@contextlib.contextmanager
def compiling() -> Iterator[None]:
    """`torch.compiler.is_compiling()` is True while aotc traces, as under torch.compile.

    Library code checks the flag to take its traceable path: torch.optim's Adam/AdamW keep the
    step count a tensor instead of calling `.item()` on it, and group tensors lazily. The flag is
    torch.compiler's own (set by Dynamo for the duration of its compilations). Also sets
    `TRACING.active` (Note [Compiled functions called while aotc traces]), and holds eager's
    layouts for fake tensors (Note [Eager's layouts of normalization kernels] in
    aotc/eagerlayouts.py) and records Generators in fx traces (Note [Generators in a trace] in
    aotc/fxgenerators.py)."""
    tracing = TRACING.enter()
    try:
        session = getattr(torch.compiler, "_compile_session_context", None)
        if session is not None:
            with session(), hopcalls.held(), eagerlayouts.held(), fxgenerators.held():
                yield
            return
        old = torch.compiler._is_compiling_flag
        torch.compiler._is_compiling_flag = True
        try:
            with hopcalls.held(), eagerlayouts.held(), fxgenerators.held():
                yield
        finally:
            torch.compiler._is_compiling_flag = old
    finally:
        TRACING.leave(tracing)


# Note [as_strided past its input view]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# `as_strided` takes an absolute storage offset, so on a view it can reach elements its input
# does not hold (`x.narrow(0, 1, 1).as_strided((2,), (1,), 1)` reads x[1] and x[2]). Eager's
# AsStridedBackward0 restricts the gradient to its input's elements: x[2] gets none. Inside the
# compiled graph autograd does the same. But a returned view of an input is regenerated by the
# epilogue as one `as_strided` of the user's tensor, whose backward would restrict only to that
# tensor's elements (fuzz seed 19188: x.grad[2] got the gradient). So the metadata pass notes,
# per view made that way and per view of it, the geometries of the views such an `as_strided`
# reached past (`EagerChecks.narrowed`); an output that aliases an input carries them
# (`OutputInfo.narrowed_by`) and the epilogue takes them, in order, before the output's own
# geometry, each an `as_strided` with grad, so its autograd graph restricts as eager's does. A
# view of an intermediate made that way is refused (aotc/aliasing.py): it is regenerated from
# the graph's value without such a chain.


class EagerChecks(TorchDispatchMode):
    """The plain metadata run's stand-in for what fake tensors do not do as eager does.

    Writes into memory that overlaps itself (an `expand()`ed view) or one of the op's inputs:
    eager refuses some (TensorIterator's overlap checks on `add_`, `copy_` ...) and accepts
    others (`fill_`, `masked_fill_`, `index_put_`). Fake tensors check nothing, so a suspect
    write is replayed on real CPU tensors with the same geometry and aliasing; eager's refusal is
    noted and `check()` raises it afterwards with the user's line (raising inside a dispatch can
    abort from C++ callers). Accepted self-overlapping writes are counted: the functional runs
    must have rewritten each of them (see `OverlappingWrites`).

    `squeeze_(dim)` of a symbolic dim crashes fake tensors (the process dies): it is done as
    `as_strided_` to the out-of-place squeeze's geometry instead.

    `as_strided` past the end of its tensor's storage: eager refuses it, the meta kernel fake
    tensors run does not check (fuzz seed 12499, a view nothing reads, so no later op fails
    either). Checked here when every size is concrete, except on the storages of
    `unsized_inputs`: a fresh fake (symbolic compilations, Dynamo's graphs) has no more storage
    than its own extent, where the real input may have more.

    A write into elements of an input's storage that no graph input holds (`a.as_strided((2,),
    (1,), 1).mul_(2)` on a view `a` at offset 4: fuzz seed 16893): eager writes them, aotc's
    graph writes back only its inputs, so it is refused (`inputs`: the graph's inputs, synthetic
    bases included; see `_written_outside`)."""

    def __init__(
        self, unsized_inputs: Sequence[object] = (), inputs: Sequence[object] = ()
    ) -> None:
        super().__init__()
        self.problem: str | None = None
        self.created: str | None = None  # Note [Kernels that size state on the first call]
        self.accepted_overlaps = 0
        # Views made by `as_strided` past the elements of the view it was applied to, and views
        # of those: the geometries of those inner views (Note [as_strided past its input view])
        self.narrowed: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._written: set[StorageWeakRef] = set()  # storages an op wrote into
        self._unsized = {
            StorageWeakRef(t.untyped_storage())
            for t in unsized_inputs
            if isinstance(t, torch.Tensor) and t.layout is torch.strided
        }
        self._inputs = [
            t for t in inputs if isinstance(t, torch.Tensor) and t.layout is torch.strided
        ]
        # id(view) -> (view, the tensor it was made from, its op as data or None, grad mode,
        # both tensors' geometries then): every view op of the run, for Note [Replayed views]
        # in runtime/viewreplay.py
        self.views: dict[int, ViewRecord] = {}
        # id(view) -> its version when made (Note [Views taken before a write])
        self.view_versions: dict[int, int] = {}
        self.reshaped: dict[int, torch.Tensor] = {}  # tensors an in-place op gave new geometry
        # storages reshaped in place under an earlier view (Note [Views of a tensor reshaped in
        # place] in aotc/tracer.py)
        self._reshaped_under_views: set[StorageWeakRef] = set()
        # storages of inference tensors: fakes' views of them made outside inference mode are
        # not inference tensors, eager's are (Note [Views of inference tensors])
        self._call_inference = torch.is_inference_mode_enabled()  # the call's mode
        self.switched_inference = False
        self._inference: set[StorageWeakRef] = {
            StorageWeakRef(t.untyped_storage()) for t in self._inputs if t.is_inference()
        }

    supports_higher_order_operators = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        inference = torch.is_inference_mode_enabled()
        if inference != self._call_inference:
            self.switched_inference = True  # Note [Inference mode switched inside a call]
        if self.problem is None and func._schema.is_mutable and self._inference and not inference:
            self._check_inference_write(func, args)
        if self.problem is None and func in _AS_STRIDED:
            self._eager_error(
                func,
                _storage_bounds_error(func, args, kwargs, self._unsized),
                "a view reaching past the end of its tensor's storage",
                "Fix the view's size, stride or storage offset.",
            )
        if self.created is None and func in _SIZED_ON_FIRST_CALL:
            self.created = _sized_on_first_call(func, args, kwargs)
        if self.problem is None and func in _INDEX_OPS:
            self._eager_error(
                func,
                _too_many_indices(args),
                "fake tensors do not check it",
                "Index with at most as many indices as the tensor has dimensions.",
            )
        if func in _SQUEEZE_IN_PLACE and _is_symbolic(args[0]):
            out = _SQUEEZE_IN_PLACE[func](*args, **kwargs)
            return torch.ops.aten.as_strided_.default(
                args[0], out.shape, out.stride(), out.storage_offset()
            )
        if self.problem is None and func._schema.is_mutable:
            try:
                self._check(func, args, kwargs)
            except Exception:  # noqa: BLE001 best effort: a failing check must not fail a compile
                self.problem = None
        if func._schema.is_mutable:
            note_writing_op(func)  # Note [Custom operators that write their inputs]
            reshape = func._schema.name in _VIEW_METADATA_IN_PLACE
            for arg, value in zip(func._schema.arguments, args):
                if arg.alias_info is not None and arg.alias_info.is_write:
                    if isinstance(value, torch.Tensor) and value.layout is torch.strided:
                        ref = StorageWeakRef(value.untyped_storage())
                        self._written.add(ref)
                        if not reshape and ref in self._reshaped_under_views:
                            self._refuse_write_after_reshape(func)
            if reshape and isinstance(args[0], torch.Tensor):
                self._note_reshaped_under_views(args[0])
            if func._schema.name in _RESHAPES_IN_PLACE and isinstance(args[0], torch.Tensor):
                self.reshaped[id(args[0])] = args[0]
        out = func(*args, **kwargs)
        if inference:  # every tensor made here is an inference tensor
            for t in out if isinstance(out, (list, tuple)) else (out,):
                if isinstance(t, torch.Tensor) and t.layout is torch.strided:
                    self._inference.add(StorageWeakRef(t.untyped_storage()))
        if func.is_view and args and isinstance(args[0], torch.Tensor):
            self._note_narrowing(func, args[0], out)
            self._note_view(func, args, kwargs, out)
            if (
                self.problem is None
                and func is torch.ops.aten.as_strided.default
                and StorageWeakRef(args[0].untyped_storage()) in self._written
            ):
                self._check_read_after_write(func, args[0], out)
        return out

    def _note_reshaped_under_views(self, t: torch.Tensor) -> None:
        """Note [Views of a tensor reshaped in place] in aotc/tracer.py: `t` is reshaped in place
        while another view of its storage that requires grad, made earlier, is alive."""
        if t.layout is not torch.strided:
            return
        ref = StorageWeakRef(t.untyped_storage())
        for view, *_ in self.views.values():
            if (
                view is not t
                and view.requires_grad
                and view.layout is torch.strided
                and StorageWeakRef(view.untyped_storage()) == ref
            ):
                self._reshaped_under_views.add(ref)
                return

    def _refuse_write_after_reshape(self, func: torch._ops.OpOverload) -> None:
        """A write into a storage `_note_reshaped_under_views` noted: in the joint trace
        autograd would rebuild the earlier views' nodes by replaying their view ops on the
        reshaped tensor, not as eager's `as_strided` of the storage (a wrong gradient)."""
        if self.problem is not None:
            return
        where = _user_frame(traceback.extract_stack())
        self.problem = (
            f"metadata pass: the program at {where}: {func} writes into a tensor whose sizes or "
            "strides an earlier in-place op (`squeeze_`, `t_`, `transpose_`, ...) changed while "
            "another view of it that requires grad was alive: aotc's strict trace cannot give "
            "that view eager's gradient. Use the out-of-place op (`x = x.squeeze(0)`), or the "
            "default capture mode (aotc.compile without capture='trace')."
        )

    def _check_read_after_write(
        self, func: torch._ops.OpOverload, inp: torch.Tensor, out: torch.Tensor
    ) -> None:
        """`as_strided` (an absolute storage offset) of an input's storage the program wrote:
        the functional graph replays it on the written value, a tensor of the input's own
        elements: elements no input holds (fuzz seed 21673) cannot be read back from there."""
        ref = StorageWeakRef(inp.untyped_storage())
        same = [t for t in self._inputs if StorageWeakRef(t.untyped_storage()) == ref]
        offsets = [t.storage_offset() for t in same]
        if not same or not all(type(o) is int for o in offsets):
            return
        if not _written_outside(out, self._inputs):
            return
        what = "reads elements of an input's storage that no input holds"
        where = _user_frame(traceback.extract_stack())
        self.problem = (
            f"metadata pass: the program at {where}: {func} {what}, after the program wrote into "
            "that input: eager reads the caller's memory, aotc's graph replays the view on the "
            "written value, which holds only the input's own elements. Pass the tensor that holds "
            "those elements (the input's base) as an argument, or take the view before the write."
        )

    def _eager_error(
        self, func: torch._ops.OpOverload, eager: str | None, why: str, fix: str
    ) -> None:
        """Note eager's error `eager` for `func` at the user's line (nothing if None)."""
        if eager is not None:
            where = _user_frame(traceback.extract_stack(sys._getframe(2)))
            self.problem = (
                f"metadata pass: the program failed at {where}: {func} raises '{eager}' in "
                f"eager PyTorch too ({why}). {fix}"
            )

    def _check_inference_write(self, func: torch._ops.OpOverload, args: Sequence[Any]) -> None:
        """Note [Views of inference tensors]: eager refuses an in-place op outside inference mode
        on an inference tensor, and every view of one is one, also a view made outside inference
        mode; a fake view made there is a normal tensor, which the fake op writes freely. So a
        write outside inference mode into an inference tensor's storage is refused here, with
        eager's message."""
        for arg, value in zip(func._schema.arguments, args):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            if not isinstance(value, torch.Tensor) or value.layout is not torch.strided:
                continue
            if StorageWeakRef(value.untyped_storage()) in self._inference:
                where = _user_frame(traceback.extract_stack())
                self.problem = (
                    f"metadata pass: the program failed at {where}: {func} raises 'Inplace update "
                    "to inference tensor outside InferenceMode is not allowed' in eager PyTorch "
                    "too (the tensor is a view of an inference tensor). Make a .clone() to get "
                    "a normal tensor before the in-place update."
                )
                return

    def _note_view(
        self, func: torch._ops.OpOverload, args: Any, kwargs: dict[str, Any], out: Any
    ) -> None:
        outs = out if isinstance(out, (list, tuple)) else [out]
        try:
            rest = plain_args(args[1:])
            named = tuple((k, plain_args(v)) for k, v in kwargs.items())
        except TypeError:  # a tensor or a symbolic size argument: not replayable as data
            rest = named = None
        # Symbolic geometries are not compared (that would add guards): `reshaped` says instead
        # whether a tensor's geometry changed in place (see `view_chain` in aotc/aliasing.py).
        symbolic = any(_is_symbolic(t) for t in (args[0], *outs))
        grad = torch.is_grad_enabled()
        for i, o in enumerate(outs):
            if isinstance(o, torch.Tensor):
                if not o.is_inference():  # an inference tensor has no version counter
                    self.view_versions[id(o)] = o._version
                if rest is None or named is None:
                    self.views[id(o)] = (o, args[0], None, grad, None, None)
                    continue
                index = i if isinstance(out, (list, tuple)) else None
                op = ViewOp(str(func), rest, named, index)  # type: ignore[arg-type]
                if symbolic:
                    self.views[id(o)] = (o, args[0], op, grad, None, None)
                else:
                    then = (geometry_of(args[0]), geometry_of(o))
                    self.views[id(o)] = (o, args[0], op, grad, *then)

    def _note_narrowing(self, func: torch._ops.OpOverload, inp: torch.Tensor, out: Any) -> None:
        """See Note [as_strided past its input view]."""
        chain = self.narrowed.get(inp, ())
        if (
            func is torch.ops.aten.as_strided.default
            and inp._base is not None
            and isinstance(out, torch.Tensor)
            and not elements_within(out, inp)
        ):
            chain = (*chain, (tuple(inp.shape), tuple(inp.stride()), inp.storage_offset()))
        if chain:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.narrowed[t] = chain

    def _check(
        self, func: torch._ops.OpOverload, args: tuple[object, ...], kwargs: dict[str, object]
    ) -> None:
        written = [
            value
            for arg, value in zip(func._schema.arguments, args)
            if arg.alias_info is not None
            and arg.alias_info.is_write
            and isinstance(value, torch.Tensor)
        ]
        read = [a for a in args if isinstance(a, torch.Tensor) and all(a is not w for w in written)]
        for w in written:
            if _written_outside(w, self._inputs):
                where = _user_frame(traceback.extract_stack())
                self.problem = (
                    f"metadata pass: the program at {where}: {func} writes elements of an "
                    "input's storage that no input holds (through a view with an absolute "
                    "storage offset, such as `as_strided`): eager writes them, aotc writes back "
                    "only the inputs' own elements. Pass the tensor that holds those elements "
                    "(the input's base) as an argument, or write into a .clone()."
                )
                return
            overlap = torch._debug_has_internal_overlap(w)
            if overlap == 2 and func not in _ORDER_FREE_WRITES and overlaps_itself(w):
                self.problem = self._message(func, None, _SELF_OVERLAP)
                return
            self_overlap = overlap == 1
            partial = func._schema.name.endswith("_") and any(
                _partial_overlap(w, r) or _elements_overlap(w, r) for r in read
            )
            if not (self_overlap or partial):
                continue
            eager = _eager_error(func, args, kwargs)
            if eager is not None:
                self.problem = self._message(func, eager)
            elif partial:
                self.problem = self._message(
                    func,
                    None,
                    "writes into a tensor that partially overlaps one of its inputs, which eager "
                    "accepts for this op but aotc's functional graph cannot reproduce (it reads "
                    "the inputs before any write)",
                )
            else:
                self.accepted_overlaps += 1

    @staticmethod
    def _message(func: object, eager: str | None, what: str = "") -> str:
        where = _user_frame(traceback.extract_stack())
        if eager is not None:
            reason = eager.strip().splitlines()[0].rstrip(".")
            return (
                f"metadata pass: the program failed at {where}: {func} raises "
                f"'{reason}' in eager PyTorch too. .clone() the tensor before modifying it."
            )
        return (
            f"metadata pass: the program at {where}: {func} {what}. .clone() the tensor before "
            "modifying it."
        )

    def check(self, rewritten: int | None = None) -> None:
        """Raise the noted problem; `rewritten`: self-overlapping writes the functional run
        rewrote (fewer than eager accepted: a write aotc could not replay)."""
        if self.problem is not None:
            raise UnsupportedError(self.problem)
        if self.created is not None:
            raise StateCreated(self.created)
        if rewritten is not None and rewritten < self.accepted_overlaps:
            raise UnsupportedError(
                "metadata pass: the program writes into a tensor in which several elements share "
                "memory (an expand()ed view) through an operation aotc cannot replay "
                "(e.g. indexing assignment or an out= argument). Write into a .clone(), or "
                "call the method (`t.fill_`, `t.masked_fill_`, `t.index_put_`) on it directly."
            )


# Note [Kernels that size state on the first call]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Some eager kernels resize the state tensors they write, and their meta kernels do not: the fused
# observer and fake-quantize op of quantization-aware training (`FusedMovingAvgObsFakeQuantize`,
# torch.ao's default QAT config) gives a per-channel observer's running min/max (created empty)
# and its scale and zero point (created with one element) one element per channel on the first
# call. Fake tensors keep the old sizes, so the graph's copy-back into the caller's buffers failed
# after the call, with some of them written (a raw "doesn't match the broadcast shape" error).
# That first call creates state, like an optimizer's first step (Note [State created on the first
# call] in aotc/recording.py): `StateCreated`, so strict mode runs it eagerly and compiles the
# next call, whose buffers have their final sizes; a Dynamo graph holding the op runs eagerly.
_SIZED_ON_FIRST_CALL = frozenset(
    getattr(torch.ops.aten, name).default
    for name in ("fused_moving_avg_obs_fake_quant", "_fused_moving_avg_obs_fq_helper")
    if hasattr(torch.ops.aten, name)
)


def _sized_on_first_call(
    func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str | None:
    """Why this call of a `_SIZED_ON_FIRST_CALL` op resizes its state in eager, or None."""
    bound = dict(zip((a.name for a in func._schema.arguments), args)) | kwargs
    x = bound.get("self")
    if not isinstance(x, torch.Tensor) or not bound.get("per_row_fake_quant", False):
        return None
    axis = bound.get("ch_axis", 0)
    channels = x.shape[axis] if isinstance(axis, int) and -x.dim() <= axis < x.dim() else None
    state = ("running_min", "running_max", "scale", "zero_point")
    sized = [n for n in state if not isinstance(bound.get(n), torch.Tensor)
             or bound[n].numel() != channels]  # fmt: skip
    if channels is None or not sized:
        return None
    where = _user_frame(traceback.extract_stack())
    return (
        f"{func} at {where} sizes its observer state ({', '.join(sized)}) to the {channels} "
        "channels of its input on this call; a graph cannot replay resizing state"
    )


# the ops whose meta kernels take more indices than the tensor has dimensions (eager refuses)
_INDEX_OPS = frozenset(
    {
        torch.ops.aten.index.Tensor,
        torch.ops.aten.index_put.default,
        torch.ops.aten.index_put_.default,
        torch.ops.aten._index_put_impl_.default,
    }
)


# Note [Inference mode switched inside a call]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A strict-mode graph runs in the mode of the call: under `torch.inference_mode()` every tensor
# it makes is an inference tensor and no autograd is recorded; outside, none is. A program that
# switches the mode inside (`with torch.inference_mode(False):` in a call made under inference
# mode, or the reverse) makes the region's tensors in the other mode in eager. The plain run
# makes them as eager does (it runs the program's switches), and eager's refusals there are
# raised (an in-place update of an inference tensor, with Note [Views of inference tensors]).
# What the graph cannot reproduce is an output whose mode is the region's: an output eager made
# a normal tensor, or one requiring grad, in a call under inference mode, or an inference tensor
# in a call outside it. `check_inference_outputs` refuses those after the plain run; outputs the
# program made back in the call's mode (a sum of the region's result) match and compile.
def check_inference_outputs(outs: Sequence[object], leaves: Sequence[object]) -> None:
    call = torch.is_inference_mode_enabled()
    inputs = {id(t) for t in leaves if isinstance(t, torch.Tensor)}
    for j, o in enumerate(outs):
        if not isinstance(o, torch.Tensor) or id(o) in inputs:
            continue
        if o.is_inference() != call or (call and o.requires_grad):
            made = "an inference tensor" if o.is_inference() else "a normal tensor"
            mode = "under" if call else "outside"
            raise UnsupportedError(
                f"metadata pass: output {j} is {made}"
                + (" that requires grad" if o.requires_grad else "")
                + f", made where the program switches torch.inference_mode, in a call {mode} "
                "inference mode. Strict mode compiles one graph that runs in the call's mode. "
                "Use torch.no_grad() for the region, make the call in the mode the program "
                "needs, or use the default capture mode."
            )


def _too_many_indices(args: Sequence[Any]) -> str | None:
    """Eager's IndexError for `self[indices]` with more indices than `self` has dims, or None."""
    if len(args) < 2 or not isinstance(args[0], torch.Tensor):
        return None
    count = 0
    for index in args[1]:
        masks = isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)
        count += index.dim() if masks else 1
    dims = args[0].dim()
    return (
        f"too many indices for tensor of dimension {dims} (got {count})" if count > dims else None
    )


# the ops eager checks against their tensor's storage size: each has the arguments `self`,
# `size`, `stride` and `storage_offset=None` (as_strided_scatter also a `src`)
_AS_STRIDED = frozenset(
    {
        torch.ops.aten.as_strided.default,
        torch.ops.aten.as_strided_.default,
        torch.ops.aten.as_strided_copy.default,
        torch.ops.aten.as_strided_scatter.default,
    }
)


def _storage_bounds_error(
    func: torch._ops.OpOverload,
    args: tuple[object, ...],
    kwargs: dict[str, object],
    unsized: set[StorageWeakRef],
) -> str | None:
    """eager's error (its `setStorage` message) for an `as_strided` family call whose geometry
    reaches past the end of the tensor's storage, or None. Storages in `unsized` are not checked
    (their fake size is not the real one)."""
    try:
        bound = func._schema.arguments
        values = dict(zip((a.name for a in bound), args))
        values.update(kwargs)
        t = values["self"]
        if not isinstance(t, torch.Tensor) or t.layout is not torch.strided:
            return None
        if StorageWeakRef(t.untyped_storage()) in unsized:
            return None
        raw_offset = values.get("storage_offset")
        offset = cast(int, t.storage_offset() if raw_offset is None else raw_offset)
        nbytes = t.untyped_storage().nbytes()
        size, stride = list(values["size"]), list(values["stride"])  # type: ignore[call-overload]
        numbers = (*size, *stride, offset, nbytes)
        if not all(type(v) is int for v in numbers):
            return None
        if any(n == 0 for n in size):
            return None
        itemsize = t.element_size()
        extent = offset + _extent(size, stride)
        if extent * itemsize <= nbytes:
            return None
    except Exception:  # noqa: BLE001 best effort: a failing check must not fail a compile
        return None
    return (
        f"setStorage: sizes {size}, strides {stride}, storage offset {offset}, and itemsize "
        f"{itemsize} requiring a storage size of {extent * itemsize} are out of bounds for "
        f"storage of size {nbytes}"
    )


_SQUEEZE_IN_PLACE = {
    torch.ops.aten.squeeze_.dim: torch.ops.aten.squeeze.dim,
    torch.ops.aten.squeeze_.dims: torch.ops.aten.squeeze.dims,
}


def geometry_of(t: torch.Tensor) -> tuple[object, ...]:
    return (tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype)


# in-place ops that change only their tensor's sizes and strides (Note [Views of a tensor
# reshaped in place] in aotc/tracer.py)
VIEW_METADATA_IN_PLACE = frozenset(
    ("squeeze_", "unsqueeze_", "t_", "transpose_", "swapdims_", "swapaxes_", "as_strided_")
)
_VIEW_METADATA_IN_PLACE = frozenset(f"aten::{name}" for name in VIEW_METADATA_IN_PLACE)


# in-place ops that change their tensor's sizes, strides or storage (not its values)
_RESHAPES_IN_PLACE = frozenset(
    f"aten::{name}"
    for name in (
        "transpose_", "t_", "squeeze_", "unsqueeze_", "as_strided_", "swapdims_", "swapaxes_",
        "resize_", "resize_as_", "set_", "detach_", "_unsafe_set_data",
    )
)  # fmt: skip


# A view op of the plain run: (view, the tensor it was made from, its op as data or None (not
# replayable), grad mode, the two tensors' geometries then (None with no op)).
ViewRecord = tuple[
    torch.Tensor,
    torch.Tensor,
    ViewOp | None,
    bool,
    tuple[object, ...] | None,
    tuple[object, ...] | None,
]


def _is_symbolic(t: object) -> bool:
    return isinstance(t, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in t.shape)


class _NoReplay(Exception):
    pass


def _eager_error(
    func: torch._ops.OpOverload, args: tuple[object, ...], kwargs: dict[str, object]
) -> str | None:
    """eager's error for this call, found by running it on zero-filled real CPU tensors with the
    same geometry and storage sharing; None if eager accepts it (or it cannot be replayed)."""
    storages: dict[StorageWeakRef, torch.Tensor] = {}

    def real(t: object) -> object:
        if not isinstance(t, torch.Tensor):
            return t
        values = (*t.shape, *t.stride(), t.storage_offset())
        if any(isinstance(v, torch.SymInt) for v in values) or t.layout is not torch.strided:
            raise _NoReplay
        ref = StorageWeakRef(t.untyped_storage())
        numel = t.untyped_storage().nbytes() // max(t.element_size(), 1)
        base = storages.get(ref)
        if base is None:
            base = storages[ref] = torch.zeros(numel, dtype=t.dtype)
        elif base.dtype != t.dtype:
            raise _NoReplay
        return base.as_strided(t.shape, t.stride(), t.storage_offset())

    try:
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            real_args, real_kwargs = pytree.tree_map(real, (args, kwargs))
            func(*real_args, **real_kwargs)
    except _NoReplay:
        return None
    except RuntimeError as e:
        return str(e) if "unsupported operation" in str(e) else None
    return None


class OverlappingWrites(TorchFunctionMode):
    """The functional runs' rewrite of in-place methods that write into a tensor whose elements
    share memory through stride-0 dims (`x.expand(3, 4).fill_(1)`), which eager accepts for some
    ops (see `EagerChecks`). Functionalization would propagate such a write back through the
    expand's inverse (a sum), which is wrong; so the write is done on a clone, and for every
    memory location the last written value (eager's sequential order) goes into the tensor with
    the stride-0 dims narrowed to one element (taken from the base without the expand where it
    is one, `_unexpanded`), which functionalization replays exactly; `count` says how many were
    rewritten.

    With autograd recording such a write, eager's forward works but its backward through it
    raises (CopySlices writes the gradient into the same overlapping view). `rewrite=False` (the
    plain run) only notes the autograd nodes of such writes in `refused_nodes`; the metadata pass
    then refuses the backward of every output whose gradient reaches one of them, as eager does.
    """

    def __init__(self, rewrite: bool = True) -> None:
        super().__init__()
        self.rewrite = rewrite
        self.count = 0
        # id -> the node itself: held, so that a node of a value the program drops (a write
        # into an intermediate no output uses) keeps its id from being reused by another node
        # (fuzz seed 39899: an output's own node then looked refused)
        self.refused_nodes: dict[int, object] = {}
        # expand results -> what they expand, for tensors with no `_base` (views made in
        # inference mode do not record one; see `_unexpanded`)
        self.expanded = WeakIdKeyDictionary()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        selected = _symbolic_getitem(name, args, kwargs)
        if selected is not None:
            return selected
        if name in _EXPANDS and args and isinstance(args[0], torch.Tensor):
            result = func(*args, **kwargs)
            if isinstance(result, torch.Tensor) and result._base is None:
                self.expanded[result] = args[0]
            return result
        if (
            not name.endswith("_")
            or name.startswith("_")
            or not args
            or not isinstance(args[0], torch.Tensor)
            or name in _METADATA_IN_PLACE
        ):
            return func(*args, **kwargs)
        target = args[0]
        dims = [
            d for d, (n, st) in enumerate(zip(target.shape, target.stride())) if st == 0 and n > 1
        ]
        if not dims or torch._debug_has_internal_overlap(target) != 1:
            if self.rewrite and not target.is_contiguous():
                return _keep_strides(func, name, args, kwargs)
            return func(*args, **kwargs)
        if not self.rewrite:
            root = target._base if target._base is not None else target
            before = root.grad_fn
            result = func(*args, **kwargs)
            # Only a write autograd recorded (a new node: not under no_grad) has the backward
            # eager refuses.
            if root.grad_fn is not None and root.grad_fn is not before:
                self.refused_nodes[id(root.grad_fn)] = root.grad_fn
            return result
        self.count += 1
        written = target.clone()
        func(written, *args[1:], **kwargs)
        old = target.expand_as(written)
        changed = written != old
        if written.is_floating_point() or written.is_complex():
            changed = changed & ~(written.isnan() & old.isnan())
        value = written
        for d in reversed(dims):
            position = torch.arange(written.shape[d], device=written.device).view(
                [-1 if k == d else 1 for k in range(written.dim())]
            )
            last = (changed * position).amax(d, keepdim=True)
            value = value.gather(d, last.expand([1 if k == d else -1 for k in range(value.dim())]))
            changed = changed.any(d, keepdim=True)
        dest = target
        for d in dims:
            dest = dest.narrow(d, 0, 1)
        dest = _unexpanded(target, dest, cast("torch.Tensor | None", self.expanded.get(target)))
        dest.copy_(value)
        return target


_EXPANDS = frozenset({"expand", "expand_as", "broadcast_to"})


def _symbolic_getitem(name: str, args: tuple, kwargs: dict | None) -> torch.Tensor | None:
    """`t[index]` (a `__getitem__` call) as `_symbolic_select`, or None."""
    if name != "__getitem__" or len(args) != 2 or kwargs:
        return None
    return _symbolic_select(*args)


def _symbolic_select(t: object, index: object) -> torch.Tensor | None:
    """`t[i]`, `t[:, i]`, `t[j, 1:, i]`... (ints and slices only) with some index a symbolic
    int, as the slices, then `select`s, last dim first; None otherwise. Tensor indexing
    converts a SymInt index with `__index__`, which specializes the trace on its value
    (`x[x.shape[0] // 2]` compiled one entry per size under dynamic=True); `select` takes it as
    a SymInt. Eager's indexing is these `select`s for such an index."""
    if not isinstance(t, torch.Tensor):
        return None
    parts = index if type(index) is tuple else (index,)
    if not parts or len(parts) > t.dim() or not any(type(p) is torch.SymInt for p in parts):
        return None
    if not all(type(p) in (int, torch.SymInt, slice) for p in parts):
        return None
    slices = tuple(p if type(p) is slice else slice(None) for p in parts)
    if any(p != slice(None) for p in slices):
        t = t[slices]  # the slices first: they keep every dim, so the selects' dims hold
    for dim in range(len(parts) - 1, -1, -1):
        if type(parts[dim]) is not slice:
            t = t.select(dim, parts[dim])
    return t


class SymbolicIndexing(TorchFunctionMode):
    """`_symbolic_select` for runs of the program outside the metadata pass's modes (the cache
    key's fake run in the compile's ShapeEnv), which would otherwise add the specializing guard
    to the compile's ShapeEnv."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        selected = _symbolic_getitem(getattr(func, "__name__", ""), args, kwargs)
        return func(*args, **(kwargs or {})) if selected is None else selected


def _unexpanded(
    target: torch.Tensor, dest: torch.Tensor, source: torch.Tensor | None = None
) -> torch.Tensor:
    """`dest` (the expanded `target` narrowed to one element along its stride-0 dims) as a view
    of target's base without the expand, when target is its base expanded (new leading dims,
    size-1 dims broadcast): functionalization replays a write through an expand as base +
    sum(new - old) over the expanded dims, which cancels (1e35 + (2 - 1e35) is 0; fuzz seed
    19294); through `unsqueeze` (or, for a contiguous block of a contiguous base, a flat slice)
    it is exact. Else `dest` itself. `source`: what `target` expands, for a target with no
    `_base` (made in inference mode, which records none; fuzz seed 35956)."""
    root = target._base if target._base is not None else source
    if root is None:
        return dest

    def same(alt: torch.Tensor) -> bool:
        return (
            tuple(alt.shape) == tuple(dest.shape)
            and alt.storage_offset() == dest.storage_offset()
            and all(a == d for n, a, d in zip(alt.shape, alt.stride(), dest.stride()) if n != 1)
        )

    if target.dim() >= root.dim():
        alt = root
        for _ in range(target.dim() - root.dim()):
            alt = alt.unsqueeze(0)
        if same(alt):
            return alt
    # A contiguous block of a contiguous base (`x.view(-1).expand(2, -1)`, fuzz seed 23122):
    # the base flattened, sliced and viewed as dest, all replayed exactly.
    if root.is_contiguous() and dest.is_contiguous():
        start = dest.storage_offset() - root.storage_offset()
        if 0 <= start and start + dest.numel() <= root.numel():
            alt = root.view(-1)[start : start + dest.numel()].view(dest.shape)
            if same(alt):
                return alt
    return dest


def _keep_strides(
    func: Callable[..., object], name: str, args: tuple[object, ...], kwargs: dict[str, object]
) -> object:
    """`t.op_(...)` on a non-contiguous `t` as `t.copy_(t.op(...))`: functionalization would give
    `t` the strides of the out-of-place result (often contiguous), eager keeps t's, and later
    stride-dependent ops (`.contiguous()`, `.reshape()`) and output layouts would differ; a
    functional `copy` keeps the destination's layout."""
    target = args[0]
    assert isinstance(target, torch.Tensor)
    if name == "zero_":
        value: object = torch.zeros_like(target)
    elif name == "fill_":
        value = torch.full_like(target, args[1]) if len(args) > 1 else None  # type: ignore[arg-type]
    else:
        op = getattr(torch.Tensor, name[:-1], None)
        source = target
        if op is not None and torch.is_grad_enabled() and _any_requires_grad(args, kwargs):
            # The out-of-place op's autograd node saves its input, which the copy_ below then
            # changes: eager's in-place node saves a copy of it (its `original_self`), and so
            # must this one (fuzz seed 18188: `v.mul_(w)` on a transposed view gave w the
            # gradient of the written values). A saved value changed in place is no error here
            # (the trace's saved-tensor hooks skip the version check).
            source = target.clone()
        value = op(source, *args[1:], **kwargs) if op is not None else None
    if not isinstance(value, torch.Tensor) or value.shape != target.shape:
        return func(*args, **kwargs)
    return target.copy_(value)


def _any_requires_grad(args: tuple[object, ...], kwargs: dict[str, object]) -> bool:
    return any(
        isinstance(a, torch.Tensor) and a.requires_grad for a in pytree.tree_leaves((args, kwargs))
    )


_METADATA_IN_PLACE = frozenset(
    {
        "t_",
        "transpose_",
        "squeeze_",
        "unsqueeze_",
        "as_strided_",
        "swapdims_",
        "swapaxes_",
        "resize_",
        "resize_as_",
        "set_",
        "requires_grad_",
        "retain_grad",
        "share_memory_",
        "detach_",
        "record_stream",
    }
)


# Note [Writes into a tensor that overlaps itself]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# `base.as_strided((3, 3), (2, 1))` over 10 elements addresses elements 2, 4 and 6 twice.
# Eager's overlap check refuses a write only into stride-0 dims (an `expand`); for others it
# cannot decide cheaply (`_debug_has_internal_overlap` says "too hard") and writes element by
# element in its kernel's order, so `x.mul_(2)` doubles each shared element twice, and what
# `x.add_(y)` or `x.copy_(y)` leave there depends on which index the kernel visits last. aotc's
# functional graph computes every element once from the old values, a different result, silently.
# So such a write is refused when two of the tensor's elements really share memory
# (`overlaps_itself`), except for writes whose result does not depend on the order
# (`_ORDER_FREE_WRITES`: one value for every element), which the graph's scatter reproduces.
_SELF_OVERLAP = (
    "writes into a tensor in which several indices address the same element (an `as_strided` "
    "view whose strides overlap): eager's result then depends on the order its kernel visits "
    "the elements, which aotc's functional graph cannot reproduce"
)
_ORDER_FREE_WRITES = frozenset(
    {torch.ops.aten.fill_.Scalar, torch.ops.aten.fill_.Tensor, torch.ops.aten.zero_.default}
)


def overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two indices of `t` address the same element (see Note [Writes into a tensor that
    overlaps itself]); False for symbolic geometry (left to eager's own check)."""
    geometry = [(n, st) for n, st in zip(t.shape, t.stride()) if n != 1]
    if not all(type(n) is int and type(st) is int for n, st in geometry):
        return False
    if any(n == 0 for n, _ in geometry):
        return False
    reach = 0  # the largest offset the dims with smaller strides reach
    for n, st in sorted(geometry, key=lambda d: abs(d[1])):
        if abs(st) <= reach:
            break
        reach += abs(st) * (n - 1)
    else:
        return False  # each stride steps past every offset below it: no overlap
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        offsets = torch.zeros((), dtype=torch.int64)
        for n, st in geometry:
            offsets = offsets.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * st
        return int(offsets.unique().numel()) < offsets.numel()


# Storages up to this many elements are compared element by element in `_elements_overlap`;
# larger ones by their byte ranges (a conservative answer: a refusal, never a silent difference).
_OVERLAP_ELEMENTS = 1 << 22


def _elements_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether writing `a` in place while reading `b` touches an element of both, `b` not being
    `a`'s own geometry. Eager then gives a result that depends on the order it visits elements
    (`a.add_(a[:, 1:2])`: later columns add the updated column; fuzz seed 14905), and its own
    overlap check only covers dense tensors (`_partial_overlap`); aotc's functional graph reads
    every input before it writes."""
    if a.device != b.device or a.layout is not torch.strided or b.layout is not torch.strided:
        return False
    if StorageWeakRef(a.untyped_storage()) != StorageWeakRef(b.untyped_storage()):
        return False
    geometry = [(*t.shape, *t.stride(), t.storage_offset()) for t in (a, b)]
    nbytes = a.untyped_storage().nbytes()
    if not all(type(v) is int for g in geometry for v in g) or type(nbytes) is not int:
        return False  # symbolic: left to the checks above
    if geometry[0] == geometry[1] and a.dtype == b.dtype:
        return False
    if a.numel() == 0 or b.numel() == 0:
        return False

    def span(t: torch.Tensor) -> tuple[object, object]:
        start = t.storage_offset() * t.element_size()
        return start, start + _extent(t.shape, t.stride()) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    if not (a0 < b1 and b0 < a1):  # type: ignore[operator]
        return False
    size = a.element_size()
    if b.element_size() != size or nbytes // size > _OVERLAP_ELEMENTS:
        return True
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        index = torch.arange(nbytes // size)
        ia = index.as_strided(a.shape, a.stride(), a.storage_offset()).reshape(-1)
        ib = index.as_strided(b.shape, b.stride(), b.storage_offset()).reshape(-1)
        return bool(torch.isin(ia, ib).any())


def elements_within(out: torch.Tensor, inp: torch.Tensor) -> bool:
    """Whether every element `out` views is one of `inp`'s (same storage); True where
    `_written_outside` cannot tell (symbolic sizes)."""
    return not _written_outside(out, [inp])


def _written_outside(w: torch.Tensor, inputs: Sequence[torch.Tensor]) -> bool:
    """Whether an in-place write into `w` reaches an element of an input's storage that no
    input on that storage holds (see EagerChecks). Element-exact up to `_OVERLAP_ELEMENTS`
    elements of storage; above, only a write outside every input's span counts. False when a
    size is symbolic or the element sizes differ (not checked)."""
    if w.layout is not torch.strided or w.numel() == 0:
        return False
    ref = StorageWeakRef(w.untyped_storage())
    same = [t for t in inputs if t.numel() and StorageWeakRef(t.untyped_storage()) == ref]
    if not same:
        return False
    geometry = [v for t in (w, *same) for v in (*t.shape, *t.stride(), t.storage_offset())]
    nbytes = w.untyped_storage().nbytes()
    if not all(type(v) is int for v in geometry) or type(nbytes) is not int:
        return False
    size = w.element_size()
    if any(t.element_size() != size for t in same):
        return False

    def span(t: torch.Tensor) -> tuple[int, int]:  # sizes are ints here (checked above)
        start = cast(int, t.storage_offset())
        return start, start + cast(int, _extent(t.shape, t.stride()))

    from torch._prims_common import is_non_overlapping_and_dense_or_false as dense

    (w0, w1), spans = span(w), [span(t) for t in same]
    if any(_same_geometry(w, t) for t in same) or any(
        t0 <= w0 and w1 <= t1 and dense(t) for t, (t0, t1) in zip(same, spans, strict=True)
    ):
        return False  # the fast paths: an input itself, or inside a dense one (it holds its span)
    elements = nbytes // size
    if elements > _OVERLAP_ELEMENTS or w1 > elements:
        return not any(t0 <= w0 and w1 <= t1 for t0, t1 in spans)
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        index = torch.arange(elements)
        held = torch.zeros(elements, dtype=torch.bool)
        for t, (_, t1) in zip(same, spans, strict=True):
            if t1 <= elements:
                held[index.as_strided(t.shape, t.stride(), t.storage_offset())] = True
        return not bool(held[index.as_strided(w.shape, w.stride(), w.storage_offset())].all())


def _same_geometry(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.shape, a.stride(), a.storage_offset()) == (b.shape, b.stride(), b.storage_offset())


def _partial_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """eager's partial-overlap check (TensorIterator's assert_no_partial_overlap): two dense
    tensors on one storage whose byte ranges intersect, other than the same range and strides."""
    from torch._prims_common import is_non_overlapping_and_dense_or_false as dense

    if a.device != b.device or not (dense(a) and dense(b)):
        return False
    if StorageWeakRef(a.untyped_storage()) != StorageWeakRef(b.untyped_storage()):
        return False
    a0, b0 = a.storage_offset() * a.element_size(), b.storage_offset() * b.element_size()
    a1, b1 = a0 + a.numel() * a.element_size(), b0 + b.numel() * b.element_size()
    if (a0, a1) == (b0, b1):
        return a.stride() != b.stride()
    return a0 < b1 and b0 < a1
