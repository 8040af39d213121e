"""Runtime wrappers: the callable a user holds.

Stage: `build_entry(plan, fwd, bwd) -> CompiledEntry` (one compiled signature) and
`Dispatcher` (picks the entry for a call by its guard key, compiling on a miss).

Every call of a compiled entry goes:
    user leaves --apply_convention--> graph args --autograd node (or plain forward)--> fwd outputs
    --apply_mutations--> inputs updated --build_outputs--> user outputs --unflatten--> result
Entries whose plan needs none of the fix-ups run a generated straight-line version of this
instead (runtime/fastpath.py, Note [Direct plans]).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.utils._pytree as pytree

from aotc.runtime.autograd import (
    GRAD_ANCHOR,
    AutogradPlan,
    HigherOrder,
    make_autograd_function,
    refresh_watched,
    watch_outputs,
)
from aotc.runtime.convention import apply_convention
from aotc.runtime.epilogue import (
    EpiloguePlan,
    StepKind,
    apply_mutations,
    build_outputs,
    read_versions,
    regenerated_view,
    stale_input_views,
)
from aotc.runtime.errors import GuardError, UnsupportedError
from aotc.runtime.fastpath import make_fast_call
from aotc.runtime.guards import MISS, explain_bad_leaves, remember_probe, signature_key
from aotc.runtime.schema import CallingConvention, GraphArg, OutputKind
from aotc.runtime.segments import SegmentNodes, SegmentProgram

log = logging.getLogger("aotc.recompiles")

# One compilation at a time per process: tracing enters process-wide torch state (the Python
# dispatcher, fx's stack-trace anchors, aotc's lifted-value swaps). Taken before a dispatcher's
# own lock, always in that order; reentrant for a compiled function called while tracing another.
COMPILE_LOCK = threading.RLock()

# Calls of entries that mutate their inputs run one at a time (see Note [Concurrent mutations]).
MUTATION_LOCK = threading.RLock()


@dataclass(frozen=True, slots=True)
class RuntimePlan:
    """Everything the runtime needs besides the two graph callables."""

    name: str
    convention: CallingConvention
    epilogue: EpiloguePlan
    autograd: AutogradPlan | None  # None: an inference entry (forward graph only)
    detach_args: tuple[GraphArg, ...]  # require grad but statically get no gradient
    out_spec: pytree.TreeSpec
    # Compiled under no_grad for a program that enables grad inside: the autograd node runs
    # with grad on, so outputs computed under torch.enable_grad() require grad as in eager.
    enable_grad: bool = False
    # The program calls torch.func.grad/vjp/jacrev/hessian, which eager runs only when no
    # saved-tensor hooks are active; the graphs no longer contain them, so calls check. See Note
    # [Traces under torch.func] in aotc/functional.py. Such entries take the general path.
    refuse_saved_hooks: bool = False
    # The fast path runs the forward graph under eager's own autograd instead of the compiled
    # pair: Note [Eager autograd on the ATen path] in aotc/eagerautograd.py.
    eager_autograd: bool = False
    # With eager_autograd: the input writes (graph arg, fwd output) the replayed forward does in
    # place, so the epilogue only sets their versions (Note [Buffers written in place] in
    # runtime/replay.py).
    writes_in_place: tuple[tuple[int, int], ...] = ()


class CompiledEntry:
    """One compiled signature. `call(leaves)` (also `run`, the same function) is the per-call hot
    path: the generated fast path for direct plans (runtime/fastpath.py), else `_call_general`."""

    __slots__ = (
        "plan",
        "record",
        "call",
        "run",
        "hit",
        "run_args",
        "_fwd",
        "_fn",
        "_watch",
        "_watch_outputs",
        "_apply",
        "_detach",
        "_diff",
        "_holder_size",
        "_unflatten",
        "_mutates",
        "_anchor",
        "_enable_grad",
        "_segments",
        "_replay",
        "_in_place",
    )

    def __init__(
        self,
        plan: RuntimePlan,
        fwd: Callable[..., tuple[torch.Tensor, ...]],
        bwd: Callable[..., tuple[torch.Tensor, ...]] | None,
        record: object = None,
        higher: HigherOrder | None = None,
        backward_graph: Any = None,
        segments: Sequence[SegmentProgram] = (),
        segment_highers: Sequence[HigherOrder | None] = (),
        segment_backwards: Sequence[Callable[..., Any] | None] = (),
        replay: Callable[..., tuple[torch.Tensor, ...]] | None = None,
    ) -> None:
        """`backward_graph`: the fx graph `bwd` runs (pruned for outputs that get no gradient,
        Note [Absent gradients] in runtime/absent.py). `segments`: the entry's autograd nodes
        when it has several (Note [Segments] in passes/segments.py), with their differentiable
        backwards; `bwd` and `higher` are then unused. `replay`: the forward the fast path runs
        under eager's autograd when the plan says `eager_autograd` (runtime/replay.py)."""
        self.plan = plan
        self.record = record
        self._segments: SegmentNodes | None = None
        written = frozenset(m.target for m in plan.epilogue.mutations if m.kind is StepKind.COPY)
        if segments:
            assert plan.autograd is not None
            self._segments = SegmentNodes(
                fwd,
                segments,
                plan.autograd.num_graph_args,
                plan.autograd.num_fwd_outs,
                plan.name,
                segment_highers or (None,) * len(segments),
                segment_backwards or (None,) * len(segments),
                written,
                _segment_views(plan.epilogue, segments, plan.autograd.num_fwd_outs),
                functools.partial(regenerated_view, plan.epilogue),
            )
        if plan.autograd is None:
            fwd = _without_grad(fwd)  # an inference entry's outputs never require grad
        self._fwd = fwd
        self._fn: type[torch.autograd.Function] | None = None
        self._apply: Callable[..., Any] | None = None
        self._diff: tuple[int, ...] = ()
        self._holder_size = 0
        if plan.autograd is not None and self._segments is None:
            assert bwd is not None
            self._fn = make_autograd_function(
                fwd, bwd, plan.autograd, plan.name, higher, written, backward_graph
            )
            # See Note [Direct apply]
            # torch's stubs declare `apply` on Function only, not on its C base (_FunctionBase).
            self._apply = super(torch.autograd.Function, self._fn).apply  # type: ignore[misc]
            _direct_backward(self._fn)
            self._diff = plan.autograd.diff_outs
        # [] for a node that fills its holder, else one slot per fwd output for the placement
        # below (Note [No holder when every output is differentiable] in runtime/autograd.py).
        fills = self._fn is None or self._fn.aotc_fills_holder  # type: ignore[attr-defined]
        self._holder_size = 0 if fills else plan.autograd.num_fwd_outs  # type: ignore[union-attr]
        self._detach = frozenset(plan.detach_args)
        epilogue = plan.epilogue
        self._mutates = bool(epilogue.mutations or epilogue.versions or epilogue.make_require_grad)
        self._anchor = plan.autograd is not None and plan.autograd.anchor
        self._watch = plan.autograd is not None and bool(plan.autograd.watch)
        self._watch_outputs = plan.autograd.watch_outputs if plan.autograd is not None else ()
        self._enable_grad = plan.enable_grad
        self._replay = replay  # None unless the plan says eager_autograd (never segmented)
        self._in_place = frozenset(plan.writes_in_place)  # done by `replay`, not the epilogue
        self._unflatten = _unflattener(plan.out_spec)
        self.call: Callable[[list[object]], object]
        if self._mutates:
            fast = None
            if replay is not None:  # Note [Generated buffer writes] in runtime/fastpath.py
                fast = make_fast_call(
                    plan, fwd, self._apply, self._call_locked, replay=replay, lock=MUTATION_LOCK
                )
            self.call = fast or self._call_locked
        elif self._segments is not None:
            self.call = self._call_general
        else:
            fast = make_fast_call(
                plan,
                fwd,
                self._apply,
                self._call_general,
                fills_holder=self._holder_size == 0,
                replay=replay,
            )
            self.call = fast or self._call_general
        # `run` is `call` itself, not a method calling it: one frame less for callers that hold
        # `entry.run` (the torch.compile backend's per-call closure).
        self.run: Callable[[list[object]], object] = self.call
        # After a passing signature check (Note [Calls after a guard hit] in runtime/fastpath.py).
        self.hit: Callable[[list[object]], object] = getattr(self.call, "aotc_hit", self.call)
        # `call` taking the leaves as arguments: the torch.compile backend's closure for graphs
        # that lift nothing is this function itself (runtime/fastpath.py generates it).
        self.run_args: Callable[..., object] = getattr(self.call, "aotc_run", None) or (
            lambda *leaves: self.call([*leaves])
        )

    def _call_locked(self, leaves: list[object]) -> object:
        with MUTATION_LOCK:
            return self._call_general(leaves)

    def _call_general(self, leaves: list[object]) -> object:
        if self.plan.refuse_saved_hooks and _saved_hooks_active(True) is not None:
            raise UnsupportedError(f"{self.plan.name}: {FUNCTORCH_HOOKS_REFUSAL}")
        if torch._C._is_any_autocast_enabled():  # See Note [Graphs run without autocast]
            with torch._C._DisableAutocast():
                return self._run(leaves)
        if self._replay is not None and not torch._C._are_functorch_transforms_active():
            return self._run(leaves, self._replay)
        return self._run(leaves)

    def _run(self, leaves: list[object], replay: Callable[..., Any] | None = None) -> object:
        """`replay`: the forward eager's autograd records (Note [Eager autograd on the ATen
        path] in aotc/eagerautograd.py), run in place of the autograd node."""
        plan = self.plan
        for a in plan.epilogue.make_require_grad:
            cast(torch.Tensor, leaves[a]).requires_grad_()
        args = apply_convention(plan.convention, leaves)
        if self._segments is not None:
            return self._run_segments(leaves, args)
        diff: Any = None
        fwd_outs: Sequence[torch.Tensor]
        in_place: frozenset[tuple[int, int]] = frozenset()
        versions = None
        if replay is not None:
            if self._in_place:  # Note [Buffers written in place] in runtime/replay.py
                in_place, versions = self._in_place, read_versions(plan.epilogue, leaves)
            fwd_outs = replay(*args)
        elif self._fn is not None:
            if self._detach:
                args = [a.detach() if i in self._detach else a for i, a in enumerate(args)]
            if self._anchor:
                args = [*args, GRAD_ANCHOR]
            holder: list[torch.Tensor] = [None] * self._holder_size  # type: ignore[list-item]
            # Inference mode records no history even inside enable_grad (eager's rule): a graph
            # Dynamo compiled with inference mode off must not turn it on again.
            regrad = self._enable_grad and not torch.is_inference_mode_enabled()
            with torch.enable_grad() if regrad else _NO_CHANGE:
                if torch._C._are_functorch_transforms_active():
                    diff = self._fn.apply(holder, *args)
                else:
                    assert self._apply is not None  # set with _fn
                    diff = self._apply(holder, *args)
            for pos, k in enumerate(self._diff):
                holder[k] = diff[pos]
            fwd_outs = holder
        else:
            fwd_outs = self._fwd(*args)
        early = None
        if self._mutates:
            early = stale_input_views(plan.epilogue, leaves)
            graph_args = apply_convention(plan.convention, leaves)
            apply_mutations(plan.epilogue, leaves, graph_args, fwd_outs, in_place, versions)
            if self._watch and diff is not None:
                refresh_watched(diff)
        result = build_outputs(plan.epilogue, leaves, fwd_outs, early)
        if diff is not None and self._watch_outputs:
            watch_outputs(diff, result, self._watch_outputs)
        return self._unflatten(result)

    def _run_segments(self, leaves: list[object], args: list[Any]) -> object:
        """`_run` for an entry of several autograd nodes (Note [Segments] in
        passes/segments.py); such entries write inputs only under no_grad, in the epilogue."""
        plan = self.plan
        assert self._segments is not None
        if self._detach:
            args = [a.detach() if i in self._detach else a for i, a in enumerate(args)]
        regrad = self._enable_grad and not torch.is_inference_mode_enabled()
        with torch.enable_grad() if regrad else _NO_CHANGE:
            fwd_outs, diffs, early = self._segments.run(args, leaves)
        if self._mutates:
            early.update(stale_input_views(plan.epilogue, leaves))
            graph_args = apply_convention(plan.convention, leaves)
            apply_mutations(plan.epilogue, leaves, graph_args, fwd_outs)
            for diff in diffs:
                refresh_watched(diff)
        result = build_outputs(plan.epilogue, leaves, fwd_outs, early)
        for diff, seg_plan in zip(diffs, self._segments.plans):
            if seg_plan.watch_outputs:
                watch_outputs(diff, result, seg_plan.watch_outputs)
        return self._unflatten(result)


def _segment_views(
    epilogue: EpiloguePlan, segments: Sequence[SegmentProgram], num_fwd: int
) -> dict[int, tuple[int, int | None]]:
    """The consumed outputs no segment returns (views the runtime regenerates), each with its
    user output and its base's FwdOut; from `num_fwd` on, views of inputs (base None) named by
    `num_fwd + j` (Note [Views other outputs are computed from] in passes/segments.py)."""
    owned = {k for seg in segments for k in seg.owned}
    views: dict[int, tuple[int, int | None]] = {}
    for seg in segments:
        for k in seg.consumes:
            if k in owned or k in views:
                continue
            if k >= num_fwd:
                views[k] = (k - num_fwd, None)
                continue
            for j, s in enumerate(epilogue.outputs):
                if s.source == k and s.kind is OutputKind.ALIAS_OF_INTERMEDIATE:
                    assert s.base is not None
                    views[k] = (j, s.base)
                    break
                if s.source == k and s.kind is OutputKind.ALIAS_OF_OUTPUT:
                    assert s.base is not None
                    base = epilogue.outputs[s.base].source
                    assert base is not None
                    views[k] = (j, base)
                    break
            else:
                raise AssertionError(f"segment input fwd_out{k} is neither returned nor a view")
    return views


_saved_hooks_active = torch._C._autograd._top_saved_tensors_default_hooks
FUNCTORCH_HOOKS_REFUSAL = (
    "torch.func.{grad, vjp, jacrev, hessian} don't yet support saved tensor hooks. The compiled "
    "program calls one of these transforms, and eager raises this error for it under "
    "saved-tensor hooks (saved_tensors_hooks, save_on_cpu, activation checkpointing) too. Call "
    "it outside those hooks, or use torch.autograd.grad inside it instead of the transform."
)


class _NoChange:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NO_CHANGE = _NoChange()


def _without_grad(
    fwd: Callable[..., tuple[torch.Tensor, ...]],
) -> Callable[..., tuple[torch.Tensor, ...]]:
    """Run an inference entry's forward with grad off: its graph ops would otherwise record
    autograd history for inputs that require grad (the entry was compiled because no output
    needs a gradient, e.g. all computed under torch.no_grad())."""
    is_enabled, set_enabled = torch.is_grad_enabled, torch._C._set_grad_enabled

    def run(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if not is_enabled():
            return fwd(*args)
        set_enabled(False)
        try:
            return fwd(*args)
        finally:
            set_enabled(True)

    run.__aotc_source__ = getattr(fwd, "__aotc_source__", None)  # type: ignore[attr-defined]
    return run


# Note [Concurrent mutations]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A call that mutates an input reads it (graph args), computes the new value, then writes it back
# in the epilogue. Two threads calling a module that does `self.steps.add_(1)` would both read the
# old value and one update would be lost, where eager's in-place kernels, each run whole under the
# GIL, lose none. So entries with input mutations run their whole call under one process-wide
# lock (reentrant, for a compiled function called inside another's call). Entries that mutate
# nothing take no lock: their per-call path is unchanged.


# Note [Graphs run without autocast]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A trace under torch.autocast records the ops autocast produced (the casts and the low-precision
# matmuls), so the graphs already carry eager's dtypes; running them under autocast again would
# cast a second time (an fp32 matmul the user wrapped in `autocast(enabled=False)` would become
# bf16). The autocast state is part of the guard key, so each state has its own graphs.

# Note [Direct apply]
# ~~~~~~~~~~~~~~~~~~~
# `torch.autograd.Function.apply` is a Python classmethod that binds default arguments for
# `setup_context` (we define none) and unwraps dead functorch wrappers (only needed while a
# functorch transform is active) before calling the C++ `_FunctionBase.apply`. Calling the C++
# apply directly when no transform is active halves the cost of a tiny training call on CPU
# (measured 35 -> 15 us for a 2-op graph); with a transform active we take the full path.


# Note [Direct backward]
# ~~~~~~~~~~~~~~~~~~~~~~
# The autograd engine runs a custom Function's node by calling `apply` on its backward object,
# an instance of the class `FunctionMeta` makes for it (a `BackwardCFunction` subclass). The
# inherited `apply` is a Python method that looks up `backward` and `vjp` on the forward class,
# refuses classes that define both, checks `boxed_grads_call`, then calls `backward(ctx, *grads)`:
# a Python frame and a few attribute reads per backward call. Our classes define `backward`
# only and never set `boxed_grads_call`, so that method always calls our `backward` with the
# same arguments; binding `backward` as the backward class's `apply` skips it (measured with
# callgrind: ~2% of a tiny training step). Anything else (a `vjp`, boxed grads) keeps the
# inherited method.


def _direct_backward(fn: type[torch.autograd.Function]) -> None:
    backward_cls = getattr(fn, "_backward_cls", None)
    if (
        backward_cls is None
        or fn.vjp is not torch.autograd.Function.vjp
        or getattr(fn, "boxed_grads_call", False)
        or backward_cls.apply is not torch.autograd.function.BackwardCFunction.apply
    ):
        return
    backward_cls.apply = fn.backward


def _unflattener(spec: pytree.TreeSpec) -> Callable[[list[object]], object]:
    if spec.is_leaf():
        return lambda leaves: leaves[0]
    if spec.type is tuple and all(c.is_leaf() for c in spec.children()):
        return tuple
    return lambda leaves: pytree.tree_unflatten(leaves, spec)


_TENSOR_FIELDS = ("dtype", "device", "shape", "stride", "requires_grad", "is_leaf")


def describe_change(old: tuple[Any, ...], new: tuple[Any, ...]) -> str:
    """Why a guard key differs from the previous one, in words (see runtime/guards.py)."""
    (old_extra, (old_parts, old_alias, old_grad, old_ac)) = old
    (new_extra, (new_parts, new_alias, new_grad, new_ac)) = new
    reasons: list[str] = []
    if old_grad != new_grad:
        reasons.append(f"grad mode {old_grad} -> {new_grad}")
    if old_ac != new_ac:
        reasons.append(f"autocast {old_ac} -> {new_ac}")
    if old_extra != new_extra:
        reasons.append("argument structure or module training flags changed")
    if len(old_parts) != len(new_parts):
        reasons.append(f"{len(old_parts)} -> {len(new_parts)} inputs")
    for i, (a, b) in enumerate(zip(old_parts, new_parts)):
        if a == b:
            continue
        if len(a) == len(_TENSOR_FIELDS) and len(b) == len(_TENSOR_FIELDS):
            for name, x, y in zip(_TENSOR_FIELDS, a, b):
                if x != y:
                    reasons.append(
                        f"input {i} {name} {tuple(x) if name == 'shape' else x} -> "
                        f"{tuple(y) if name == 'shape' else y}"
                    )
        else:
            reasons.append(f"input {i} {a[-1]!r} -> {b[-1]!r}")
    if old_alias != new_alias:
        reasons.append("which inputs alias each other changed")
    return "; ".join(reasons) or "unknown"


class Dispatcher:
    """Maps guard keys to compiled entries. Compiles under a lock, so concurrent first calls
    compile once; lookups of existing entries take no lock.

    A call first runs the generated check of the entry that ran last (Note [Guard checks] in
    runtime/guards.py): it compares the call's leaves with that entry's signature without
    building a key. Only when it fails (another signature, or one without a check) is the key
    built and looked up; the entry found becomes the one checked first."""

    def __init__(
        self,
        compile_entry: Callable[[list[object], tuple[object, ...]], CompiledEntry],
        name: str,
        warn_limit: int,
        max_signatures: int,
    ) -> None:
        self._compile = compile_entry
        self._entries: dict[tuple[object, ...], CompiledEntry] = {}
        self._lock = threading.Lock()
        self._name = name
        self._warn_limit = warn_limit
        self._max = max_signatures
        self.recompile_reasons: list[str] = []
        # The entry that ran last: its key's extra part and its probe (Note [Fused guard and
        # call] in runtime/guards.py), or None.
        self._last: tuple[object, Callable[[Sequence[object]], object]] | None = None
        self._probes: dict[tuple[object, ...], Callable[[Sequence[object]], object] | None] = {}

    @property
    def entries(self) -> list[CompiledEntry]:
        return list(self._entries.values())

    def __call__(self, leaves: list[object], extra: object) -> object:
        last = self._last
        if last is not None and extra == last[0]:
            out = last[1](leaves)
            if out is not MISS:
                return out
        try:
            key = (extra, signature_key(leaves))
            entry = self._entries.get(key)
        except (RuntimeError, TypeError) as e:
            reason = explain_bad_leaves(leaves, ())
            if reason is None:
                raise
            raise UnsupportedError(f"{self._name}: {reason}") from e
        if entry is None:
            entry = self._miss(key, leaves)
        self._remember(key, entry)
        return entry.call(leaves)

    def _remember(self, key: tuple[object, ...], entry: CompiledEntry) -> None:
        """Make `entry` the one checked first (its check is generated once per key)."""
        self._last = remember_probe(self._probes, key, entry)

    def _miss(self, key: tuple[object, ...], leaves: list[object]) -> CompiledEntry:
        with COMPILE_LOCK, self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                return entry
            if self._entries:
                last = next(reversed(self._entries))
                reason = describe_change(last, key)
                self.recompile_reasons.append(reason)
                log.info("recompiling %s: %s", self._name, reason)
                if len(self._entries) >= self._max:
                    raise GuardError(
                        f"{self._name} has been compiled for {len(self._entries)} input "
                        f"signatures (max_signatures={self._max}); the last change was {reason}. "
                        "Keep shapes/dtypes stable, or raise max_signatures."
                    )
                if len(self._entries) == self._warn_limit:
                    import warnings

                    warnings.warn(
                        f"aotc: {self._name} recompiled {len(self._entries)} times; the last "
                        f"change was {reason}. Frequent recompiles cost compile time.",
                        stacklevel=4,
                    )
            entry = self._compile(leaves, key)
            self._entries[key] = entry
            return entry
