"""Epilogue: make the call's side effects and aliases look exactly like eager.

Stage: `plan_epilogue(meta, fwd_plan, convention) -> EpiloguePlan` at compile time;
`apply_epilogue(plan, leaves, graph_args, fwd_outs) -> user output leaves` every call.

Requires: `fwd_outs` are the forward graph's outputs (FwdOut order), the differentiable ones as
returned by the autograd node. Ensures: inputs mutated by the program are updated in place
(metadata replayed with as_strided_, data copied with copy_, under no_grad when every mutation
was), and each output is the right object: a fresh tensor, the input itself, or a real view
regenerated off the user's input or off a differentiable intermediate base.

Worked example (f(x) = (x.mul_(2), x.t()), x a non-leaf requiring grad):

    mutations: copy graph_arg0 <- fwd_out0
    output 0: is_input user_arg0
    output 1: view of user_arg0 as_strided((4, 3), (1, 4), +0)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aotc.runtime.schema import (
    CallingConvention,
    FwdOutputPlan,
    Geometry,
    GraphArg,
    MutationAliasInfo,
    OutputKind,
    UserOut,
)


@dataclass(frozen=True, slots=True)
class MutationStep:
    arg: GraphArg
    new_value: int | None  # FwdOut of the updated value for data mutations, else None
    geometry: Geometry | None  # new geometry for metadata mutations, else None
    no_grad: bool  # replay under no_grad (every mutation happened under no_grad)


@dataclass(frozen=True, slots=True)
class OutputStep:
    kind: OutputKind
    requires_grad: bool
    source: int | None  # FwdOut (in-graph kinds), UserArg (input kinds) or UserOut (output kinds)
    base: int | None  # ALIAS_OF_INTERMEDIATE: FwdOut of the base
    geometry: Geometry | None  # ALIAS_OF_INPUT
    constant: object
    track_grad: bool  # regenerate the view with autograd tracking (eager's view had it)
    lazy_conj: bool = False  # ALIAS_OF_INPUT: reapply the conjugate bit after as_strided
    lazy_neg: bool = False  # ALIAS_OF_INPUT: reapply the negative bit after as_strided


@dataclass(frozen=True, slots=True)
class EpiloguePlan:
    mutations: tuple[MutationStep, ...]  # in GraphArg order
    outputs: tuple[OutputStep, ...]  # len == num user outputs; UserOut space
    order: tuple[UserOut, ...]  # outputs computed first, then aliases of outputs

    def format(self) -> str:
        lines = ["# stage: epilogue"]
        for m in self.mutations:
            what = []
            if m.geometry is not None:
                what.append(f"as_strided_ graph_arg{m.arg} {m.geometry}")
            if m.new_value is not None:
                what.append(f"copy graph_arg{m.arg} <- fwd_out{m.new_value}")
            lines.append("mutation: " + "; ".join(what) + (" (no_grad)" if m.no_grad else ""))
        for j, s in enumerate(self.outputs):
            lines.append(f"output {j}: {s.kind.value} source={s.source} base={s.base}")
        return "\n".join(lines)


def plan_epilogue(
    meta: MutationAliasInfo, fwd_plan: FwdOutputPlan, convention: CallingConvention
) -> EpiloguePlan:
    del convention  # output bases are in UserArg space already
    fwd_of_mut = {g: len(fwd_plan.user_outs) + k for k, g in enumerate(fwd_plan.mutated_args)}
    base0 = len(fwd_plan.user_outs) + len(fwd_plan.mutated_args)
    mutations = tuple(
        MutationStep(
            arg=GraphArg(g),
            new_value=fwd_of_mut.get(GraphArg(g)),
            geometry=info.new_geometry,
            no_grad=info.mutated_under_no_grad,
        )
        for g, info in enumerate(meta.inputs)
        if info.mutation is not info.mutation.NONE
    )
    fwd_of_user = {j: k for k, j in enumerate(fwd_plan.user_outs)}
    steps = []
    for j, info in enumerate(meta.outputs):
        match info.kind:
            case OutputKind.FRESH | OutputKind.ALIAS_OF_OUTPUT:
                source, base = fwd_of_user[UserOut(j)], None
            case OutputKind.ALIAS_OF_INTERMEDIATE:
                assert info.base_intermediate is not None
                source, base = fwd_of_user[UserOut(j)], base0 + info.base_intermediate
            case OutputKind.IS_INPUT | OutputKind.ALIAS_OF_INPUT:
                source, base = info.base_arg, None
            case OutputKind.IS_OUTPUT:
                source, base = info.base_out, None
            case OutputKind.NOT_TENSOR:
                source, base = None, None
        if info.kind is OutputKind.ALIAS_OF_OUTPUT:
            base = info.base_out  # UserOut of the base output
        steps.append(
            OutputStep(
                info.kind,
                info.requires_grad,
                source,
                base,
                info.geometry,
                info.constant,
                track_grad=info.requires_grad and not info.view_without_grad,
                lazy_conj=info.lazy_conj,
                lazy_neg=info.lazy_neg,
            )
        )
    late = (OutputKind.ALIAS_OF_OUTPUT, OutputKind.IS_OUTPUT)
    order = tuple(UserOut(j) for j, s in enumerate(steps) if s.kind not in late)
    order += tuple(UserOut(j) for j, s in enumerate(steps) if s.kind in late)
    return EpiloguePlan(mutations=mutations, outputs=tuple(steps), order=order)


def apply_mutations(
    plan: EpiloguePlan, graph_args: list[torch.Tensor], fwd_outs: list[torch.Tensor]
) -> None:
    for m in plan.mutations:
        target = graph_args[m.arg]
        with torch.no_grad() if m.no_grad else _nullcontext:
            if m.geometry is not None:
                g = m.geometry
                target.as_strided_(g.size, g.stride, target.storage_offset() + g.offset)
            if m.new_value is not None:
                target.copy_(fwd_outs[m.new_value])


def build_outputs(
    plan: EpiloguePlan, leaves: list[object], fwd_outs: list[torch.Tensor]
) -> list[object]:
    result: list[object] = [None] * len(plan.outputs)
    for j in plan.order:
        s = plan.outputs[j]
        match s.kind:
            case OutputKind.FRESH:
                result[j] = fwd_outs[s.source]  # type: ignore[index]
            case OutputKind.IS_INPUT:
                result[j] = leaves[s.source]  # type: ignore[index]
            case OutputKind.ALIAS_OF_INPUT:
                base = leaves[s.source]  # type: ignore[index]
                g = s.geometry
                assert isinstance(base, torch.Tensor) and g is not None
                with _grad_for(s.track_grad):
                    view = base.as_strided(g.size, g.stride, base.storage_offset() + g.offset)
                    if s.lazy_conj:
                        view = view.conj()
                    if s.lazy_neg:
                        view = view._neg_view()
                    result[j] = view
            case OutputKind.ALIAS_OF_INTERMEDIATE:
                result[j] = _view_like(fwd_outs[s.base], fwd_outs[s.source], s.track_grad)  # type: ignore[index]
            case OutputKind.ALIAS_OF_OUTPUT:
                base_out = result[s.base]  # type: ignore[index]
                assert isinstance(base_out, torch.Tensor)
                result[j] = _view_like(base_out, fwd_outs[s.source], s.track_grad)  # type: ignore[index]
            case OutputKind.IS_OUTPUT:
                result[j] = result[s.source]  # type: ignore[index]
            case OutputKind.NOT_TENSOR:
                result[j] = s.constant
    return result


def _view_like(base: torch.Tensor, raw: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """A real view of `base` with the geometry `raw` (the graph's own view of it) has."""
    with _grad_for(requires_grad):
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
        return view


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_nullcontext = _Null()


def _grad_for(requires_grad: bool) -> object:
    return _nullcontext if requires_grad else torch.no_grad()
