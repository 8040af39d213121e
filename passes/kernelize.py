"""Lower one stage graph to generated Triton kernels plus ATen calls.

Stage: `lower_graph(module, interpret) -> CompiledGraph`.
Requires: a functional ATen fx graph (forward or backward) with `meta["val"]` on every node.
Ensures: `decompose` -> `lower` -> `plan_fusion` -> `generate_kernel` for every fused group, and
a `runtime.kernels.CompiledGraph` whose callable takes the placeholders positionally and returns
the output tuple, like `runtime.launch.make_callable`. A group whose kernel cannot be generated
or compiled runs as ATen calls (its fx nodes) with a warning on `aotc.kernels`; ops lowering
does not know stay ATen calls.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from passes.codegen import generate_kernel
from passes.decompose import decompose
from passes.fusion import FusionPlan, GroupKind, plan_fusion
from passes.lowering import Extern, _non_overlapping, lower, view_output_positions
from runtime.kernels import (
    AtenStep,
    BufferSpec,
    CompiledGraph,
    KernelSource,
    KernelStep,
    Step,
    load_kernel,
)

log = logging.getLogger("aotc.kernels")


def graph_device(module: fx.GraphModule) -> torch.device | None:
    for node in module.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            return val.device
    return None


def lower_graph(module: fx.GraphModule, interpret: bool) -> CompiledGraph:
    decomposed = decompose(module)
    plan = plan_fusion(lower(decomposed, view_output_positions(module)))
    device = str(graph_device(decomposed) or "cpu")
    outputs = {o for o in plan.lowered.outputs if isinstance(o, str)}
    extern_reads = {b for g in plan.groups if g.kind is GroupKind.EXTERN for b in g.reads}
    steps: list[Step] = []
    kernels: list[KernelSource] = []
    for group in plan.groups:
        if group.kind is GroupKind.EXTERN:
            ext = group.members[0]
            assert isinstance(ext, Extern)
            steps.append(AtenStep(ext.name, _node_runner([ext.node], [ext.name],
                                                         plan.lowered.aliases)))
            continue
        nodes = sorted({n for m in group.members for n in m.cone},
                       key=_position(decomposed))
        fallback = _node_runner(nodes, list(group.stores), plan.lowered.aliases)
        try:
            kernel = generate_kernel(plan, group, device, interpret)
            load_kernel(kernel)
        except Exception as e:  # noqa: BLE001 - a group that cannot compile runs as ATen calls
            log.warning("could not generate a kernel for %s (%s: %s); running its ops as ATen "
                        "calls", group.name, type(e).__name__, e)
            steps.append(AtenStep(group.name, fallback))
            continue
        kernels.append(kernel)
        specs = tuple(_spec(plan, name, device) for name in group.stores)
        steps.append(KernelStep(kernel, specs, fallback))
    steps, num_slots = _plan_buffers(steps, plan, outputs | extern_reads)
    return CompiledGraph(
        kernels=tuple(kernels), steps=tuple(steps), placeholders=tuple(plan.lowered.placeholders),
        outputs=tuple(plan.lowered.outputs), num_slots=num_slots, fusion_text=plan.format(),
        input_strides=tuple(_input_stride(plan, name) for name in plan.lowered.placeholders),
    )


def _input_stride(plan: FusionPlan, name: str) -> tuple[int, ...] | None:
    """The traced strides of a placeholder that some kernel reads (ATen calls take any)."""
    read = any(name in g.reads for g in plan.kernel_groups)
    return plan.lowered.buffers[name][1] if read and name in plan.lowered.buffers else None


def _position(module: fx.GraphModule) -> Callable[[fx.Node], int]:
    order = {n: i for i, n in enumerate(module.graph.nodes)}
    return order.__getitem__


def _spec(plan: FusionPlan, name: str, device: str) -> BufferSpec:
    size, stride, _, dtype = plan.lowered.buffers[name]
    return BufferSpec(name, size, stride, dtype, device, None)


def _node_runner(nodes: list[fx.Node], keep: list[str], aliases: dict[str, str]
                 ) -> Callable[[dict[str, Any]], None]:
    """Run fx nodes as ATen calls, reading and writing buffers by node name."""
    def run(env: dict[str, Any]) -> None:
        local: dict[str, Any] = {}

        def get(n: fx.Node) -> Any:
            if n.name in local:
                return local[n.name]
            return env[n.name] if n.name in env else env[aliases[n.name]]

        for node in nodes:
            if node.op == "get_attr":
                local[node.name] = _fetch_attr(node.graph.owning_module, str(node.target))
                continue
            args = fx.node.map_arg(node.args, get)
            kwargs = fx.node.map_arg(node.kwargs, get)
            local[node.name] = node.target(*args, **kwargs)  # type: ignore[operator]
            val = node.meta.get("val")
            out = local[node.name]
            if (isinstance(val, torch.Tensor) and isinstance(out, torch.Tensor)
                    and out.stride() != val.stride() and node.name in keep
                    and val.numel() > 1 and _non_overlapping(val.shape, val.stride())):
                fixed = torch.empty_strided(val.shape, val.stride(), dtype=out.dtype,
                                            device=out.device)
                local[node.name] = fixed.copy_(out)
        for name in keep:
            env[name] = local[name]
    return run


def _fetch_attr(module: Any, target: str) -> Any:
    for part in target.split("."):
        module = getattr(module, part)
    return module


def _plan_buffers(steps: list[Step], plan: FusionPlan, pinned: set[str]
                  ) -> tuple[list[Step], int]:
    """Free each buffer after its last reader; share storage between kernel outputs that are
    neither graph outputs nor read by ATen calls when their lifetimes do not overlap."""
    last_use: dict[str, int] = {}
    for i, group in enumerate(plan.groups):  # steps are one per group, in the same order
        for b in group.reads:
            last_use[b] = i
    free_slots: dict[tuple[Any, ...], list[int]] = {}
    num_slots = 0
    releases: dict[int, list[tuple[tuple[Any, ...], int]]] = {}
    out: list[Step] = []
    for i, step in enumerate(steps):
        if isinstance(step, KernelStep):
            specs = []
            for spec in step.outputs:
                if spec.name in pinned or spec.name not in last_use:
                    specs.append(spec)
                    continue
                key = (spec.size, spec.stride, spec.dtype, spec.device)
                pool = free_slots.setdefault(key, [])
                slot = pool.pop() if pool else None
                if slot is None:
                    slot, num_slots = num_slots, num_slots + 1
                releases.setdefault(last_use[spec.name], []).append((key, slot))
                specs.append(BufferSpec(spec.name, spec.size, spec.stride, spec.dtype,
                                        spec.device, slot))
            step = KernelStep(step.kernel, tuple(specs), step.fallback)
        frees = tuple(sorted(b for b, last in last_use.items()
                             if last == i and b not in pinned))
        step = (KernelStep(step.kernel, step.outputs, step.fallback, frees)
                if isinstance(step, KernelStep) else AtenStep(step.name, step.run, frees))
        out.append(step)
        for key, slot in releases.get(i, []):
            free_slots[key].append(slot)
    return out, num_slots

