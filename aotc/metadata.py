"""Metadata pass: what the user program does to its inputs and how its outputs alias.

Stage: `collect_metadata(program, leaves, convention, fake_mode, grad_enabled) -> MetadataResult`.
Requires: `leaves` are the real user leaves of one call; `convention` maps them to graph args.
Ensures: one `InputInfo` per graph arg, one `OutputInfo` per output leaf, and the fake metadata
of every forward output (for making tangents), all from one run on fake functional tensors.

Worked example:

    def f(x, y):          # x: float[3] requires_grad non-leaf, y: float[3]
        y.add_(1)
        return x.view(-1), x * y

    input  0: mutation=none requires_grad=True leaf=False
    input  1: mutation=data requires_grad=False leaf=True
    output 0: alias_of_input base=user_arg0 requires_grad=True dtype=torch.float32
    output 1: fresh requires_grad=True dtype=torch.float32
    intermediate bases: 0

See Note [Output aliasing] for how outputs are classified.

Note [Two metadata runs]
~~~~~~~~~~~~~~~~~~~~~~~~
The program runs twice here, both times on fake tensors. The functional run answers which inputs
are mutated and how (data, metadata, under no_grad): functionalization records that exactly.
But a functional wrapper's strides after a data mutation are those of the out-of-place result
(`x.add_(1)` on a strided slice yields a contiguous value), so geometry, aliasing and
requires_grad of outputs come from a plain run, which behaves as eager does, metadata included.

Note [Output aliasing]
~~~~~~~~~~~~~~~~~~~~~~
Checked in this order, on the outputs of the plain fake run:
  1. the output *is* a user input object               -> IS_INPUT
  2. it is the same object as an earlier output        -> IS_OUTPUT
  3. it shares storage with a graph arg                -> ALIAS_OF_INPUT (geometry recorded
     relative to the user leaf, so the runtime regenerates it with one as_strided)
  4. its autograd `._base` is another (fresh) output   -> ALIAS_OF_OUTPUT
  5. it has some other `._base`                        -> ALIAS_OF_INTERMEDIATE (the base becomes
     an extra forward output so the view can be regenerated off it with its own autograd edge)
  6. otherwise                                         -> FRESH
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef

from aotc.functional import (
    FlatProgram,
    OverlapCheck,
    fakeify,
    functionalization,
    to_functional,
    user_errors,
)
from aotc.runtime.autograd import stale_saved_value, version_checked_saves
from aotc.runtime.convention import apply_convention, expand_graph_args
from aotc.runtime.errors import UnsupportedError
from aotc.runtime.schema import (
    CallingConvention,
    FwdOutputPlan,
    Geometry,
    GraphArg,
    InputInfo,
    MutationAliasInfo,
    MutationKind,
    OutputInfo,
    OutputKind,
    UserArg,
    UserOut,
)


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
    # Why eager's backward would fail (a value its autograd saved was modified in place
    # afterwards), or None. See Note [Backward eager would refuse] in runtime/autograd.py.
    backward_error: str | None = None


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
    # Run 1, functional: which inputs are mutated, and how (see Note [Two metadata runs]).
    with fake_mode:
        fakes = fakeify(fake_mode, graph_args, as_leaves=False)
        wrappers = [to_functional(f) for f in fakes]
        with (
            user_errors("metadata pass"),
            functionalization(),
            torch.set_grad_enabled(grad_enabled),
        ):
            f_leaves = expand_graph_args(convention, wrappers, constants)
            f_outs, out_spec = program(f_leaves)
        for w in wrappers:
            torch._sync(w)
        mutations = [_mutation_of(w, arg_names, g) for g, w in enumerate(wrappers)]
    # Run 2, plain fake tensors: eager's own view of outputs, aliasing and geometry.
    # A symbolic compilation's fakes carry its ShapeEnv's symbols: stay in its mode.
    symbolic = any(isinstance(a, FakeTensor) for a in graph_args)
    eager_mode = fake_mode if symbolic else FakeTensorMode(allow_non_fake_inputs=False)
    with eager_mode:
        plain = fakeify(eager_mode, graph_args, as_leaves=False)
        before = [(p.storage_offset(), p.requires_grad, p.is_leaf, p) for p in plain]
        overlap = OverlapCheck()
        with (
            user_errors("metadata pass"),
            torch.set_grad_enabled(grad_enabled),
            version_checked_saves(),
            overlap,
        ):
            p_leaves = expand_graph_args(convention, plain, constants)
            p_outs, _ = program(p_leaves)
        overlap.check()
        inputs = tuple(_input_info(kind, *state) for kind, state in zip(mutations, before))
        outputs, base_outs = _classify_outputs(p_outs, p_leaves, convention)
        backward_error = stale_saved_value([*p_outs, *p_leaves]) if grad_enabled else None
    f_bases = [f_outs[j]._base for j in base_outs]  # type: ignore[union-attr]
    fwd_plan, specs = _plan_fwd_outputs(outputs, inputs, f_outs, wrappers, f_bases)
    meta = MutationAliasInfo(inputs=inputs, outputs=outputs, num_intermediate_bases=len(f_bases))
    return MetadataResult(meta, fwd_plan, specs, out_spec, backward_error)


def _mutation_of(w: torch.Tensor, arg_names: list[str], g: int) -> tuple[MutationKind, bool]:
    """Mutation kind of one functional graph arg, and whether every data mutation was under
    no_grad."""
    data = torch._functionalize_has_data_mutation(w)
    metadata = torch._functionalize_has_metadata_mutation(w)
    if torch._functionalize_was_storage_changed(w):
        name = arg_names[g] if g < len(arg_names) else f"graph argument {g}"
        raise UnsupportedError(
            f"the program swaps or resizes the storage of input {name!r} (set_ / resize_). "
            "aotc cannot replay storage changes on inputs; do this outside the compiled function."
        )
    kind = {
        (False, False): MutationKind.NONE,
        (False, True): MutationKind.METADATA_ONLY,
        (True, False): MutationKind.DATA,
        (True, True): MutationKind.DATA_AND_METADATA,
    }[(data, metadata)]
    no_grad = data and torch._functionalize_are_all_mutations_under_no_grad_or_inference_mode(w)
    return kind, no_grad


def _input_info(
    mutation: tuple[MutationKind, bool],
    offset_before: int,
    requires_grad: bool,
    is_leaf: bool,
    plain: torch.Tensor,
) -> InputInfo:
    """`plain` is the plain fake input after the run; the other fields are from before it."""
    kind, no_grad = mutation
    geometry = None
    if kind.has_metadata:
        geometry = Geometry(
            tuple(plain.shape), tuple(plain.stride()), plain.storage_offset() - offset_before
        )
    return InputInfo(
        mutation=kind,
        mutated_under_no_grad=no_grad,
        requires_grad=requires_grad,
        is_leaf=is_leaf,
        new_geometry=geometry,
    )


def _classify_outputs(
    outs: list[object],
    user_leaves: list[object],
    convention: CallingConvention,
) -> tuple[tuple[OutputInfo, ...], list[UserOut]]:
    """See Note [Output aliasing]. Returns the infos and, per intermediate base, one output
    whose `._base` it is."""
    leaf_of_id = {
        id(t): UserArg(i) for i, t in enumerate(user_leaves) if isinstance(t, torch.Tensor)
    }
    storage_leaf: dict[StorageWeakRef, UserArg] = {}
    for leaf, _g in convention.leaf_to_graph:
        storage_leaf.setdefault(StorageWeakRef(user_leaves[leaf].untyped_storage()), leaf)  # type: ignore[union-attr]
    out_of_id: dict[int, UserOut] = {}
    bases: list[torch.Tensor] = []
    infos: list[OutputInfo] = []
    for j, o in enumerate(outs):
        if not isinstance(o, torch.Tensor):
            _check_constant(o, j)
            infos.append(OutputInfo(OutputKind.NOT_TENSOR, False, None, constant=o))
            continue
        if o.requires_grad and o.is_leaf and o._base is None and id(o) not in leaf_of_id:
            raise UnsupportedError(
                f"output {j} is a tensor created inside the compiled function with "
                "requires_grad=True. aotc cannot return new leaf tensors; create it outside and "
                "pass it as an argument."
            )
        rg, dtype = o.requires_grad, o.dtype
        storage = StorageWeakRef(o.untyped_storage())
        if id(o) in leaf_of_id:
            infos.append(OutputInfo(OutputKind.IS_INPUT, rg, dtype, base_arg=leaf_of_id[id(o)]))
        elif id(o) in out_of_id:
            infos.append(OutputInfo(OutputKind.IS_OUTPUT, rg, dtype, base_out=out_of_id[id(o)]))
        elif storage in storage_leaf:
            leaf = storage_leaf[storage]
            base = user_leaves[leaf]
            assert isinstance(base, torch.Tensor)
            if base.dtype != o.dtype:
                raise UnsupportedError(
                    f"output {j} is a view of input {leaf} with another dtype ({base.dtype} -> "
                    f"{o.dtype}); aotc cannot regenerate dtype-changing views of inputs. Return "
                    ".clone() of it instead."
                )
            geometry = Geometry(
                tuple(o.shape), tuple(o.stride()), o.storage_offset() - base.storage_offset()
            )
            infos.append(
                OutputInfo(
                    OutputKind.ALIAS_OF_INPUT,
                    rg,
                    dtype,
                    base_arg=leaf,
                    geometry=geometry,
                    view_without_grad=o.grad_fn is None,
                    lazy_conj=o.is_conj() and not base.is_conj(),
                    lazy_neg=o.is_neg() and not base.is_neg(),
                )
            )
        elif o._base is not None and id(o._base) in out_of_id:
            infos.append(
                OutputInfo(OutputKind.ALIAS_OF_OUTPUT, rg, dtype, base_out=out_of_id[id(o._base)])
            )
        elif o._base is not None:
            idx = next((k for k, b in enumerate(bases) if b is o._base), None)
            if idx is None:
                idx = len(bases)
                bases.append(o._base)
            infos.append(
                OutputInfo(OutputKind.ALIAS_OF_INTERMEDIATE, rg, dtype, base_intermediate=idx)
            )
        else:
            infos.append(OutputInfo(OutputKind.FRESH, rg, dtype))
            out_of_id[id(o)] = UserOut(j)
    # A fresh output that is the base of an earlier alias: reclassify that alias.
    fixed = []
    for o, info in zip(outs, infos):
        if info.kind is OutputKind.ALIAS_OF_INTERMEDIATE and id(o._base) in out_of_id:  # type: ignore[union-attr]
            info = OutputInfo(
                OutputKind.ALIAS_OF_OUTPUT,
                info.requires_grad,
                info.dtype,
                base_out=out_of_id[id(o._base)],  # type: ignore[union-attr]
            )
        fixed.append(info)
    used = sorted({i.base_intermediate for i in fixed if i.base_intermediate is not None})
    remap = {old: new for new, old in enumerate(used)}
    first_user = {}
    for j, i in enumerate(fixed):
        if i.base_intermediate is not None:
            first_user.setdefault(i.base_intermediate, UserOut(j))
    fixed = [
        OutputInfo(i.kind, i.requires_grad, i.dtype, base_intermediate=remap[i.base_intermediate])
        if i.base_intermediate is not None
        else i
        for i in fixed
    ]
    return tuple(fixed), [first_user[k] for k in used]


def _check_constant(value: object, j: int) -> None:
    if value is None or isinstance(
        value, (int, float, bool, str, complex, torch.dtype, torch.device)
    ):
        return
    raise UnsupportedError(
        f"output {j} has type {type(value).__name__}, which aotc cannot return from a compiled "
        "function. Return tensors, Python numbers/strings/None, or tuples/lists/dicts of them."
    )


def _plan_fwd_outputs(
    outputs: tuple[OutputInfo, ...],
    inputs: tuple[InputInfo, ...],
    outs: list[object],
    wrappers: list[torch.Tensor],
    bases: list[torch.Tensor],
) -> tuple[FwdOutputPlan, tuple[TensorSpec, ...]]:
    in_graph = (OutputKind.FRESH, OutputKind.ALIAS_OF_INTERMEDIATE, OutputKind.ALIAS_OF_OUTPUT)
    user_outs = tuple(UserOut(j) for j, o in enumerate(outputs) if o.kind in in_graph)
    mutated = tuple(GraphArg(g) for g, i in enumerate(inputs) if i.mutation.has_data)
    tensors: list[torch.Tensor] = [outs[j] for j in user_outs]  # type: ignore[misc]
    tensors += [wrappers[g] for g in mutated]
    tensors += bases
    needs = [outputs[j].kind is OutputKind.FRESH and outputs[j].requires_grad for j in user_outs]
    needs += [wrappers[g].requires_grad and not inputs[g].mutated_under_no_grad for g in mutated]
    needs += [b.requires_grad for b in bases]
    specs = tuple(TensorSpec(tuple(t.shape), tuple(t.stride()), t.dtype, t.device) for t in tensors)
    plan = FwdOutputPlan(
        user_outs=user_outs,
        mutated_args=mutated,
        num_intermediate_bases=len(bases),
        needs_tangent=tuple(needs),
    )
    return plan, specs
