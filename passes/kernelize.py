"""Lower one stage graph to generated Triton kernels plus ATen calls.

Stage: `lower_graph(module, interpret) -> CompiledGraph`.
Requires: a functional ATen fx graph (forward or backward) with `meta["val"]` on every node.
Ensures: `decompose` -> `lower` -> `plan_fusion` -> `generate_kernel` for every fused group, and
a `runtime.kernels.CompiledGraph` whose callable takes the placeholders positionally and returns
the output tuple, like `runtime.launch.make_callable`. A group whose kernel cannot be generated
or compiled runs as ATen calls (its fx nodes) with a warning on `aotc.kernels`; ops lowering
does not know stay ATen calls. With symbolic sizes, the graph's size symbols are bound to its
placeholders (runtime.symsizes.bind_symbols; a symbol that cannot be bound raises, and
passes.select runs the graph as ATen calls) and every size is evaluated per call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import fx

from aotc.passes.codegen import generate_kernel
from aotc.passes.decompose import decompose
from aotc.passes.fusion import FusionPlan, GroupKind, plan_fusion
from aotc.passes.kernel_figures import kernel_figures
from aotc.passes.loop_ir import is_static, static_or_expr
from aotc.passes.lowering import _non_overlapping, lower, view_output_positions
from aotc.passes.lowering_ir import Computed, Extern
from aotc.runtime import precompile
from aotc.runtime.kernels import (
    AtenStep,
    BufferSpec,
    CompiledGraph,
    KernelSource,
    KernelStep,
    Step,
    load_kernel,
)
from aotc.runtime.steps import node_runner
from aotc.runtime.symsizes import SymSource, bind_symbols, compile_sizes

log = logging.getLogger("aotc.kernels")

# Called with every CompiledGraph lowering makes (observers only: e.g. the test suite compiles
# every generated kernel for GPU targets, see tests/conftest.py).
KERNEL_LISTENERS: list[Callable[[CompiledGraph], None]] = []


def graph_device(module: fx.GraphModule) -> torch.device | None:
    for node in module.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            return val.device
    return None


def lower_graph(
    module: fx.GraphModule, interpret: bool, decomposed: fx.GraphModule | None = None
) -> CompiledGraph:
    """`decomposed`: `decompose(module)` from an earlier compile (a disk-cache hit). The four
    steps (decompose, lower, fuse, generate) are also the compile driver's stages
    (aotc/pipeline.py runs them one by one, timed)."""
    decomposed = decompose(module) if decomposed is None else decomposed
    plan = plan_fusion(lower(decomposed, view_output_positions(module)))
    return generate_graph(plan, decomposed, interpret)


def generate_graph(plan: FusionPlan, decomposed: fx.GraphModule, interpret: bool) -> CompiledGraph:
    """The runnable lowering of `decomposed` under fusion plan `plan`: one Triton kernel per
    kernel group (a group whose kernel cannot be generated runs its nodes as ATen calls), ATen
    steps for the rest, and the buffer plan."""
    device = str(graph_device(decomposed) or "cpu")
    symbols = plan.lowered.symbols
    sources = (
        bind_symbols(
            [n.meta.get("val") for n in decomposed.graph.nodes if n.op == "placeholder"], symbols
        )
        if symbols
        else ()
    )
    outputs = {o for o in plan.lowered.outputs if isinstance(o, str)}
    extern_reads = {b for g in plan.groups if g.kind is GroupKind.EXTERN for b in g.reads}
    steps: list[Step] = []
    kernels: list[KernelSource] = []
    generated: set[str] = set()
    for group in plan.groups:
        if group.kind is GroupKind.EXTERN:
            ext = group.members[0]
            assert isinstance(ext, Extern)
            steps.append(
                AtenStep(
                    ext.name,
                    _node_runner([ext.node], [ext.name], plan.lowered.aliases, sources),
                    nodes=(ext.node.name,),
                    keep=(ext.name,),
                )
            )
            continue
        computed = [m for m in group.members if isinstance(m, Computed)]
        assert len(computed) == len(group.members), group  # only extern groups hold externs
        nodes = sorted({n for m in computed for n in m.cone}, key=_position(decomposed))
        fallback = _node_runner(nodes, list(group.stores), plan.lowered.aliases, sources)
        as_data = {"nodes": tuple(n.name for n in nodes), "keep": tuple(group.stores)}
        try:
            kernel = generate_kernel(plan, group, device, interpret)
            if interpret:  # the kernel a GPU would run for this group (see KernelSource.cuda)
                kernel = replace(kernel, cuda=generate_kernel(plan, group, "cuda", False))
            load_kernel(kernel)
            if not interpret and device.startswith("cuda"):
                precompile.warm([kernel], device)  # Note [Warm compiles] in runtime/precompile.py
        except Exception as e:  # noqa: BLE001 - a group that cannot compile runs as ATen calls
            log.warning(
                "could not generate a kernel for %s (%s: %s); running its ops as ATen calls",
                group.name,
                type(e).__name__,
                e,
            )
            steps.append(AtenStep(group.name, fallback, **as_data))
            continue
        kernels.append(kernel)
        generated.add(group.name)
        specs = tuple(_spec(plan, name, device) for name in group.stores)
        steps.append(KernelStep(kernel, specs, fallback, **as_data))
    steps, num_slots = _plan_buffers(steps, plan, outputs | extern_reads)
    compiled = CompiledGraph(
        kernels=tuple(kernels),
        steps=tuple(steps),
        placeholders=tuple(plan.lowered.placeholders),
        outputs=tuple(plan.lowered.outputs),
        num_slots=num_slots,
        fusion_text=plan.format(),
        input_strides=tuple(_input_stride(plan, name) for name in plan.lowered.placeholders),
        symbols=sources,
        decomposed=decomposed,
        figures=kernel_figures(plan, generated),
        aliases=tuple(sorted(plan.lowered.aliases.items())),
    )
    for listener in KERNEL_LISTENERS:
        listener(compiled)
    return compiled


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


def _node_runner(
    nodes: list[fx.Node],
    keep: list[str],
    aliases: dict[str, str],
    sources: tuple[SymSource, ...] = (),
) -> Callable[[dict[str, Any]], None]:
    """runtime.steps.node_runner with this module's stride fix (symbolic sizes too)."""
    return node_runner(nodes, keep, aliases, lambda node, kept: _stride_fix(node, kept, sources))


def _stride_fix(
    node: fx.Node, keep: bool, sources: tuple[SymSource, ...] = ()
) -> Callable[[Any, dict[str, Any]], Any] | None:
    """ATen results whose strides differ from the traced ones (which kernels index with) are
    copied into the traced layout (evaluated per call when symbolic; see runtime.kernels.SYMS)."""
    val = node.meta.get("val")
    if not keep or not isinstance(val, torch.Tensor):
        return None
    shape_e = [static_or_expr(s) for s in val.shape]
    stride_e = [static_or_expr(s) for s in val.stride()]
    if not all(is_static(v) for v in (*shape_e, *stride_e)):
        return _symbolic_stride_fix(shape_e, stride_e, sources)
    if val.numel() <= 1:
        return None
    if not _non_overlapping(val.shape, val.stride()):
        return None
    shape, stride = tuple(val.shape), tuple(val.stride())

    def fix(out: Any, env: dict[str, Any]) -> Any:
        if not isinstance(out, torch.Tensor) or out.stride() == stride:
            return out
        return torch.empty_strided(shape, stride, dtype=out.dtype, device=out.device).copy_(out)

    return fix


def _symbolic_stride_fix(
    shape: list[Any], stride: list[Any], sources: tuple[SymSource, ...]
) -> Callable[[Any, dict[str, Any]], Any] | None:
    from aotc.runtime.kernels import SYMS

    if not _non_overlapping(shape, stride):
        return None
    strides_of = compile_sizes(stride, [src.symbol for src in sources])

    def fix(out: Any, env: dict[str, Any]) -> Any:
        if not isinstance(out, torch.Tensor) or out.numel() <= 1:
            return out
        want = strides_of(env[SYMS])
        if all(st == w for st, w, n in zip(out.stride(), want, out.shape) if n > 1):
            return out
        return torch.empty_strided(out.shape, want, dtype=out.dtype, device=out.device).copy_(out)

    return fix


def _plan_buffers(steps: list[Step], plan: FusionPlan, pinned: set[str]) -> tuple[list[Step], int]:
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
                specs.append(
                    BufferSpec(spec.name, spec.size, spec.stride, spec.dtype, spec.device, slot)
                )
            step = replace(step, outputs=tuple(specs))
        frees = tuple(sorted(b for b, last in last_use.items() if last == i and b not in pinned))
        step = replace(step, frees=frees)
        out.append(step)
        for key, slot in releases.get(i, []):
            free_slots[key].append(slot)
    return out, num_slots
