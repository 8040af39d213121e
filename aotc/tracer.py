"""Trace: one functional ATen graph holding the forward and, when training, the backward.

Stage: `trace_joint(program, leaves, convention, metadata, ...) -> JointGraph`.
Requires: `metadata` came from `collect_metadata` on the same program, leaves and convention.
Ensures: training: joint(primals, tangents) -> (fwd outputs, grads of primals); inference:
forward(primals) -> fwd outputs. Fwd outputs follow `metadata.fwd_plan` (FwdOut order); a grad is
None where the primal does not require grad or gets none. The graph has no mutating ops.

Worked example (f(x) = x.sin() with x requiring grad, trained):

    def forward(self, arg0_1, arg1_1):        # primal graph_arg0, tangent of fwd_out0
        sin = torch.ops.aten.sin.default(arg0_1)
        cos = torch.ops.aten.cos.default(arg0_1)
        mul = torch.ops.aten.mul.Tensor(arg1_1, cos)
        return (sin, mul)                     # fwd_out0, grad of graph_arg0

Note [Mutated inputs that require grad]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
In the joint trace every primal is a leaf (gradients are taken with respect to it), but the user's
tensor may be a non-leaf that eager lets them mutate in place. So a primal that is data- or
metadata-mutated and requires grad is handed to the program as `primal.clone()`: the program
mutates the clone, the clone's final value is the "updated input" forward output, and the gradient
of the original value flows back through the clone into the primal. The epilogue later copies the
updated value into the user's tensor, which gives it the same autograd history eager would.
Inference traces (no output takes a tangent) do the same while grad mode is on: eager's input is
then a non-leaf (eager refuses the write into a leaf that requires grad).

Note [Inference traces keep requires_grad]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A trace without a backward (no output needs a gradient: `return (y.detach(),)`) still gives each
primal the `requires_grad` the user's tensor has. The program sees what eager sees: Python that
reads `x.requires_grad` takes eager's branch (it took the other one, silently), and a tensor
derived from an input that requires grad is no leaf, so `v = a.clone(); v.requires_grad_();
v.t_()` traces as in eager (fuzz seed 17730: "a leaf Variable that requires grad is being used
in an in-place operation"). Nothing is differentiated, so the graph is the same.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import cast

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.experimental.proxy_tensor import make_fx

from aotc import oncediff
from aotc.eagerautograd import SHAPE_KEY, autograd_shape
from aotc.functional import (
    NESTED_BACKWARD,
    VIEW_METADATA_IN_PLACE,
    FlatProgram,
    OverlappingWrites,
    fakeify,
    from_functional,
    functionalization,
    refused_by_functorch,
    to_functional,
    to_functional_leaf,
    transform_state,
    user_errors,
)
from aotc.metadata import MetadataResult
from aotc.passes.descriptors import (
    FwdOutput,
    GradOutput,
    InputDesc,
    OutputDesc,
    PrimalInput,
    TangentInput,
)
from aotc.passes.ir import JointGraph
from aotc.passes.pin_dtypes import pin_default_dtypes
from aotc.passes.segments import SEGMENTS_KEY, Segmentation
from aotc.provenance import Recorder, recording
from aotc.rngreplay import RandomDraws
from aotc.runtime.convention import apply_convention, expand_graph_args
from aotc.runtime.schema import (
    CallingConvention,
    FwdOut,
    FwdOutputPlan,
    GraphArg,
    MutationAliasInfo,
    OutputKind,
)
from aotc.segmenting import MadeTensors, mark_segments


def trace_joint(
    program: FlatProgram,
    leaves: list[object],
    convention: CallingConvention,
    metadata: MetadataResult,
    fake_mode: FakeTensorMode,
    grad_enabled: bool,
    training: bool,
) -> JointGraph:
    graph_args = apply_convention(convention, leaves)
    meta, plan = metadata.meta, metadata.fwd_plan
    default_dtype = torch.get_default_dtype()  # the graph runs under it: the entry guards on it
    constants = [None if isinstance(x, torch.Tensor) else x for x in leaves]
    num_primals = len(graph_args)
    # See Note [Mutated inputs that require grad]
    clone_args = {
        g
        for g, info in enumerate(meta.inputs)
        if info.mutation is not info.mutation.NONE
        and (training or grad_enabled)
        and graph_args[g].requires_grad
    }
    tangent_outs = [FwdOut(k) for k, needs in enumerate(plan.needs_tangent) if needs]
    recorder = Recorder()  # See Note [Node provenance] in aotc/provenance.py

    ran: list[object] = []  # the leaves the program last ran on (for the backward's state)
    traced_outs: list[object] = []  # the user outputs of the last run

    def run_program(primals: list[torch.Tensor]) -> list[object]:
        user_args = [p.clone() if g in clone_args else p for g, p in enumerate(primals)]
        user_leaves = expand_graph_args(convention, user_args, constants)
        ran[:] = user_leaves
        outs, _ = program(user_leaves)
        traced_outs[:] = outs
        fwd = [outs[j] for j in plan.user_outs]
        fwd += [user_args[g] for g in plan.mutated_args]
        fwd += [ref.resolve(outs) for ref in metadata.base_refs]
        fwd += [ref.resolve(outs) for ref in metadata.root_value_refs]
        return fwd

    refused = {k for k, _ in metadata.refused}
    hooked = True  # the trace runs under identity hooks (see below)
    # See Note [Segments] in passes/segments.py: calls that write their inputs with history,
    # reshape them, make leaves or share storage between inputs keep one node. Writes eager
    # records no history for (a BatchNorm's running statistics) leave the boundaries as they are.
    segmentable = (
        training
        and not refused
        and not convention.synthetic_bases
        and all(
            c.geometry is None and not c.with_grad and not c.requires_grad
            for c in meta.leaf_changes
        )
        and all(
            info.mutation is info.mutation.NONE
            or (info.mutation is info.mutation.DATA and info.hidden_from_autograd)
            for info in meta.inputs
        )
    )
    found: list[Segmentation | None] = [None]
    regenerated = _regenerated_views(meta, plan) if segmentable else ()
    # Outputs that are views of inputs, with the input (Note [Views other outputs are computed
    # from] in passes/segments.py)
    input_views = (
        tuple(
            (j, info.base_arg)
            for j, info in enumerate(meta.outputs)
            if info.kind is OutputKind.ALIAS_OF_INPUT
            and info.requires_grad
            and info.base_arg is not None
            and not info.view_without_grad
        )
        if segmentable
        else ()
    )

    # See Note [Autocast casts of parameters]
    cast_once = frozenset(cached_cast_args(graph_args))
    cast_cache = torch.is_autocast_cache_enabled()  # the caller's (make_fx turns it off)

    # See Note [Hidden segment boundaries] in passes/segments.py
    watch_made = segmentable and len(tangent_outs) >= 2

    traced_shape: list[object] = [None]

    def joint(*flat: torch.Tensor) -> tuple[list[object], list[object]]:
        found[0] = None
        traced_shape[0] = None
        made = MadeTensors() if watch_made and hooked else None
        primals = [
            to_functional_leaf(p) if g in cast_once else to_functional(p)
            for g, p in enumerate(flat[:num_primals])
        ]
        tangents = [to_functional(t) for t in flat[num_primals:]]
        with functionalization():
            with (
                torch.set_grad_enabled(grad_enabled),
                OverlappingWrites(),
                # Without hooks (torch.func refused them) the refused outputs are left out.
                _saved_geometry(metadata) if hooked else contextlib.nullcontext(),
                # See Note [Views of a tensor reshaped in place]
                _KeepVersions() if metadata.reshapes_in_place else contextlib.nullcontext(),
                autocast_cache(cast_cache),
                made if made is not None else contextlib.nullcontext(),
            ):
                fwd = run_program(primals)
            grads: list[object] = [None] * num_primals
            if training:
                # Outputs that take a tangent are tensors.
                # Without identity hooks, autograd's version check would refuse a backward
                # from the outputs eager refuses one for: leave those out (their backward raises
                # eager's error at run time, Note [Backward eager would refuse]).
                take = [i for i, k in enumerate(tangent_outs) if hooked or k not in refused]
                diff = [cast(torch.Tensor, fwd[tangent_outs[i]]) for i in take]
                wrt = [g for g, p in enumerate(primals) if p.requires_grad]
                # See Note [State during the traced backward]
                around = getattr(program, "aotc_backward_state", None)
                if diff and wrt and hooked:
                    # See Note [Eager autograd on the ATen path] in aotc/eagerautograd.py
                    traced_shape[0] = autograd_shape(diff, [(g, primals[g]) for g in wrt])
                if diff and wrt and segmentable and hooked:
                    found[0], boundaries = mark_segments(
                        diff,
                        [tangent_outs[i] for i in take],
                        [primals[g] for g in wrt],
                        [(cast(torch.Tensor, fwd[k]), k, b) for k, b in regenerated],
                        made,
                        len(fwd),
                        [
                            (cast(torch.Tensor, traced_outs[j]), j, cast(torch.Tensor, ran[u]))
                            for j, u in input_views
                        ],
                    )
                    fwd = [*fwd, *boundaries]  # forward outputs only the segment nodes use
                if diff and wrt:
                    leaves = [primals[g] for g in sorted(cast_once)]
                    before = [p.grad for p in leaves]
                    with (
                        torch.enable_grad(),
                        # See Note [The traced backward runs without autocast]
                        torch._C._DisableAutocast(),
                        recorder.backward(diff),
                        oncediff.marking(diff),  # Note [Once-differentiable backwards]
                        around(ran) if around is not None else contextlib.nullcontext(),
                    ):
                        got = torch.autograd.grad(
                            diff,
                            [primals[g] for g in wrt],
                            [tangents[i] for i in take],
                            allow_unused=True,
                        )
                        if any(p.grad is not b for p, b in zip(leaves, before)):
                            # A leaf's .grad changed during the backward: a nested backward.
                            raise RuntimeError(NESTED_BACKWARD)
                    for g, grad in zip(wrt, got):
                        grads[g] = grad
        unwrapped = [from_functional(t) for t in fwd]
        return (unwrapped, [from_functional(g) for g in grads]) if training else (unwrapped, [])

    graph_of = dict(convention.leaf_to_graph)
    made_to_require_grad = {graph_of[c.leaf] for c in meta.leaf_changes if c.requires_grad}
    with fake_mode:
        primals = fakeify(fake_mode, graph_args, as_leaves=True)
        # See Note [Inference traces keep requires_grad]
        for g, p in enumerate(primals):
            if g in made_to_require_grad:
                p.requires_grad_(True)  # the call sets it first (EpiloguePlan.make_require_grad)
        # Contiguous, as the compiled backward hands them to its graph: see Note [Tangents are
        # contiguous] in runtime/autograd.py
        tangents = (
            [
                torch.empty(s.shape, dtype=s.dtype, device=s.device)
                for k, s in enumerate(metadata.fwd_specs)
                if plan.needs_tangent[k]
            ]
            if training
            else []
        )
        # Saved values go through identity hooks: see Note [Traces under torch.func].
        draws = RandomDraws()
        try:
            with (
                _lstm_trainable(training),
                transform_state(),
                user_errors("joint trace", eager_ran=True),
                recording(),
                draws.tracking(),
                torch.autograd.graph.saved_tensors_hooks(_identity, _identity),
                _use_lazy_graph_module(True),  # Note [The joint module writes no code]
            ):
                module = make_fx(joint, record_stack_traces=True)(*primals, *tangents)
        except Exception as e:
            if not refused_by_functorch(e):
                raise
            hooked = False
            draws = RandomDraws()
            with (
                _lstm_trainable(training),
                transform_state(),
                user_errors("joint trace", eager_ran=True),
                recording(),
                draws.tracking(),
                _use_lazy_graph_module(True),
            ):
                module = make_fx(joint, record_stack_traces=True)(*primals, *tangents)
        recorder.annotate(module)
        oncediff.mark_from_stack_traces(module)  # Functions Dynamo captured
        if found[0] is not None:
            module.meta[SEGMENTS_KEY] = found[0]
        if traced_shape[0] is not None:
            module.meta[SHAPE_KEY] = traced_shape[0]
        # See Note [Factory ops follow the default dtype] in passes/pin_dtypes.py
        pin_default_dtypes(module, default_dtype)
        # See Note [Random ops the traced backward draws again] in aotc/rngreplay.py
        draws.pair(module, recorder.forward_names)

    inputs: tuple[InputDesc, ...] = tuple(PrimalInput(GraphArg(g)) for g in range(num_primals))
    inputs += tuple(TangentInput(k) for k in tangent_outs) if training else ()
    num_fwd = plan.num_outputs + (len(found[0].hidden) if found[0] is not None else 0)
    outputs: tuple[OutputDesc, ...] = tuple(FwdOutput(FwdOut(k)) for k in range(num_fwd))
    outputs += tuple(GradOutput(GraphArg(g)) for g in range(num_primals)) if training else ()
    _flatten_output(module, _view_bases(meta, plan), _detached_fresh(meta, plan))
    return JointGraph(module=module, inputs=inputs, outputs=outputs)


# Note [Views of a tensor reshaped in place]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# `v = a[0]; a.squeeze_(); return v.double()`: the in-place reshape bumps the version counter `a`
# and `v` share, so autograd rebuilds `v`'s node when `v` is next used. Eager rebuilds it as an
# `as_strided` of the base's storage, which gives `v`'s elements their gradient whatever `a`'s
# new shape. In the joint trace the tensors are functional wrappers, which autograd cannot
# `as_strided`: it replays `v`'s view ops (`select(0, 0)`) on `a` as it is now, a view of other
# elements and another shape, whose gradient autograd then sums to `v`'s shape: a wrong gradient
# (fuzz seed 32479), or a failing trace when the shapes do not broadcast. A reshape in place
# changes no element, so `v`'s node as first recorded already routes the gradient as eager's
# rebuilt one does: during the trace the reshape ops leave the version counter where it was (the
# counter is not a graph value, and the entry restores eager's versions, Note [Exact versions]).
# A later write into the storage still bumps it and makes autograd replay the views on the
# reshaped tensor: the metadata pass refuses that (`EagerChecks._refuse_write_after_reshape`).
# The reshaped tensor's own node, when it is a view, was recorded at the bumped version, which
# the next write would reach again (autograd would then keep that node, from before the write:
# a wrong gradient, fuzz seed 37925); so it is read once right after the counter is put back,
# and autograd rebuilds it there by replaying its views, reshape included, on its base.


class _KeepVersions(torch.overrides.TorchFunctionMode):
    """See Note [Views of a tensor reshaped in place]."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) not in VIEW_METADATA_IN_PLACE or not args:
            return func(*args, **kwargs)
        t = args[0]
        # an inference tensor has no version counter (and no autograd to rebuild a node)
        plain = isinstance(t, torch.Tensor) and not t.is_inference()
        before = t._version if plain else None
        out = func(*args, **kwargs)
        if before is not None and t._version != before:
            torch._C._autograd._unsafe_set_version_counter((t,), (before,))
            if t._base is not None and t.requires_grad:
                # The op recorded the view's node at the bumped version, which the next write
                # into the storage would reach again: the view would keep a node made before
                # that write (fuzz seed 37925). Read its node now, at the version eager's counter
                # has, so autograd rebuilds and records it here.
                _ = t.grad_fn
        return out


# Note [Autocast casts of parameters]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Under autocast, eager casts an fp32 leaf that requires grad (a parameter; not a view) to the
# lower-precision dtype once per autocast region: the cast is cached, and every use in the region
# reads the same cast tensor. So its autograd graph has one cast node, where the gradients of all
# the uses are summed in the lower precision and cast to fp32 once. A weight used 20 times
# (an unrolled RNN cell, layers shared across depth) gets a bf16 sum of 20 terms.
#
# The trace saw neither condition. make_fx turns the autocast cache off, and every primal that
# requires grad is a non-leaf functional wrapper (`_mirror_autograd_meta_to` gives it an error
# grad_fn). Each use was cast on its own and the casts' gradients were summed in fp32: measured
# on an unrolled 20-step tanh RNN under CPU bf16 autocast, the weight gradient differed from
# eager's by 0.5% (norm). So the graph args that eager would cache, namely fp32 leaves that
# require grad and are not views (`cached_cast_args`, read from the caller's tensors), enter the
# trace as leaf wrappers (`to_functional_leaf`). The forward then runs with the caller's cache
# setting. An autocast region the program enters itself sets the cache as eager's does, and
# clears it on leaving the outermost region. Under the caller's region, the casts of the trace's
# wrappers stay in its cache until the region ends, as eager's own casts do (they hold fake
# tensors, and no real tensor can hit them: entries are keyed by the wrapper).
#
# Still different from eager: a cast cached by the caller's region before the call is not shared
# with the graph, and the compiled graph keeps the cast structure of its first call. The structure
# depends on whether those inputs are leaves, which is not guarded, so only the rounding of the
# sum can differ.


# Note [The traced backward runs without autocast]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Eager's backward runs with the autocast state of the `.backward()` call, which is off in the
# usual `with autocast(): loss = model(x)` then `loss.backward()`. The compiled backward runs
# without autocast too (Note [Graphs run without autocast] in runtime/wrappers.py). But the
# trace ran `autograd.grad` inside the caller's autocast region, so autocast recast the backward's
# fp32 matmuls to bf16 and the graph kept those casts. Linear layers hide this, since their
# backward operands are bf16 already. Attention's math path does not: it upcasts to fp32, and its
# backward bmms came out in bf16, 6e-2 off eager's gradients (CPU SDPA with dropout: RoBERTa,
# Swin). The traced backward now runs with autocast off. A custom Function's `custom_bwd`
# switches it back on, as in eager. Not matched: a `.backward()` called inside the autocast
# region, where eager casts in the backward too.


def cached_cast_args(graph_args: list[torch.Tensor]) -> frozenset[int]:
    """Graph args whose autocast casts eager caches (Note [Autocast casts of parameters])."""
    return frozenset(
        g
        for g, t in enumerate(graph_args)
        if isinstance(t, torch.Tensor)
        and t.dtype == torch.float32
        and t.requires_grad
        and t.is_leaf
        and not t._is_view()
    )


@contextlib.contextmanager
def autocast_cache(enabled: bool) -> Iterator[None]:
    """The caller's autocast cache setting inside make_fx, which turns it off."""
    before = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(enabled)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(before)


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


# Note [State during the traced backward]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The program reads module parameters and other lifted state through their locations, which hold
# the trace's values only while the program runs (`swapped`, aotc/lifting.py). Activation
# checkpointing (`torch.utils.checkpoint`, non-reentrant) runs part of the program again inside
# the backward, where it read the user's real parameters instead and the trace refused them. A
# program that lifts state sets `aotc_backward_state(leaves)`, a context that puts the same
# values back for the traced backward (aotc/api.py), so the recomputation reads what the forward
# read, as eager's does. A random op the backward runs again (dropout inside a checkpointed
# function) uses the forward's draw, as eager's restored generator state makes it (Note [Random
# ops the traced backward draws again] in aotc/rngreplay.py).


def _lstm_trainable(training: bool) -> AbstractContextManager[object]:
    """See Note [LSTM layers in a training trace]."""
    return torch.backends.mkldnn.flags(enabled=False) if training else contextlib.nullcontext()


# Note [LSTM layers in a training trace]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# While make_fx traces, `aten.lstm` runs torch's Python decomposition, which picks oneDNN's
# inference-only layer (`mkldnn_rnn_layer(..., train=False)`, no workspace) whenever oneDNN is
# enabled, the tensors are CPU float and the *input* needs no gradient, even when the weights do.
# Its autograd formula then records a backward that needs the workspace the layer never made:
# the compiled backward failed ("Expected a proper Tensor but got None ... 'workspace'"). Eager
# calls the layer with train=True. A training trace therefore runs with oneDNN disabled, so the
# decomposition unrolls the layer into plain ops (matmuls and pointwise gates) that the joint
# graph differentiates; nothing else the trace records reads that flag (the graphs still run
# oneDNN kernels where ATen picks them at run time). Inference traces keep the oneDNN layer.


# Note [Saved values changed in place]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# When the program changes a value autograd saved (`y = x.tanh(); y.transpose_(0, 1)`), eager's
# backward refuses (the metadata pass found which outputs: `MetadataResult.refused`, and the entry
# raises eager's error when a gradient reaches one of them). The joint trace still differentiates
# those outputs, and autograd there hands the backward formula the saved object itself: after a
# metadata change in place (`transpose_`, `as_strided_`, ...) it has the new shape and the
# formula fails to trace. So only when some backward is refused, each value is saved as an alias
# taken when it was saved, which keeps the geometry it had then (the computed gradients are never
# handed out: the entry refuses them first).


def _saved_geometry(metadata: MetadataResult) -> AbstractContextManager[object]:
    if not metadata.refused:
        return contextlib.nullcontext()
    return torch.autograd.graph.saved_tensors_hooks(torch.ops.aten.alias.default, _same)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _view_bases(meta: MutationAliasInfo, plan: FwdOutputPlan) -> dict[int, list[int]]:
    """Forward outputs the runtime regenerates views from (fresh outputs and intermediate
    bases), each with the forward outputs that are the graph's own views of it."""
    fwd_of_user = {j: k for k, j in enumerate(plan.user_outs)}
    base0 = len(plan.user_outs) + len(plan.mutated_args)
    bases: dict[int, list[int]] = {}
    for j, k in fwd_of_user.items():
        info = meta.outputs[j]
        if info.kind is OutputKind.FRESH:
            bases.setdefault(k, [])
    for b in range(plan.num_intermediate_bases):
        bases.setdefault(base0 + b, [])
    for j, k in fwd_of_user.items():
        info = meta.outputs[j]
        if info.kind is OutputKind.ALIAS_OF_OUTPUT:
            assert info.base_out is not None
            bases[fwd_of_user[info.base_out]].append(k)
        elif info.kind is OutputKind.ALIAS_OF_INTERMEDIATE:
            assert info.base_intermediate is not None
            bases[base0 + info.base_intermediate].append(k)
    return bases


def _regenerated_views(
    meta: MutationAliasInfo, plan: FwdOutputPlan
) -> tuple[tuple[FwdOut, FwdOut], ...]:
    """The differentiable outputs the runtime regenerates as views of another forward output,
    with that output (Note [Views other outputs are computed from] in passes/segments.py)."""
    fwd_of_user = {j: k for k, j in enumerate(plan.user_outs)}
    base0 = len(plan.user_outs) + len(plan.mutated_args)
    views = []
    for j, k in fwd_of_user.items():
        info = meta.outputs[j]
        if not info.requires_grad:
            continue
        if info.kind is OutputKind.ALIAS_OF_OUTPUT and info.base_out in fwd_of_user:
            views.append((FwdOut(k), FwdOut(fwd_of_user[info.base_out])))
        elif info.kind is OutputKind.ALIAS_OF_INTERMEDIATE and info.base_intermediate is not None:
            views.append((FwdOut(k), FwdOut(base0 + info.base_intermediate)))
    return tuple(views)


def _detached_fresh(meta: MutationAliasInfo, plan: FwdOutputPlan) -> set[int]:
    """Fresh user outputs that need no gradient from the graph (none, or leaves the program made
    with `requires_grad_()`): the graph may return them as views (Note [Forward outputs that are
    views])."""
    return {
        k
        for k, j in enumerate(plan.user_outs)
        if meta.outputs[j].kind is OutputKind.FRESH
        and (not meta.outputs[j].requires_grad or meta.outputs[j].new_leaf)
        and not plan.needs_tangent[k]
    }


def fresh_views(module: torch.fx.GraphModule) -> frozenset[int]:
    """The forward outputs that the flat graph returns as views (`_flatten_output` kept them):
    the epilogue detaches them."""
    out = next(n for n in reversed(module.graph.nodes) if n.op == "output")
    return frozenset(
        k for k, v in enumerate(out.args[0]) if isinstance(v, torch.fx.Node) and _is_view_node(v)
    )


def _flatten_output(
    module: torch.fx.GraphModule, view_bases: dict[int, list[int]], detached: set[int]
) -> None:
    """make_fx returns ((fwd...), (grads...)); the stages want one flat tuple of values.

    See Note [Forward outputs that are views].
    """
    graph = module.graph
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    flat: list[object] = []
    for part in out.args[0]:
        flat.extend(part)
    for k, raws in view_bases.items():
        value = flat[k]
        if not (isinstance(value, torch.fx.Node) and _is_view_node(value)):
            continue
        if not raws and k in detached and _is_static(value):
            continue  # returned as the view: the epilogue detaches it
        with graph.inserting_before(out):
            if _is_static(value) and all(
                _is_static(flat[r]) and _retakeable(value, flat[r])  # type: ignore[arg-type]
                for r in raws
            ):
                flat[k], moved = _fresh_copy(graph, value, [flat[r] for r in raws])  # type: ignore[misc]
                for r, node in zip(raws, moved):
                    flat[r] = node
            else:
                clone = graph.call_function(torch.ops.aten.clone.default, (value,))
                clone.meta = dict(value.meta)
                flat[k] = clone
    out.args = (tuple(flat),)
    # Random ops stay even if unused (they advance the RNG): fx treats them as pure inside a
    # Dynamo compilation (Inductor's convention) unless told otherwise.
    graph.eliminate_dead_code(is_impure_node=lambda n: n.is_impure(impure_random=True))
    module.graph._codegen = torch.fx.graph.CodeGen()
    module.recompile()  # lazy: see Note [The joint module writes no code]


# Note [The joint module writes no code]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A GraphModule writes and compiles its graph's Python code whenever its graph is set, and the
# joint module's graph is set twice (make_fx, then `_flatten_output`'s new output). The stages
# only read the joint graph (cleanup copies it, the partition builds its own modules), so that
# code is usually never run or read: 2.4 of 40 ms of the LayerNorm MLP's cold compile, 17 of 220
# ms of the GPT stack's (bench/compile_time.py). The joint trace makes a lazy graph module
# (`torch.fx._lazy_graph_module`): its code is written on first use (a call, `.code`, a dump),
# from the graph as it is then.


# Note [Forward outputs that are views]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A forward output the runtime regenerates views from (a fresh user output, or the base of
# outputs that are views of an intermediate) may be a view node in the graph: `y = x * 2;
# y.t_(); return y.view(-1)` makes the base `t(mul)`. Returned from the autograd node, a view
# becomes a view created in a custom Function, and every view of it inherits that: eager lets
# the caller write `out.add_(1)`, autograd would refuse. So such an output is returned as a
# fresh tensor with the same sizes and strides (`empty_strided` + `copy`), and the graph's own
# views of it that the epilogue reads geometry from are re-taken off that copy with `as_strided`
# at the same offsets relative to it. A view with no such views gets the same copy (a `clone`
# would make `a.t().add(1)[0].detach().requires_grad_()` contiguous, eager keeps its stride;
# fuzz seed 23840). (With symbolic sizes it is a `clone`, as before.)
# A fresh output that needs no gradient and has no such views is not returned through autograd
# at all: it stays the graph's view (`a.neg().diagonal().detach()` keeps eager's strides and
# storage: a copy would come back contiguous), and the epilogue detaches it (`OutputStep.detach`),
# since eager's fresh outputs are never views. A leaf the program made (`requires_grad_()`) needs
# no gradient from the graph either: it is detached the same way and made a leaf after
# (`a.exp().expand(2, 3).detach().requires_grad_()` keeps its stride 0, which no copy can have;
# fuzz seed 30738).


def _is_static(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return False
    values = (*val.shape, *val.stride(), val.storage_offset())
    return not any(isinstance(v, torch.SymInt) for v in values)


def _fresh_copy(
    graph: torch.fx.Graph, value: torch.fx.Node, raws: list[torch.fx.Node]
) -> tuple[torch.fx.Node, list[torch.fx.Node]]:
    aten = torch.ops.aten
    val = value.meta["val"]
    empty = graph.call_function(
        aten.empty_strided.default,
        (list(val.shape), list(val.stride())),
        {"dtype": val.dtype, "device": val.device},
    )
    copy = graph.call_function(aten.copy.default, (empty, value))
    with val.fake_mode:
        fresh = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device)
    empty.meta = {**value.meta, "val": fresh}
    copy.meta = {**value.meta, "val": fresh}
    moved = []
    for raw in raws:
        rv = raw.meta["val"]
        source, source_val = copy, fresh
        if rv.dtype != val.dtype:  # view_as_real, or a view(dtype) of the same item size
            op = aten.view_as_real.default if val.is_complex() and not rv.is_complex() else None
            source = graph.call_function(op or aten.view.dtype, (copy,) if op else (copy, rv.dtype))
            with val.fake_mode:
                source_val = torch.view_as_real(fresh) if op else fresh.view(rv.dtype)
            source.meta = {**raw.meta, "val": source_val}
        ratio = val.element_size() // rv.element_size()
        offset = rv.storage_offset() - val.storage_offset() * ratio
        node = graph.call_function(
            aten.as_strided.default, (source, list(rv.shape), list(rv.stride()), offset)
        )
        with val.fake_mode:
            node.meta = {**raw.meta, "val": source_val.as_strided(rv.shape, rv.stride(), offset)}
        moved.append(node)
    return copy, moved


def _retakeable(value: torch.fx.Node, raw: torch.fx.Node) -> bool:
    """Whether `_fresh_copy` can re-take `raw` off a copy of `value`: the same dtype, the real
    view of a complex value, or a dtype of the same item size (else: a clone, as with symbolic
    sizes)."""
    val, rv = value.meta["val"], raw.meta["val"]
    if rv.dtype == val.dtype:
        return True
    if val.is_complex() and not rv.is_complex():
        return val.element_size() == 2 * rv.element_size()
    return val.element_size() == rv.element_size()


def _is_view_node(node: torch.fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and target.is_view
