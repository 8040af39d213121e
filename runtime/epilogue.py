"""Epilogue: make the call's side effects and aliases look exactly like eager.

Stage: `plan_epilogue(meta, fwd_plan, convention) -> EpiloguePlan` at compile time;
`apply_mutations(plan, leaves, graph_args, fwd_outs)` and
`build_outputs(plan, leaves, fwd_outs) -> user output leaves` every call.

Requires: `fwd_outs` are the forward graph's outputs (FwdOut order), the differentiable ones as
returned by the autograd node. Ensures: inputs mutated by the program are updated in place (data
copied with copy_, geometry replayed with as_strided_ on each user tensor that changed it, with
grad on exactly when eager recorded history for it), every changed input's `_version` ends where
eager's does, and each output is the right object: a fresh tensor, the input itself, a real view
regenerated off the user's input or off a differentiable intermediate base, or a detached alias
(see Note [Detached aliases] in aotc/aliasing.py), with eager's requires_grad, leafness and view
creation meta.

Worked example (f(x) = (x.mul_(2), x.t()), x a non-leaf requiring grad):

    mutation: copy graph_arg0 <- fwd_out0
    version: user_arg0 +1
    output 0: is_input source=0 base=None
    output 1: alias_of_input source=0 base=None
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import cast

import torch

from aotc.runtime.schema import (
    CallingConvention,
    DetachedRoot,
    FwdOutputPlan,
    Geometry,
    GraphArg,
    MutationAliasInfo,
    OutputKind,
    RootGrad,
    RootSource,
    UserArg,
    UserOut,
)
from aotc.runtime.viewreplay import ViewOp, replay

_MULTI_OUTPUT = torch._C._autograd.CreationMeta.MULTI_OUTPUT_NODE
_set_creation_meta = torch._C._autograd._set_creation_meta
_set_versions = torch._C._autograd._unsafe_set_version_counter


def _preserve_version(t: torch.Tensor) -> AbstractContextManager[object]:
    """Keeps `t`'s version counter across a step that is not eager's write (inference tensors,
    made under `torch.inference_mode()`, have no counter)."""
    if t.is_inference():
        return contextlib.nullcontext()
    return torch.autograd._unsafe_preserve_version_counter(t)


class StepKind(enum.Enum):
    COPY = "copy"  # graph arg .copy_(its new value)
    GEOMETRY = "geometry"  # user tensor .as_strided_(its new geometry)


@dataclass(frozen=True, slots=True)
class MutationStep:
    kind: StepKind
    target: int  # GraphArg (COPY) or UserArg (GEOMETRY)
    new_value: int | None  # COPY: FwdOut of the updated value
    geometry: Geometry | None  # GEOMETRY: relative to the tensor's storage offset before
    no_grad: bool  # replay under no_grad (eager recorded no history for it)
    via_view: bool = False  # COPY: write through a view of the arg taken before any reshape


@dataclass(frozen=True, slots=True)
class OutputStep:
    kind: OutputKind
    requires_grad: bool
    # FwdOut (in-graph kinds), UserArg (input kinds), UserOut (output kinds), root (DETACHED)
    source: int | None
    base: int | None  # ALIAS_OF_INTERMEDIATE: FwdOut of the base; ALIAS_OF_OUTPUT: UserOut
    geometry: Geometry | None  # ALIAS_OF_INPUT; DETACHED: the view of the root, None: the root
    constant: object
    track_grad: bool  # regenerate the view with autograd tracking (eager's view had it)
    lazy_conj: bool = False  # ALIAS_OF_INPUT: reapply the conjugate bit after as_strided
    lazy_neg: bool = False  # ALIAS_OF_INPUT: reapply the negative bit after as_strided
    multi_output_view: bool = False  # eager's view came from unbind/split: forbid in-place
    new_leaf: bool = False  # a view eager made a leaf with requires_grad_()
    stale_view: bool = False  # eager's no_grad view whose base was written after: reading its
    # grad_fn raises; one version bump after it is made gives it the same state
    # ALIAS_OF_INPUT: made before the epilogue writes its input (Note [Views taken before a
    # write])
    taken_before_write: bool = False
    via_geometry: Geometry | None = None  # ALIAS_OF_INPUT: the no_grad view it was taken from
    # ALIAS_OF_INPUT: views an as_strided on the way reached past (OutputInfo.narrowed_by)
    narrowed_by: tuple[Geometry, ...] = ()
    detach: bool = False  # FRESH: the graph returns a view; eager's output is none (detach it)
    # eager's view ops from the base, and their grad mode (Note [Replayed views])
    replay: tuple[ViewOp, ...] | None = None
    replay_grad: bool = True
    # FRESH: made a view of this UserArg / earlier UserOut at `geometry`, its gradient going to
    # the graph's value (OutputInfo.custom_view)
    custom_arg: int | None = None
    custom_out: int | None = None


@dataclass(frozen=True, slots=True)
class EpiloguePlan:
    mutations: tuple[MutationStep, ...]  # in execution order
    outputs: tuple[OutputStep, ...]  # len == num user outputs; UserOut space
    order: tuple[UserOut, ...]  # outputs computed first, then aliases of outputs
    versions: tuple[tuple[UserArg, int], ...] = ()  # eager's version bumps, per distinct tensor
    roots: tuple[DetachedRoot, ...] = ()  # detached aliases DETACHED outputs are built from
    new_leaves: tuple[int, ...] = ()  # FwdOuts that are leaves made inside: requires_grad_()
    # User tensors the program turns into leaves that require grad (`x.requires_grad_()`): set
    # before the graphs run, which were traced with them requiring grad.
    make_require_grad: tuple[UserArg, ...] = ()

    def format(self) -> str:
        lines = ["# stage: epilogue"]
        for m in self.mutations:
            if m.kind is StepKind.COPY:
                what = f"copy graph_arg{m.target} <- fwd_out{m.new_value}"
            else:
                what = f"as_strided_ user_arg{m.target} {m.geometry}"
            lines.append("mutation: " + what + (" (no_grad)" if m.no_grad else ""))
        lines += [f"version: user_arg{a} +{n}" for a, n in self.versions]
        for k, r in enumerate(self.roots):
            lines.append(f"root {k}: {r.source.value} {r.index}.detach() grad={r.grad.value}")
        lines += [f"new leaf: fwd_out{k}" for k in self.new_leaves]
        lines += [f"requires_grad_() before the call: user_arg{a}" for a in self.make_require_grad]
        for j, s in enumerate(self.outputs):
            line = f"output {j}: {s.kind.value} source={s.source} base={s.base}"
            if s.custom_arg is not None:
                line += f" (made a custom Function's view of user_arg{s.custom_arg} again)"
            elif s.custom_out is not None:
                line += f" (made a custom Function's view of output {s.custom_out} again)"
            lines.append(line)
        return "\n".join(lines)


# Note [Writes eager does not count]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Most in-place ops bump the version of what they write, and the metadata pass counts eager's
# bumps per input (`LeafChange.version_bumps`). A few kernels write an argument without a bump:
# batch norm in training mode updates its running statistics in place and leaves their
# `_version` alone. The epilogue's copy-back bumps every input it writes, so each written input
# gets its version set to eager's (its version before the call plus eager's count, possibly 0)
# after the copy. It matters beyond `_version` itself: eager's batch norm saved the running
# statistics for its backward, and a second call before that backward must not make the first
# one's backward refuse (Note [Inputs changed after the call] in runtime/autograd.py).


def _versions(
    meta: MutationAliasInfo, graph_of: dict[UserArg, GraphArg]
) -> tuple[tuple[UserArg, int], ...]:
    versions = {c.leaf: c.version_bumps for c in meta.leaf_changes if c.version_bumps}
    written = {g for g, info in enumerate(meta.inputs) if info.mutation.has_data}
    seen_graph: set[int] = set()
    for leaf, g in graph_of.items():
        if g in written and leaf not in versions and g not in seen_graph:
            bumps = next((c.version_bumps for c in meta.leaf_changes if c.leaf == leaf), 0)
            versions[leaf] = bumps
        seen_graph.add(g)
    return tuple(versions.items())


def plan_epilogue(
    meta: MutationAliasInfo,
    fwd_plan: FwdOutputPlan,
    convention: CallingConvention,
    fresh_views: frozenset[int] = frozenset(),
) -> EpiloguePlan:
    fwd_of_mut = {g: len(fwd_plan.user_outs) + k for k, g in enumerate(fwd_plan.mutated_args)}
    base0 = len(fwd_plan.user_outs) + len(fwd_plan.mutated_args)
    graph_of = dict(convention.leaf_to_graph)
    reshaped = [c for c in meta.leaf_changes if c.geometry is not None]
    # Every tensor's geometry first (eager's value of a plain arg is in its new geometry), then
    # the data. A synthetic base keeps its geometry: if one of its members is the base object
    # itself, the copy goes through a view taken before the reshapes.
    mutations = [
        MutationStep(StepKind.GEOMETRY, c.leaf, None, c.geometry, not c.with_grad) for c in reshaped
    ]
    for g, info in enumerate(meta.inputs):
        if info.mutation.has_data:
            synthetic = convention.graph_sources[g] is None
            via_view = synthetic and any(graph_of[c.leaf] == g for c in reshaped)
            mutations.append(
                MutationStep(
                    StepKind.COPY,
                    g,
                    fwd_of_mut[GraphArg(g)],
                    None,
                    info.hidden_from_autograd,
                    via_view,
                )
            )
    fwd_of_user = {j: k for k, j in enumerate(fwd_plan.user_outs)}
    # (A view of an input made a leaf is regenerated from the input: its OutputStep.new_leaf.)
    new_leaves = [
        fwd_of_user[UserOut(j)]
        for j, o in enumerate(meta.outputs)
        if o.new_leaf and UserOut(j) in fwd_of_user and fwd_of_user[UserOut(j)] not in fresh_views
    ]
    new_leaves += [base0 + b for b in meta.new_leaf_bases]
    steps = []
    for j, out in enumerate(meta.outputs):
        base: int | None = None
        source: int | None
        match out.kind:
            case OutputKind.FRESH:
                source = fwd_of_user[UserOut(j)]
            case OutputKind.ALIAS_OF_OUTPUT:
                source, base = fwd_of_user[UserOut(j)], out.base_out
            case OutputKind.ALIAS_OF_INTERMEDIATE:
                assert out.base_intermediate is not None
                source, base = fwd_of_user[UserOut(j)], base0 + out.base_intermediate
            case OutputKind.IS_INPUT | OutputKind.ALIAS_OF_INPUT:
                source = out.base_arg
            case OutputKind.IS_OUTPUT:
                source = out.base_out
            case OutputKind.DETACHED:
                source = out.base_root
            case OutputKind.NOT_TENSOR:
                source = None
        steps.append(
            OutputStep(
                out.kind,
                out.requires_grad,
                source,
                base,
                out.geometry,
                out.constant,
                track_grad=out.requires_grad and not out.view_without_grad,
                lazy_conj=out.lazy_conj,
                lazy_neg=out.lazy_neg,
                multi_output_view=out.multi_output_view,
                # a FRESH new leaf the graph returns as a view is made a leaf after its detach
                new_leaf=out.new_leaf
                and (out.kind is not OutputKind.FRESH or source in fresh_views),
                stale_view=out.stale_view,
                taken_before_write=out.taken_before_write,
                via_geometry=out.via_geometry,
                narrowed_by=out.narrowed_by,
                detach=out.kind is OutputKind.FRESH and source in fresh_views,
                replay=out.replay,
                replay_grad=out.replay_grad,
                custom_arg=out.base_arg if out.custom_view else None,
                custom_out=out.base_out if out.custom_view else None,
            )
        )
    late = (OutputKind.ALIAS_OF_OUTPUT, OutputKind.IS_OUTPUT)

    def is_late(s: OutputStep) -> bool:
        return s.kind in late or s.custom_out is not None

    order = tuple(UserOut(j) for j, s in enumerate(steps) if not is_late(s))
    order += tuple(UserOut(j) for j, s in enumerate(steps) if is_late(s))
    return EpiloguePlan(
        mutations=tuple(mutations),
        outputs=tuple(steps),
        order=order,
        versions=_versions(meta, graph_of),
        roots=meta.roots,
        new_leaves=tuple(new_leaves),
        make_require_grad=tuple(c.leaf for c in meta.leaf_changes if c.requires_grad),
    )


def apply_mutations(
    plan: EpiloguePlan,
    leaves: list[object],
    graph_args: list[torch.Tensor],
    fwd_outs: Sequence[torch.Tensor],
    in_place: frozenset[tuple[int, int]] = frozenset(),
    versions: tuple[tuple[torch.Tensor, ...], tuple[int, ...]] | None = None,
) -> None:
    """`in_place`: the writes (graph arg, fwd output) the forward did itself (Note [Buffers
    written in place] in runtime/replay.py), skipped here; `versions`: eager's versions of the
    written inputs, read before such a forward ran (`read_versions`)."""
    if versions is None:
        versions = read_versions(plan, leaves)
    dest = {
        m.target: graph_args[m.target].as_strided(
            graph_args[m.target].shape,
            graph_args[m.target].stride(),
            graph_args[m.target].storage_offset(),
        )
        for m in plan.mutations
        if m.via_view
    }
    for m in plan.mutations:
        if (m.target, m.new_value) in in_place:
            continue
        with torch.set_grad_enabled(not m.no_grad):
            if m.kind is StepKind.COPY:
                target = dest.get(m.target, graph_args[m.target])
                _copy_back(target, fwd_outs[m.new_value])  # type: ignore[index]
            else:
                leaf = leaves[m.target]
                g = m.geometry
                assert isinstance(leaf, torch.Tensor) and g is not None
                leaf.as_strided_(g.size, g.stride, leaf.storage_offset() + g.offset)
    if versions[0]:
        _set_versions(*versions)


def read_versions(
    plan: EpiloguePlan, leaves: list[object]
) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...]]:
    """The written inputs (inference tensors have no version) and the versions eager leaves
    them at: what they are now, before the call's writes, plus eager's count."""
    return buffer_versions(
        tuple(cast(torch.Tensor, leaves[a]) for a, _ in plan.versions),
        tuple(n for _, n in plan.versions),
    )


def buffer_versions(
    bumped: tuple[torch.Tensor, ...], bumps: tuple[int, ...]
) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...]]:
    """`read_versions` with the inputs and counts picked out by the generated call."""
    keep = [(t, t._version + n) for t, n in zip(bumped, bumps) if not t.is_inference()]
    return tuple(t for t, _ in keep), tuple(v for _, v in keep)


def write_buffers(
    targets: tuple[torch.Tensor, ...],
    values: tuple[torch.Tensor, ...],
    versions: tuple[tuple[torch.Tensor, ...], tuple[int, ...]],
) -> None:
    """`apply_mutations` for a plan whose writes are all copies under no_grad into the inputs
    themselves (`runtime.fastpath.writes_buffers`: a BatchNorm's running statistics), with its
    targets, new values and versions (`buffer_versions`, read before the call) already picked
    out by the generated call; the writes the forward did in place are not among them."""
    if targets:
        with torch.no_grad():
            for target, value in zip(targets, values):
                _copy_back(target, value)
    if versions[0]:
        _set_versions(*versions)


def _copy_back(target: torch.Tensor, value: torch.Tensor) -> None:
    """`target.copy_(value)`, also where `target` is an expanded view (a stride-0 dimension: an
    intermediate Dynamo passes to the graph after a break, `x.expand(2, -1).masked_fill_(...)`).
    `copy_` refuses a destination whose elements share memory. Eager's op wrote each shared
    location once per alias (only ops that write the same value through every alias accept
    such a destination, `masked_fill_`), and functionalization derived the new value from the
    first alias (the inverse of `expand` reads index 0), so the copy goes through index 0 of
    every expanded dimension."""
    if any(st == 0 and n > 1 for n, st in zip(target.shape, target.stride())):
        index = tuple(
            0 if st == 0 and n > 1 else slice(None) for n, st in zip(target.shape, target.stride())
        )
        target, value = target[index], value[index]
    target.copy_(value)


# Note [Views taken before a write]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# `v = a.squeeze(); v.mul_(2); return v` with `a` an input that needs no grad: eager's `v` was
# made before the write, so its version moved since. That is invisible until `a` is made to
# require grad afterwards (`a.requires_grad_()` in Python between two Dynamo graphs): reading
# `v.grad_fn` then regenerates a node for a view written since it was made, and `v` is no leaf.
# A view the epilogue made after its copy-back into `a` would have its current version and stay
# a leaf. So the metadata pass notes each view's version when it is made
# (`EagerChecks.view_versions`); an output view of an input that needs no grad and whose version
# moved since is made before the epilogue writes the inputs, as stale views are (fuzz seed
# 32051). Values are the same either way: it shares the input's storage. Only in a call that
# changes no input's geometry: made early, a view would see an input's geometry from before an
# in-place `t_()` or `unsqueeze_()` (fuzz seeds 32432, 32837).
def stale_input_views(plan: EpiloguePlan, leaves: list[object]) -> dict[int, torch.Tensor]:
    """Outputs that are views of inputs eager's call made before writing those inputs (reading
    their grad_fn then raises, or Note [Views taken before a write]): made before
    `apply_mutations` writes the inputs, so they end in the same state. Empty for nearly every
    plan."""
    views = {}
    for j, s in enumerate(plan.outputs):
        if s.kind is OutputKind.ALIAS_OF_INPUT and (s.stale_view or s.taken_before_write):
            base = leaves[s.source]  # type: ignore[index]
            assert isinstance(base, torch.Tensor) and s.geometry is not None
            views[j] = _view(base, s.geometry, s, bump=False)
    return views


def build_outputs(
    plan: EpiloguePlan,
    leaves: list[object],
    fwd_outs: Sequence[torch.Tensor],
    early: dict[int, torch.Tensor] | None = None,
) -> list[object]:
    for k in plan.new_leaves:
        fwd_outs[k].requires_grad_()
    result: list[object] = [None] * len(plan.outputs)
    roots: list[torch.Tensor | None] = [None] * len(plan.roots)
    for j in plan.order:
        s = plan.outputs[j]
        match s.kind:
            case OutputKind.FRESH:
                fresh = fwd_outs[s.source]  # type: ignore[index]
                if s.custom_arg is not None or s.custom_out is not None:
                    if s.custom_arg is not None:
                        base = leaves[s.custom_arg]
                    else:
                        assert s.custom_out is not None
                        base = result[s.custom_out]
                    assert isinstance(base, torch.Tensor) and s.geometry is not None
                    result[j] = custom_view(base, fresh, s.geometry)
                else:
                    out = fresh.detach() if s.detach else fresh
                    if s.detach and s.new_leaf:
                        out.requires_grad_()
                    result[j] = out
            case OutputKind.IS_INPUT:
                result[j] = leaves[s.source]  # type: ignore[index]
            case OutputKind.ALIAS_OF_INPUT:
                base = leaves[s.source]  # type: ignore[index]
                assert isinstance(base, torch.Tensor) and s.geometry is not None
                if early and j in early:
                    result[j] = early[j]
                elif s.source in plan.make_require_grad and _view_before_grad(base, s):
                    result[j] = _view_of_root(base, s.geometry, s)
                else:
                    result[j] = _view(base, s.geometry, s)
            case OutputKind.ALIAS_OF_INTERMEDIATE:
                if early and j in early:  # made between segment nodes (runtime/segments.py)
                    result[j] = early[j]
                else:
                    result[j] = _view_like(fwd_outs[s.base], fwd_outs[s.source], s)  # type: ignore[index]
            case OutputKind.ALIAS_OF_OUTPUT:
                if early and j in early:
                    result[j] = early[j]
                    continue
                base_out = result[s.base]  # type: ignore[index]
                assert isinstance(base_out, torch.Tensor)
                result[j] = _view_like(base_out, fwd_outs[s.source], s)  # type: ignore[index]
            case OutputKind.IS_OUTPUT:
                result[j] = result[s.source]  # type: ignore[index]
            case OutputKind.DETACHED:
                assert s.source is not None
                root = roots[s.source]
                if root is None:
                    root = roots[s.source] = _materialize(plan.roots[s.source], leaves, fwd_outs)
                if s.geometry is None:
                    result[j] = root
                elif s.stale_view and plan.roots[s.source].source is RootSource.INPUT:
                    result[j] = _stale_view_of_input_alias(root, s.geometry, s)
                else:
                    result[j] = _view(root, s.geometry, s)
            case OutputKind.NOT_TENSOR:
                result[j] = s.constant
    return result


class _CustomView(torch.autograd.Function):
    """The view of `base` at a geometry, whose gradient goes to `value` (the graph's copy of
    it) and not to `base`: Note [Views a custom Function returns] in aotc/aliasing.py."""

    @staticmethod
    def forward(ctx, base, value, size, stride, offset):  # type: ignore[no-untyped-def]
        return base.as_strided(size, stride, offset)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        return None, grad, None, None, None


def custom_view(base: torch.Tensor, value: torch.Tensor, g: Geometry) -> torch.Tensor:
    return _CustomView.apply(base, value, g.size, g.stride, base.storage_offset() + g.offset)  # type: ignore[no-any-return]


def _stale_view_of_input_alias(root: torch.Tensor, g: Geometry, s: OutputStep) -> torch.Tensor:
    """A stale view (OutputStep.stale_view) of a detached alias of an input. The alias shares
    the input's version counter, which the mutations already set to eager's: a bump after the
    view is made would count eager's write twice (fuzz seed 24612). The view is made one version
    earlier instead, then the counter goes back."""
    version = 0 if root.is_inference() else root._version
    if version == 0:
        return _view(root, g, s)
    _set_versions((root,), (version - 1,))
    try:
        return _view(root, g, s, bump=False)
    finally:
        _set_versions((root,), (version,))


def _materialize(
    root: DetachedRoot, leaves: list[object], fwd_outs: Sequence[torch.Tensor]
) -> torch.Tensor:
    """The detached alias of one call (see Note [Detached aliases] in aotc/aliasing.py)."""
    src = leaves[root.index] if root.source is RootSource.INPUT else fwd_outs[root.index]
    assert isinstance(src, torch.Tensor)
    t = src.detach()
    g = root.geometry
    if not root.whole and (tuple(t.shape), tuple(t.stride()), 0) != (g.size, g.stride, g.offset):
        with _preserve_version(t):
            t.as_strided_(g.size, g.stride, src.storage_offset() + g.offset)
    match root.grad:
        case RootGrad.NONE:
            pass
        case RootGrad.NEW_LEAF:
            t.requires_grad_()
        case RootGrad.HISTORY:
            assert root.history is not None
            with torch.enable_grad(), _preserve_version(t):
                t.copy_(fwd_outs[root.history])
    return t


# Note [Views taken before their input required grad]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# `v = a.narrow(0, 1, 1); a.requires_grad_(); return v` with `a` an input that is itself a view
# (`x.t()`) of a tensor that needs no grad: eager's `v` was taken before `a` required grad, and
# a view's autograd follows its root base, which still needs none, so `v` is a plain view that
# does not require grad. The epilogue runs after `requires_grad_()` was applied to the input
# (`make_require_grad`, before the graph), so a view re-taken off `a` would require grad. For
# such an output (eager's needs no grad, its input is one the program made require grad, and
# that input is a view of a root that needs none) the view is taken off the root instead, with
# the same geometry: the same `_base`, storage and flags as eager's (fuzz seed 31973).
def _view_before_grad(base: torch.Tensor, s: OutputStep) -> bool:
    root = base._base
    return (
        not s.requires_grad
        and base.requires_grad
        and root is not None
        and not root.requires_grad
        and not (s.lazy_conj or s.lazy_neg or s.narrowed_by or s.via_geometry is not None)
    )


def _view_of_root(base: torch.Tensor, g: Geometry, s: OutputStep) -> torch.Tensor:
    root = base._base
    assert root is not None
    return _mark(root.as_strided(g.size, g.stride, base.storage_offset() + g.offset), s)


def _view(base: torch.Tensor, g: Geometry, s: OutputStep, bump: bool = True) -> torch.Tensor:
    if s.replay is not None:
        return _replayed(base, s, bump)
    # Geometries are relative to `base`; as_strided takes an absolute storage offset.
    root = base.storage_offset()
    if s.via_geometry is not None:  # a leaf view made under no_grad, then the view of it
        v = s.via_geometry
        with torch.no_grad():
            base = base.as_strided(v.size, v.stride, root + v.offset)
    with torch.set_grad_enabled(s.track_grad):
        for n in s.narrowed_by:  # Note [as_strided past its input view] in aotc/functional.py
            base = base.as_strided(n.size, n.stride, root + n.offset)
        view = base.as_strided(g.size, g.stride, root + g.offset)
        if s.lazy_conj:
            view = view.conj()
        if s.lazy_neg:
            view = view._neg_view()
    return _mark(view, s, bump)


def _replayed(base: torch.Tensor, s: OutputStep, bump: bool = True) -> torch.Tensor:
    """Eager's view ops from `base`, in eager's grad mode (Note [Replayed views] in
    runtime/viewreplay.py)."""
    assert s.replay is not None
    with torch.set_grad_enabled(s.replay_grad):
        return _mark(replay(base, s.replay), s, bump)


def _mark(view: torch.Tensor, s: OutputStep, bump: bool = True) -> torch.Tensor:
    if s.multi_output_view and view.requires_grad and view._base is not None:
        _set_creation_meta(view, _MULTI_OUTPUT)
    if s.new_leaf:
        view.requires_grad_()
    if s.stale_view and bump and not view.is_inference():  # a graph value's storage
        _set_versions((view,), (view._version + 1,))
    return view


def regenerated_view(
    plan: EpiloguePlan,
    j: int,
    fwd_outs: Sequence[torch.Tensor],
    base: torch.Tensor | None,
    leaves: Sequence[object],
) -> torch.Tensor:
    """User output `j` (a view of an intermediate base or of a fresh output), regenerated from
    `base`, the tensor that base's autograd node returned; with no `base`, a view of an input,
    regenerated from the user's tensor."""
    s = plan.outputs[j]
    assert s.source is not None
    if base is None:
        leaf = leaves[s.source]
        assert isinstance(leaf, torch.Tensor) and s.geometry is not None
        return _view(leaf, s.geometry, s)
    return _view_like(base, fwd_outs[s.source], s)


def _view_like(base: torch.Tensor, raw: torch.Tensor, s: OutputStep) -> torch.Tensor:
    """A real view of `base` with the geometry `raw` (the graph's own view of it) has."""
    if s.replay is not None:
        return _replayed(base, s)
    with torch.set_grad_enabled(s.track_grad):
        if raw.dtype != base.dtype:  # view_as_real / view(dtype) of the base
            if base.is_complex() and not raw.is_complex():
                base = torch.view_as_real(base.resolve_conj())
            else:
                base = base.view(raw.dtype)
        view = base.as_strided(raw.size(), raw.stride(), raw.storage_offset())
        if raw.is_conj() and not view.is_conj():
            view = view.conj()
        if raw.is_neg() and not view.is_neg():
            view = view._neg_view()
    return _mark(view, s)
