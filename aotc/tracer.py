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
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from aotc.functional import (
    FlatProgram,
    OverlappingWrites,
    fakeify,
    from_functional,
    functionalization,
    to_functional,
    user_errors,
)
from aotc.metadata import MetadataResult
from aotc.passes.descriptors import FwdOutput, GradOutput, PrimalInput, TangentInput
from aotc.passes.ir import JointGraph
from aotc.runtime.convention import apply_convention, expand_graph_args
from aotc.runtime.schema import CallingConvention, FwdOut, GraphArg, OutputKind


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
    constants = [None if isinstance(x, torch.Tensor) else x for x in leaves]
    num_primals = len(graph_args)
    # See Note [Mutated inputs that require grad]
    clone_args = {
        g
        for g, info in enumerate(meta.inputs)
        if info.mutation is not info.mutation.NONE and training and graph_args[g].requires_grad
    }
    tangent_outs = [FwdOut(k) for k, needs in enumerate(plan.needs_tangent) if needs]

    def run_program(primals: list[torch.Tensor]) -> list[torch.Tensor]:
        user_args = [p.clone() if g in clone_args else p for g, p in enumerate(primals)]
        user_leaves = expand_graph_args(convention, user_args, constants)
        outs, _ = program(user_leaves)
        fwd = [outs[j] for j in plan.user_outs]
        fwd += [user_args[g] for g in plan.mutated_args]
        fwd += [ref.resolve(outs) for ref in metadata.base_refs]
        fwd += [ref.resolve(outs) for ref in metadata.root_value_refs]
        return fwd

    def joint(*flat: torch.Tensor) -> tuple[list[object], list[object]]:
        primals = [to_functional(p) for p in flat[:num_primals]]
        tangents = [to_functional(t) for t in flat[num_primals:]]
        with functionalization():
            with torch.set_grad_enabled(grad_enabled), OverlappingWrites():
                fwd = run_program(primals)
            grads: list[object] = [None] * num_primals
            if training:
                diff = [fwd[k] for k in tangent_outs]
                wrt = [g for g, p in enumerate(primals) if p.requires_grad]
                if diff and wrt:
                    with torch.enable_grad():
                        got = torch.autograd.grad(
                            diff, [primals[g] for g in wrt], tangents, allow_unused=True
                        )
                    for g, grad in zip(wrt, got):
                        grads[g] = grad
        unwrapped = [from_functional(t) for t in fwd]
        return (unwrapped, [from_functional(g) for g in grads]) if training else (unwrapped, [])

    with fake_mode:
        primals = fakeify(fake_mode, graph_args, as_leaves=True)
        if not training:
            for p in primals:
                p.requires_grad_(False)
        tangents = (
            [
                torch.empty_strided(s.shape, s.stride, dtype=s.dtype, device=s.device)
                for k, s in enumerate(metadata.fwd_specs)
                if plan.needs_tangent[k]
            ]
            if training
            else []
        )
        with user_errors("joint trace"):
            module = make_fx(joint, record_stack_traces=True)(*primals, *tangents)

    inputs = tuple(PrimalInput(GraphArg(g)) for g in range(num_primals))
    inputs += tuple(TangentInput(k) for k in tangent_outs) if training else ()
    outputs = tuple(FwdOutput(FwdOut(k)) for k in range(plan.num_outputs))
    outputs += tuple(GradOutput(GraphArg(g)) for g in range(num_primals)) if training else ()
    fresh = [k for k, j in enumerate(plan.user_outs) if meta.outputs[j].kind is OutputKind.FRESH]
    _flatten_output(module, fresh)
    return JointGraph(module=module, inputs=inputs, outputs=outputs)


def _flatten_output(module: torch.fx.GraphModule, fresh: list[int]) -> None:
    """make_fx returns ((fwd...), (grads...)); the stages want one flat tuple of values.

    A fresh user output (fwd positions `fresh`) that the graph computes as a view of an
    intermediate (`y = x * 2; y.unsqueeze_(0); return y`) is cloned: eager returns a tensor that
    is no view, and a view returned from the autograd node could not be mutated in place.
    """
    graph = module.graph
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    flat: list[object] = []
    for part in out.args[0]:
        flat.extend(part)
    for k in fresh:
        value = flat[k]
        if isinstance(value, torch.fx.Node) and _is_view_node(value):
            with graph.inserting_before(out):
                clone = graph.call_function(torch.ops.aten.clone.default, (value,))
            clone.meta = dict(value.meta)
            flat[k] = clone
    out.args = (tuple(flat),)
    graph.eliminate_dead_code()
    module.graph._codegen = torch.fx.graph.CodeGen()
    module.recompile()


def _is_view_node(node: torch.fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and target.is_view
