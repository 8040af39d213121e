"""Metadata pass: what the user program does to its inputs and how its outputs alias.

Stage: `collect_metadata(program, leaves, convention, fake_mode, grad_enabled) -> MetadataResult`.
Requires: `leaves` are the real user leaves of one call; `convention` maps them to graph args.
Ensures: one `InputInfo` per graph arg, one `OutputInfo` per output leaf, a `LeafChange` per user
tensor whose geometry or version the call changes, the detached roots outputs are regenerated
from, and the fake metadata of every forward output (for making tangents), all from two runs on
fake tensors.

Worked example:

    def f(x, y):          # x: float[3] requires_grad non-leaf, y: float[3]
        y.add_(1)
        return x.view(-1), x * y

    input  0: mutation=none requires_grad=True leaf=False
    input  1: mutation=data requires_grad=False leaf=True
    output 0: alias_of_input base=user_arg0 requires_grad=True dtype=torch.float32
    output 1: fresh requires_grad=True dtype=torch.float32
    intermediate bases: 0
    user_arg1: version +1

See Note [Output aliasing] in aotc/aliasing.py for how outputs are classified.

Note [Two metadata runs]
~~~~~~~~~~~~~~~~~~~~~~~~
The program runs twice here, both times on fake tensors. The functional run answers which inputs
are data-mutated: functionalization records that exactly, and gives the values' fake metadata
for tangents. Everything eager can observe comes from a plain run, which behaves as eager does:
output geometry, aliasing and autograd flags; each user tensor's geometry and `_version` after
the call (metadata mutations and version bumps are per tensor, so a view passed next to its base
keeps its own `t_()`); whether a data mutation changed the input's autograd history at all (it
does not under no_grad, through a `detach()`ed alias, or with values that need no grad: then the
runtime replays it under no_grad, see `InputInfo.hidden_from_autograd`); and the errors eager's
backward would raise (Note [Backward eager would refuse] in runtime/autograd.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from aotc.aliasing import RootRef, ValueRef, classify_outputs
from aotc.functional import (
    NO_HOOKS,
    EagerChecks,
    FlatProgram,
    OverlappingWrites,
    check_inference_outputs,
    fakeify,
    functionalization,
    refused_by_functorch,
    symbolic_dispatch,
    to_functional,
    transform_state,
    user_errors,
)
from aotc.functionhop import checked_function_saves
from aotc.runtime.autograd import STALE, SavedValues, autograd_nodes
from aotc.runtime.convention import apply_convention, expand_graph_args
from aotc.runtime.errors import UnsupportedError
from aotc.runtime.schema import (
    CallingConvention,
    DetachedRoot,
    FwdOut,
    FwdOutputPlan,
    Geometry,
    GraphArg,
    InputInfo,
    LeafChange,
    MutationAliasInfo,
    MutationKind,
    OutputInfo,
    OutputKind,
    RootGrad,
    RootSource,
    UserArg,
    UserOut,
)
from aotc.symkey import is_symbolic


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Fake metadata of one forward output, for making its tangent."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


@dataclass(frozen=True, slots=True)
class MetadataResult:
    meta: MutationAliasInfo
    fwd_plan: FwdOutputPlan
    fwd_specs: tuple[TensorSpec, ...]  # len == fwd_plan.num_outputs; FwdOut space
    out_spec: object  # pytree spec of the user's return value
    # Forward outputs whose backward eager would refuse, with eager's reason. See Note [Backward
    # eager would refuse] in runtime/autograd.py.
    refused: tuple[tuple[FwdOut, str], ...] = ()
    # How the joint trace reaches each intermediate base and each HISTORY root's value.
    base_refs: tuple[ValueRef, ...] = ()  # len == fwd_plan.num_intermediate_bases
    root_value_refs: tuple[ValueRef, ...] = ()  # len == fwd_plan.num_root_values
    # The program runs a torch.func transform that refuses saved-tensor hooks (Note [Traces under
    # torch.func] in aotc/functional.py): calls under such hooks raise, as in eager.
    refuses_saved_hooks: bool = False
    # Graph args whose version counter a value eager's autograd saved shares (the arg itself, a
    # view or a detached alias of it), unchanged since it was saved. See Note [Inputs changed
    # after the call] in runtime/autograd.py.
    saved_args: tuple[GraphArg, ...] = ()
    # Per saved_args entry: the forward outputs whose backward unpacks one of its saved values;
    # None: every differentiable output's (or unknown). See the same Note.
    saved_arg_outs: tuple[tuple[FwdOut, ...] | None, ...] = ()
    # User outputs (positions in the flat outputs) whose version counter a value eager's
    # autograd saved shares and no graph arg does (`amax`'s result, a view of `softmax`'s), with
    # the same per-entry outputs as saved_arg_outs. See Note [Outputs changed after the call]
    # in runtime/autograd.py.
    saved_outs: tuple[int, ...] = ()
    saved_out_outs: tuple[tuple[FwdOut, ...] | None, ...] = ()
    # The program changes a tensor's sizes or strides in place (`squeeze_`, `t_`, ...): see
    # Note [Views of a tensor reshaped in place] in aotc/tracer.py.
    reshapes_in_place: bool = False


@dataclass(frozen=True, slots=True)
class _State:
    """A plain fake user tensor's state, before or after the program."""

    grad_fn: object  # of the tensor, or of its base for a view (see `_state`)
    requires_grad: bool
    is_leaf: bool
    geometry: Geometry
    version: int


def _state(t: torch.Tensor) -> _State:
    """A view's autograd history is its base's: eager rebases the base when the view is
    written, and regenerates a view's own grad_fn whenever its version moved (reading it then
    can even raise), so the base is what says whether eager recorded history."""
    root = t._base if t._base is not None else t
    try:
        is_leaf = t.is_leaf
    except RuntimeError:  # a view whose grad_fn eager refuses to regenerate
        is_leaf = False
    return _State(
        root.grad_fn,
        t.requires_grad,
        is_leaf,
        Geometry(tuple(t.shape), tuple(t.stride()), t.storage_offset()),
        0 if t.is_inference() else t._version,  # inference tensors have no version counter
    )


def collect_metadata(
    program: FlatProgram,
    leaves: list[object],
    convention: CallingConvention,
    fake_mode: FakeTensorMode,
    grad_enabled: bool,
    arg_names: list[str],
) -> MetadataResult:
    graph_args = apply_convention(convention, leaves)
    constants = [None if isinstance(x, torch.Tensor) else x for x in leaves]
    # Run 1, plain fake tensors: eager's own view of outputs, aliasing, autograd and versions
    # (see Note [Two metadata runs]); first, so an error eager would raise is reported as such.
    # A symbolic compilation's fakes carry its ShapeEnv's symbols: stay in its mode.
    symbolic = any(isinstance(a, FakeTensor) for a in graph_args)
    eager_mode = fake_mode if symbolic else FakeTensorMode(allow_non_fake_inputs=False)
    saved: SavedValues | None = SavedValues()
    while True:  # at most twice: see Note [Traces under torch.func] in aotc/functional.py
        with eager_mode:
            plain = fakeify(eager_mode, graph_args, as_leaves=False)
            with torch.set_grad_enabled(grad_enabled):
                p_leaves = expand_graph_args(convention, plain, constants)
            args_before = [_state(p) for p in plain]
            storage_before = [_storage_bytes(p) for p in plain]
            leaves_before = {id(t): _state(t) for t in p_leaves if isinstance(t, torch.Tensor)}
            checks = EagerChecks(unsized_inputs=plain if symbolic else (), inputs=plain)
            overlaps = OverlappingWrites(rewrite=False)
            try:
                with (
                    # Note [Symbolic sizes need the Python dispatcher]: only for sizes that
                    # are symbols; a Dynamo graph's fakes of static shapes dispatch as eager's
                    # tensors do (its C++ `matmul` returns no view where the Python one would)
                    symbolic_dispatch(symbolic and is_symbolic(plain)),
                    transform_state(),
                    user_errors("metadata pass"),
                    torch.set_grad_enabled(grad_enabled),
                    saved.hooks() if saved is not None else NO_HOOKS,
                    checked_function_saves(),  # Note [Saved values of Functions Dynamo captured]
                    checks,
                    overlaps,
                ):
                    p_outs, _ = program(p_leaves)
            except Exception as e:
                checks.check()  # eager's earlier refusal, noted in a dispatch, comes first
                if saved is None or not refused_by_functorch(e):
                    raise
                saved = None  # run again without hooks; probe every output for staleness
                continue
            checks.check()
            _refuse_grown_storages(plain, storage_before, arg_names)
            if checks.switched_inference:  # Note [Inference mode switched inside a call]
                check_inference_outputs(p_outs, p_leaves)
            break
    # Run 2, functional: which inputs are data-mutated, and the values' fake metadata.
    with fake_mode:
        fakes = fakeify(fake_mode, graph_args, as_leaves=False)
        wrappers = [to_functional(f) for f in fakes]
        rewrites = OverlappingWrites()
        with (
            user_errors("metadata pass", eager_ran=True),
            functionalization(),
            torch.set_grad_enabled(grad_enabled),
            rewrites,
        ):
            f_leaves = expand_graph_args(convention, wrappers, constants)
            f_outs, out_spec = program(f_leaves)
        for w in wrappers:
            torch._sync(w)
        kinds = [_mutation_of(w, arg_names, g) for g, w in enumerate(wrappers)]
    checks.check(rewrites.count)
    _check_same_program(wrappers, plain, f_outs, p_outs)
    with eager_mode:
        inputs = tuple(
            _input_info(kind, before, p) for kind, before, p in zip(kinds, args_before, plain)
        )
        changes = _leaf_changes(p_leaves, leaves_before)
        _check_grad_of_merged_inputs(changes, convention)
        _check_grad_of_reshaped_leaves(changes, p_leaves)
        _check_strided_outputs(p_outs)
        # Note [Views taken before a write] in runtime/epilogue.py: an output made before the
        # epilogue writes its input sees the inputs' geometry from before the call, so only a
        # call that changes no input's geometry gets one.
        still = not any(c.geometry is not None for c in changes)
        analysis = classify_outputs(
            p_outs,
            p_leaves,
            checks.narrowed,
            checks.views,
            checks.reshaped,
            checks.view_versions if still else None,
        )
        # The recorded views hold their tensors, and so the autograd graph behind them: released
        # before anything asks which saved values are still held (`_watched_args`).
        checks.views.clear()
        reshapes_in_place = bool(checks.reshaped)
        checks.reshaped.clear()
        checks.view_versions.clear()
        fwd_plan, specs, plain_values, roots = _plan_fwd_outputs(
            analysis.infos, inputs, analysis.bases, analysis.roots, f_outs, p_outs, wrappers, plain
        )
        refused = _backward_refusals(
            saved, overlaps.refused_nodes, plain_values, fwd_plan.needs_tangent
        )
        # Without hooks (a torch.func retry) nothing was noted.
        watched = _watched_args(saved, plain, plain_values, fwd_plan.needs_tangent, p_outs)
    _check_detached_sources(roots, specs, plain_values)
    meta = MutationAliasInfo(
        inputs=inputs,
        outputs=tuple(analysis.infos),
        num_intermediate_bases=len(analysis.bases),
        leaf_changes=changes,
        roots=roots,
        new_leaf_bases=tuple(analysis.new_leaf_bases),
    )
    root_values = tuple(r.value for r in analysis.roots if r.grad is RootGrad.HISTORY)
    return MetadataResult(
        meta,
        fwd_plan,
        specs,
        out_spec,
        refused,
        tuple(analysis.bases),
        root_values,
        refuses_saved_hooks=saved is None,
        saved_args=tuple(GraphArg(g) for g, _ in watched if g < len(plain)),
        saved_arg_outs=tuple(outs for g, outs in watched if g < len(plain)),
        saved_outs=tuple(g - len(plain) for g, _ in watched if g >= len(plain)),
        saved_out_outs=tuple(outs for g, outs in watched if g >= len(plain)),
        reshapes_in_place=reshapes_in_place,
    )


def _check_strided_outputs(outs: list[object]) -> None:
    """aotc's graphs return dense tensors: a sparse (or other non-strided) output is refused by
    name instead of failing inside the output analysis."""
    for j, o in enumerate(outs):
        if isinstance(o, torch.Tensor) and o.layout is not torch.strided:
            raise UnsupportedError(
                f"output {j} is a {o.layout} tensor; aotc compiles programs whose tensor outputs "
                "are dense (torch.strided). Return `.to_dense()` of it, or make the sparse "
                "tensor outside the compiled function."
            )


def _check_same_program(
    wrappers: list[torch.Tensor],
    plain: list[torch.Tensor],
    f_outs: list[object],
    p_outs: list[object],
) -> None:
    """The functional run must have computed what the plain run did: same output shapes and
    dtypes, same final input shapes. They part when the program asks for strides after an
    in-place op: functionalization gives the written tensor the strides of the out-of-place
    result, so `.contiguous()`, `.reshape()` or `.view()` can alias in one run and copy in the
    other."""
    pairs = list(zip(wrappers, plain)) + [
        (f, p) for f, p in zip(f_outs, p_outs) if isinstance(p, torch.Tensor)
    ]
    for f, p in pairs:
        if not isinstance(f, torch.Tensor) or (tuple(f.shape), f.dtype) != (
            tuple(p.shape),
            p.dtype,
        ):
            raise UnsupportedError(
                "metadata pass: aotc's functional trace of the program parts from eager's (a "
                "tensor is [{}] there, [{}] in eager): the program reads strides after an "
                "in-place op on a non-contiguous tensor (e.g. `.contiguous()`, `.reshape()` or "
                "`.view()` after `x.t().masked_fill_(...)`), where the functional graph's layout "
                "differs from eager's. Call .contiguous() on the tensor before the in-place op, "
                "or use .clone() instead of .contiguous().".format(
                    ", ".join(map(str, getattr(f, "shape", ()))), ", ".join(map(str, p.shape))
                )
            )


def _storage_bytes(t: object) -> int | None:
    if not isinstance(t, torch.Tensor) or t.layout is not torch.strided:
        return None
    nbytes = t.untyped_storage().nbytes()
    return nbytes if isinstance(nbytes, int) else None


def _refuse_grown_storages(
    plain: list[torch.Tensor], before: list[int | None], arg_names: list[str]
) -> None:
    """An input whose storage the program made larger: an `out=` tensor of another size (eager
    resizes it, `torch.add(x, 1, out=torch.empty(0))`) or a `resize_()` past its storage. Eager
    gives that tensor new memory; the compiled call writes back into the caller's tensor and
    cannot grow it (functionalization reports no storage change for it)."""
    for g, (p, nbytes) in enumerate(zip(plain, before)):
        after = _storage_bytes(p)
        if nbytes is not None and after is not None and after > nbytes:
            name = arg_names[g] if g < len(arg_names) else f"graph argument {g}"
            raise UnsupportedError(
                f"the program grows the storage of input {name!r} from {nbytes} to {after} "
                "bytes (an `out=` tensor smaller than the result, which eager resizes, or "
                "`resize_()`). aotc cannot replay storage changes on inputs: pass an `out=` "
                "tensor of the result's size, or do this outside the compiled function."
            )


def _mutation_of(w: torch.Tensor, arg_names: list[str], g: int) -> MutationKind:
    """Mutation kind of one functional graph arg."""
    data = torch._functionalize_has_data_mutation(w)  # type: ignore[attr-defined]  # no stub
    metadata = torch._functionalize_has_metadata_mutation(w)
    if torch._functionalize_was_storage_changed(w):
        name = arg_names[g] if g < len(arg_names) else f"graph argument {g}"
        raise UnsupportedError(
            f"the program swaps or resizes the storage of input {name!r} (set_ / resize_). "
            "aotc cannot replay storage changes on inputs; do this outside the compiled function."
        )
    return {
        (False, False): MutationKind.NONE,
        (False, True): MutationKind.METADATA_ONLY,
        (True, False): MutationKind.DATA,
        (True, True): MutationKind.DATA_AND_METADATA,
    }[(data, metadata)]


def _input_info(kind: MutationKind, before: _State, plain: torch.Tensor) -> InputInfo:
    """`plain` is the plain fake graph arg after the run."""
    after = _state(plain)
    # (requires_grad alone may change: `x.requires_grad_()` makes a leaf without history)
    unchanged = after.grad_fn is before.grad_fn
    return InputInfo(
        mutation=kind,
        hidden_from_autograd=unchanged,
        requires_grad=before.requires_grad,
        is_leaf=before.is_leaf,
    )


def _check_grad_of_merged_inputs(
    changes: tuple[LeafChange, ...], convention: CallingConvention
) -> None:
    """An input merged into a synthetic base (it shares storage with an input the program
    writes) reaches the graph only through the base, so it cannot become a leaf with a gradient
    of its own: refuse `requires_grad_()` on it (fuzz seed 9181; its output came back without
    history)."""
    merged = {m for base in convention.synthetic_bases for m in base.members}
    for change in changes:
        if change.requires_grad and change.leaf in merged:
            raise UnsupportedError(
                f"input {int(change.leaf)} (in the flattened arguments) is made to require grad "
                "inside the compiled function (`requires_grad_()`) while it shares storage with "
                "another input the function writes in place; aotc passes such "
                "inputs as one base tensor and cannot give this one a gradient of its own. Call "
                "requires_grad_() on it before the call, or pass a .clone() of one of the inputs."
            )


def _check_grad_of_reshaped_leaves(changes: tuple[LeafChange, ...], p_leaves: list[object]) -> None:
    """A leaf that requires grad after the call and whose sizes or strides the call changes in
    place (`squeeze_`, `t_`, `as_strided_` under no_grad, or before `requires_grad_()`): autograd
    records the input's geometry when the compiled node is applied, before the epilogue replays
    the change, so the gradient would not fit the leaf (fuzz seeds 14258, 14403: a crash in the
    backward where eager runs; 14009: eager's own backward refuses). Refused by name."""
    for change in changes:
        t = p_leaves[int(change.leaf)]
        if change.geometry is not None and isinstance(t, torch.Tensor):
            if t.requires_grad and t.is_leaf:
                raise UnsupportedError(
                    f"input {int(change.leaf)} (in the flattened arguments) is a leaf that "
                    "requires grad, and the compiled function changes its sizes or strides in "
                    "place (e.g. squeeze_, t_, as_strided_ under no_grad); aotc cannot give its "
                    "gradient the new geometry. Change the tensor's geometry outside the "
                    "compiled function, or use the out-of-place op (squeeze, t, as_strided)."
                )


def _leaf_changes(p_leaves: list[object], before: dict[int, _State]) -> tuple[LeafChange, ...]:
    """Geometry and version changes of each distinct user tensor (first occurrence)."""
    changes = []
    seen: set[int] = set()
    for i, t in enumerate(p_leaves):
        if not isinstance(t, torch.Tensor) or id(t) in seen:
            continue
        seen.add(id(t))
        old = before[id(t)]
        now = _state(t)
        geometry = None
        if now.geometry != old.geometry:
            g = now.geometry
            geometry = Geometry(g.size, g.stride, g.offset - old.geometry.offset)
        bumps = now.version - old.version
        made_to_require_grad = now.requires_grad and not old.requires_grad and now.is_leaf
        if geometry is not None or bumps or made_to_require_grad:
            with_grad = now.requires_grad and now.grad_fn is not old.grad_fn
            changes.append(LeafChange(UserArg(i), geometry, bumps, with_grad, made_to_require_grad))
    return tuple(changes)


def _plan_fwd_outputs(
    outputs: list[OutputInfo],
    inputs: tuple[InputInfo, ...],
    bases: list[ValueRef],
    root_refs: list[RootRef],
    f_outs: list[object],
    p_outs: list[object],
    wrappers: list[torch.Tensor],
    plain: list[torch.Tensor],
) -> tuple[FwdOutputPlan, tuple[TensorSpec, ...], list[torch.Tensor], tuple[DetachedRoot, ...]]:
    """FwdOut order: in-graph user outputs, mutated args, intermediate bases, root values. Also
    the plain-run tensor of each forward output and the detached roots in FwdOut terms."""
    in_graph = (OutputKind.FRESH, OutputKind.ALIAS_OF_INTERMEDIATE, OutputKind.ALIAS_OF_OUTPUT)
    user_outs = tuple(UserOut(j) for j, o in enumerate(outputs) if o.kind in in_graph)
    mutated = tuple(GraphArg(g) for g, i in enumerate(inputs) if i.mutation.has_data)
    history = [r for r in root_refs if r.grad is RootGrad.HISTORY]
    tensors: list[torch.Tensor] = [f_outs[j] for j in user_outs]  # type: ignore[misc]
    tensors += [wrappers[g] for g in mutated]
    tensors += [b.resolve(f_outs) for b in bases]
    tensors += [r.value.resolve(f_outs) for r in history]
    values: list[torch.Tensor] = [p_outs[j] for j in user_outs]  # type: ignore[misc]
    values += [plain[g] for g in mutated]
    values += [b.resolve(p_outs) for b in bases]
    values += [r.value.resolve(p_outs) for r in history]
    needs = [
        outputs[j].kind is OutputKind.FRESH and outputs[j].requires_grad and not outputs[j].new_leaf
        for j in user_outs
    ]
    needs += [plain[g].requires_grad and not inputs[g].hidden_from_autograd for g in mutated]
    needs += [b.requires_grad and b.grad_fn is not None for b in values[len(needs) :]]
    specs = tuple(TensorSpec(tuple(t.shape), tuple(t.stride()), t.dtype, t.device) for t in tensors)
    plan = FwdOutputPlan(
        user_outs=user_outs,
        mutated_args=mutated,
        num_intermediate_bases=len(bases),
        needs_tangent=tuple(needs),
        num_root_values=len(history),
    )
    fwd_of_user = {j: FwdOut(k) for k, j in enumerate(user_outs)}
    base0 = len(user_outs) + len(mutated)
    value0 = base0 + len(bases)
    roots = []
    for r in root_refs:
        if r.source_arg is not None:
            source, index = RootSource.INPUT, int(r.source_arg)
        elif r.source_out is not None:
            source, index = RootSource.VALUE, int(fwd_of_user[r.source_out])
        else:
            assert r.source_base is not None
            source, index = RootSource.VALUE, base0 + r.source_base
        value = FwdOut(value0 + history.index(r)) if r.grad is RootGrad.HISTORY else None
        roots.append(DetachedRoot(source, index, r.geometry, r.grad, value, whole=r.whole))
    return plan, specs, values, tuple(roots)


def _check_detached_sources(
    roots: tuple[DetachedRoot, ...], specs: tuple[TensorSpec, ...], values: list[torch.Tensor]
) -> None:
    """A detached root on a graph value is placed by eager's geometry relative to that value:
    the graph must lay the value out as eager does."""
    for root in roots:
        if root.source is RootSource.VALUE:
            spec, eager = specs[root.index], values[root.index]
            if (spec.shape, spec.stride) != (tuple(eager.shape), tuple(eager.stride())):
                raise UnsupportedError(
                    "an output is a detached alias (`.detach()`) of a value that the compiled "
                    f"graph lays out as {list(spec.shape)} stride {spec.stride}, eager as "
                    f"{list(eager.shape)} stride {eager.stride()}; aotc cannot place the alias. "
                    "Return a .clone() of it instead."
                )


def _backward_refusals(
    saved: SavedValues | None,
    overlap_nodes: Mapping[int, object],
    values: list[torch.Tensor],
    needs: tuple[bool, ...],
) -> tuple[tuple[FwdOut, str], ...]:
    """Forward outputs whose backward eager would refuse (Note [Backward eager would refuse]):
    because a value its autograd saved was modified in place afterwards (only when some saved
    value is stale does it run a fake backward from each differentiable output to see which),
    or because it reaches a write into an overlapping tensor (`OverlappingWrites`)."""
    refused = []
    if overlap_nodes:
        for k, (value, need) in enumerate(zip(values, needs)):
            if need and any(id(n) in overlap_nodes for n in autograd_nodes([value])):
                refused.append((FwdOut(k), _OVERLAP_BACKWARD))
    if saved is not None and not saved.any_stale():
        return tuple(refused)
    done = {k for k, _ in refused}
    for k, (value, need) in enumerate(zip(values, needs)):
        if not need or k in done:
            continue
        try:
            torch.autograd.backward([value], [torch.ones_like(value)], retain_graph=True)
        except RuntimeError as e:
            if STALE in str(e):
                refused.append((FwdOut(k), str(e).split(" Hint:", 1)[0]))
        except Exception:  # noqa: BLE001 a probe that fails otherwise refuses nothing
            continue
    return tuple(refused)


def _watched_args(
    saved: SavedValues | None,
    args: list[torch.Tensor],
    values: list[torch.Tensor],
    needs: tuple[bool, ...],
    outputs: list[object],
) -> tuple[tuple[int, tuple[FwdOut, ...] | None], ...]:
    """The graph args, then the user outputs (numbered after the args), whose version counter a
    value eager saved shares, each with the forward outputs whose backward unpacks such a value
    (None: all of them). A value sharing an arg's counter is the arg's, never an output's. With
    several differentiable outputs, a fake backward from each notes what it unpacks; an entry
    whose saved values no backward unpacks (their nodes are gone: they fed no output) is left
    out. See Notes [Inputs changed after the call] and [Outputs changed after the call] in
    runtime/autograd.py."""
    if saved is None:
        return ()
    # A non-tensor output stands in as an inference tensor: it shares no counter.
    out_tensors = [o if isinstance(o, torch.Tensor) else _NO_COUNTER for o in outputs]
    sharing = [
        (int(g), held)
        for g, indices in saved.sharing_version([*args, *out_tensors])
        if (held := frozenset(i for i in indices if saved.held(i)))
    ]
    diff = [k for k, need in enumerate(needs) if need]
    if not sharing or len(diff) < 2:
        return tuple((g, None) for g, _ in sharing)
    unpacked: dict[int, set[int] | None] = {}
    for k in diff:
        value = values[k]
        with saved.recording() as found:
            try:
                torch.autograd.backward([value], [torch.ones_like(value)], retain_graph=True)
            except Exception:  # noqa: BLE001 a refused or failing probe: assume it uses all
                unpacked[k] = None
                continue
        unpacked[k] = found
    watched = []
    for g, indices in sharing:
        outs = [k for k in diff if (u := unpacked[k]) is None or not u.isdisjoint(indices)]
        if outs:
            watched.append((g, None if len(outs) == len(diff) else tuple(map(FwdOut, outs))))
    return tuple(watched)


with torch.inference_mode():
    _NO_COUNTER = torch.empty(0)  # has no version counter: sharing_version skips it


_OVERLAP_BACKWARD = (
    "unsupported operation: more than one element of the written-to tensor refers to a single "
    "memory location (the backward of an in-place write into an expand()ed view)."
)
